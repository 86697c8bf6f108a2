"""klrl.plots: every figure renders to a PNG for one run, a sweep and runs with metrics missing (synthetic
metrics, so this module compiles nothing); fit_gao recovers the Gao et al. coefficients; write_report
on in-memory results. Figures of a real tiny run and a real sweep: tests/test_api.py (it has them)."""

from __future__ import annotations

import numpy as np
import pytest

import klrl
from klrl import plots
from klrl.results import RunResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("beta_kl", "frontier", "overoptimization", "perplexity_diversity", "controller_comparison")
ALPHA, B = 0.8, 0.3


def synthetic(
    beta: float = 0.01, kind: str = "fixed", n: int = 40, seed: int = 0, gold: bool = True
) -> RunResult:
    """A testbed-like run: KL grows to a beta-dependent plateau, gold follows the Gao form."""
    rng = np.random.default_rng(seed)
    cfg = klrl.RunConfig().replace(kl={"beta": beta}, ctrl={"kind": kind, "target": 3.0})
    t = np.arange(n)
    kl = 6.0 * (1 - np.exp(-t / 10)) / (1 + 20 * beta)
    d = np.sqrt(kl)
    m = {
        "kl/exact_seq_sum": kl,
        "kl/seq_sum": kl + 0.05 * rng.standard_normal(n),
        "ctrl/beta": np.full(n, beta) if kind == "fixed" else beta * np.exp(0.03 * t),
        "ctrl/target": np.full(n, 3.0),
        "ctrl/kl_observed_seq_sum": kl,
        "reward/proxy": 0.5 * d,
        "reward/task": 0.5 * d,
        "eval/oracle_ppl": 20 + kl,
        "eval/independent_ppl": 25 + kl,
        "eval/ref_ppl": 22 + kl,
        "eval/distinct_1": 0.5 - 0.01 * kl,
        "eval/distinct_2": 0.8 - 0.02 * kl,
    }
    if gold:
        m["reward/gold"] = plots.gao_curve(d, ALPHA, B) + 0.01 * rng.standard_normal(n)
    return RunResult(cfg, None, m)


def study() -> list[RunResult]:
    return [synthetic(b, seed=i) for i, b in enumerate((0.001, 0.01, 0.1))] + [synthetic(0.05, "pi")]


def render(fig, path) -> None:
    fig.savefig(path, dpi=40)
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


@pytest.mark.parametrize("name", FIGURES)
def test_each_figure_renders_for_a_run_and_a_sweep(name, tmp_path):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    fn = getattr(plots, name)
    render(fn(synthetic()), tmp_path / "one.png")
    render(fn(study()), tmp_path / "sweep.png")
    # figures are built without pyplot: nothing shown, nothing held by a figure manager
    assert plt.get_fignums() == before


@pytest.mark.parametrize("name", FIGURES)
def test_missing_metrics_are_skipped(name, tmp_path):
    cfg = klrl.RunConfig()
    empty = RunResult(cfg, None, {})
    only_kl = RunResult(cfg, None, {"kl/seq_sum": np.linspace(0, 1, 5)})
    nan = RunResult(cfg, None, {"ctrl/beta": np.full(5, np.nan), "reward/task": np.full(5, np.nan)})
    fn = getattr(plots, name)
    for i, rs in enumerate(([empty], [only_kl], [nan, synthetic(gold=False)], [])):
        fig = fn(rs)
        render(fig, tmp_path / f"{i}.png")
        if i in (0, 3):  # nothing to draw: no data line anywhere, a "no ... logged" note instead
            assert all(len(ax.get_lines()) == 0 and not ax.collections for ax in fig.axes), name
            notes = [t.get_text() for ax in fig.axes for t in ax.texts]
            assert notes and all(t.startswith("no ") and t.endswith(" logged") for t in notes), notes


def test_beta_kl_axis_label_and_target_line():
    fixed = plots.beta_kl(synthetic())
    ax_k = fixed.axes[1]
    assert "kl/exact_seq_sum" in ax_k.get_ylabel() and "nats/sequence" in ax_k.get_ylabel()
    assert len(ax_k.get_lines()) == 1  # no target for a fixed beta
    adaptive = plots.beta_kl(synthetic(kind="pi"))
    assert len(adaptive.axes[1].get_lines()) == 2  # KL and its target
    np.testing.assert_array_equal(adaptive.axes[1].get_lines()[1].get_ydata(), np.full(40, 3.0))
    sampled = synthetic()
    del sampled.metrics["kl/exact_seq_sum"]
    assert "kl/seq_sum" in plots.beta_kl(sampled).axes[1].get_ylabel()


def test_labels_come_from_the_config():
    assert plots.label(synthetic(0.01)) == "fixed beta=0.01"
    pi = plots.label(synthetic(0.05, "pi").config)
    assert pi.startswith("pi target=3") and "kp=0.1 ki=0.01" in pi
    fig = plots.controller_comparison(study())
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "fixed beta=0.001" in texts and any(t.startswith("pi target=3") for t in texts)


def test_fit_gao_exact_without_noise():
    d = np.linspace(0.0, 4.0, 60)  # d = 0 included: d log d -> 0
    alpha, b = plots.fit_gao(d, plots.gao_curve(d, ALPHA, B))
    np.testing.assert_allclose([alpha, b], [ALPHA, B], rtol=1e-10)
    alpha, b = plots.fit_gao(d, d * (-0.2 + 0.05 * np.log(np.where(d > 0, d, 1))))  # negative alpha, b
    np.testing.assert_allclose([alpha, b], [-0.2, -0.05], rtol=1e-10, atol=1e-12)


def test_fit_gao_with_noise_and_bad_points():
    rng = np.random.default_rng(0)
    d = rng.uniform(0.05, 4.0, 2000)
    r = plots.gao_curve(d, ALPHA, B) + 0.05 * rng.standard_normal(d.shape)
    d[:5], r[5:10] = np.nan, np.inf  # dropped
    alpha, b = plots.fit_gao(d, r)
    assert abs(alpha - ALPHA) < 0.02 and abs(b - B) < 0.02
    with pytest.raises(ValueError, match="at least two"):
        plots.fit_gao([0.0, 1.0, np.nan], [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="length"):
        plots.fit_gao([1.0, 2.0], [1.0])


def test_overoptimization_fit_in_the_legend():
    fig = plots.overoptimization(study())
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    fit = [t for t in texts if "alpha=" in t]
    assert len(fit) == 1
    alpha = float(fit[0].split("alpha=")[1].split(",")[0])
    assert abs(alpha - ALPHA) < 0.1  # pooled, relative to iteration 0 (gold there is about 0)
    no_fit = plots.overoptimization(study(), fit=False)
    assert not [t for t in no_fit.axes[0].get_legend().get_texts() if "alpha=" in t.get_text()]


def test_write_report_of_in_memory_results(tmp_path):
    with pytest.raises(ValueError, match="no run directory"):
        klrl.write_report(study())
    path = klrl.write_report(study(), out_dir=tmp_path)
    text = path.read_text()
    assert path == tmp_path / "report.md"
    assert "## Members" in text and text.count("| fixed beta=") == 3
    for name in FIGURES:  # all five have data here
        assert f"(report-{name}.png)" in text
        assert (tmp_path / f"report-{name}.png").read_bytes()[:8] == PNG_MAGIC
