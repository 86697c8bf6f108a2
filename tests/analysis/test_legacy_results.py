"""Runs stored before issue 12's renames, and gzipped ``metrics.jsonl.gz``, read by ``load_run``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from klrl.analysis.results import LEGACY_NAMES, load_run, load_sweep
from klrl.config import RunConfig
from klrl.io.readers import RunDirError

ROOT = Path(__file__).resolve().parents[2]
OLD_ROWS = [
    {"iteration": i, "kl/seq_sum": 2.0 * i, "kl/token_mean": 0.25 * i, "eval/oracle_ppl": 20.0 + i,
     "eval/oracle_impossible_frac": 0.1, "ctrl/target": 6.0, "ctrl/beta": 0.1}
    for i in range(3)
]  # fmt: skip


def _run_dir(tmp_path: Path, kind: str, gz: bool) -> Path:
    d = tmp_path / f"{kind}-{gz}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(RunConfig().replace(ctrl={"kind": kind}).to_dict()))
    text = "".join(json.dumps(r) + "\n" for r in OLD_ROWS).encode()
    if gz:
        (d / "metrics.jsonl.gz").write_bytes(gzip.compress(text))
    else:
        (d / "metrics.jsonl").write_bytes(text)
    return d


@pytest.mark.parametrize("gz", [False, True])
def test_old_names_read_under_new_ones(tmp_path, gz):
    m = load_run(_run_dir(tmp_path, "fixed", gz)).metrics
    np.testing.assert_array_equal(m["kl/k1_seq_sum"], [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(m["kl/k1_seq_token_mean"], [0.0, 0.25, 0.5])
    np.testing.assert_array_equal(m["eval/oracle_ppl_floored"], [20.0, 21.0, 22.0])
    np.testing.assert_array_equal(m["eval/oracle_floored_frac"], [0.1] * 3)
    assert not set(LEGACY_NAMES) & set(m)
    assert "ctrl/target" not in m  # a fixed beta has no target, whatever an old run logged
    adaptive = load_run(_run_dir(tmp_path, "proportional", gz)).metrics
    np.testing.assert_array_equal(adaptive["ctrl/target"], [6.0] * 3)


def test_damaged_gzip_names_the_file(tmp_path):
    d = _run_dir(tmp_path, "fixed", True)
    (d / "metrics.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(RunDirError, match="metrics.jsonl.gz: not a valid gzip file"):
        load_run(d)


def test_stored_results_load():
    rs = load_sweep(ROOT / "experiments" / "results" / "overoptimization")
    # seed 0 stored before the renames, seeds 1 and 2 after (experiments/merge_seeds.py): one sweep
    assert [(r.config.kl.beta, r.config.train.seed) for r in rs] == [
        (b, s) for b in (0.001, 0.003, 0.01, 0.03, 0.1, 1.0) for s in (0, 1, 2)
    ]
    assert all(len(r.metrics["kl/k1_seq_sum"]) == 400 and "eval/oracle_ppl_floored" in r.metrics for r in rs)


def test_run_resumed_across_the_rename(tmp_path):
    d = _run_dir(tmp_path, "proportional", False)
    with (d / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"iteration": 3, "kl/k1_seq_sum": 7.0, "ctrl/target": 6.0}) + "\n")
    m = load_run(d).metrics
    np.testing.assert_array_equal(m["kl/k1_seq_sum"], [0.0, 2.0, 4.0, 7.0])
    assert "kl/seq_sum" not in m and np.isnan(m["eval/oracle_ppl_floored"][3])
