"""Preference pairs for a Bradley-Terry reward model (``klrl reward-model``): read, checked, tokenised.

A pairs file is JSONL or Parquet with TRL's columns (``RewardTrainer``'s preference format):
``chosen`` and ``rejected`` required, ``prompt`` optional. Each value is either

* **text**: a string. The sequence is ``prompt + chosen`` (resp. ``rejected``), as TRL concatenates
  them; with ``chat_template=True`` a string prompt is wrapped as one user message and rendered with
  the model's chat template (as klrl's own prompts are, :func:`klrl.data.chat.render`);
* **conversational**: a list of ``{role, content}`` messages. The last message of ``chosen`` (resp.
  ``rejected``) is the response; the prompt's messages and the earlier ones of the response side
  (TRL's "implicit prompt" layout) are rendered with the chat template and the generation prompt.

Either way a sequence is laid out as a klrl rollout is: ``encode(prompt)`` then ``encode(response)``
followed by the tokenizer's end token (``stop_ids[0]``, unless the response already ends with a stop
id; TRL appends EOS too), so the reward model is trained to read the position that klrl's reward
(:func:`klrl.tasks.text.model_reward`) reads at RL time: the last real token. Sequences are
right-padded to ``max_len``; a longer one loses the start of its prompt, then the end of its response
(counted in :attr:`Pairs.truncated`).

**PPO's text format** (:func:`encode_as_ppo`, what ``klrl reward-model`` trains on by default): each
pair is laid out exactly as PPO's reward model reads a rollout. The prompt goes through PPO's own prompt
pipeline (:func:`klrl.data.prompts.build_pool` with the run's ``data`` section: the chat template when
``data.chat_template``, a long prompt cut inside its user content to ``data.prompt_len``); the response
is encoded without special tokens, cut after its first stop id, ended with the tokenizer's end token
when ``sampling.use_eos`` (as a sampled response ends at a stop id), and cut to
``sampling.response_len`` tokens (a response PPO cut there has no stop token; neither has this one).
The token ids are the real tokens of PPO's ``sequence(prompt, prompt_mask, response, mask)``, right-
padded to ``data.prompt_len + sampling.response_len``. A row without a prompt is the response alone,
encoded with the tokenizer's special tokens (a BOS), never wrapped in the template.

Every problem (a missing, empty or foreign file, a missing column, a non-text or empty value) is a
:class:`PairsError` whose message is one line naming the file and row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from klrl.config import DataConfig, SamplingConfig
from klrl.data.chat import PromptDataError, one_line
from klrl.data.prompts import build_pool, read_records
from klrl.data.tokenizer import Tokenizer

FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
REQUIRED = ("chosen", "rejected")


class PairsError(ValueError):
    """A pairs file or one of its rows is unusable; the message is one line naming the file and row."""


class Pairs(NamedTuple):
    """Tokenised pairs: ``chosen``/``rejected`` ``[N, T]`` int32 right-padded with the pad id, their
    masks ``[N, T]`` float32 (1 on real tokens), ``truncated`` the number of cut pairs;
    ``chosen_prompt_len``/``rejected_prompt_len`` ``[N]`` int32 the number of prompt tokens before each
    response (the response is ``mask`` from there on: :meth:`completion`)."""

    chosen: np.ndarray
    chosen_mask: np.ndarray
    rejected: np.ndarray
    rejected_mask: np.ndarray
    truncated: int
    chosen_prompt_len: np.ndarray | None = None
    rejected_prompt_len: np.ndarray | None = None

    def take(self, idx: np.ndarray) -> Pairs:
        sub = lambda x: None if x is None else x[idx]
        return Pairs(self.chosen[idx], self.chosen_mask[idx], self.rejected[idx], self.rejected_mask[idx], 0,
                     sub(self.chosen_prompt_len), sub(self.rejected_prompt_len))  # fmt: skip

    def completion(self, side: str) -> np.ndarray:
        """``[N, T]`` float32, 1 on the response tokens of ``side`` (``'chosen'`` or ``'rejected'``)."""
        mask, plen = getattr(self, f"{side}_mask"), getattr(self, f"{side}_prompt_len")
        return mask * (np.arange(mask.shape[1])[None, :] >= plen[:, None]).astype(np.float32)

    def __len__(self) -> int:  # type: ignore[override]
        return int(self.chosen.shape[0])


def read_pairs(path: str | Path) -> list[dict]:
    """The rows of a pairs file (JSONL or Parquet), checked with :func:`check_pairs`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise PairsError(f"{p}: pairs file not found")
    if not p.is_file():
        raise PairsError(f"{p}: not a regular file (a pairs file is .jsonl or .parquet)")
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise PairsError(f"{p}: unknown pairs file type {p.suffix!r} (use .jsonl or .parquet)")
    try:
        records, where = read_records(p, format=fmt)
    except PromptDataError as e:
        msg = str(e).replace("no prompts in the file", "no pairs in the file")
        raise PairsError(msg.replace("prompt file not found", "pairs file not found")) from None
    check_pairs(records, [f"{p} {w}" for w in where])
    return records


def _kind(value: Any, label: str) -> str:
    """``'text'`` or ``'chat'``; anything else (or an empty value) is a :class:`PairsError`."""
    if isinstance(value, str):
        if not value.strip():
            raise PairsError(f"{label}: empty")
        return "text"
    ok = isinstance(value, list | tuple) and len(value) > 0
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        what = "an empty list" if isinstance(value, list | tuple) and not value else type(value).__name__
        raise PairsError(f"{label}: expected a string or a list of {{role, content}} messages, got {what}")
    if not value[-1]["content"].strip():
        raise PairsError(f"{label}: the last message (the response) is empty")
    return "chat"


def check_pairs(records: list[dict], where: list[str]) -> None:
    """Columns ``chosen`` and ``rejected`` in every row; every value text or a conversation, non-empty;
    ``chosen`` and ``rejected`` of one kind; ``prompt`` (optional, may be null) text or a conversation."""
    if not records:
        raise PairsError(f"{where[0] if where else '<records>'}: no pairs")
    for rec, w in zip(records, where, strict=True):
        missing = [c for c in REQUIRED if c not in rec]
        if missing:
            cols = ", ".join(list(rec)[:10]) or "none"
            raise PairsError(f"{w}: no column {missing[0]!r} (columns: {cols}); a pair needs both")
        kinds = {_kind(rec[c], f"{w}: {c}") for c in REQUIRED}
        if len(kinds) > 1:
            raise PairsError(f"{w}: chosen and rejected must both be text or both conversations")
        prompt = rec.get("prompt")
        if prompt is not None and not (isinstance(prompt, str) and not prompt.strip()):
            _kind(prompt, f"{w}: prompt")


def _template(tokenizer: Tokenizer, msgs: list[dict], label: str) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise PairsError(f"{label}: a conversation needs a chat template; the tokenizer has none")
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateError, or whatever the template raises
        raise PairsError(f"{label}: the chat template failed ({one_line(e)})") from None


def texts(
    rec: dict, side: str, tokenizer: Tokenizer, chat_template: bool, label: str
) -> tuple[str, str, bool]:
    """``(prompt text, response text, templated)`` of one side (``'chosen'`` or ``'rejected'``) of a row
    (module docstring)."""
    prompt, resp = rec.get("prompt"), rec[side]
    if isinstance(resp, str):
        if isinstance(prompt, list | tuple):
            return _template(tokenizer, [dict(m) for m in prompt], label), resp, True
        prompt = prompt or ""
        if chat_template and prompt:
            return _template(tokenizer, [{"role": "user", "content": prompt}], label), resp, True
        return prompt, resp, False
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}] if prompt else []
    before = list(prompt or [])
    msgs = [*before, *resp[:-1]]
    return (_template(tokenizer, msgs, label) if msgs else ""), resp[-1]["content"], bool(msgs)


def _sequence(prompt: list[int], resp: list[int], max_len: int) -> tuple[list[int], bool]:
    if len(prompt) + len(resp) <= max_len:
        return prompt + resp, False
    keep = max(max_len - len(resp), 0)
    return (prompt[len(prompt) - keep :] if keep else []) + resp[:max_len], True


def encode_pairs(
    records: list[dict], tokenizer: Tokenizer, max_len: int, *, chat_template: bool = False, source: str = ""
) -> Pairs:
    """Tokenise checked rows (:func:`check_pairs`) into :class:`Pairs` (module docstring)."""
    stops = tuple(getattr(tokenizer, "stop_ids", ()) or ())
    n = len(records)
    toks = {s: np.full((n, max_len), tokenizer.pad_id, np.int32) for s in REQUIRED}
    masks = {s: np.zeros((n, max_len), np.float32) for s in REQUIRED}
    cut = np.zeros(n, bool)
    plens = {s: np.zeros(n, np.int32) for s in REQUIRED}
    for i, rec in enumerate(records):
        for side in REQUIRED:
            label = f"{source} row {i}: {side}".strip()
            p_text, r_text, templated = texts(rec, side, tokenizer, chat_template, label)
            p_ids = list(tokenizer.encode(p_text, add_special_tokens=not templated)) if p_text else []
            r_ids = list(tokenizer.encode(r_text, add_special_tokens=not templated and not p_text))
            if not r_ids:
                raise PairsError(f"{label}: the response encodes to no tokens")
            if stops and r_ids[-1] not in stops:
                r_ids.append(stops[0])
            ids, c = _sequence(p_ids, r_ids, max_len)
            plens[side][i] = min(len(p_ids), max(max_len - len(r_ids), 0))
            cut[i] |= c
            toks[side][i, : len(ids)] = ids
            masks[side][i, : len(ids)] = 1.0
    return Pairs(toks["chosen"], masks["chosen"], toks["rejected"], masks["rejected"], int(cut.sum()),
                 plens["chosen"], plens["rejected"])  # fmt: skip


def split(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held-out)`` row indices, each ascending: ``round(eval_fraction * n)`` rows (at least
    one, never all) picked by a ``seed``-ed permutation (as :func:`klrl.data.prompts.split_indices`)."""
    if not 0 < eval_fraction < 1:
        raise PairsError(f"--eval-fraction: must be in (0, 1) (got {eval_fraction})")
    if n < 2:
        raise PairsError(f"--eval-fraction: {n} pair(s) cannot be split into training and held-out pairs")
    k = min(max(1, round(eval_fraction * n)), n - 1)
    held = np.sort(np.random.default_rng(seed).permutation(n)[:k])
    return np.setdiff1d(np.arange(n), held), held


# ---- PPO's text format ---------------------------------------------------------------------------------
def ppo_prompt(rec: dict, side: str) -> tuple[Any, str]:
    """``(prompt value, response text)`` of one side of a row, the prompt as PPO's ``data.field`` would
    hold it (a string or a conversation; None without one): a conversational response's earlier
    messages join the prompt (TRL's implicit prompt)."""
    prompt, resp = rec.get("prompt"), rec[side]
    if isinstance(resp, str):
        return (prompt if prompt else None), resp
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}] if prompt else []
    msgs = [dict(m) for m in [*(prompt or []), *resp[:-1]]]
    return (msgs or None), resp[-1]["content"]


def response_ids(ids: list[int], stops: tuple[int, ...], sampling: SamplingConfig) -> tuple[list[int], bool]:
    """A response's ids as PPO samples them: cut after the first stop id and ended with ``stops[0]``
    (``sampling.use_eos``), then cut to ``sampling.response_len``; ``(ids, cut)``."""
    ids = list(ids)
    if sampling.use_eos and stops:
        at = next((k for k, t in enumerate(ids) if t in stops), None)
        ids = ids[: at + 1] if at is not None else [*ids, stops[0]]
    r = sampling.response_len
    return ids[:r], len(ids) > r


def text_format(tokenizer: Tokenizer, data: DataConfig, sampling: SamplingConfig) -> dict:
    """The text format as ``reward_model.json`` records it (and :func:`format_line` prints it)."""
    stops = tuple(int(i) for i in getattr(tokenizer, "stop_ids", ()) or ())
    end = tokenizer.decode([stops[0]], skip_special_tokens=False) if stops and sampling.use_eos else None
    return {
        "chat_template": data.chat_template,
        "prompt_len": data.prompt_len,
        "truncate": data.truncate,
        "response_len": sampling.response_len,
        "use_eos": sampling.use_eos,
        "end_token": end,
    }


def format_line(fmt: dict) -> str:
    """One line saying which text a reward model reads (:func:`text_format`'s dict)."""
    tpl = "on (the model's chat template around each prompt)" if fmt["chat_template"] else "off (raw prompts)"
    end = (
        f"responses end with {fmt['end_token']!r} unless cut"
        if fmt["use_eos"] and fmt["end_token"] is not None
        else "no end token added (sampling.use_eos false)"
    )
    return (
        f"text format (as PPO shows it to --model.reward_path): chat template {tpl}; prompts cut to "
        f"data.prompt_len {fmt['prompt_len']} tokens (truncate {fmt['truncate']}); responses cut to "
        f"sampling.response_len {fmt['response_len']} tokens; {end}"
    )


def encode_as_ppo(
    records: list[dict], tokenizer: Tokenizer, data: DataConfig, sampling: SamplingConfig, *, source: str = ""
) -> Pairs:
    """Tokenise checked rows (:func:`check_pairs`) in PPO's text format (module docstring) into
    :class:`Pairs` of width ``data.prompt_len + sampling.response_len``."""
    stops = tuple(int(i) for i in getattr(tokenizer, "stop_ids", ()) or ())
    n, width = len(records), data.prompt_len + sampling.response_len
    sides = [(i, s, *ppo_prompt(rec, s)) for i, rec in enumerate(records) for s in REQUIRED]
    with_prompt = [k for k, x in enumerate(sides) if x[2] is not None]
    cfg = dataclasses.replace(data, field="prompt")
    pool = None
    if with_prompt:
        try:
            pool = build_pool([{"prompt": sides[k][2]} for k in with_prompt], tokenizer, cfg,
                              source=source or "<pairs>",
                              where=[f"row {sides[k][0]}: {sides[k][1]}" for k in with_prompt])  # fmt: skip
        except PromptDataError as e:
            raise PairsError(str(e)) from None
    row_of = {k: j for j, k in enumerate(with_prompt)}
    toks = {s: np.full((n, width), tokenizer.pad_id, np.int32) for s in REQUIRED}
    masks = {s: np.zeros((n, width), np.float32) for s in REQUIRED}
    cut = np.zeros(n, bool)
    plens = {s: np.zeros(n, np.int32) for s in REQUIRED}
    for k, (i, side, _, resp) in enumerate(sides):
        p_ids: list[int] = []
        if k in row_of:
            j = row_of[k]
            p_ids = pool.tokens[j][pool.mask[j] > 0].tolist()
            cut[i] |= bool(pool.truncated[j])
        r_ids, c = response_ids(tokenizer.encode(resp, add_special_tokens=not p_ids), stops, sampling)
        if not r_ids:
            raise PairsError(f"{source} row {i}: {side}: the response encodes to no tokens".strip())
        cut[i] |= c
        ids = p_ids + r_ids
        plens[side][i] = len(p_ids)
        toks[side][i, : len(ids)] = ids
        masks[side][i, : len(ids)] = 1.0
    return Pairs(toks["chosen"], masks["chosen"], toks["rejected"], masks["rejected"], int(cut.sum()),
                 plens["chosen"], plens["rejected"])  # fmt: skip


def heldout_prompts(pairs: Pairs, limit: int, pad_id: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The prompts of the first ``limit`` pairs that have one, left-padded as PPO's prompt pool
    (``[n, P]`` int32 tokens with the pad id, ``[n, P]`` float32 mask, ``P`` the longest prompt): the
    tokens before each chosen response (the same prompt as the rejected one's). ``(None, None)``
    when none has a prompt or ``limit`` is 0."""
    plen = pairs.chosen_prompt_len
    rows = [i for i in range(len(pairs)) if plen[i] > 0][:limit]
    if not rows:
        return None, None
    width = int(max(plen[i] for i in rows))
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for k, i in enumerate(rows):
        n = int(plen[i])
        tokens[k, width - n :] = pairs.chosen[i, :n]
        mask[k, width - n :] = 1.0
    return tokens, mask


def gold_pairs(
    rows: list[dict[str, Any]], prompts: list[Any], n_pairs: int, noise: float, seed: int
) -> list[dict]:
    """Up to ``n_pairs`` pairs of responses to the same prompt with different gold, drawn without replacement
    from all such pairs, as TRL's ``prompt``/``chosen``/``rejected`` records: ``chosen`` the higher gold,
    flipped with probability ``noise`` (``gold_chosen`` says whether the label agrees with the gold;
    ``rows``: the indices of chosen and rejected in ``rows``). ``rows`` are scored responses
    (``prompt_idx``, ``gold``, ``completion``), e.g. a study's pool; the label noise is symmetric (each label
    flipped independently with probability ``noise``), a weaker proxy's data."""
    rng = np.random.default_rng(seed)
    by: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by.setdefault(r["prompt_idx"], []).append(i)
    gold = [r["gold"] for r in rows]
    cand = [(a, b) for g in by.values() for i, a in enumerate(g) for b in g[i + 1 :] if gold[a] != gold[b]]
    out = []
    for k in rng.permutation(len(cand))[:n_pairs]:
        a, b = cand[k]
        hi, lo = (a, b) if gold[a] > gold[b] else (b, a)
        flip = bool(rng.random() < noise)
        c, r = (lo, hi) if flip else (hi, lo)
        out.append({"prompt": prompts[rows[a]["prompt_idx"]], "chosen": rows[c]["completion"],
                    "rejected": rows[r]["completion"], "gold_chosen": not flip, "rows": (c, r)})  # fmt: skip
    return out
