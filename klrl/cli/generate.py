"""``klrl generate`` and ``klrl eval``: sample from a run, a checkpoint, an export or a model, and score it.

::

    klrl generate SOURCE (--prompts FILE | --prompt TEXT ...) [--n N] [--max-new-tokens T]
        [--temperature X] [--seed S] [--step N] [--out FILE.jsonl] [--batch-size B]
        [--data.chat_template B] [--data.prompt_len P] [--data.field NAME]
    klrl eval SOURCE --prompts FILE [the same flags] [--reward.fn SPEC [--reward.weights W] |
        --reward-model DIR] [--ref MODEL] [--judge MODEL]

``SOURCE`` is read by :func:`klrl.cli.sources.load_source` (a run directory: its latest checkpoint or
``--step N``, LoRA merged; a checkpoint directory; an export; an HF directory, a ``.gguf`` or a Hub
name in the local cache). The prompts (a prompt file in any format PPO reads, column ``data.field``,
or ``--prompt`` texts) go through PPO's own prompt pipeline (:func:`klrl.data.prompts.build_pool`:
the chat template, a long prompt cut inside its user content to ``data.prompt_len``; a run's ``data``
section, PPO's defaults otherwise) and are answered by PPO's sampler (:func:`klrl.models.rollout.generate`:
``--n`` samples each, per-row keys ``fold_in(key(seed), row)``, a stop id ends a response, at most
``--max-new-tokens``; ``--temperature 0`` is greedy). The same seed gives the same output.

``generate`` writes one JSON row per completion (``prompt``, ``sample``, ``completion``, ``tokens``,
``stopped``) to ``--out`` (a new file) or stdout. ``eval`` adds, per completion:

* ``reward``: the ``--reward.fn`` functions (TRL's signature, :mod:`klrl.rewards.host`; the prompt
  file's other columns passed by name) or ``--reward-model DIR`` (:func:`klrl.load_reward_model`:
  the text as PPO shows it); a run's own ``reward.fn`` or ``model.reward_path`` by default;
* ``kl_exact_seq_sum``: the exact KL to the reference along the completion, in nats per sequence,
  ``sum_t sum_v pi(v | y<t) (log pi(v | y<t) - log pi_ref(v | y<t))`` (:func:`klrl.algo.kl.full_kl`,
  both at temperature 1; its mean over completions sampled at temperature 1 is the sequence KL);
  the reference is the run's ``model.path`` or ``--ref``;
* ``judge_nll_token_mean``: ``--judge MODEL``'s negative log-likelihood per token of the completion
  (its own tokenizer and chat template), and the means; ``judge_ppl`` is ``exp`` of the NLL over
  all completion tokens.

The means go to one printed line and, with ``--out FILE.jsonl``, to ``FILE.summary.json`` (``eval/*``
names). Bad input (a SOURCE, prompt file, reward, reference or judge that cannot be read; a value out
of range; an unknown flag, with a did-you-mean) is one line, exit status 2, before anything is sampled.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.algo import kl as kl_lib
from klrl.algo.logprobs import token_logprobs
from klrl.cli.args import check_new_path, fail
from klrl.cli.flags import generate_parser
from klrl.cli.sources import Source, SourceError, load_reference, load_source
from klrl.config import ConfigError, DataConfig, SamplingConfig
from klrl.config.schema import closest
from klrl.data.chat import PromptDataError
from klrl.data.prompts import PromptPool, build_pool, read_records, resolve_path
from klrl.models.base import forward
from klrl.models.catalog import resolve_model_path
from klrl.models.hf import CheckpointFormatError
from klrl.models.pretrained import from_pretrained
from klrl.models.rollout import generate, response_slice, sequence
from klrl.rewards import RewardLoadError, make_host_reward, parse_specs
from klrl.rewards.model import load_reward_model
from klrl.tasks.text import is_sequence_classifier


# ---- flags -----------------------------------------------------------------------------------------
def parse_args(cmd: str, argv: list[str]) -> argparse.Namespace:
    p = generate_parser(cmd)
    ns, rest = p.parse_known_args(argv)
    if rest:
        flags = [s for act in p._actions for s in act.option_strings if s.startswith("--")]
        name = rest[0].split("=", 1)[0]
        near = closest(name, flags) if name.startswith("-") else None
        what = "unknown flag" if name.startswith("-") else "unexpected argument"
        fail(f"klrl {cmd}: {name}: {what}" + (f"; did you mean {near}?" if near else ""))
    _check(cmd, ns)
    return ns


def _check(cmd: str, ns: argparse.Namespace) -> None:
    given = [x for x in (ns.prompts, getattr(ns, "prompt", None)) if x]
    if len(given) != 1:
        both = "--prompts FILE or --prompt TEXT" if cmd == "generate" else "--prompts FILE"
        fail(f"klrl {cmd}: give {both}" + (" (not both)" if len(given) > 1 else ""))
    positive = lambda v: v is None or v >= 1
    t = ns.temperature
    rules = [
        (ns.n >= 1, "--n", ns.n, "must be >= 1"),
        (positive(ns.max_new_tokens), "--max-new-tokens", ns.max_new_tokens, "must be >= 1"),
        (math.isfinite(t) and t >= 0, "--temperature", t, "must be >= 0 (0: greedy)"),
        (ns.batch_size >= 1, "--batch-size", ns.batch_size, "must be >= 1"),
        (positive(ns.prompt_len), "--data.prompt_len", ns.prompt_len, "must be >= 1"),
    ]
    for ok, flag, value, rule in rules:
        if not ok:
            fail(f"{flag}: {rule} (got {value})")
    if ns.chat_template is not None:
        v = ns.chat_template.strip().lower()
        if v not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            fail(f"--data.chat_template: expected true or false (got {ns.chat_template!r})")
        ns.chat_template = v in ("true", "1", "yes", "on")
    if ns.out:  # nothing there; a name too long, a loop, read-only, a full disk: one line
        check_new_path(ns.out, "--out", directory=False)
    if ns.out and not Path(ns.out).resolve().parent.is_dir():
        fail(f"--out: {Path(ns.out).parent}: no such directory")
    if cmd == "eval" and ns.reward_fn and ns.reward_model:
        fail("--reward-model: give --reward.fn or --reward-model, not both")


# ---- prompts and sampling --------------------------------------------------------------------------
def prompt_pool(ns: argparse.Namespace, src: Source) -> tuple[PromptPool, DataConfig]:
    """The prompts through PPO's pipeline with the source's ``data`` section (the flags over it)."""
    over = {k: getattr(ns, k) for k in ("chat_template", "prompt_len", "field") if getattr(ns, k) is not None}
    try:
        data = dataclasses.replace(src.data, **over)
    except ConfigError as e:
        fail(f"--{e}")
    try:
        if getattr(ns, "prompt", None):
            records, where, source = [{data.field: t} for t in ns.prompt], None, "--prompt"
        else:
            records, where = read_records(ns.prompts, field=data.field)
            source = str(resolve_path(ns.prompts))
        pool = build_pool(records, src.tok, data, source=source, where=where)
    except PromptDataError as e:
        fail(f"--prompts: {e}")
    return pool, data


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
def _sample(model, params, prompt, pmask, keys, cfg, stops, pad):
    ro = generate(model, params, prompt, pmask, keys, cfg, stops, pad)
    return ro.response, ro.mask


def _chunks(n: int, size: int):
    """``(rows, k)``: row indices in fixed-size chunks (the last filled up with row 0), ``k`` real rows."""
    size = min(size, n)
    for i in range(0, n, size):
        rows = np.arange(i, i + size)
        k = int(min(size, n - i))
        yield np.where(rows < n, rows, 0), k


def sample(src: Source, pool: PromptPool, n: int, max_new: int, temperature: float, seed: int, batch: int):
    """``(idx [M], response [M, R], mask [M, R])``: ``n`` completions of each prompt (prompt-major),
    row ``m`` drawn with key ``fold_in(key(seed), m)``; temperature 0: greedy (top-1 at temperature 1)."""
    cfg = SamplingConfig(response_len=max_new, temperature=temperature or 1.0, top_k=0 if temperature else 1,
                         use_eos=src.sampling.use_eos)  # fmt: skip
    idx = np.repeat(np.arange(len(pool)), n)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(len(idx)))
    stops = tuple(int(s) for s in src.tok.stop_ids)
    resp, mask = np.zeros((len(idx), max_new), np.int32), np.zeros((len(idx), max_new), np.float32)
    for rows, k in _chunks(len(idx), batch):
        p = idx[rows]
        r, m = _sample(src.model, src.params, jnp.asarray(pool.tokens[p]), jnp.asarray(pool.mask[p]),
                       keys[rows], cfg, stops, int(src.tok.pad_id))  # fmt: skip
        resp[rows[:k]], mask[rows[:k]] = np.asarray(r)[:k], np.asarray(m)[:k]
    return idx, resp, mask


def decode(tok: Any, response: np.ndarray, mask: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``(texts, tokens [M], stopped [M])``: the completions without their stop token (as
    :func:`klrl.models.generate.generate_text` decodes them)."""
    stops = set(int(s) for s in tok.stop_ids)
    texts, stopped = [], []
    for r, m in zip(response, mask, strict=True):
        ids = [int(t) for t, ok in zip(r, m, strict=True) if ok > 0]
        stopped.append(bool(ids) and ids[-1] in stops)
        texts.append(tok.decode([i for i in ids if i not in stops]))
    return texts, mask.sum(axis=1).astype(int), np.asarray(stopped)


# ---- the scores ------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 2))
def _exact_kl(model, params, ref_model, ref_params, prompt, pmask, response, mask):
    tokens, key_mask = sequence(prompt, pmask, response, mask)
    p, r = prompt.shape[1], response.shape[1]
    logits = response_slice(forward(model, params, tokens, key_mask).logits, p, r)
    ref = response_slice(forward(ref_model, ref_params, tokens, key_mask).logits, p, r)
    return kl_lib.seq_sum(kl_lib.full_kl(logits, ref, mask), mask)


def exact_kl(
    src: Source, ref: tuple[Any, Any], pool: PromptPool, idx, response, mask, batch: int
) -> np.ndarray:
    """``[M]`` the exact KL(pi || pi_ref) of each completion, nats per sequence (module docstring)."""
    out = np.zeros(len(idx), np.float32)
    for rows, k in _chunks(len(idx), batch):
        p = idx[rows]
        batch_arrays = (pool.tokens[p], pool.mask[p], response[rows], mask[rows])
        v = _exact_kl(src.model, src.params, ref[0], ref[1], *map(jnp.asarray, batch_arrays))
        out[rows[:k]] = np.asarray(v)[:k]
    return out


@functools.partial(jax.jit, static_argnums=(0,))
def _nll(model, params, prompt, pmask, response, mask):
    tokens, key_mask = sequence(prompt, pmask, response, mask)
    logits = response_slice(
        forward(model, params, tokens, key_mask).logits, prompt.shape[1], response.shape[1]
    )
    return -jnp.sum(token_logprobs(logits, response) * mask, axis=-1)


def load_judge(path: str, records: list[Any], data: DataConfig) -> tuple[Any, Any, Any, PromptPool]:
    """``(model, params, tokenizer, prompt pool)`` of the judge ``path``: ``records``' prompts through PPO's
    prompt pipeline with the judge's tokenizer and chat template."""
    try:
        model, params, tok = from_pretrained(resolve_model_path(path, "--judge"))
    except ConfigError as e:
        fail(str(e))
    except (CheckpointFormatError, OSError, ValueError) as e:
        fail(f"--judge: {e}")
    if tok is None:
        fail(f"--judge: {path}: no tokenizer")
    try:
        pool = build_pool(records, tok, data, source="--judge prompts")
    except PromptDataError as e:
        fail(f"--judge: {e}")
    return model, params, tok, pool


def judge_nll(judge: tuple, idx: np.ndarray, texts: list[str], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """``(nll [M], tokens [M])``: the judge's (:func:`load_judge`) negative log-likelihood of each
    completion after its prompt (row ``idx[m]`` of its pool), summed over the completion's tokens."""
    model, params, tok, pool = judge
    ids = [tok.encode(t) for t in texts]
    r = max(1, max(map(len, ids)))
    resp, mask = np.full((len(ids), r), tok.pad_id, np.int32), np.zeros((len(ids), r), np.float32)
    for i, x in enumerate(ids):
        resp[i, : len(x)], mask[i, : len(x)] = x, 1.0
    nll = np.zeros(len(ids), np.float32)
    for rows, k in _chunks(len(ids), batch):
        v = _nll(model, params, jnp.asarray(pool.tokens[idx[rows]]), jnp.asarray(pool.mask[idx[rows]]),
                 jnp.asarray(resp[rows]), jnp.asarray(mask[rows]))  # fmt: skip
        nll[rows[:k]] = np.asarray(v)[:k]
    return nll, mask.sum(axis=1)


def prepare_reward(ns: argparse.Namespace, src: Source, pool: PromptPool) -> tuple[Any, str]:
    """``(score(idx, response, mask, texts) -> [M] or None, what)``: ``--reward.fn``, ``--reward-model``,
    or the run's own reward; loaded (and checked) before anything is sampled."""
    spec, weights, rm = ns.reward_fn, ns.reward_weights, ns.reward_model
    if not (spec or rm) and src.cfg is not None:  # the run's own reward
        if src.cfg.reward.fn:
            spec, weights = src.cfg.reward.fn, src.cfg.reward.weights
        elif src.cfg.model.reward_path and is_sequence_classifier(src.cfg.model.reward_path):
            rm = src.cfg.model.reward_path
    if rm:
        try:
            model = load_reward_model(resolve_model_path(rm, "--reward-model"))
        except ConfigError as e:
            fail(str(e))
        except (CheckpointFormatError, OSError, ValueError) as e:
            fail(f"--reward-model: {e}")

        def by_model(idx, response, mask, texts):
            try:
                return model.score([pool.prompts[i] for i in idx], texts, ns.batch_size)
            except ValueError as e:
                fail(f"--reward-model: {e}")

        return by_model, f"reward model {rm}"
    if not spec:
        return (lambda *_: None), "no reward (give --reward.fn or --reward-model)"
    try:
        specs, w = parse_specs(spec, weights)
        host = make_host_reward(specs, w, src.tok, pool.prompts, pool.columns)
    except RewardLoadError as e:
        fail(f"--reward.fn: {e}")

    def by_fns(idx, response, mask, texts):
        scores, _, error = host.score_numpy(idx, response, mask)
        if (error != 0).any():
            fail(f"--reward.fn: {host.errors[0] if host.errors else 'a reward function failed'}")
        return scores

    return by_fns, f"reward.fn {spec}"


# ---- the commands ----------------------------------------------------------------------------------
def _setup(cmd: str, argv: list[str]) -> tuple[argparse.Namespace, Source, PromptPool, DataConfig]:
    ns = parse_args(cmd, argv)
    try:
        src = load_source(ns.source, ns.step, getattr(ns, "ref", None))
    except SourceError as e:
        fail(str(e))
    pool, data = prompt_pool(ns, src)
    if ns.max_new_tokens is None:
        ns.max_new_tokens = src.sampling.response_len if src.cfg is not None else 64
    return ns, src, pool, data


def _rows(pool: PromptPool, idx, n: int, texts, tokens, stopped) -> list[dict]:
    return [
        {
            "prompt": pool.prompts[i],
            "sample": int(m % n),
            "completion": t,
            "tokens": int(k),
            "stopped": bool(s),
        }
        for m, (i, t, k, s) in enumerate(zip(idx, texts, tokens, stopped, strict=True))
    ]


def _write(rows: list[dict], out: str | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if out:
        Path(out).write_text(text)
    else:
        sys.stdout.write(text)


def generate_main(argv: list[str]) -> int:
    """``klrl generate SOURCE ...`` (module docstring)."""
    ns, src, pool, _ = _setup("generate", argv)
    print(f"{src.what}; {len(pool)} prompts x {ns.n}, at most {ns.max_new_tokens} new tokens, "
          f"temperature {ns.temperature:g}, seed {ns.seed}")  # fmt: skip
    idx, resp, mask = sample(src, pool, ns.n, ns.max_new_tokens, ns.temperature, ns.seed, ns.batch_size)
    rows = _rows(pool, idx, ns.n, *decode(src.tok, resp, mask))
    _write(rows, ns.out)
    if ns.out:
        print(f"wrote {len(rows)} completions to {ns.out}")
    return 0


def _mean(x) -> float | None:
    return None if x is None or not len(x) else float(np.mean(x))


def eval_main(argv: list[str]) -> int:
    """``klrl eval SOURCE --prompts FILE ...`` (module docstring)."""
    ns, src, pool, data = _setup("eval", argv)
    ref = None
    if src.ref is not None:
        try:
            ref = load_reference(src)
        except SourceError as e:
            fail(str(e))
    score, what = prepare_reward(ns, src, pool)
    judge = load_judge(ns.judge, [{data.field: p} for p in pool.prompts], data) if ns.judge else None
    print(f"{src.what}; {len(pool)} prompts x {ns.n}, temperature {ns.temperature:g}, seed {ns.seed}")
    idx, resp, mask = sample(src, pool, ns.n, ns.max_new_tokens, ns.temperature, ns.seed, ns.batch_size)
    texts, tokens, stopped = decode(src.tok, resp, mask)
    reward = score(idx, resp, mask, texts)
    kl = exact_kl(src, ref, pool, idx, resp, mask, ns.batch_size) if ref is not None else None
    nll = ntok = None
    if judge is not None:
        nll, ntok = judge_nll(judge, idx, texts, ns.batch_size)
    rows = _rows(pool, idx, ns.n, texts, tokens, stopped)
    for m, row in enumerate(rows):
        row["reward"] = None if reward is None else float(reward[m])
        row["kl_exact_seq_sum"] = None if kl is None else float(kl[m])
        if nll is not None:
            row["judge_nll_token_mean"] = float(nll[m] / ntok[m]) if ntok[m] else None
    summary = {"eval/count": len(rows), "eval/length": _mean(tokens), "eval/reward": _mean(reward),
               "eval/kl_exact_seq_sum": _mean(kl)}  # fmt: skip
    if nll is not None:
        per = [r["judge_nll_token_mean"] for r in rows if r["judge_nll_token_mean"] is not None]
        summary["eval/judge_nll_token_mean"] = _mean(per)
        summary["eval/judge_ppl"] = float(np.exp(nll.sum() / max(ntok.sum(), 1.0)))
    if ns.out:
        _write(rows, ns.out)
        Path(ns.out).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"
    line = f"{len(rows)} completions: mean reward {fmt(summary['eval/reward'])} ({what}); "
    where = f"to {src.ref}" if ref is not None else "no reference: give --ref"
    line += f"mean exact KL {fmt(summary['eval/kl_exact_seq_sum'])} nats/seq ({where})"
    if nll is not None:
        line += f"; judge NLL {fmt(summary['eval/judge_nll_token_mean'])} nats/token"
        line += f", perplexity {fmt(summary['eval/judge_ppl'])}"
    if ns.out:
        line += f"; wrote {ns.out} and {Path(ns.out).with_suffix('.summary.json')}"
    print(line)
    return 0
