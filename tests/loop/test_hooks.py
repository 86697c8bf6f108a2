"""klrl.loop.hooks, each hook driven directly (fake rows, writers and states; no model, no step):
checkpoints (every=, the metadata, where_saved, drop/restore), the metrics sink (rows, aliases,
timing, the on_step callback, notes, a rollback's truncation), samples, progress, the skip stop, the
quality rollback (its Restore and Stop requests), the held-out evaluation, the reward failure and the
signals (their Stop requests); against hand values."""

from __future__ import annotations

import math
import os
import signal
from typing import Any, NamedTuple

import numpy as np
import pytest

import klrl.loop.hooks as H
from klrl.config import RunConfig
from klrl.io import checkpoint as ckpt
from klrl.loop.hooks import (
    Checkpoints,
    HeldOut,
    Loop,
    MetricsSink,
    Note,
    ProgressLine,
    QualityRollback,
    Rejected,
    Restore,
    RewardFailure,
    Row,
    Signals,
    SkipStop,
    Stop,
)
from klrl.loop.program import Program
from klrl.loop.reliability import StopSignals
from klrl.loop.samples import SampleLog, Samples
from klrl.rewards.host import RewardFunctionError


def _cfg(**train: Any) -> RunConfig:
    return RunConfig().replace(train={"iterations": 6, **train})


def _prog(cfgs: list[RunConfig], stacked: bool = False, **kw: Any) -> Program:
    return Program(configs=cfgs, stacked=stacked, init=lambda: None, step=lambda s, e: (s, {}),
                   place=kw.pop("place", lambda s: s), env="env", **kw)  # fmt: skip


def _loop(cfgs: list[RunConfig], stacked: bool = False, rows: Any = None, **kw: Any) -> Loop:
    prog = _prog(cfgs, stacked, **kw.pop("prog", {}))
    rows = rows if rows is not None else [[] for _ in cfgs]
    return Loop(prog, kw.pop("root", None), kw.pop("dirs", [None] * len(cfgs)), kw.pop("writers", []),
                kw.pop("state", None), rows, start=kw.pop("start", len(rows[0])), **kw)  # fmt: skip


class _Writer:
    """A MetricsWriter that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def write(self, it: int, m: dict) -> None:
        self.calls.append(("write", it, dict(m)))

    def write_timing(self, it: int, m: dict) -> None:
        self.calls.append(("timing", it, dict(m)))

    def event(self, it: int, kind: str, msg: str) -> None:
        self.calls.append(("event", it, kind, msg))


def _row(loop: Loop, it: int, members: list[dict], metrics: dict | None = None, samples: Any = None) -> Row:
    """Row ``it`` appended to the loop's rows, as the driver records it."""
    for j, mj in enumerate(members):
        loop.rows[j].append({"iteration": it, **mj})
    return Row(it, metrics or {}, members, samples or {})


def test_loop_starts_at_its_start_and_reads_the_program():
    loop = _loop([_cfg(), _cfg()], stacked=True, rows=[[{}, {}], [{}, {}]])
    assert (loop.i, loop.start, loop.recorded, loop.iterations, loop.stacked) == (2, 2, 2, 6, True)
    assert (loop.pending, loop.stopped, loop.stop_error, loop.reward_stop) == (None, None, None, None)


# ---- checkpoints -----------------------------------------------------------------------------------


def test_checkpoints_due_every_and_at_the_end():
    c = Checkpoints(None, 3, 7, None, lambda: None)
    assert [i for i in range(1, 8) if c.due(i)] == [3, 6, 7]
    assert [i for i in range(1, 8) if Checkpoints(None, 0, 7, None, lambda: None).due(i)] == [7]


def test_checkpoints_without_a_manager_save_nothing():
    c = Checkpoints(None, 1, 4, None, lambda: None)
    c.save(_loop([_cfg()]), 2)
    assert c.last_saved == -1 and c.where_saved() == "not saved (write=False)"
    c.on_stop(_loop([_cfg()]))  # nothing to close


def test_checkpoints_save_once_with_the_rows_in_the_meta(tmp_path):
    mgr = ckpt.manager(tmp_path, keep=5, async_save=True)
    base = {"metric": "m", "value": 0.5}
    c = Checkpoints(mgr, 2, 6, {"w": np.zeros(3, np.float32)}, lambda: base)
    loop = _loop(
        [_cfg()], rows=[[{"a": 1.0}, {"a": 2.0}]], rollbacks=1, state={"w": np.arange(3.0, dtype=np.float32)}
    )
    assert c.where_saved() == "none yet"
    c.save(loop, 2)
    loop.rows[0].append({"a": 3.0})
    c.save(loop, 2)  # the same step: not saved again
    loop.state = {"w": np.full(3, 7.0, np.float32)}
    c.save(loop, 3)
    assert c.steps() == [2, 3] and c.last_saved == 3
    assert c.where_saved() == f"checkpoint 3 in {mgr.directory}"
    meta = ckpt.read_meta(mgr, 2)
    assert meta["iteration"] == 2 and meta["metrics_lines"] == 2 and meta["rollbacks"] == 1
    assert meta["rollback_base"] == base and meta["config"] == _cfg().to_dict() and "members" not in meta
    assert ckpt.read_meta(mgr, 3)["metrics_lines"] == 3
    np.testing.assert_array_equal(c.restore(2)["w"], [0.0, 1.0, 2.0])
    c.drop_after(2)
    assert ckpt.steps(mgr) == [2] and c.last_saved == 2
    c.drop_after(0)
    assert ckpt.steps(mgr) == [] and c.last_saved == -1
    c.on_stop(loop)


def test_checkpoints_of_a_sweep_keep_every_members_config(tmp_path):
    mgr = ckpt.manager(tmp_path, keep=2, async_save=False)
    cfgs = [_cfg(), _cfg().replace(kl={"beta": 0.5})]
    c = Checkpoints(mgr, 1, 6, None, lambda: None)
    c.save(_loop(cfgs, stacked=True, state={"w": np.zeros(2)}), 1)
    meta = ckpt.read_meta(mgr, 1)
    assert meta["members"] == [x.to_dict() for x in cfgs] and meta["rollback_base"] is None
    c.on_stop(None)


# ---- metrics sink -----------------------------------------------------------------------------------


class _Clock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_sink_writes_each_member_with_aliases_times_rows_and_calls_back(monkeypatch):
    writers = [_Writer(), _Writer()]
    cfgs = [_cfg(batch_size=4), _cfg(batch_size=8)]
    loop = _loop(cfgs, stacked=True, writers=writers)
    seen = []
    sink = MetricsSink({"ctrl/beta": "coef", "x": "y"}, lambda it, m: seen.append((it, m)))
    monkeypatch.setattr(H.time, "time", _Clock(10.0, 12.5, 12.5, 20.0))
    members = [{"ctrl/beta": 0.1, "response/length": 5.0}, {"ctrl/beta": 1.0}]
    for it in range(4):
        if it == 3:
            sink.truncate(loop, 3)  # a restore: the next row is not timed
        sink.on_row(loop, _row(loop, it, members))
    w0 = writers[0].calls
    assert w0[0] == ("write", 0, {"ctrl/beta": 0.1, "response/length": 5.0, "coef": 0.1})
    # iteration 1: 2.5 s after iteration 0; 5 tokens x 4 sequences / 2.5 s; iteration 2 took 0 s
    assert w0[1] == ("timing", 1, {"train/iteration_s": 2.5, "perf/tokens_per_s": 8.0})
    assert [c[:2] for c in w0] == [("write", 0), ("timing", 1), ("write", 1), ("write", 2), ("write", 3)]
    assert writers[1].calls[1] == ("timing", 1, {"train/iteration_s": 2.5})  # no response/length
    assert [it for it, _ in seen] == [0, 1, 2, 3]
    np.testing.assert_array_equal(seen[0][1]["ctrl/beta"], [0.1, 1.0])
    assert "coef" not in seen[0][1]  # aliases only in the files


def test_sink_without_aliases_writers_or_on_process_0():
    loop = _loop([_cfg()], writers=[_Writer()])
    seen = []
    MetricsSink({}, lambda it, m: seen.append((it, m))).on_row(loop, _row(loop, 0, [{"a": 1.0}]))
    assert loop.writers[0].calls == [("write", 0, {"a": 1.0})] and seen == [(0, {"a": 1.0})]
    other = _loop([_cfg()], main=False)
    MetricsSink({}, lambda it, m: seen.append(it)).on_row(other, _row(other, 0, [{"a": 1.0}]))
    assert len(seen) == 1  # not on the other processes


def test_sink_times_the_steps_ready_not_the_recording(monkeypatch):
    # two rows recorded at the same moment (a checkpoint's pair) whose steps finished 3 s apart
    loop = _loop([_cfg(batch_size=4)], writers=[_Writer()])
    monkeypatch.setattr(H.time, "time", lambda: 100.0)
    sink = MetricsSink({}, None)
    for it, ready in enumerate([50.0, 53.0]):
        sink.on_row(loop, Row(it, {}, [{"response/length": 3.0}], {}, ready))
    assert loop.writers[0].calls[1] == ("timing", 1, {"train/iteration_s": 3.0, "perf/tokens_per_s": 4.0})


class _Late:
    """Ready ``delay`` seconds after it is made (a step still running on a device)."""

    def __init__(self, delay: float) -> None:
        import time

        self.at = time.time() + delay

    def block_until_ready(self) -> _Late:
        import time

        time.sleep(max(0.0, self.at - time.time()))
        return self


def test_ready_times_when_outputs_become_ready_in_dispatch_order():
    import time

    times = H.ReadyTimes()
    t0 = time.time()
    a, b = _Late(0.2), _Late(0.4)
    when_a, when_b = times.watch({"m": a}), times.watch([b])
    assert time.time() - t0 < 0.1  # watch does not wait
    assert when_b() == pytest.approx(b.at, abs=0.05) and when_a() == pytest.approx(a.at, abs=0.05)
    times.close()
    assert times.watch({})() >= b.at  # a new watcher after a stop


# ---- samples and progress ------------------------------------------------------------------------------


class _SampleLog:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def write(self, it: int, rows: Any, stacked: bool) -> list[str]:
        self.calls.append((it, rows, stacked))
        return ["| table |"]

    def close(self) -> None:
        self.calls.append("close")


def test_samples_written_and_closed():
    log = _SampleLog()
    loop = _loop([_cfg()])
    h = Samples(log)
    notes = h.on_row(loop, _row(loop, 3, [{}], samples={"ids": [1]}))
    h.on_stop(loop)
    assert log.calls == [(3, {"ids": [1]}, False), "close"]
    assert notes == [Note(0, 3, "samples", "| table |", tag="samples/text")]  # TensorBoard's, via the sink
    off = Samples(None)  # off: nothing to do
    off.on_row(loop, _row(loop, 4, [{}]))
    off.on_stop(loop)


def test_samples_only_with_writers_a_tokenizer_and_samples_every(tmp_path):
    tok = object()
    assert Samples.of(_loop([_cfg(samples_every=2)], prog={"tokenizer": tok})).log is None  # no writer
    w = [_Writer()]
    assert Samples.of(_loop([_cfg(samples_every=2)], writers=w)).log is None  # no tokenizer
    assert Samples.of(_loop([_cfg(samples_every=0)], writers=w, prog={"tokenizer": tok})).log is None
    h = Samples.of(_loop([_cfg(samples_every=2)], writers=w, dirs=[tmp_path], prog={"tokenizer": tok}))
    assert isinstance(h.log, SampleLog) and (h.log.every, h.log.iterations) == (2, 6)
    h.on_stop(None)


class _Progress:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def update(self, it: int, metrics: dict, extra: str = "") -> None:
        self.calls.append((it, metrics, extra))

    def close(self) -> None:
        self.calls.append("close")


def test_progress_line_of_a_run_and_of_a_sweep():
    p = _Progress()
    one = _loop([_cfg()])
    ProgressLine(p).on_row(one, Row(2, {"reward/task": np.float32(0.5)}, [{}]))
    assert p.calls == [(2, {"reward/task": 0.5}, "")] and type(p.calls[0][1]["reward/task"]) is float
    sweep = _loop([_cfg(), _cfg()], stacked=True)
    m = {"reward/task": np.array([1.0, 3.0]), "ctrl/beta": np.array([0.1, 1.0])}
    h = ProgressLine(p)
    h.on_row(sweep, Row(4, m, [{}, {}]))
    h.on_stop(sweep)
    assert p.calls[1:] == [(4, {"reward/task": 2.0}, "beta 0.1..1 (2 members, mean)"), "close"]


# ---- quality rollback ----------------------------------------------------------------------------------


class _Ctrl(NamedTuple):
    beta: Any


class _State(NamedTuple):
    w: Any
    ctrl: _Ctrl


def _rollback(tc: Any, stacked: bool, n: int, initial: Any = None) -> tuple[QualityRollback, list[str]]:
    logs: list[str] = []
    if initial is None:
        initial = _State(0, _Ctrl(np.zeros(n if stacked else (), np.float32)))
    metrics = dict.fromkeys(g.metric for g in tc.guards())
    traces, bases = {m: [[] for _ in range(n)] for m in metrics}, {m: [None] * n for m in metrics}
    return QualityRollback(tc, stacked, logs.append, traces, bases, initial), logs


def test_rollback_traces_its_metric_and_words_a_bad_base():
    tc = _cfg(rollback_metric="m", rollback_threshold=2.0).train
    writers = [_Writer(), _Writer()]
    loop = _loop(
        [_cfg(), _cfg()], stacked=True, writers=writers, state=_State(5, _Ctrl(np.ones(2, np.float32)))
    )
    h, logs = _rollback(tc, True, 2)
    notes = h.on_row(loop, _row(loop, 0, [{"m": 1.0}, {"m": 0.0}]))
    assert logs == ["member 01: quality rollback off: m = 0.0 at iteration 0 is not a positive number"]
    assert notes == [Note(1, 0, "rollback_off", logs[0])]  # for the sink, the event files' owner
    assert writers[1].calls == [] and writers[0].calls == []
    assert h.base_meta() == {"metric": "m", "values": [1.0, 0.0]}
    assert h.on_row(loop, _row(loop, 1, [{"m": 1.9}, {"m": 5.0}])) == []
    assert not h.crossed()  # 1.9 < 2 x 1; member 1's check is off
    h.ckpts = _Ckpts([])
    (restore,) = h.on_row(loop, _row(loop, 2, [{"m": 2.1}, {}]))  # crossed: a rollback to step 0
    assert h.crossed() and h.traces["m"][0] == [1.0, 1.9, 2.1] and math.isnan(h.traces["m"][1][-1])
    assert isinstance(restore, Restore) and restore.step == 0
    assert len(logs) == 2 and logs[1].startswith("rollback 1/3: member 00: m = 2.1")  # the base set once


def test_rollback_base_of_a_run_and_inert_without_a_metric():
    h, _ = _rollback(_cfg(rollback_metric="m", rollback_threshold=2.0).train, False, 1)
    loop = _loop([_cfg()])
    h.on_row(loop, _row(loop, 0, [{"m": math.nan}]))
    assert h.base_meta() == {"metric": "m", "value": None}  # a non-finite base is saved as None
    off, logs = _rollback(_cfg().train, False, 1)
    off.on_row(loop, _row(loop, 1, [{"m": 5.0}]))
    assert off.base_meta() is None and not off.crossed() and off.traces == {} and not logs


class _Ckpts:
    """The part of Checkpoints the rollback and the reward failure use, recorded."""

    def __init__(self, steps: list[int], restored: Any = None, mgr: Any = "mgr") -> None:
        self._steps, self.restored, self.mgr, self.calls = steps, restored, mgr, []

    def steps(self) -> list[int]:
        return self._steps

    def restore(self, step: int) -> Any:
        self.calls.append(("restore", step))
        return self.restored

    def drop_after(self, step: int) -> None:
        self.calls.append(("drop_after", step))

    def save(self, loop: Loop, step: int) -> None:
        self.calls.append(("save", step, loop.state))

    def where_saved(self) -> str:
        return "there"


def test_rollback_restores_the_newest_good_checkpoint_with_beta_raised(tmp_path):
    """The rollback hook asks (a Restore of checkpoint 2 with beta raised, its line as a note); the owners
    cut their outputs back (the trace here, metrics.jsonl the sink's: test_sink_truncates_...)."""
    tc = _cfg(rollback_metric="m", rollback_threshold=2.0, rollback_factor=2.0).train
    loop = _loop([_cfg()], dirs=[tmp_path], state=_State(9, _Ctrl(np.float32(0.3))))
    h, logs = _rollback(tc, False, 1)
    ck = _Ckpts([1, 2], restored=_State(2, _Ctrl(np.float32(0.1))))
    h.ckpts = ck
    for it, v in enumerate([1.0, 1.2, 1.5]):
        assert h.on_row(loop, _row(loop, it, [{"m": v}])) == []
    (r,) = h.on_row(loop, _row(loop, 3, [{"m": 2.5}]))
    # crossing at 3 (2.5 > 2 x 1.0); checkpoint 2 is good (1.5); beta 2 x max(0.1, 0.3) = 0.6
    assert isinstance(r, Restore) and r.step == 2 and ck.calls == [("restore", 2)]
    assert r.state.w == 2 and float(r.state.ctrl.beta) == pytest.approx(0.6)
    assert r.state.ctrl.beta.dtype == np.float32
    want = ("rollback 1/3: m = 2.5 at iteration 3 is 2.500x its start (threshold 2.0); restored "
            "checkpoint 2, beta 0.1 -> 0.6")  # fmt: skip
    assert logs == [want] and r.notes == (Note(0, 3, "rollback", want),)
    assert loop.rollbacks == 0 and loop.recorded == 4  # the driver does what the request says
    h.truncate(loop, 2)
    assert h.traces == {"m": [[1.0, 1.2]]}


def test_rollback_to_the_initial_state_and_the_limit(tmp_path):
    tc = _cfg(rollback_metric="m", rollback_threshold=0.5, max_rollbacks=1).train
    initial = _State(0, _Ctrl(np.array([0.1, 0.2], np.float32)))
    loop = _loop([_cfg(), _cfg()], stacked=True, state=_State(5, _Ctrl(np.array([0.4, 0.1], np.float32))))
    h, logs = _rollback(tc, True, 2, initial)
    h.ckpts = ck = _Ckpts([])
    for it, (a, b) in enumerate([(1.0, 1.0), (0.8, 1.0)]):
        assert h.on_row(loop, _row(loop, it, [{"m": a}, {"m": b}])) == []
    (r,) = h.on_row(loop, _row(loop, 2, [{"m": 0.4}, {"m": 0.9}]))  # member 0 fell below 0.5 x 1.0
    assert isinstance(r, Restore) and r.step == 0 and ck.calls == [] and r.state.w == 0
    np.testing.assert_allclose(r.state.ctrl.beta, [0.8, 0.2])  # member 1 replays with its own beta
    assert logs[-1].startswith("rollback 1/1: member 00: m = 0.4 at iteration 2 is 0.400x its start")
    h.truncate(loop, 0)
    loop.rows, loop.rollbacks = [[], []], 1  # (as the driver does it)
    assert h.traces == {"m": [[], []]}
    h.on_row(loop, _row(loop, 0, [{"m": 1.0}, {"m": 1.0}]))
    (stop,) = h.on_row(loop, _row(loop, 1, [{"m": 0.3}, {"m": 1.0}]))  # max_rollbacks reached: the stop
    assert isinstance(stop, Stop) and not stop.save and not stop.rewind and stop.raises is None
    assert stop.line == ("member 00: m = 0.3 at iteration 1 is 0.300x its start, past "
                         "train.rollback_threshold 0.5, after 1 rollbacks (train.max_rollbacks); newest good "
                         "checkpoint: 0")  # fmt: skip


def _two_guards(rows: list[tuple[float, float]], steps: list[int], m: float = 1.0, done: int = 0,
                **train: Any) -> Any:  # fmt: skip
    """A single run guarded by ``ppl>1.5,d2<0.7`` (and ``train``), ``done`` rollbacks made, fed ``rows`` of
    (ppl, d2) (metric ``m``: 1, then ``m`` in the last row); the hook, the last row's request, the log."""
    tc = _cfg(rollback_guards="ppl>1.5, d2<0.7", **train).train
    loop = _loop([_cfg()], state=_State(9, _Ctrl(np.float32(0.3))), rollbacks=done)
    h, logs = _rollback(tc, False, 1)
    h.ckpts = _Ckpts(steps, restored=_State(7, _Ctrl(np.float32(0.1))))
    *head, last = rows
    for it, (ppl, d2) in enumerate(head):
        assert h.on_row(loop, _row(loop, it, [{"ppl": ppl, "d2": d2, "m": 1.0}])) == []
    (r,) = h.on_row(loop, _row(loop, len(head), [{"ppl": last[0], "d2": last[1], "m": m}]))
    return h, r, logs


def test_two_guards_each_fires_alone_and_its_note_names_it():
    # the perplexity guard: 16 > 1.5 x 10 at iteration 3 while d2 = 0.6 >= 0.7 x 0.8 = 0.56 holds;
    # checkpoint 2 is good (14 <= 15); beta 2 x max(0.1, 0.3)
    h, r, logs = _two_guards([(10.0, 0.8), (12.0, 0.7), (14.0, 0.6), (16.0, 0.6)], [1, 2])
    want = ("rollback 1/3: ppl = 16 at iteration 3 is 1.600x its start 10 (guard ppl>1.5); restored "
            "checkpoint 2, beta 0.1 -> 0.6")  # fmt: skip
    assert isinstance(r, Restore) and r.step == 2 and float(r.state.ctrl.beta) == pytest.approx(0.6)
    assert logs == [want] and r.notes == (Note(0, 3, "rollback", want),)
    assert h.traces["d2"] == [[0.8, 0.7, 0.6, 0.6]]
    assert h.base_meta() == {"metric": "ppl", "value": 10.0, "others": {"d2": [0.8]}}
    # the diversity guard: 0.5 < 0.7 x 0.8 at iteration 2 while ppl = 12 <= 15 holds; checkpoint 1 is good
    h, r, logs = _two_guards([(10.0, 0.8), (11.0, 0.7), (12.0, 0.5)], [1, 2])
    want = ("rollback 1/3: d2 = 0.5 at iteration 2 is 0.625x its start 0.8 (guard d2<0.7); restored "
            "checkpoint 1, beta 0.1 -> 0.6")  # fmt: skip
    assert isinstance(r, Restore) and r.step == 1
    assert logs == [want] and r.notes == (Note(0, 2, "rollback", want),)


def test_guards_crossing_together_one_restore_a_note_each_and_one_limit():
    # both cross at iteration 2 (16 > 15, 0.5 < 0.56): one restore (beta raised once), one line per guard
    h, r, logs = _two_guards([(10.0, 0.8), (11.0, 0.7), (16.0, 0.5)], [1])
    assert isinstance(r, Restore) and r.step == 1 and float(r.state.ctrl.beta) == pytest.approx(0.6)
    assert [x.split(" (guard ")[1].split(")")[0] for x in logs] == ["ppl>1.5", "d2<0.7"]
    assert [n.text for n in r.notes] == logs
    # with train.rollback_metric too: its guard first, worded as before (threshold, no reference)
    h, r, logs = _two_guards([(10.0, 0.8), (11.0, 0.7), (16.0, 0.7)], [], m=2.5, rollback_metric="m")
    assert isinstance(r, Restore) and r.step == 0 and len(logs) == 2
    assert logs[0] == ("rollback 1/3: m = 2.5 at iteration 2 is 2.500x its start (threshold 1.1); restored "
                       "the initial state, beta 0 -> 0.6")  # fmt: skip
    assert logs[1].startswith("rollback 1/3: ppl = 16 at iteration 2 is 1.600x its start 10 (guard ppl>1.5)")
    # train.max_rollbacks counts the rollbacks of every guard: one made (by either), the second allowed...
    h, r, logs = _two_guards([(10.0, 0.8), (11.0, 0.5)], [], done=1, max_rollbacks=2)
    assert isinstance(r, Restore) and logs[0].startswith("rollback 2/2: d2 = 0.5")
    # ...and past it, the stop names the guard
    h, stop, _ = _two_guards([(10.0, 0.8), (11.0, 0.5)], [], done=2, max_rollbacks=2)
    assert isinstance(stop, Stop) and stop.line == (
        "d2 = 0.5 at iteration 1 is 0.625x its start 0.8, past guard d2<0.7 (train.rollback_guards), "
        "after 2 rollbacks (train.max_rollbacks); newest good checkpoint: 0"
    )


def test_guards_per_member_of_a_sweep():
    """Each member checked against each guard: member 0's perplexity and member 1's diversity cross at
    iteration 2; one restore (the older of their targets), both betas raised, a note per member naming
    its guard; the references per member, the second metric's under ``others``."""
    tc = _cfg(rollback_guards="ppl>1.5,d2<0.7").train
    initial = _State(0, _Ctrl(np.array([0.1, 0.2, 0.3], np.float32)))
    loop = _loop([_cfg()] * 3, stacked=True, state=_State(5, _Ctrl(np.array([0.4, 0.1, 0.3], np.float32))))
    h, logs = _rollback(tc, True, 3, initial)
    h.ckpts = _Ckpts([1], restored=_State(1, _Ctrl(np.array([0.1, 0.2, 0.3], np.float32))))
    rows = [[(10.0, 0.8), (20.0, 0.5), (1.0, 1.0)], [(11.0, 0.8), (21.0, 0.5), (1.0, 1.0)],
            [(16.0, 0.8), (22.0, 0.3), (1.0, 1.0)]]  # fmt: skip
    for it, row in enumerate(rows[:2]):
        assert h.on_row(loop, _row(loop, it, [{"ppl": p, "d2": d} for p, d in row])) == []
    (r,) = h.on_row(loop, _row(loop, 2, [{"ppl": p, "d2": d} for p, d in rows[2]]))
    assert isinstance(r, Restore) and r.step == 1  # both checkpoints 1 good: 11 <= 15, 0.5 >= 0.35
    np.testing.assert_allclose(r.state.ctrl.beta, [0.8, 0.4, 0.3])  # 2 x max(restored, failing)
    assert [n.member for n in r.notes] == [0, 1] and logs == [n.text for n in r.notes]
    assert logs[0].startswith(
        "rollback 1/3: member 00: ppl = 16 at iteration 2 is 1.600x its start 10 (guard ppl>1.5)"
    )
    assert logs[1].startswith(
        "rollback 1/3: member 01: d2 = 0.3 at iteration 2 is 0.600x its start 0.5 (guard d2<0.7)"
    )
    assert h.base_meta() == {"metric": "ppl", "values": [10.0, 20.0, 1.0], "others": {"d2": [0.8, 0.5, 1.0]}}


def test_skip_stop_after_k_skips_saves_a_single_run():
    h = SkipStop(2)
    loop = _loop([_cfg()], rows=[[{"guard/consecutive_skips": 1.0}]])
    assert h.on_row(loop, Row(0, {}, [{}])) is None
    loop.rows[0].append({"guard/consecutive_skips": 2.0})
    stop = h.on_row(loop, Row(1, {}, [{}]))
    loop.saved = "checkpoint 1 in D"
    assert isinstance(stop, Stop) and stop.save and stop.line(loop).startswith("2 consecutive iterations")
    assert stop.line(loop).endswith("last good state: checkpoint 1 in D")
    sweep = _loop([_cfg(), _cfg()], stacked=True, rows=[[{"guard/consecutive_skips": 2.0}], [{}]])
    assert not h.on_row(sweep, Row(0, {}, [{}, {}])).save  # a sweep's state is not saved


def test_sink_truncates_to_the_rolled_back_file_and_writes_notes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"iteration": {i}}}\n' for i in range(4)))
    w = _Writer()
    loop = _loop([_cfg()], writers=[w], dirs=[tmp_path])
    sink = MetricsSink({}, None)
    sink.last = 5.0
    sink.truncate(loop, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"iteration": 0}\n{"iteration": 1}\n'
    assert (tmp_path / "metrics.rolled_back.jsonl").read_text() == '{"iteration": 2}\n{"iteration": 3}\n'
    assert sink.last is None  # the next row follows a restore: not timed
    sink.on_note(loop, Note(0, 3, "rollback", "why"))
    assert w.calls == [("event", 3, "rollback", "why")]


# ---- held-out evaluation, reward failure ----------------------------------------------------------------


def test_heldout_evaluates_when_due_and_merges_once():
    cfg = _cfg(iterations=5).replace(data={"eval_every": 2})
    seen = []
    loop = _loop(
        [cfg], state="s0", prog={"evaluate": lambda s, env: seen.append((s, env)) or {"eval/x": 3.0}}
    )
    h = HeldOut(loop.prog)
    due = []
    for i in range(5):
        loop.i = i
        due.append(h.evaluated(loop))
    assert due == [True, False, True, False, True]  # every 2 and the last iteration
    assert seen == [("s0", "env")] * 3 and sorted(h.rows) == [0, 2, 4]
    assert h.take(2) == {"eval/x": 3.0} and h.take(2) == {} and h.take(1) == {}
    m = {"a": 1.0}
    h.on_metrics(loop, 4, m)  # merged into the step's metrics before its row is made
    assert m == {"a": 1.0, "eval/x": 3.0}
    loop.i = 5
    assert not h.evaluated(loop)  # all done: no evaluation after the last step
    assert not HeldOut(_prog([cfg])).evaluated(loop)  # no evaluation


def _raises(msg: str):
    def check() -> None:
        raise RewardFunctionError(msg)

    return check


def test_reward_failure_only_on_a_rejected_row():
    calls = []
    loop = _loop([_cfg()], prog={"reward_check": lambda: calls.append(1)})
    assert RewardFailure(loop.prog).rejected(0, {"guard/skipped": np.float32(1.0)}) is None and calls == [1]
    assert RewardFailure(_prog([_cfg()])).rejected(0, {}) is None  # no host reward
    h = RewardFailure(_prog([_cfg()], reward_check=_raises("boom")))
    assert h.rejected(3, {"guard/skipped": np.array([0.0, 0.0])}) is None
    r = h.rejected(3, {"guard/skipped": np.array([0.0, 1.0])})
    assert r.it == 3 and str(r.error) == "boom" and not r.accepted_none()  # member 0 accepted it
    np.testing.assert_array_equal(r.skipped, [0.0, 1.0])
    assert Rejected(3, r.error, np.array([1.0, 1.0])).accepted_none()


class _Counted(NamedTuple):
    iteration: Any
    skipped: Any


def test_reward_stop_saves_the_last_good_state_restamped():
    rows = [[{"guard/consecutive_skips": 0.0}, {"guard/consecutive_skips": 0.0}]]
    loop = _loop([_cfg()], rows=rows, state=_Counted(np.int32(3), np.int32(1)))
    loop.i = 4
    stop = RewardFailure.stop(loop, Rejected(2, RewardFunctionError("boom"), np.ones(1)))
    assert stop.save and stop.rewind and stop.raises is RewardFunctionError
    restamped = stop.state(loop.state)
    assert int(restamped.iteration) == 2 and int(restamped.skipped) == 0
    loop.saved = "there"
    assert stop.line(loop) == "boom; last good state: there"
    # a member accepted the iteration: nothing saved, the state kept
    stop2 = RewardFailure.stop(loop, Rejected(1, RewardFunctionError("x"), np.array([0.0, 1.0])))
    assert not stop2.save and stop2.state is None
    h = RewardFailure(_prog([_cfg()], reward_check=_raises("boom")))
    assert h.on_metrics(loop, 3, {"guard/skipped": np.array([0.0])}) is None  # accepted: recorded
    assert isinstance(h.on_metrics(loop, 3, {"guard/skipped": np.array([1.0])}), Stop)  # refused


def test_heldout_reward_failure_saves_the_state_as_it_is():
    cfg = _cfg(iterations=5).replace(data={"eval_every": 2})
    ev = {"evaluate": lambda s, env: {"eval/x": 1.0}}
    loop = _loop([cfg], rows=[[{}, {}]], state="s")
    assert HeldOut(loop.prog).before_step(loop) is None  # no evaluation
    assert HeldOut(_prog([cfg], heldout_check=lambda: None, **ev)).before_step(loop) is None  # it passed
    h = HeldOut(_prog([cfg], heldout_check=_raises("nan reward"), **ev))
    loop.i = 1
    assert h.before_step(loop) is None  # not due: not evaluated, not asked
    loop.i = 2
    stop = h.before_step(loop)
    assert isinstance(stop, Stop) and stop.save and stop.state is None and stop.raises is RewardFunctionError
    loop.saved = "there"
    assert stop.line(loop) == "nan reward (held-out evaluation); last good state: there"


def test_signals_ask_for_a_saved_stop():
    sig = Signals(StopSignals(print), print)
    loop = _loop([_cfg()])
    assert sig.before_step(loop) is None
    sig.signals.received = signal.SIGTERM
    stop = sig.before_step(loop)
    assert isinstance(stop, Stop) and stop.save and stop.signal == "SIGTERM" and stop.raises is None


# ---- signals -----------------------------------------------------------------------------------------


def test_signals_installed_while_the_loop_runs():
    logs: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    sig = Signals(StopSignals(logs.append), print)
    with sig:
        assert sig.received is None and sig.name is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert sig.received == signal.SIGTERM and sig.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
    assert logs == ["SIGTERM: stopping after this iteration and a checkpoint"]
    own = Signals(None, logs.append)  # without a guard's: its own
    assert isinstance(own.signals, StopSignals) and own.signals._log == logs.append


def test_kl_sign_note_once_when_the_penalised_mean_is_negative_and_the_exact_kl_positive():
    """k1's batch mean below zero (past float noise) while the exact KL is positive: one note naming the
    iteration, the member, both values and the batch; never again, never for noise or agreement."""
    lines: list[str] = []
    note = H.KLSignNote("k1", lines.append)
    loop = _loop([_cfg(batch_size=8), _cfg(batch_size=8)], stacked=True, dirs=[None, None])
    k, e = "kl/reward_k1_seq_sum", "kl/exact_seq_sum"
    note.on_row(loop, _row(loop, 0, [{k: -1e-7, e: 7e-8}, {k: 3.6e-7, e: 7e-8}]))  # iteration 0: noise
    note.on_row(loop, _row(loop, 1, [{k: 0.2, e: 0.1}, {k: 0.3, e: 0.1}]))  # agree
    note.on_row(loop, _row(loop, 2, [{k: 0.2, e: 0.1}, {k: -0.41, e: 0.12}]))
    note.on_row(loop, _row(loop, 3, [{k: -0.5, e: 0.1}, {k: -0.5, e: 0.1}]))  # once only
    assert len(lines) == 1
    assert lines[0].startswith("note: iteration 2: member 01: the penalised KL estimate kl/reward_k1_seq_sum")
    assert "batch mean -0.41 nats/seq while the exact KL is 0.12" in lines[0] and "at batch 8" in lines[0]
    quiet = H.KLSignNote("k1", lines.append)
    quiet.on_row(loop, _row(loop, 4, [{k: -0.5}, {k: -0.5}]))  # no exact KL (kl.exact_metric false)
    assert len(lines) == 1
