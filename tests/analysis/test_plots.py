"""klrl.analysis.plots: every figure renders to a PNG for one run, a sweep and runs with metrics missing
(synthetic metrics, so this module compiles nothing); seeds are grouped (mean line, band = the t-interval
computed here), legends sit outside the axes, ``ax=`` draws into the given Axes, every axis label has a unit,
frontier points are window means computed here, the controller comparison normalises only adaptive
runs; fit_gao recovers the Gao et al. coefficients. Figures of a real tiny run and a real sweep:
tests/e2e/test_api.py (it has them); write_report: tests/analysis/test_report.py."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

import klrl
from klrl.analysis import plots
from klrl.analysis.results import RunResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("beta_kl", "frontier", "overoptimization", "perplexity_diversity", "controller_comparison")
ALPHA, B = 0.8, 0.3


T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824}  # t_{0.975, df}, from a printed t-table
UNITS = {"nats/sequence", "nats/token", "a.u.", "ratio", "fraction", "exp(nats/token)", "PPO iterations",
         "reward a.u. per nat", "sqrt(nats/sequence)", "tokens"}  # fmt: skip


def synthetic(
    beta: float = 0.01,
    kind: str = "fixed",
    n: int = 40,
    seed: int = 0,
    gold: bool = True,
    train_seed: int = 0,
) -> RunResult:
    """A testbed-like run: KL grows to a beta-dependent plateau, gold follows the Gao form."""
    rng = np.random.default_rng(seed)
    cfg = klrl.RunConfig().replace(
        kl={"beta": beta}, ctrl={"kind": kind, "target": 3.0}, train={"seed": train_seed}
    )
    t = np.arange(n)
    kl = 6.0 * (1 - np.exp(-t / 10)) / (1 + 20 * beta)
    d = np.sqrt(kl)
    m = {
        "kl/exact_seq_sum": kl,
        "kl/k1_seq_sum": kl + 0.05 * rng.standard_normal(n),
        "ctrl/beta": np.full(n, beta) if kind == "fixed" else beta * np.exp(0.03 * t),
        "ctrl/target": np.full(n, 3.0),
        "ctrl/kl_observed_seq_sum": kl,
        "reward/proxy": 0.5 * d,
        "reward/task": 0.5 * d,
        "eval/oracle_ppl_floored": 20 + kl,
        "eval/independent_ppl": 25 + kl,
        "eval/ref_ppl": 22 + kl,
        "eval/distinct_1": 0.5 - 0.01 * kl,
        "eval/distinct_2": 0.8 - 0.02 * kl,
    }
    if gold:
        m["reward/gold"] = plots.gao_curve(d, ALPHA, B) + 0.01 * rng.standard_normal(n)
    if train_seed:  # another seed: every metric moves by its own noise
        m = {k: v * (1 + 0.1 * rng.standard_normal(n)) for k, v in m.items()}
    return RunResult(cfg, None, m)


def seeded() -> list[RunResult]:
    """Two settings (fixed beta 0.01, PI) x three seeds, interleaved as a sweep would list them."""
    return [synthetic(b, kind, seed=10 * s + i, train_seed=s) for s in range(3)
            for i, (b, kind) in enumerate(((0.01, "fixed"), (0.05, "pi")))]  # fmt: skip


def ref_band(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mean, mean - t s / sqrt(n), mean + t s / sqrt(n) over seeds, per iteration, by Python loops."""
    mean, lo, hi = [], [], []
    for col in zip(*rows, strict=True):
        n = len(col)
        m = sum(col) / n
        h = T975[n - 1] * math.sqrt(sum((x - m) ** 2 for x in col) / (n - 1)) / math.sqrt(n)
        mean.append(m)
        lo.append(m - h)
        hi.append(m + h)
    return np.array(mean), np.array(lo), np.array(hi)


def loop_trailing(v, w):
    return np.array([np.mean(v[max(0, i - w + 1) : i + 1]) for i in range(len(v))])


def band_of(ax, i=0):
    """(x, lower, upper) of the i-th band (fill_between) of ax: per x, the min and max vertex."""
    poly = [c for c in ax.collections if isinstance(c, PolyCollection)][i]
    xy = poly.get_paths()[0].vertices
    xs = np.unique(xy[:, 0])
    return (
        xs,
        np.array([xy[xy[:, 0] == x, 1].min() for x in xs]),
        np.array([xy[xy[:, 0] == x, 1].max() for x in xs]),
    )


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


def legends(fig):
    return [*fig.legends, *(a.get_legend() for a in fig.axes if a.get_legend() is not None)]


def legend_texts(fig):
    return [t.get_text() for leg in legends(fig) for t in leg.get_texts()]


def empty_text(ax):
    return [t.get_text() for t in ax.texts if t.get_text().startswith("no ")]


@pytest.mark.parametrize("name", FIGURES)
def test_missing_metrics_are_skipped(name, tmp_path):
    cfg = klrl.RunConfig()
    empty = RunResult(cfg, None, {})
    only_kl = RunResult(cfg, None, {"kl/k1_seq_sum": np.linspace(0, 1, 5)})
    nan = RunResult(cfg, None, {"ctrl/beta": np.full(5, np.nan), "reward/task": np.full(5, np.nan)})
    fn = getattr(plots, name)
    for i, rs in enumerate(([empty], [only_kl], [nan, synthetic(gold=False)], [])):
        fig = fn(rs)
        render(fig, tmp_path / f"{i}.png")
        drawn = [a for a in fig.axes if a.lines or a.collections]
        if i in (0, 3):  # nothing logged: every panel says so, nothing is drawn
            assert not drawn and all(empty_text(a) for a in fig.axes)
    # gold missing: the gold frontier panel says so, the proxy one is drawn
    fig = plots.frontier([synthetic(gold=False)], ax=list(Figure().subplots(2, 1)))
    assert fig.axes[0].lines and empty_text(fig.axes[1]) == ["no reward/gold logged"]  # (the KL is)


def test_frontier_draws_only_the_rewards_logged():
    """A text task logs reward/task and the KL, no gold: the default frontier is one panel, drawn, with
    no empty half (issue 48: 'no reward/gold or KL logged' beside a logged KL)."""
    r = synthetic(gold=False)
    text_task = RunResult(r.config, None, {k: v for k, v in r.metrics.items() if k != "reward/proxy"})
    fig = plots.frontier([text_task])
    assert len(fig.axes) == 1 and fig.axes[0].lines and not empty_text(fig.axes[0])
    assert "reward/task" in fig.axes[0].get_ylabel()
    assert len(plots.frontier([synthetic()]).axes) == 2  # proxy and gold: both drawn
    nothing = plots.frontier([RunResult(r.config, None, {"kl/exact_seq_sum": r.metrics["kl/exact_seq_sum"]})])
    assert [empty_text(a) for a in nothing.axes] == [["no reward/proxy or reward/task logged"]]


def test_seeds_are_one_line_with_the_t_interval_band():
    rs = seeded()
    fig = plots.curve(rs, "kl/exact_seq_sum", smooth=1)
    ax = fig.axes[0]
    assert len(ax.lines) == 2 and len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 2
    for i, setting in enumerate((rs[0::2], rs[1::2])):  # fixed, pi: three seeds each
        mean, lo, hi = ref_band([r.metrics["kl/exact_seq_sum"] for r in setting])
        np.testing.assert_allclose(ax.lines[i].get_ydata(), mean, rtol=1e-12)
        xs, blo, bhi = band_of(ax, i)
        np.testing.assert_array_equal(xs, np.arange(40))
        np.testing.assert_allclose(blo, lo, rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(bhi, hi, rtol=1e-4, atol=1e-9)
    assert any("95% t-interval" in leg.get_title().get_text() for leg in legends(fig))
    assert sum("(n=3 seeds)" in t for t in legend_texts(fig)) == 2
    # smoothed: each seed's trailing mean first, then the interval over seeds
    ax_k = plots.beta_kl(rs, smooth=5).axes[1]
    mean, lo, hi = ref_band([loop_trailing(r.metrics["kl/exact_seq_sum"], 5) for r in rs[0::2]])
    np.testing.assert_allclose(ax_k.lines[0].get_ydata(), mean, rtol=1e-12)
    np.testing.assert_allclose(band_of(ax_k, 0)[1], lo, rtol=1e-4, atol=1e-9)
    # one seed per setting: no band, and the legend says so
    fig = plots.curve(study(), "kl/exact_seq_sum")
    assert not [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
    assert any("one seed per setting" in leg.get_title().get_text() for leg in legends(fig))


@pytest.mark.parametrize("name", FIGURES)
def test_legends_are_outside_the_data(name):
    for rs in (study(), seeded(), [synthetic()]):
        fig = getattr(plots, name)(rs)
        FigureCanvasAgg(fig).draw()
        legs = legends(fig)
        assert legs
        for leg in legs:
            box = leg.get_window_extent()
            for a in fig.axes:
                assert not box.overlaps(a.get_window_extent()), (name, a.get_ylabel())


PANELS = {
    "beta_kl": 2,
    "frontier": 2,
    "overoptimization": 1,
    "perplexity_diversity": 2,
    "controller_comparison": 3,
}


@pytest.mark.parametrize("name", [*FIGURES, "curve"])
def test_ax_draws_into_the_given_axes(name):
    fn = getattr(plots, name)
    args = ("reward/gold",) if name == "curve" else ()
    fig = Figure()
    given = list(np.atleast_1d(fig.subplots(PANELS.get(name, 1), 1)))
    out = fn(study(), *args, ax=given[0] if len(given) == 1 else given)
    assert out is fig and fig.axes == given
    assert all(a.lines or a.collections for a in given)
    with pytest.raises(ValueError, match="ax= needs"):
        fn(study(), *args, ax=list(Figure().subplots(4, 1)))


def unit(text):
    m = re.search(r"\(([^()]*(?:\([^()]*\))?[^()]*)\)$", text)
    return m.group(1) if m else None


@pytest.mark.parametrize("name", FIGURES)
def test_every_axis_has_a_label_with_a_unit(name):
    for rs in (study(), seeded()):
        fig = getattr(plots, name)(rs)
        bottom = fig.axes[-1]
        assert unit(bottom.get_xlabel()) in UNITS, bottom.get_xlabel()
        for a in fig.axes:
            assert unit(a.get_ylabel()) in UNITS, a.get_ylabel()
            if a is not bottom:  # x shared with the bottom panel, which has its label
                assert a.get_shared_x_axes().joined(a, bottom)
                assert unit(a.get_xlabel()) in UNITS or not a.get_xlabel()
    ylabels = [a.get_ylabel() for a in plots.frontier(study()).axes]
    assert ylabels == ["proxy reward [reward/proxy]\n(a.u.)", "gold reward [reward/gold]\n(a.u.)"]


def test_frontier_points_are_window_means():
    r = synthetic(n=45)
    ax_p, ax_g = plots.frontier(r, window=7).axes
    ends = range(44, 5, -7)[::-1]  # windows of 7 ending at the last iteration; the first 3 left out
    win = lambda v: np.array([v[e - 6 : e + 1].mean() for e in ends])
    kl = r.metrics["kl/exact_seq_sum"]
    np.testing.assert_allclose(ax_p.lines[0].get_xdata(), win(kl), rtol=1e-12)
    np.testing.assert_allclose(ax_p.lines[0].get_ydata(), win(r.metrics["reward/proxy"]), rtol=1e-12)
    np.testing.assert_allclose(ax_g.lines[0].get_ydata(), win(r.metrics["reward/gold"]), rtol=1e-12)
    last = ax_p.lines[1]  # the final point, marked: the means over the last 7 iterations
    assert last.get_xdata()[0] == pytest.approx(kl[-7:].mean()) and last.get_markersize() > 5
    # seeds: the mean over seeds of each seed's window means, with error bars
    rs = seeded()
    ax_p = plots.frontier(rs, reward="reward/proxy", window=10).axes[0]
    xs = [
        np.array([r.metrics["kl/exact_seq_sum"][e - 9 : e + 1].mean() for e in (9, 19, 29, 39)])
        for r in rs[0::2]
    ]
    np.testing.assert_allclose(ax_p.lines[0].get_xdata(), ref_band(xs)[0], rtol=1e-12)
    assert len(ax_p.containers) == 2  # one errorbar set per setting


def test_controller_comparison_normalises_only_adaptive_runs():
    rs = study()  # three fixed betas (config target 3, never used) and one PI run
    fig = plots.controller_comparison(rs, smooth=1)
    ax_r, ax_b, ax_f = fig.axes
    assert len(ax_r.lines) == 2  # the PI run's KL / target, and the line at 1
    pi = rs[3]
    np.testing.assert_allclose(ax_r.lines[0].get_ydata(), pi.metrics["ctrl/kl_observed_seq_sum"] / 3.0)
    assert len(ax_f.lines) == 3 and "nats/sequence" in ax_f.get_ylabel()
    np.testing.assert_allclose(ax_f.lines[0].get_ydata(), rs[0].metrics["ctrl/kl_observed_seq_sum"])
    # the legend's line styles are those of the lines: solid adaptive, dotted fixed
    (leg,) = legends(fig)
    for handle, text in zip(leg.legend_handles, [t.get_text() for t in leg.get_texts()], strict=True):
        match = [ln for ln in ax_b.lines if ln.get_color() == handle.get_color()]
        assert match and all(ln.get_linestyle() == handle.get_linestyle() for ln in match)
        assert handle.get_linestyle() == (":" if text.startswith("fixed") else "-")
    only_adaptive = plots.controller_comparison([rs[3]])
    assert len(only_adaptive.axes) == 2
    sampled = plots.controller_comparison(rs, kl="kl/k1_seq_sum", smooth=1)  # another KL, by name
    np.testing.assert_allclose(sampled.axes[0].lines[0].get_ydata(), pi.metrics["kl/k1_seq_sum"] / 3.0)


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
    assert "kl/k1_seq_sum" in plots.beta_kl(sampled).axes[1].get_ylabel()


def test_labels_come_from_the_config():
    assert plots.label(synthetic(0.01)) == "fixed beta=0.01"
    pi = plots.label(synthetic(0.05, "pi").config)
    assert pi.startswith("pi target=3") and "kp=0.1 ki=0.01" in pi
    texts = legend_texts(plots.controller_comparison(study()))
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
    texts = legend_texts(plots.overoptimization(study()))
    fit = [t for t in texts if "alpha=" in t]
    assert len(fit) == 1
    alpha = float(fit[0].split("alpha=")[1].split(",")[0])
    assert abs(alpha - ALPHA) < 0.1  # pooled, relative to iteration 0 (gold there is about 0)
    no_fit = plots.overoptimization(study(), fit=False)
    assert not [t for t in legend_texts(no_fit) if "alpha=" in t]
