"""klrl.analysis.summary: the sweep's summary table, against rows written out by hand."""

from __future__ import annotations

import numpy as np

from klrl.analysis.results import RunResult
from klrl.analysis.summary import summary_table
from klrl.config import RunConfig


def _result(beta: float, reward: list[float]) -> RunResult:
    n = len(reward)
    metrics = {"reward/task": np.asarray(reward), "ctrl/beta": np.full(n, beta), "other": np.zeros(n)}
    return RunResult(RunConfig().replace(kl={"beta": beta}), None, metrics)


def test_summary_table_rows_and_columns():
    # 10 iterations: start and end are the means of the first and last 2 (a fifth of them)
    results = [_result(0.1, [0, 2, 4, 4, 4, 4, 4, 4, 5, 7]), _result(1.0, [1] * 10)]
    assert summary_table(results, ["kl.beta"]).splitlines() == [
        "| member | kl.beta | reward/task | ctrl/beta |",
        "|---|---|---|---|",
        "| 00 | 0.1 | 1 -> 6 | 0.1 -> 0.1 |",
        "| 01 | 1.0 | 1 -> 1 | 1 -> 1 |",
    ]
    assert summary_table(results).splitlines()[0] == "| member | reward/task | ctrl/beta |"  # no axes
    assert summary_table([]).splitlines() == ["| member |", "|---|"]
