"""Metrics the run loop adds on the host (the compiled step is unchanged): the final values of the
HParams dashboard, the learning rate from the optimizer state, throughput, and other frameworks'
names for the metrics (``train.metric_aliases``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from klrl import distributed
from klrl.aggregate import tail_mean
from klrl.results import SUMMARY_KEYS

FINAL_KEYS = (*SUMMARY_KEYS, "reward/gold", "eval/ref_ppl", "eval/oracle_ppl_floored", "eval/independent_ppl")


def final_metrics(metrics: dict[str, np.ndarray], window: int) -> dict[str, float]:
    """The final value of each logged :data:`FINAL_KEYS` metric: the mean of its finite values over
    the last ``window`` iterations (:func:`klrl.aggregate.tail_mean`); non-finite ones left out."""
    out = {}
    for k in FINAL_KEYS:
        if k in metrics and len(metrics[k]):
            v = tail_mean(metrics[k], window)
            if math.isfinite(v):
                out[k] = v
    return out


def learning_rates(state: Any, n: int) -> np.ndarray | None:
    """The peak learning rate of each of ``n`` members, read on the host from the optimizer state's
    injected hyper-parameter (``opt_state[-1].hyperparams['step_size']`` = -lr, see
    :func:`klrl.train_parts.make_optimizer`); None for a state without one."""
    try:
        step_size = state.opt_state[-1].hyperparams["step_size"]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return np.broadcast_to(-np.asarray(distributed.to_host(step_size), np.float64).reshape(-1), (n,))


def tokens_per_s(response_length: float, batch_size: int, seconds: float) -> float:
    """Response tokens generated per second: ``response/length`` (mean tokens per sequence) x
    ``train.batch_size`` sequences over the iteration's wall time."""
    return response_length * batch_size / seconds


def alias_map(kind: str) -> dict[str, str]:
    """``train.metric_aliases``: klrl metric name -> TRL's (``trl``, its PPOTrainer) or verl's names
    (:mod:`klrl.aliases`); ``''``: none."""
    from klrl import aliases

    return {"": {}, "trl": aliases.TRL_METRICS, "verl": aliases.VERL_METRICS}[kind]


def with_aliases(metrics: dict[str, float], names: dict[str, str]) -> dict[str, float]:
    """``metrics`` plus the same values under their aliases (an alias that is a klrl name is skipped)."""
    extra = {a: metrics[k] for k, a in names.items() if k in metrics and a not in metrics}
    return {**metrics, **extra}
