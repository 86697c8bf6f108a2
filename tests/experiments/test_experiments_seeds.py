"""The study scripts' seed axis (``--seeds``), their per-setting aggregation over seeds, and
``experiments/merge_seeds.py`` (stored seed 0 + a new sweep of seeds 1, 2 -> one sweep directory).
No training: configs and hand-written metrics only."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments import merge_seeds, study
from klrl.analysis.results import load_sweep
from klrl.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
T975_2 = 4.302652729911275  # t_{0.975, 2}, from a table


def test_seeds_axis_is_configuration_major():
    base = RunConfig()
    members = [base.replace(kl={"beta": b}) for b in (0.1, 1.0)]
    out = study.with_seeds(members, study.parse_seeds("0,1,2"))
    assert [(m.kl.beta, m.train.seed) for m in out] == [
        (0.1, 0),
        (0.1, 1),
        (0.1, 2),
        (1.0, 0),
        (1.0, 1),
        (1.0, 2),
    ]
    assert study.with_seeds(members, study.parse_seeds(None)) == members


@pytest.mark.parametrize("spec", ["0,x", "1,1", "", "0,-1", "0,99999999999999999999"])
def test_bad_seeds_are_one_line_and_exit_2(spec, capsys):
    with pytest.raises(SystemExit) as e:
        study.with_seeds([RunConfig()], study.parse_seeds(spec))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seeds" in err


class _R:
    def __init__(self, beta, seed):
        self.config = RunConfig().replace(kl={"beta": beta}, train={"seed": seed, "name": f"n{seed}"})


def test_by_setting_mean_and_t_interval_by_hand():
    results = [_R(b, s) for b in (0.1, 1.0) for s in (0, 1, 2)]
    vals = {0.1: [1.0, 2.0, 6.0], 1.0: [0.5, math.nan, 0.7]}
    table = []
    for r in results:
        b, s = r.config.kl.beta, r.config.train.seed
        table.append({"beta": b, "seed": s, "x": vals[b][s], "settle": ["never", 3, 4][s],
                      "diagnosis": f"healthy (@{s})"})  # fmt: skip
    agg = study.by_setting(results, table, ["beta"])
    assert [a["beta"] for a in agg] == [0.1, 1.0] and agg[0]["seeds"] == [0, 1, 2]
    x = agg[0]["x"]
    # mean 3, sample sd sqrt(((-2)^2 + (-1)^2 + 3^2) / 2) = sqrt(7)
    assert x["mean"] == pytest.approx(3.0) and x["n"] == 3
    assert x["half"] == pytest.approx(T975_2 * math.sqrt(7) / math.sqrt(3), rel=1e-9)
    assert x["values"] == [1.0, 2.0, 6.0]
    y = agg[1]["x"]  # a NaN seed is missing: two seeds, t_{0.975, 1} = 12.706
    assert y["n"] == 2 and y["mean"] == pytest.approx(0.6)
    assert y["half"] == pytest.approx(12.706204736 * np.std([0.5, 0.7], ddof=1) / math.sqrt(2), rel=1e-6)
    assert agg[0]["settle"] == ["never", 3, 4]  # not a number for every seed: listed, not averaged
    assert study.pm(agg[0]["diagnosis"]) == "healthy x3"
    assert study.pm({"mean": 1.0, "half": float("nan")}) == "1"
    md = study.settings_markdown(agg)
    assert "| 0.1 | 0, 1, 2 | 3 ± 6.57 | never / 3 / 4 | healthy x3 |" in md


def _sweep_dir(root: Path, name: str, seeds, betas=(0.01, 0.1), iterations=6, cache="") -> Path:
    d = root / name
    d.mkdir()
    members = []
    for b in betas:
        for s in seeds:
            train = {"seed": s, "name": name, "iterations": iterations}
            cfg = RunConfig().replace(kl={"beta": b}, train=train, task={"cache_dir": cache})
            m = d / f"m-{b}-{s}"
            m.mkdir()
            (m / "config.json").write_text(json.dumps(cfg.to_dict()))
            rows = "".join(
                json.dumps({"iteration": i, "reward/gold": 10 * s + b + i}) + "\n" for i in range(iterations)
            )
            (m / "metrics.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
            members.append(m.name)
    (d / "sweep.json").write_text(json.dumps({"members": members}))
    (d / "task.json").write_text(json.dumps({"language": 0}))
    return d


def test_merge_adds_seeds_and_names_members(tmp_path):
    into = _sweep_dir(tmp_path, "stored", [0], cache="/tmp/klrlcache", iterations=4)
    kept = (into / "m-0.01-0" / "metrics.jsonl.gz").read_bytes()
    src = _sweep_dir(tmp_path, "new", [1, 2], betas=(0.01, 0.1, 1.0), iterations=6)
    left = merge_seeds.merge(into, src, iterations=4)
    assert sorted(left) == ["m-1.0-1", "m-1.0-2"]  # beta = 1 is not one of the stored settings
    rs = load_sweep(into)
    assert [(r.config.kl.beta, r.config.train.seed) for r in rs] == [(0.01, 0), (0.01, 1), (0.01, 2),
                                                                    (0.1, 0), (0.1, 1), (0.1, 2)]  # fmt: skip
    assert json.loads((into / "sweep.json").read_text())["members"][1] == "kl.beta=0.01,train.seed=1"
    assert (into / "kl.beta=0.01,train.seed=0" / "metrics.jsonl.gz").read_bytes() == kept  # byte for byte
    r = rs[5]  # seed 2, beta 0.1, cut to its first 4 iterations
    np.testing.assert_allclose(r.metrics["reward/gold"], [20.1, 21.1, 22.1, 23.1])
    assert r.config.train.iterations == 4 and not (into / "m-0.01-0").exists()


def test_merge_refuses_and_leaves_the_study_unchanged(tmp_path, capsys):
    into = _sweep_dir(tmp_path, "stored", [0])
    before = {p: p.read_bytes() for p in into.rglob("*") if p.is_file()}
    cases = [
        (_sweep_dir(tmp_path, "dup", [0]), None, "already in"),
        (_sweep_dir(tmp_path, "other", [1], betas=(0.5,)), None, "no member has one of"),
        (_sweep_dir(tmp_path, "short", [1], iterations=3), 5, "ran 3 iterations"),
        (_sweep_dir(tmp_path, "long", [1], iterations=8), None, "no member has one of"),  # 8 != 6 iterations
    ]
    task = _sweep_dir(tmp_path, "task", [1])
    (task / "task.json").write_text(json.dumps({"language": 1}))
    cases.append((task, None, "not the same task"))
    for src, it, msg in cases:
        with pytest.raises(SystemExit) as e:
            merge_seeds.merge(into, src, it)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and msg in err, (src, err)
    assert {p: p.read_bytes() for p in into.rglob("*") if p.is_file()} == before


class _Run:
    """A run with hand-written metrics: gold a single bump at ``peak``, KL a line of ``slope`` nats/seq
    per iteration (with a +-1 zigzag) from iteration 100 on."""

    def __init__(self, seed, task, peak, slope, n=300):
        self.config = RunConfig().replace(kl={"beta": 0.001}, train={"seed": seed}, task={"seed": task})
        i = np.arange(n, dtype=float)
        kl = np.where(i < 100, 0.3 * i, 30 + slope * (i - 100)) + np.where(i % 2 == 0, 1.0, -1.0)
        self.metrics = {"reward/gold": np.exp(-(((i - peak) / 3.0) ** 2)), "kl/exact_seq_sum": kl}


def test_small_beta_claims_median_range_and_flat_count_by_hand():
    """The beta = 0.001 claims over every run (issue 30): the gold peak iteration as median and range
    (a mean +- t-interval over 17, 18, 35, 122 would hide their shape), and per 100-iteration block
    the KL slope with the runs on which it is flat (|slope| < 5 nats/seq per 100 iterations)."""
    from experiments import seed_claims

    runs = [_Run(0, 0, 17, 0.0), _Run(5, 0, 122, 0.12), _Run(6, 0, 35, 0.02), _Run(0, 3, 18, -0.08)]
    q = seed_claims.small_beta_claims(runs)
    peak = q["b0.001 (all runs): gold peak iter"]
    # a 10-iteration trailing mean of a symmetric bump is highest 4.5 after it (a tie: the first, +4)
    assert peak["per_seed"] == {"0": 21, "5": 126, "6": 39, "task 3, seed 0": 22}
    assert (peak["median"], peak["min"], peak["max"], peak["n"]) == (30.5, 21, 126, 4)
    kl = q["b0.001 (all runs): KL slope, iterations 200-300 (nats/seq per 100 iters)"]
    assert kl["per_seed"] == pytest.approx({"0": 0.0, "5": 12.0, "6": 2.0, "task 3, seed 0": -8.0}, abs=0.1)
    assert kl["flat"] == 2 and kl["n"] == 4
    assert list(q) == [
        "b0.001 (all runs): gold peak iter",
        "b0.001 (all runs): KL slope, iterations 100-200 (nats/seq per 100 iters)",
        "b0.001 (all runs): KL slope, iterations 200-300 (nats/seq per 100 iters)",
    ]
