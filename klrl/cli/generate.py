"""``klrl generate`` and ``klrl eval``: sample from a run, a checkpoint, an export or a model, and score it.

::

    klrl generate SOURCE (--prompts FILE | --prompt TEXT ...) [--n N] [--max-new-tokens T]
        [--temperature X] [--seed S] [--step N] [--out FILE.jsonl] [--batch-size B]
        [--data.chat_template B] [--data.prompt_len P] [--data.field NAME] [--ids]
    klrl eval SOURCE --prompts FILE [the same flags] [--reward.fn SPEC [--reward.weights W] |
        --reward-model DIR] [--ref MODEL] [--judge MODEL [--judge.chat_template B]]

``SOURCE`` is read by :func:`klrl.eval.policy.load_source` (a run directory: its latest checkpoint or
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
  each position floored at 0, both at temperature 1; its mean over completions sampled at temperature 1
  is the sequence KL); the reference is the run's ``model.path`` or ``--ref``;
* ``judge_nll_token_mean``: ``--judge MODEL``'s negative log-likelihood per token of the completion
  after its prompt, and ``judge_relevance_pmi_token_mean``, the judge's pointwise mutual information
  of completion and prompt per token (``(log p(y | x) - log p(y)) / |y|``, :mod:`klrl.eval.score`);
  the judge reads the prompts in its own format, not the policy's (``--judge.chat_template``: default
  its own chat template when its tokenizer has one, raw text otherwise); ``judge_ppl`` is ``exp`` of
  the NLL over all completion tokens.

``generate --ids`` adds each completion's token ids (``ids``, the stop token included).

The means go to one printed line and, with ``--out FILE.jsonl``, to ``FILE.summary.json`` (``eval/*``
names). Bad input (a SOURCE, prompt file, reward, reference or judge that cannot be read; a value out
of range; an unknown flag, with a did-you-mean) is one line, exit status 2, before anything is sampled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from klrl.cli.args import check_new_path, fail
from klrl.cli.flags import generate_parser
from klrl.config import ConfigError, DataConfig
from klrl.config.schema import closest
from klrl.data.chat import PromptDataError
from klrl.data.prompts import PromptPool, build_pool, read_records, resolve_path
from klrl.eval.policy import Source, SourceError, load_reference, load_source
from klrl.eval.sample import decode, token_ids
from klrl.eval.sample import sample as sample_pool
from klrl.eval.score import Judge, JudgeError, exact_kl
from klrl.models.catalog import resolve_model_path
from klrl.models.hf import CheckpointFormatError
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
    for flag, dest in (
        ("--data.chat_template", "chat_template"),
        ("--judge.chat_template", "judge_chat_template"),
    ):
        raw = getattr(ns, dest, None)
        if raw is not None:
            v = raw.strip().lower()
            if v not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                fail(f"{flag}: expected true or false (got {raw!r})")
            setattr(ns, dest, v in ("true", "1", "yes", "on"))
    if getattr(ns, "judge_chat_template", None) is not None and not ns.judge:
        fail("--judge.chat_template: give --judge MODEL too")
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


def sample(src: Source, pool: PromptPool, n: int, max_new: int, temperature: float, seed: int, batch: int):
    """:func:`klrl.eval.sample.sample` of ``src``'s policy with its ``sampling.use_eos``."""
    return sample_pool(
        src.model, src.params, src.tok, pool, n, max_new, temperature, seed, batch, src.sampling.use_eos
    )


def load_judge(ns: argparse.Namespace) -> Judge:
    """``--judge MODEL`` in its own format (``--judge.chat_template``: default its own template if its
    tokenizer has one, raw text otherwise), independent of the policy's ``data.chat_template``."""
    try:
        return Judge.load(ns.judge, ns.judge_chat_template)
    except JudgeError as e:
        fail(str(e))


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
        form = src.cfg.reward.completions if src.cfg is not None else "auto"  # a run's own rule
        host = make_host_reward(specs, w, src.tok, pool.prompts, pool.columns, completions=form)
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
    print(
        f"{src.what}; {len(pool)} prompts x {ns.n}, at most {ns.max_new_tokens} new tokens, "
        f"temperature {ns.temperature:g}, seed {ns.seed}"
    )
    idx, resp, mask = sample(src, pool, ns.n, ns.max_new_tokens, ns.temperature, ns.seed, ns.batch_size)
    rows = _rows(pool, idx, ns.n, *decode(src.tok, resp, mask))
    if ns.ids:
        for row, ids in zip(rows, token_ids(resp, mask), strict=True):
            row["ids"] = ids
    _write(rows, ns.out)
    if ns.out:
        print(f"wrote {len(rows)} completions to {ns.out}")
    return 0


def _mean(x) -> float | None:
    return None if x is None or not len(x) else float(np.nanmean(x)) if np.isfinite(x).any() else None


def _judge_rows(judge: Judge, pool: PromptPool, idx, texts, rows: list[dict], batch: int) -> dict[str, Any]:
    """Each row's judge NLL per token (after its prompt in the judge's format) and relevance (PMI per
    token, :meth:`klrl.eval.score.Judge.relevance`); their means."""
    rel = judge.relevance(texts, pool.prompts, idx, batch)
    n = rel["tokens"]
    with np.errstate(invalid="ignore", divide="ignore"):
        per = np.where(n > 0, rel["nll_cond"] / np.maximum(n, 1), np.nan)
    for m, row in enumerate(rows):
        row["judge_nll_token_mean"] = float(per[m]) if n[m] else None
        row["judge_relevance_pmi_token_mean"] = float(rel["pmi"][m]) if n[m] else None
    return {
        "eval/judge_nll_token_mean": _mean(per),
        "eval/judge_ppl": float(np.exp(rel["nll_cond"].sum() / max(n.sum(), 1.0))),
        "eval/judge_relevance_pmi_token_mean": _mean(rel["pmi"]),
    }


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
    judge = load_judge(ns) if ns.judge else None
    print(f"{src.what}; {len(pool)} prompts x {ns.n}, temperature {ns.temperature:g}, seed {ns.seed}")
    if judge is not None:
        print(f"judge {ns.judge}: prompts in {judge.format}")
    idx, resp, mask = sample(src, pool, ns.n, ns.max_new_tokens, ns.temperature, ns.seed, ns.batch_size)
    texts, tokens, stopped = decode(src.tok, resp, mask)
    reward = score(idx, resp, mask, texts)
    kl = (
        exact_kl(src.model, src.params, ref, pool, idx, resp, mask, ns.batch_size)
        if ref is not None
        else None
    )
    rows = _rows(pool, idx, ns.n, texts, tokens, stopped)
    for m, row in enumerate(rows):
        row["reward"] = None if reward is None else float(reward[m])
        row["kl_exact_seq_sum"] = None if kl is None else float(kl[m])
    summary = {"eval/count": len(rows), "eval/length": _mean(tokens), "eval/reward": _mean(reward),
               "eval/kl_exact_seq_sum": _mean(kl)}  # fmt: skip
    if judge is not None:
        summary.update(_judge_rows(judge, pool, idx, texts, rows, ns.batch_size))
    if ns.out:
        _write(rows, ns.out)
        Path(ns.out).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"
    line = f"{len(rows)} completions: mean reward {fmt(summary['eval/reward'])} ({what}); "
    where = f"to {src.ref}" if ref is not None else "no reference: give --ref"
    line += f"mean exact KL {fmt(summary['eval/kl_exact_seq_sum'])} nats/seq ({where})"
    if judge is not None:
        line += f"; judge NLL {fmt(summary['eval/judge_nll_token_mean'])} nats/token"
        line += f", perplexity {fmt(summary['eval/judge_ppl'])}"
        line += f", relevance {fmt(summary['eval/judge_relevance_pmi_token_mean'])} nats/token (PMI)"
    if ns.out:
        line += f"; wrote {ns.out} and {Path(ns.out).with_suffix('.summary.json')}"
    print(line)
    return 0
