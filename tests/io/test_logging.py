"""klrl.io.logging (issue 12): non-finite metrics are logged as NaN/inf without tensorboardX's warning."""

from __future__ import annotations

import json
import logging
import math

from klrl.loop.hooks import ProgressLine  # the keys the run loop's progress line shows


def test_nonfinite_metrics_are_written_without_warnings(tmp_path, caplog):
    from klrl.io.logging import MetricsWriter

    caplog.set_level(logging.DEBUG)
    w = MetricsWriter(tmp_path, hparams={"kl/beta": 0.1})
    for i in range(3):
        w.write(i, {"loss": math.nan, "kl/seq_sum": math.inf, "reward/task": 0.5})
    w.close({"loss": math.nan, "reward/task": 0.5})
    assert not [r for r in caplog.records if "NaN or Inf" in r.getMessage()], caplog.text
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"iteration": 0, "loss": "nan", "kl/seq_sum": "inf", "reward/task": 0.5}
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # the filter is on tensorboardX's logger only: other warnings still get through
    logging.getLogger("tensorboardX.x2num").warning("something else")
    assert "something else" in caplog.text


def test_a_failing_event_writer_thread_is_reported_not_hung(tmp_path, monkeypatch, capsys):
    """ENOSPC in tensorboardX's writer thread: no traceback from the thread, no hang on its full queue,
    the error comes out of the next write (where the run's guard reports a full disk in one line)."""
    import errno
    import time

    import pytest
    from tensorboardX import record_writer

    from klrl.io.logging import MetricsWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    w = MetricsWriter(tmp_path)  # (its first event is written here, in this thread)
    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    t0 = time.time()
    with pytest.raises(OSError) as e:  # 50 scalars an iteration: a dead thread would fill the queue (10)
        for i in range(200):
            w.write(i, {f"m/{k}": float(k) for k in range(50)})
            time.sleep(0.01)
    assert e.value.errno == errno.ENOSPC and time.time() - t0 < 30
    assert "Traceback" not in capsys.readouterr().err


def test_eta_counts_only_this_process_after_the_first_step():
    from klrl.io.logging import eta_seconds

    # resumed at 40 of 100; the first step of this process returned at done=41 (after the compile);
    # 10 more iterations in 5 s: 0.5 s each, 49 left
    assert eta_seconds(51, 100, 41, 5.0) == 24.5
    assert eta_seconds(41, 100, 41, 0.0) is None  # nothing timed yet (the first step holds the compile)
    assert eta_seconds(100, 100, 1, 9.0) == 0.0


def test_progress_lines_when_not_a_tty(monkeypatch):
    import io

    from klrl.io import logging as L

    clock = iter([0.0, 100.0, 101.0, 102.0])  # t0; the first update after a 100 s compile; 1 s each
    monkeypatch.setattr(L.time, "time", lambda: next(clock))
    out = io.StringIO()
    p = L.Progress(10, every=1, stream=out, start=5, keys=ProgressLine.KEYS)
    for i in (5, 6, 7):
        p.update(i, {"reward/task": 0.5, "ctrl/beta": 0.1})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[6/10] R 0.5 beta 0.1 | eta ?")
    assert "eta 3s" in lines[1] and "eta 2s" in lines[2]  # 1 s/iteration, the compile not counted


def test_progress_shows_the_exact_kl_where_logged_and_says_which():
    import io

    from klrl.io import logging as L

    out = io.StringIO()
    p = L.Progress(10, every=1, stream=out, keys=ProgressLine.KEYS)
    # the exact KL (+0.017) where the step computes it, not the k1 estimate (-0.10, negative at small KL)
    p.update(0, {"reward/task": 0.5, "kl/k1_seq_sum": -0.1, "kl/exact_seq_sum": 0.017, "ctrl/beta": 0.1})
    p.update(1, {"kl/k1_seq_sum": 0.25})  # kl.exact_metric off: k1, labelled so
    p.update(2, {"reward/task": 1.0})  # no KL logged
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[1/10] R 0.5 KL/seq(exact) 0.017 beta 0.1 | eta ?")
    assert lines[1].startswith("[2/10] KL/seq(k1) 0.25 | eta") and "-0.1" not in lines[0]
    assert lines[2].startswith("[3/10] R 1 | eta")


def test_sweep_progress_shows_the_range_of_beta():
    import numpy as np

    from klrl.loop.hooks import sweep_progress

    means, text = sweep_progress(
        {"ctrl/beta": np.array([0.1, 0.01, 1.0]), "reward/task": np.array([1.0, 2, 3])}
    )
    assert text == "beta 0.01..1 (3 members, mean)" and means == {"reward/task": 2.0}
    _, text = sweep_progress({"ctrl/beta": np.array([0.5, 0.5])})
    assert text == "beta 0.5 (2 members, mean)"


def test_progress_bar_on_a_terminal():
    import io

    from klrl.io.logging import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    p = Progress(3, stream=out, keys=ProgressLine.KEYS)
    for i in range(3):
        p.update(i, {"reward/task": 0.25})
    text = out.getvalue()
    assert "3/3" in text and "R 0.25" in text and p._bar is None  # closed at the end


def test_hparams_hold_the_critics_learning_rate_when_it_has_its_own():
    from klrl.config import RunConfig
    from klrl.io.logging import hparams_of

    assert "optim/critic_lr" not in hparams_of(RunConfig())  # 0: optim.lr
    hp = hparams_of(RunConfig().replace(optim={"critic_lr": 3e-6}))
    assert hp["optim/critic_lr"] == 3e-6 and hp["optim/lr"] == RunConfig().optim.lr
