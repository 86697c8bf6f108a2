"""``reward.timeout`` (issue 52, item 5): a host reward call that does not return within the limit is
the function's failure, like one that raises: recorded as ``TIMED_OUT`` on every row of the call, one
line naming the function from ``check``; a call that returns in time, or any call with no limit, is
unchanged (same values, same thread with no limit). The end-to-end run (last good state checkpointed,
lock released, exit 2, the process exits although the call is still running) is in
tests/loop/test_reward_failure.py."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from texttok import make_tokenizer

from klrl.rewards import RewardFunctionError, make_host_reward
from klrl.rewards.host import ABORTED, TIMED_OUT

PROMPTS = ["What is 17 + 25?", "Say something nice."]
COMPLETIONS = ["The answer is 42.", "You are kind.", "42", "hello"]
IDX = np.array([0, 1, 0, 1], np.int32)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def release():
    """An event the hanging function waits on; set at the end so that no thread outlives the test."""
    ev = threading.Event()
    yield ev
    ev.set()


def _batch(tok, r: int = 16):
    resp = np.zeros((len(COMPLETIONS), r), np.int32)
    mask = np.zeros((len(COMPLETIONS), r), np.float32)
    for i, c in enumerate(COMPLETIONS):
        ids = tok.encode(c)[:r]
        resp[i, : len(ids)], mask[i, : len(ids)] = ids, 1.0
    return resp, mask


def test_a_call_that_does_not_return_is_the_functions_failure_under_jit(tok, release):
    def hangs(completions):
        release.wait()
        return [1.0] * len(completions)

    rw = make_host_reward([hangs], None, tok, PROMPTS, stop_after_error=True, timeout=0.3)
    resp, mask = _batch(tok)
    t0 = time.monotonic()
    scores, error = jax.jit(rw)(IDX, resp, mask)
    error = np.asarray(error)
    assert 0.3 <= time.monotonic() - t0 < 30
    assert error.tolist() == [TIMED_OUT] * 4 and np.asarray(scores).tolist() == [0.0] * 4
    with pytest.raises(RewardFunctionError, match=r"^reward function \S*hangs: did not return within 0\.3 s "
                       r"\(reward\.timeout; its call is left running\)$"):  # fmt: skip
        rw.check(error)
    # a training run's mode: no later call is made (ABORTED), so no second thread hangs
    _, error2 = jax.jit(rw)(IDX, resp, mask)
    assert np.asarray(error2).tolist() == [ABORTED] * 4


def test_a_hang_before_compiling_is_one_line(tok, release):
    def hangs(completions):
        release.wait()

    rw = make_host_reward([hangs], None, tok, PROMPTS, timeout=0.2)
    with pytest.raises(RewardFunctionError, match=r"hangs: did not return within 0\.2 s .*a call before"):
        rw.probe([0, 1], ["a", "b"])


def test_in_time_and_without_a_limit_the_scores_are_the_same(tok):
    seen = []

    def length(completions):
        seen.append(threading.current_thread())
        return [float(len(c)) for c in completions]

    def raises(completions):
        raise ValueError("bad")

    resp, mask = _batch(tok)
    out = {}
    for t in (None, 0, 30.0):
        rw = make_host_reward([length], None, tok, PROMPTS, timeout=t)
        seen.clear()
        scores, error = rw.score_numpy(IDX, resp, mask)[0::2]
        out[t] = scores.tolist()
        assert error.tolist() == [0] * 4
        # no limit: called on the caller's thread; a limit: on a thread of its own
        assert (seen[0] is threading.current_thread()) == (not t)
    assert out[None] == out[0] == out[30.0] == [float(len(tok.decode(tok.encode(c)))) for c in COMPLETIONS]
    rw = make_host_reward([raises], None, tok, PROMPTS, timeout=30.0)  # its exception, not a timeout
    with pytest.raises(RewardFunctionError, match=r"raises: raised ValueError: bad"):
        rw.probe([0], ["a"])


def test_the_field():
    from klrl.config import ConfigError, RunConfig

    assert RunConfig().reward.timeout == 600.0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"^reward\.timeout: "):
            RunConfig().replace(reward={"timeout": bad})
