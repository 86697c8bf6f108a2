"""The host side of :func:`klrl.loop.driver.drive`'s stops: the lines it logs when it stops or rolls back,
the host reward's failure check and the state saved after rejected iterations (used by the hooks of
:mod:`klrl.loop.hooks`).

The decisions themselves (skip limit, rollback threshold, rollback beta) are in :mod:`klrl.loop.reliability`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from klrl.loop.reliability import Rollback
from klrl.rewards.host import RewardFunctionError


def skips_message(n_skips: int, max_skips: int, where: str) -> str:
    """The non-finite stop's one line."""
    return (
        f"{n_skips} consecutive iterations skipped by the non-finite guard (NaN/inf in loss, "
        f"gradients, reward or KL; train.max_consecutive_skips={max_skips}); last good state: {where}"
    )


def base_message(metric: str, base: float) -> str | None:
    """Why the quality rollback is off for a member (its metric at iteration 0 is not a positive
    number), or None."""
    if math.isfinite(base) and base > 0:
        return None
    return f"quality rollback off: {metric} = {base} at iteration 0 is not a positive number"


def _crossed(who: str, metric: str, d: Rollback, guard: str) -> str:
    """``metric``'s crossing; a guard of ``train.rollback_guards`` (``guard``) also names its reference
    (``d.value / d.ratio``, the metric at iteration 0)."""
    start = f"its start {d.value / d.ratio:.4g}" if guard else "its start"
    return f"{who}{metric} = {d.value:.4g} at iteration {d.crossing} is {d.ratio:.3f}x {start}"


def give_up_message(
    who: str, metric: str, d: Rollback, threshold: float, rollbacks: int, guard: str = ""
) -> str:
    """The quality rollback's stop after ``train.max_rollbacks`` rollbacks (of all its guards together);
    ``guard``: the guard of ``train.rollback_guards`` that crossed ('': ``train.rollback_metric``)."""
    past = f"guard {guard} (train.rollback_guards)" if guard else f"train.rollback_threshold {threshold}"
    return (
        f"{_crossed(who, metric, d, guard)}, past {past}, after {rollbacks} rollbacks "
        f"(train.max_rollbacks); newest good checkpoint: {d.step}"
    )


def rollback_message(
    n: int,
    max_n: int,
    who: str,
    metric: str,
    d: Rollback,
    threshold: float,
    target: int,
    old: float,
    new: float,
    guard: str = "",
) -> str:
    """A rollback's line (logged and written as an event): the guard that crossed (``guard``, as written in
    ``train.rollback_guards``; '': ``train.rollback_metric`` with ``threshold``), its metric's value, ratio
    and (a guard's) reference, the state restored and beta's change."""
    why = f"guard {guard}" if guard else f"threshold {threshold}"
    return (
        f"rollback {n}/{max_n}: {_crossed(who, metric, d, guard)} ({why}); restored "
        f"{'the initial state' if target == 0 else f'checkpoint {target}'}, "
        f"beta {old:.4g} -> {new:.4g}"
    )


def reward_error(check: Callable[[], None] | None) -> Exception | None:
    """The host reward function's failure: the ``RewardFunctionError`` ``check`` raises, or None
    (also for no ``check``)."""
    if check is None:
        return None
    try:
        check()
    except RewardFunctionError as e:
        return e
    return None


def reward_failure(check: Callable[[], None] | None, skipped: np.ndarray) -> Exception | None:
    """:func:`reward_error`, asked only when the row's iteration was rejected by the guard
    (``skipped``: its ``guard/skipped``, per member)."""
    if check is None or not (skipped > 0).any():
        return None
    return reward_error(check)


def restamp(host: Any, rows: list[list[dict[str, Any]]]) -> Any:
    """``host`` (a host copy of the last good parameters after rejected iterations) as the state after
    the rows written: its iteration counter set to their number, its skip count to their last one."""
    it = np.asarray(host.iteration)
    prev = np.asarray([r[-1].get("guard/consecutive_skips", 0.0) if r else 0.0 for r in rows])
    return host._replace(
        iteration=np.full_like(it, len(rows[0])),
        skipped=prev.reshape(it.shape).astype(np.asarray(host.skipped).dtype),
    )
