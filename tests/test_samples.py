"""samples.jsonl: one readable JSON line per sample, appended, torn last line skipped."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from klrl.io.samples import SamplesWriter, read_samples


def test_write_and_read(tmp_path) -> None:
    with SamplesWriter(tmp_path) as w:
        n = w.write(
            3,
            ["Say hi.", [{"role": "user", "content": "Hi?"}]],
            ["Hello — friend", "Hi"],
            np.array([0.5, -1.0], np.float32),
            kl_seq_sum=[0.25, math.nan],
            ref_logprob=np.array([-3.0, -4.5]),
            answer=[42, None],
        )
        assert n == 2
    with SamplesWriter(tmp_path, max_per_iteration=1) as w:  # appends, capped
        assert w.write(4, ["a", "b"], ["x", "y"], [1.0, 2.0]) == 1
    raw = (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(raw) == 3 and "Hello — friend" in raw[0]  # readable, not \u-escaped
    assert json.loads(raw[0]) == {
        "iteration": 3,
        "prompt": "Say hi.",
        "completion": "Hello — friend",
        "reward": 0.5,
        "kl_seq_sum": 0.25,
        "ref_logprob": -3.0,
        "answer": 42,
    }
    rows = read_samples(tmp_path / "samples.jsonl")
    assert rows[1]["kl_seq_sum"] == "nan" and rows[1]["prompt"] == [{"role": "user", "content": "Hi?"}]
    assert rows[1]["answer"] is None
    assert [r["completion"] for r in read_samples(tmp_path / "samples.jsonl", iteration=4)] == ["x"]
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"iteration": 5, "prompt": "tor')  # a crash mid-write
    assert len(read_samples(tmp_path / "samples.jsonl")) == 3


def test_length_mismatch_names_the_field(tmp_path) -> None:
    with SamplesWriter(tmp_path) as w, pytest.raises(ValueError, match="samples: reward has 1 values for 2"):
        w.write(0, ["a", "b"], ["x", "y"], [1.0])
