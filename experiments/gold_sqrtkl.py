"""Gold reward binned by d = sqrt(KL), beside Gao et al.'s fit restricted to what it is meant for.

``python experiments/gold_sqrtkl.py [--replay experiments/results/overoptimization] [--width 0.5]``
reads a finished fixed-beta sweep (no training) and writes ``gold_sqrtkl.md``, ``gold_sqrtkl.json``
and ``gold_sqrtkl.png`` into it. d is the square root of the exact KL (``kl/exact_seq_sum``,
nats/sequence) of each iteration's batch; gold is ``reward/gold`` minus the run's start baseline, the
mean of its first ``--base`` (10) iterations (one 64-sequence batch is too noisy a start).

* Binned gold: iterations of all runs pooled into bins of d of width ``--width``; per bin each
  seed's mean (its runs' iterations in the bin, all betas) and the mean over seeds with a 95%
  Student-t interval ``t_{0.975, k-1} s / sqrt(k)`` over the k seeds with at least ``--min-iters``
  iterations there; beside it the mean and 95% interval over the iterations in the bin (iterations
  of one run are autocorrelated, so that interval is narrower than an honest one), and each beta's
  mean in the bin.
* Gao et al.'s RL form ``R(d) = d (alpha - b log d)`` (``klrl.analysis.aggregate.fit_gao``) fitted (a) to
  every iteration (as ``overoptimization.py`` does), (b) without beta = 0.001, whose collapsed
  heavy negative tail (gold -1.3, a fluency collapse) is not the form's smooth over-optimisation,
  (c) to each run's end point (means over its last 10 iterations); each on every seed's points and
  on each seed alone (d* as a mean over seeds with a 95% t-interval).
* End points per beta: mean over seeds with a 95% t-interval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from klrl.analysis.aggregate import fit_gao
from klrl.analysis.results import load_sweep

HERE = Path(__file__).resolve().parent


def fit(d: np.ndarray, g: np.ndarray) -> dict[str, float]:
    alpha, b = fit_gao(d, g)
    pred = d * (alpha - b * np.log(np.maximum(d, 1e-12)))
    r2 = 1 - np.sum((g - pred) ** 2) / np.sum((g - g.mean()) ** 2)
    d_star = float(np.exp(alpha / b - 1)) if b > 0 else float("inf")
    return {
        "alpha": float(alpha),
        "b": float(b),
        "r2": float(r2),
        "d_star": d_star,
        "kl_star": d_star**2,
        "n": int(len(d)),
    }


def _ci(values) -> tuple[float, float, int]:
    """Mean over seeds and the half-width of its 95% t-interval (NaN half for one seed)."""
    v = np.asarray([x for x in values if np.isfinite(x)], float)
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), 0
    half = float(stats.t.ppf(0.975, n - 1) * v.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return float(v.mean()), half, n


def _pm(m: float, h: float) -> str:
    return f"{m:+.3f} +- {h:.3f}" if np.isfinite(h) else f"{m:+.3f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replay", default=str(HERE / "results" / "overoptimization"))
    p.add_argument("--width", type=float, default=0.5)
    p.add_argument("--base", type=int, default=10)
    p.add_argument("--min-iters", type=int, default=5, help="iterations a seed needs in a bin to count there")
    ns = p.parse_args(argv)
    out = Path(ns.replay)
    rs = load_sweep(out)
    runs_beta = [r.config.kl.beta for r in rs]
    runs_seed = [r.config.train.seed for r in rs]
    betas = list(dict.fromkeys(runs_beta))
    seeds = sorted(set(runs_seed))
    ds = [np.sqrt(np.maximum(r.metrics["kl/exact_seq_sum"], 0)) for r in rs]
    base = [float(np.mean(r.metrics["reward/gold"][: ns.base])) for r in rs]
    gs = [r.metrics["reward/gold"] - b0 for r, b0 in zip(rs, base, strict=True)]
    d_all, g_all = np.concatenate(ds), np.concatenate(gs)
    beta_all = np.concatenate([np.full(len(d), b) for d, b in zip(ds, runs_beta, strict=True)])
    seed_all = np.concatenate([np.full(len(d), s) for d, s in zip(ds, runs_seed, strict=True)])
    edges = np.arange(0.0, d_all.max() + ns.width, ns.width)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inb = (d_all >= lo) & (d_all < hi)
        n = int(inb.sum())
        if n == 0:
            continue
        g = g_all[inb]
        half = float(stats.t.ppf(0.975, n - 1) * g.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
        per_seed = {}
        for sd in seeds:
            sel = inb & (seed_all == sd)
            if sel.sum() >= ns.min_iters:
                per_seed[str(sd)] = float(g_all[sel].mean())
        sm, sh, sn = _ci(list(per_seed.values()))
        per = {}
        for b in betas:
            sel = inb & (beta_all == b)
            if sel.any():
                per[f"beta={b:g}"] = float(g_all[sel].mean())
        rows.append(
            {
                "sqrt(KL) bin": f"[{lo:.1f}, {hi:.1f})",
                "lo": float(lo),
                "hi": float(hi),
                "n": n,
                "gold mean": float(g.mean()),
                "ci95 half": half,
                "per seed": per_seed,
                "seed mean": sm,
                "seed ci95 half": sh,
                "seeds in bin": sn,
                "per beta": per,
            }
        )
    full = [r for r in rows if r["n"] >= 20 and r["seeds in bin"] == len(seeds)] or [
        r for r in rows if r["n"] >= 20
    ]
    peak = max(full, key=lambda r: r["seed mean"])
    ends_d = np.array([float(np.sqrt(max(np.mean(r.metrics["kl/exact_seq_sum"][-10:]), 0))) for r in rs])
    ends_g = np.array([float(np.mean(g[-10:])) for g in gs])
    keep = beta_all != min(betas)
    kinds = {
        "all iterations": lambda sel: fit(d_all[sel], g_all[sel]),
        f"without beta={min(betas):g}": lambda sel: fit(d_all[sel & keep], g_all[sel & keep]),
    }
    fits, fits_seed = {}, {}
    for k, f in kinds.items():
        fits[k] = f(np.ones_like(keep))
        fits_seed[k] = {str(sd): f(seed_all == sd) for sd in seeds}
    fits["run end points"] = fit(ends_d, ends_g)
    fits_seed["run end points"] = {
        str(sd): fit(ends_d[np.array(runs_seed) == sd], ends_g[np.array(runs_seed) == sd]) for sd in seeds
    }
    over = {k: dict(zip(("mean", "half", "n"), _ci([f["d_star"] for f in v.values()]), strict=True))
            for k, v in fits_seed.items()}  # fmt: skip
    ends = []
    for b in betas:
        idx = [i for i, rb in enumerate(runs_beta) if rb == b]
        ends.append(
            {
                "beta": b,
                "seeds": [runs_seed[i] for i in idx],
                "end sqrt(KL)": dict(zip(("mean", "half", "n"), _ci(ends_d[idx]), strict=True)),
                "end KL": dict(zip(("mean", "half", "n"), _ci(ends_d[idx] ** 2), strict=True)),
                "end gold - start": dict(zip(("mean", "half", "n"), _ci(ends_g[idx]), strict=True)),
                "start gold": dict(zip(("mean", "half", "n"), _ci([base[i] for i in idx]), strict=True)),
                "per seed end gold - start": [float(ends_g[i]) for i in idx],
                "per seed end KL": [float(ends_d[i] ** 2) for i in idx],
            }
        )
    best = max(ends, key=lambda e: e["end gold - start"]["mean"])
    res = {
        "seeds": seeds,
        "bins": rows,
        "peak_bin": peak,
        "fits": fits,
        "fits_per_seed": fits_seed,
        "d_star_over_seeds": over,
        "ends": ends,
        "best_end_beta": best["beta"],
        "width": ns.width,
        "base_window": ns.base,
        "min_iters": ns.min_iters,
    }
    (out / "gold_sqrtkl.json").write_text(json.dumps(res, indent=1))
    sl = ", ".join(map(str, seeds))
    md = [
        "# gold against sqrt(KL), binned",
        "",
        f"Seeds {sl}. Gold minus each run's start (mean of its first {ns.base} iterations); bins of sqrt(KL) "
        f"of width {ns.width}. `over seeds`: each seed's mean over its iterations in the bin (all betas "
        f"pooled; a seed counts in a bin where it has >= {ns.min_iters} iterations), then the mean over "
        "seeds +- the half-width of its 95% Student-t interval (t_{0.975, k-1} s / sqrt(k), k seeds in "
        "the bin). `over iterations`: mean +- 95% t-interval over every iteration in the bin "
        "(autocorrelated: optimistic). Per-beta columns: mean over the seeds' iterations in the bin.",
        "",
        "| sqrt(KL) bin | n | seeds | gold, over seeds | gold, over iterations | "
        + " | ".join(f"beta={b:g}" for b in betas)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(betas),
    ]
    for r in rows:
        cells = [
            f"{r['per beta'][f'beta={b:g}']:+.3f}" if f"beta={b:g}" in r["per beta"] else "" for b in betas
        ]
        head = (
            f"| {r['sqrt(KL) bin']} | {r['n']} | {r['seeds in bin']} | "
            f"{_pm(r['seed mean'], r['seed ci95 half']) if r['seeds in bin'] else ''} | "
            f"{_pm(r['gold mean'], r['ci95 half'])} | "
        )
        md.append(head + " | ".join(cells) + " |")
    top = f"{peak['sqrt(KL) bin']} (gold {_pm(peak['seed mean'], peak['seed ci95 half'])} over seeds)"
    md += [
        "",
        f"Highest bin with n >= 20 iterations and every seed present: {top}.",
        "",
        "| fit (every seed's points) | n | alpha | b | R^2 | d* | KL* (nats/seq) "
        f"| d*, fitted per seed (mean +- 95%, seeds {sl}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, f in fits.items():
        cells = f"{f['alpha']:.3f} | {f['b']:.3f} | {f['r2']:.2f} | {f['d_star']:.2f} | {f['kl_star']:.2f}"
        per = ", ".join(f"{v['d_star']:.2f}" for v in fits_seed[k].values())
        o = over[k]
        ostr = f"{o['mean']:.2f} +- {o['half']:.2f} ({per})" if np.isfinite(o["half"]) else f"{o['mean']:.2f}"
        md.append(f"| {k} | {f['n']} | {cells} | {ostr} |")
    md += [
        "",
        f"End points (means of each run's last 10 iterations), mean over seeds {sl} +- 95% t-interval:",
        "",
        "| beta | end sqrt(KL) | end KL | end gold - start | start gold | end gold - start per seed |",
        "|---|---|---|---|---|---|",
    ]
    for e in ends:
        c = lambda k: (
            f"{e[k]['mean']:.2f} +- {e[k]['half']:.2f}"
            if np.isfinite(e[k]["half"])
            else f"{e[k]['mean']:.2f}"
        )
        pers = ", ".join(f"{v:+.3f}" for v in e["per seed end gold - start"])
        md.append(
            f"| {e['beta']:g} | {c('end sqrt(KL)')} | {c('end KL')} | "
            f"{_pm(e['end gold - start']['mean'], e['end gold - start']['half'])} | "
            f"{_pm(e['start gold']['mean'], e['start gold']['half'])} | {pers} |"
        )
    md += ["", "![gold_sqrtkl](gold_sqrtkl.png)"]
    (out / "gold_sqrtkl.md").write_text("\n".join(md) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in betas:
        sel = beta_all == b
        ax.scatter(d_all[sel], g_all[sel], s=3, alpha=0.2, label=f"beta={b:g}")
    allin = [r for r in rows if r["seeds in bin"] == len(seeds)]
    some = [r for r in rows if 0 < r["seeds in bin"] < len(seeds)]
    mid = lambda rr: np.array([(r["lo"] + r["hi"]) / 2 for r in rr])
    ax.errorbar(
        mid(allin),
        [r["seed mean"] for r in allin],
        yerr=[r["seed ci95 half"] if np.isfinite(r["seed ci95 half"]) else 0.0 for r in allin],
        color="k",
        fmt="o",
        capsize=3,
        label=f"binned mean, 95% t-interval over seeds {sl}",
    )
    if some:
        ax.plot(mid(some), [r["seed mean"] for r in some], "o", mfc="none", color="k",
                label="binned mean, fewer seeds in the bin (no interval)")  # fmt: skip
    x = np.linspace(1e-3, d_all.max(), 200)
    for (k, f), c in zip(fits.items(), ("tab:gray", "tab:red", "tab:purple"), strict=True):
        lab = f"Gao fit, {k} (d*={f['d_star']:.2f})"
        ax.plot(x, x * (f["alpha"] - f["b"] * np.log(x)), color=c, ls="--", label=lab)
    ax.scatter(ends_d, ends_g, marker="*", s=90, color="k", zorder=5, label="run end points (every seed)")
    ax.set_xlabel("sqrt(KL) [sqrt(nats/sequence)], exact KL")
    ax.set_ylabel(f"gold - start (mean of first {ns.base} iterations)")
    ax.set_ylim(min(-1.6, float(np.nanmin(g_all))), 0.9)
    ax.legend(fontsize=6, ncol=2)
    fig.savefig(out / "gold_sqrtkl.png", dpi=90, bbox_inches="tight")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
