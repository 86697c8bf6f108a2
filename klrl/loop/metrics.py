"""Metrics the run loop adds on the host (the compiled step is unchanged): the final values of the
HParams dashboard, the learning rates from the optimizer state, throughput, and other frameworks'
names for the metrics (``train.metric_aliases``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from klrl import distributed
from klrl.config import aliases
from klrl.io.results import SUMMARY_KEYS, tail_mean

FINAL_KEYS = (*SUMMARY_KEYS, "reward/gold", "eval/ref_ppl", "eval/oracle_ppl_floored", "eval/independent_ppl")


def final_metrics(metrics: dict[str, np.ndarray], window: int) -> dict[str, float]:
    """The final value of each logged :data:`FINAL_KEYS` metric: the mean of its finite values over
    the last ``window`` iterations (:func:`klrl.io.results.tail_mean`); non-finite ones left out."""
    out = {}
    for k in FINAL_KEYS:
        if k in metrics and len(metrics[k]):
            v = tail_mean(metrics[k], window)
            if math.isfinite(v):
                out[k] = v
    return out


def learning_rates(state: Any, n: int) -> dict[str, np.ndarray] | None:
    """The peak learning rates of each of ``n`` members, read on the host from the optimizer state's
    injected hyper-parameters (:func:`klrl.step.optim.make_optimizer`): ``optim/lr`` from
    ``opt_state[-1].hyperparams['step_size']`` (= -lr) and, where the critic has its own
    (``optim.critic_lr > 0``), ``optim/critic_lr`` from ``'critic_step_size'``; None for a state
    without them."""
    try:
        hp = state.opt_state[-1].hyperparams
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    if not isinstance(hp, dict) or "step_size" not in hp:
        return None
    names = {"step_size": "optim/lr", "critic_step_size": "optim/critic_lr"}
    return {
        name: np.broadcast_to(-np.asarray(distributed.to_host(hp[k]), np.float64).reshape(-1), (n,))
        for k, name in names.items()
        if k in hp
    }


def tokens_per_s(response_length: float, batch_size: int, seconds: float) -> float:
    """Response tokens generated per second: ``response/length`` (mean tokens per sequence) x
    ``train.batch_size`` sequences over the iteration's wall time."""
    return response_length * batch_size / seconds


def alias_map(kind: str) -> dict[str, str]:
    """``train.metric_aliases``: klrl metric name -> TRL's (``trl``, its PPOTrainer) or verl's names
    (:mod:`klrl.config.aliases`); ``''``: none."""
    return {"": {}, "trl": aliases.TRL_METRICS, "verl": aliases.VERL_METRICS}[kind]


def with_aliases(metrics: dict[str, float], names: dict[str, str]) -> dict[str, float]:
    """``metrics`` plus the same values under their aliases (an alias that is a klrl name is skipped)."""
    extra = {a: metrics[k] for k, a in names.items() if k in metrics and a not in metrics}
    return {**metrics, **extra}


def latest(rows: list[list[dict[str, Any]]], stacked: bool) -> dict[str, Any]:
    """The newest row's metrics (``iteration`` left out): ``{name: float}`` for a run,
    ``{name: [members]}`` for a sweep (NaN where a member's row lacks the name)."""
    if stacked:
        return {k: np.array([r[-1].get(k, np.nan) for r in rows]) for k in rows[0][-1] if k != "iteration"}
    return {k: v for k, v in rows[0][-1].items() if k != "iteration"}


def member_row(
    m: dict[str, Any], j: int | None, iteration: int, batch_size: int, lrs: Any
) -> dict[str, float]:
    """One member's row of the step's host metrics ``m`` (``j``: its index on the member axis; None: a
    single run), with the host-side metrics (the compiled step is unchanged): ``train/samples``
    (prompts seen after ``iteration + 1`` iterations) and the learning rates ``lrs``
    (:func:`learning_rates`: ``{name: per member}``; an array: ``optim/lr`` per member; None: none)."""
    row = {k: float(v if j is None else v[j]) for k, v in m.items()}
    row["train/samples"] = float((iteration + 1) * batch_size)
    if lrs is not None:
        for name, per_member in (lrs if isinstance(lrs, dict) else {"optim/lr": lrs}).items():
            row[name] = float(per_member[0 if j is None else j])
    return row


def timings(row: dict[str, float], batch_size: int, seconds: float) -> dict[str, float]:
    """The wall-time metrics of an iteration that took ``seconds``: ``train/iteration_s`` and, where
    the row has ``response/length``, ``perf/tokens_per_s``."""
    out = {"train/iteration_s": seconds}
    if "response/length" in row:
        out["perf/tokens_per_s"] = tokens_per_s(row["response/length"], batch_size, seconds)
    return out
