"""klrl.loop.stops (the stop lines, the reward-failure check, restamp) and the host-side helpers the
loop uses (klrl.loop.metrics.member_row/timings, klrl.loop.reliability.rollback_betas), against hand
values."""

from typing import NamedTuple

import numpy as np
import pytest

from klrl.loop.metrics import member_row, timings
from klrl.loop.reliability import Rollback, rollback_betas
from klrl.loop.stops import base_message, restamp, reward_failure, rollback_message, skips_message
from klrl.rewards.host import RewardFunctionError


def test_messages_by_hand():
    assert skips_message(3, 3, "none yet").startswith("3 consecutive iterations skipped")
    assert skips_message(3, 3, "none yet").endswith(
        "train.max_consecutive_skips=3); last good state: none yet"
    )
    assert base_message("reward/gold", 0.5) is None
    for bad in (0.0, -1.0, float("nan")):
        assert base_message("reward/gold", bad).startswith("quality rollback off: reward/gold = ")
    d = Rollback(crossing=7, value=1.5, ratio=3.0, step=4)
    line = rollback_message(1, 2, "member 01: ", "m", d, 2.0, 0, 0.1, 0.2)
    assert line == (
        "rollback 1/2: member 01: m = 1.5 at iteration 7 is 3.000x its start (threshold 2.0); "
        "restored the initial state, beta 0.1 -> 0.2"
    )
    assert "restored checkpoint 4," in rollback_message(1, 2, "", "m", d, 2.0, 4, 0.1, 0.2)


def test_reward_failure_asks_only_after_a_rejected_iteration():
    calls = []

    def check():
        calls.append(1)
        raise RewardFunctionError("boom")

    assert reward_failure(None, np.ones(2)) is None
    assert reward_failure(check, np.zeros(2)) is None and not calls
    err = reward_failure(check, np.array([0.0, 1.0]))
    assert isinstance(err, RewardFunctionError) and str(err) == "boom" and calls == [1]
    assert reward_failure(lambda: None, np.ones(1)) is None


class _State(NamedTuple):
    iteration: np.ndarray
    skipped: np.ndarray
    w: np.ndarray


def test_restamp_sets_the_counters_from_the_rows():
    host = _State(np.array([9, 9], np.int32), np.array([0, 0], np.int32), np.arange(2.0))
    rows = [[{"guard/consecutive_skips": 0.0}, {"guard/consecutive_skips": 2.0}], [{}, {}]]
    out = restamp(host, rows)
    np.testing.assert_array_equal(out.iteration, [2, 2])
    np.testing.assert_array_equal(out.skipped, [2, 0])
    assert out.skipped.dtype == np.int32 and out.w is host.w


def test_rollback_betas_only_the_crossed_members():
    out = rollback_betas(np.array([0.1, 0.2, 0.3], np.float32), np.array([0.4, 0.1, 0.3]), [0, 1], 2.0)
    np.testing.assert_allclose(out, [0.8, 0.4, 0.3], rtol=1e-6)
    assert out.dtype == np.float32 and out.shape == (3,)
    one = rollback_betas(np.float32(0.05), np.float32(0.02), [0], 3.0)
    assert one.shape == () and float(one) == pytest.approx(0.15)


def test_member_row_and_timings():
    m = {"a": np.array([1.0, 2.0])}
    assert member_row(m, 1, 4, 8, np.array([0.1, 0.2])) == {"a": 2.0, "train/samples": 40.0, "optim/lr": 0.2}
    assert member_row({"a": 3.0}, None, 0, 2, None) == {"a": 3.0, "train/samples": 2.0}
    assert timings({}, 4, 2.0) == {"train/iteration_s": 2.0}
    t = timings({"response/length": 10.0}, 4, 2.0)
    assert t["perf/tokens_per_s"] == pytest.approx(20.0)
