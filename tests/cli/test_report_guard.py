"""``klrl report DIR`` never replaces a good ``report.md`` with less, and ``task.json`` is validated where
it is read (issue 41, item 4). Hand-made run directories (a config, metrics rows, a checkpoint of a
one-array state with the meta a run writes): nothing is compiled.

Before the fix: a ``metrics.jsonl`` cut mid-line or deleted was reported from the rows left (``0
iterations``), over the good report; fewer rows than the checkpoint counts were not checked; the
report was written in place; a ``task.json`` of two binary bytes was ignored by report and resume.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error

ROWS = [
    {"iteration": i, "reward/task": 0.1 * i, "kl/k1_seq_sum": 0.5 * i, "ctrl/beta": 0.1} for i in range(4)
]


def _run_dir(d: Path, rows: int = 4, checkpoint: int | None = 4) -> Path:
    """A run directory as a run of 4 iterations leaves it (checkpoint ``checkpoint`` counting its rows)."""
    from klrl.config import RunConfig
    from klrl.io import checkpoint as ckpt

    cfg = RunConfig().replace(train={"iterations": 4, "quiet": True})
    d.mkdir(parents=True)
    (d / "task.json").write_text(json.dumps({"name": "testbed"}))
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:rows]))
    if checkpoint is not None:
        mgr = ckpt.manager(d, async_save=False)
        meta = {"config": cfg.to_dict(), "version": ckpt.version(), "iteration": checkpoint,
                "metrics_lines": checkpoint}  # fmt: skip
        ckpt.save(mgr, checkpoint, {"x": np.arange(3, dtype=np.float32)}, meta)
        ckpt.finish(mgr)
    return d


def _report(capsys, d: Path) -> str:
    from klrl.cli import main

    return one_line_error(capsys, main, ["report", str(d)])


@pytest.fixture
def good(tmp_path, capsys):
    """A run directory with a good report.md (its bytes)."""
    from klrl.cli import main

    d = _run_dir(tmp_path / "r")
    assert main(["report", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"read 4 rows of 1 run from {d / 'metrics.jsonl'}"  # what it read, in one line
    assert out[-1] == str(d / "report.md")
    return d, (d / "report.md").read_bytes()


def test_metrics_cut_mid_line_is_refused_and_the_report_kept(good, capsys):
    d, before = good
    data = (d / "metrics.jsonl").read_bytes()
    (d / "metrics.jsonl").write_bytes(data[: len(data) - 10])
    line = _report(capsys, d)
    assert (
        line
        == f"error: --report: {d / 'metrics.jsonl'}: cut mid-line after 3 complete rows (nothing written)"
    )
    assert (d / "report.md").read_bytes() == before


def test_missing_metrics_is_refused_and_the_report_kept(good, capsys):
    d, before = good
    (d / "metrics.jsonl").unlink()
    line = _report(capsys, d)
    assert line.startswith(f"error: --report: {d / 'metrics.jsonl'}: no such file"), line
    assert (d / "report.md").read_bytes() == before


def test_fewer_rows_than_the_checkpoint_counts_is_refused(good, capsys):
    d, before = good
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    line = _report(capsys, d)
    assert f"{d / 'metrics.jsonl'} has 2 rows; checkpoint 4 in {d} counts 4" in line, line
    assert (d / "report.md").read_bytes() == before


def test_rows_after_the_checkpoint_are_reported(tmp_path, capsys):
    """A run killed after its checkpoint 2 (rows 2 and 3 written): a report reads all 4 rows."""
    from klrl.cli import main

    d = _run_dir(tmp_path / "r", rows=4, checkpoint=2)
    assert main(["report", str(d)]) == 0
    assert capsys.readouterr().out.startswith("read 4 rows of 1 run from")


def test_report_is_written_atomically(good, monkeypatch, capsys):
    """A write that fails (the disk full at the flush) leaves the good report.md whole."""
    d, before = good

    fsync = os.fsync

    def full(fd):  # the report's own file (the write check's probe before it passes)
        if ".report.md" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    (d / "metrics.jsonl").write_text("".join(json.dumps({**r, "reward/task": 9.0}) + "\n" for r in ROWS))
    from klrl.cli import main

    line = one_line_error(capsys, main, ["report", str(d)])  # (was a traceback: issue 52)
    assert line == f"error: --report: {d / 'report.md'}: No space left on device (report.md unchanged)", line
    assert (d / "report.md").read_bytes() == before
    assert not [p for p in d.iterdir() if p.name.startswith(".report.md")]  # no temporary file left


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1, 2]", b"{"], ids=["binary", "not-an-object", "cut"])
def test_corrupt_task_json_is_one_line_for_report_and_resume(content, tmp_path, capsys):
    from klrl.cli import main

    d = _run_dir(tmp_path / "r")
    (d / "task.json").write_bytes(content)
    line = _report(capsys, d)
    assert line.startswith(f"error: --report: {d / 'task.json'}: "), line
    assert not (d / "report.md").exists()
    line = one_line_error(capsys, main, ["resume", str(d), "--train.iterations", "5"])
    assert line.startswith(f"error: {d / 'task.json'}: "), line
