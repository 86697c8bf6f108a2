"""One held-out evaluation of a policy, every response stored: what a real-LM study records at each step.

:func:`evaluate` samples ``n`` responses to each prompt of a held-out pool (:func:`klrl.eval.sample.sample`,
a fixed seed: two policies that differ little draw nearly the same responses, common random numbers) and
returns one record per response with everything a claim is computed from: the text and its token ids, the
exact KL to the reference (:func:`klrl.eval.score.exact_kl`), the judge's NLL per token of the text alone
and its relevance (:meth:`klrl.eval.score.Judge.relevance`), the gold and its parts
(:func:`klrl.eval.gold.gold_parts`) and each proxy's score. :func:`summary` gives the means and the
diversity of one evaluation (:mod:`klrl.eval.diversity`). :func:`evaluate_runs` evaluates every checkpoint
of the members of a sweep (PPO or DPO) so; :func:`reference_rows` and :func:`judge_rows` are a pool of the
reference's own responses with their judge numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from klrl.config import DataConfig
from klrl.data.prompts import PromptPool, load_prompts
from klrl.eval import diversity, gold
from klrl.eval.policy import Source, checkpoint_steps, policy_at
from klrl.eval.sample import decode, sample, token_ids
from klrl.eval.score import Judge, exact_kl

Proxy = Callable[[list[Any], list[str]], np.ndarray]  # (prompts, responses) -> [M], e.g. RewardModel.score


def evaluate(
    policy: tuple[Any, Any],
    ref: tuple[Any, Any],
    tok: Any,
    pool: PromptPool,
    judge: Judge,
    free: dict[str, float],
    *,
    max_new: int,
    proxies: dict[str, Proxy] | None = None,
    n: int = 1,
    seed: int = 0,
    batch: int = 16,
) -> list[dict[str, Any]]:
    """Per response (prompt-major, ``n`` per prompt, temperature 1): ``prompt_idx``, ``sample``,
    ``completion``, ``ids``, ``kl`` (exact, nats/seq), the gold's parts (``gold``, ``sentiment``,
    ``repeated``, ``judge_nll``, ``relevance``, ...) and ``proxy_<name>`` for each of ``proxies``."""
    model, params = policy
    idx, resp, mask = sample(model, params, tok, pool, n, max_new, 1.0, seed, batch)
    texts, _, _ = decode(tok, resp, mask)
    kl = exact_kl(model, params, ref, pool, idx, resp, mask, batch)
    rel = judge.relevance(texts, pool.prompts, idx, batch)
    per = np.where(rel["tokens"] > 0, rel["nll_text"] / np.maximum(rel["tokens"], 1), np.nan)
    parts = gold.score(texts, per, rel["pmi"], free)
    prompts = [pool.prompts[i] for i in idx]
    scores = {k: np.asarray(f(prompts, texts)) for k, f in (proxies or {}).items()}
    out = []
    for m, (i, ids) in enumerate(zip(idx, token_ids(resp, mask), strict=True)):
        rec = {
            "prompt_idx": int(i),
            "sample": int(m % n),
            "completion": texts[m],
            "ids": ids,
            "kl": float(kl[m]),
        }
        rec.update(parts[m])
        rec.update({f"proxy_{k}": float(v[m]) for k, v in scores.items()})
        out.append(rec)
    return out


def summary(records: list[dict[str, Any]], threshold: float = 0.7) -> dict[str, float]:
    """The means of every numeric field of ``records`` (NaNs left out), ``kl_sd``, ``distinct2`` and
    ``duplicates`` (the cross-prompt near-duplicate share at ``threshold``)."""
    keys = [k for k, v in records[0].items() if isinstance(v, float)]
    out = {k: float(np.nanmean([r[k] for r in records])) for k in keys}
    texts, prompts = [r["completion"] for r in records], [r["prompt_idx"] for r in records]
    out["kl_sd"] = float(np.std([r["kl"] for r in records]))
    out["distinct2"] = diversity.distinct_n(texts, 2)
    out["duplicates"] = diversity.duplicate_share(texts, prompts, threshold)
    out["n"] = len(records)
    return out


def evaluate_runs(
    dirs: list[Any],
    judge: Judge,
    free: dict[str, float],
    data: DataConfig,
    *,
    max_new: int,
    proxies: Callable[[Source], dict[str, Proxy]] | None = None,
    n: int = 1,
    seed: int = 0,
    log: Callable[[int, int, dict[str, float]], Any] | None = None,
    skip: tuple[int, ...] = (),
    reference: bool = True,
) -> list[dict[str, Any]]:
    """Every run of ``dirs`` (the members of one sweep, PPO or DPO: :func:`klrl.eval.policy.policy_at`) at
    each complete checkpoint of the first, step-major, after the reference once (``member`` -1, step 0): the
    records of :func:`evaluate` on the held-out prompts of ``data`` (:func:`klrl.data.prompts.load_prompts`)
    with ``member`` (the index in ``dirs``) and ``step``. ``proxies(src)``: the proxies, built once from the
    first checkpoint's :class:`~klrl.eval.policy.Source` (its base); ``log(member, step, summary)``.
    ``skip``: checkpoint steps already evaluated (a continued run's earlier ones), left out;
    ``reference=False`` leaves out the reference's rows."""
    steps = checkpoint_steps(dirs[0])
    src0 = policy_at(dirs[0], steps[0])
    ref = (src0.model, src0.ref_params)
    pool = load_prompts(data, src0.tok).eval
    kw = {"max_new": max_new, "proxies": proxies(src0) if proxies else None, "seed": seed, "n": n}
    rows = (
        [{"member": -1, "step": 0, **r} for r in evaluate(ref, ref, src0.tok, pool, judge, free, **kw)]
        if reference
        else []
    )  # (not sampled at all when left out)
    for step in [s for s in steps if s not in skip]:
        for j, d in enumerate(dirs):
            src = policy_at(d, step)
            recs = evaluate((src.model, src.params), ref, src.tok, pool, judge, free, **kw)
            rows += [{"member": j, "step": step, **r} for r in recs]
            if log is not None:
                log(j, step, summary(recs))
    return rows


def reference_rows(
    model: Any, params: Any, tok: Any, pool: PromptPool, n: int, max_new: int, seed: int
) -> list[dict]:
    """``n`` responses (temperature 1) of ``(model, params)`` to each prompt of ``pool``: ``prompt_idx``,
    ``sample`` (0..n-1), ``completion`` (the text) and ``ids`` (its tokens)."""
    idx, resp, mask = sample(model, params, tok, pool, n, max_new, 1.0, seed, 64)
    texts, _, _ = decode(tok, resp, mask)
    return [
        {"prompt_idx": int(i), "sample": m % n, "completion": t, "ids": ids}
        for m, (i, t, ids) in enumerate(zip(idx, texts, token_ids(resp, mask), strict=True))
    ]


def judge_rows(judge: Judge, prompts: list[Any], rows: list[dict[str, Any]]) -> None:
    """Adds the judge's ``judge_nll`` per token (the text alone; NaN if empty) and ``relevance`` (PMI,
    :meth:`klrl.eval.score.Judge.relevance`) to each of ``rows`` (``prompt_idx`` into ``prompts``)."""
    rel = judge.relevance([r["completion"] for r in rows], prompts, [r["prompt_idx"] for r in rows])
    for r, a, b, k in zip(rows, rel["nll_text"], rel["pmi"], rel["tokens"], strict=True):
        r["judge_nll"], r["relevance"] = (float(a / k), float(b)) if k else (float("nan"), float("nan"))
