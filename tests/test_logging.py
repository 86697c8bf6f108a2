"""klrl.io.logging (issue 12): non-finite metrics are logged as NaN/inf without tensorboardX's warning."""

from __future__ import annotations

import json
import logging
import math


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
