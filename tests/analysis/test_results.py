"""klrl.analysis.results: member names, sweep axes, the long DataFrame (hand-built results, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from klrl.analysis.results import RunResult, Sweep, load_sweep, sweep_axes, to_frame
from klrl.config import RunConfig


def _two():
    base = RunConfig()
    a = RunResult(
        base.replace(kl={"beta": 0.1}),
        Path("/x/kl.beta=0.1"),
        {"r": np.array([1.0, 2.0]), "k": np.array([3.0, 4.0])},
    )
    b = RunResult(
        base.replace(kl={"beta": 1.0}), None, {"r": np.array([5.0, 6.0]), "k": np.array([7.0, np.nan])}
    )
    return a, b


def test_to_frame_is_long_with_the_varying_fields():
    pytest.importorskip("pandas")
    a, b = _two()
    df = Sweep([a, b]).to_frame()
    assert list(df.columns) == ["member", "iteration", "metric", "value", "kl.beta"]
    assert len(df) == 8
    rows = {(m, i, k): (v, beta) for m, i, k, v, beta in df.itertuples(index=False)}
    assert rows[("kl.beta=0.1", 1, "r")] == (2.0, 0.1)
    assert rows[("member-01", 0, "k")] == (7.0, 1.0)  # no directory: member-XX
    assert np.isnan(rows[("member-01", 1, "k")][0])
    only = to_frame([a, b], metrics=["r"])
    assert set(only["metric"]) == {"r"} and len(only) == 4
    single = a.to_frame()  # one run: nothing varies, no config columns
    assert list(single.columns) == ["member", "iteration", "metric", "value"] and len(single) == 4


def test_sweep_axes_are_the_distinct_values_in_member_order():
    base = RunConfig()
    members = [base.replace(kl={"beta": b}, train={"seed": s}) for b in (0.5, 0.1) for s in (3, 1)]
    assert sweep_axes(members) == {"kl.beta": [0.5, 0.1], "train.seed": [3, 1]}
    assert sweep_axes([base, base]) == {}


def test_load_sweep_reads_old_and_new_sweep_json(tmp_path):
    pytest.importorskip("pandas")
    cfgs = [RunConfig().replace(kl={"beta": b}) for b in (0.1, 1.0)]
    for index, names in (
        ({"members": ["member-00", "member-01"]}, ["member-00", "member-01"]),  # before the axes
        (
            {"members": ["kl.beta=0.1", "kl.beta=1.0"], "axes": {"kl.beta": [0.1, 1.0]}},
            ["kl.beta=0.1", "kl.beta=1.0"],
        ),
    ):
        root = tmp_path / names[0]
        for n, c in zip(names, cfgs, strict=True):
            (root / n).mkdir(parents=True)
            (root / n / "config.json").write_text(json.dumps(c.to_dict()))
            (root / n / "metrics.jsonl").write_text('{"iteration": 0, "r": 1.5}\n')
        (root / "sweep.json").write_text(json.dumps(index))
        back = load_sweep(root)
        assert [r.config for r in back] == cfgs
        df = back.to_frame()
        assert list(df["member"]) == names and list(df["kl.beta"]) == [0.1, 1.0]
