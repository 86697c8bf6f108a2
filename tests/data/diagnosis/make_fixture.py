"""Writes ``runs.json.gz``: the metric columns the regime diagnosis reads, of stored and fresh runs.

``python tests/data/diagnosis/make_fixture.py [MAIN_JOB_SWEEP_DIR ...]`` (from the repository root).
Runs: ``experiments/results/beta_grid`` (betas 0.001 and 1, seeds 0, 1, 2), beta = 0.001 on train seeds
5, 6, 7 (``beta0.001-seeds``) and task seed 3 (``beta0.001-task3``), the stored runs whose
labels flipped most under the diagnosis before issue 30 (``overoptimization`` beta 0.03 seed 0;
``adaptive`` and ``adaptive-target6`` controllers), every proportional run of both adaptive studies
(the beta-trend message while settling), and the members of the default main job
(``python experiments/run.py --study --train.seed S``, 100 iterations) of the sweep directories given.
Only the columns the diagnosis reads on these runs (the perplexity too: the diagnosis before issue 30
read it), rounded to 5 significant digits.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np

from klrl.analysis.results import load_sweep

COLUMNS = ("kl/exact_seq_sum", "reward/proxy", "reward/gold", "eval/oracle_ppl_floored")
CTRL = ("ctrl/beta", "ctrl/kl_observed_seq_sum", "ctrl/target")  # adaptive runs only
ROOT = Path(__file__).resolve().parents[3]


def _pick(study: str, r) -> bool:
    c = r.config
    if study == "beta_grid":
        return c.kl.beta in (0.001, 1.0)
    if study.startswith("beta0.001"):
        return True
    if study == "overoptimization":
        return c.kl.beta == 0.03 and c.train.seed == 0
    if c.ctrl.kind == "proportional":
        return True
    flips = {
        ("band", 0.1, 0, 0),
        ("pi", 0.2, 0, 0),
        ("pi", 0.1, 0, 1),
        ("band", 0.1, 0, 2),
        ("pi", 0.2, 0, 1),
    }
    return (c.ctrl.kind, c.ctrl.kp, c.ctrl.warmup_iters, c.train.seed) in flips


def _entry(source: str, r) -> dict:
    c = r.config
    names = COLUMNS + (CTRL if c.ctrl.kind != "fixed" else ())
    cols = {k: [float(f"{v:.5g}") for v in np.asarray(r.metrics[k], float)] for k in names if k in r.metrics}
    return {"source": source, "ctrl": c.ctrl.kind, "kp": c.ctrl.kp, "warmup_iters": c.ctrl.warmup_iters,
            "target": c.ctrl.target, "beta": c.kl.beta, "seed": c.train.seed, "task": c.task.seed,
            "metrics": cols}  # fmt: skip


def main(main_jobs: list[str]) -> None:
    runs = []
    for study in (
        "beta_grid",
        "beta0.001-seeds",
        "beta0.001-task3",
        "overoptimization",
        "adaptive",
        "adaptive-target6",
    ):
        runs += [
            _entry(study, r) for r in load_sweep(ROOT / "experiments/results" / study) if _pick(study, r)
        ]
    for d in main_jobs:
        runs += [_entry("main", r) for r in load_sweep(d)]
    out = Path(__file__).with_name("runs.json.gz")
    with gzip.open(out, "wt") as f:
        json.dump({"runs": runs}, f, separators=(",", ":"))
    print(f"{out}: {len(runs)} runs, {out.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main(sys.argv[1:])
