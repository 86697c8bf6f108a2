"""Gold reward binned by d = sqrt(KL), beside Gao et al.'s fit restricted to what it is meant for.

``python experiments/gold_sqrtkl.py [--replay experiments/results/overoptimization] [--width 0.5]``
reads a finished fixed-beta sweep (no training) and writes ``gold_sqrtkl.md``, ``gold_sqrtkl.json``
and ``gold_sqrtkl.png`` into it. d is the square root of the exact KL (``kl/exact_seq_sum``,
nats/sequence) of each iteration's batch; gold is ``reward/gold`` minus the run's start baseline, the
mean of its first ``--base`` (10) iterations (one 64-sequence batch is too noisy a start).

* Binned gold: iterations of all runs pooled into bins of d of width ``--width``; per bin the mean
  and a 95% interval ``mean +- t_{0.975, n-1} s / sqrt(n)`` over the iterations in it (iterations
  of one run are autocorrelated, so this interval is narrower than an honest one), and each beta's
  mean in the bin.
* Gao et al.'s RL form ``R(d) = d (alpha - b log d)`` (``klrl.aggregate.fit_gao``) fitted (a) to
  every iteration (as ``overoptimization.py`` does), (b) without beta = 0.001, whose collapsed
  heavy negative tail (gold -1.3, a fluency collapse) is not the form's smooth over-optimisation,
  (c) to each run's end point (means over its last 10 iterations).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from klrl.aggregate import fit_gao
from klrl.results import load_sweep

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replay", default=str(HERE / "results" / "overoptimization"))
    p.add_argument("--width", type=float, default=0.5)
    p.add_argument("--base", type=int, default=10)
    ns = p.parse_args(argv)
    out = Path(ns.replay)
    rs = load_sweep(out)
    betas = [r.config.kl.beta for r in rs]
    ds = [np.sqrt(np.maximum(r.metrics["kl/exact_seq_sum"], 0)) for r in rs]
    base = [float(np.mean(r.metrics["reward/gold"][: ns.base])) for r in rs]
    gs = [r.metrics["reward/gold"] - b0 for r, b0 in zip(rs, base, strict=True)]
    d_all, g_all = np.concatenate(ds), np.concatenate(gs)
    beta_all = np.concatenate([np.full(len(d), b) for d, b in zip(ds, betas, strict=True)])
    edges = np.arange(0.0, d_all.max() + ns.width, ns.width)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inb = (d_all >= lo) & (d_all < hi)
        n = int(inb.sum())
        if n == 0:
            continue
        g = g_all[inb]
        half = float(stats.t.ppf(0.975, n - 1) * g.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
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
                "per beta": per,
            }
        )
    dense = [r for r in rows if r["n"] >= 20]
    peak = max(dense, key=lambda r: r["gold mean"])
    ends_d = np.array([float(np.sqrt(max(np.mean(r.metrics["kl/exact_seq_sum"][-10:]), 0))) for r in rs])
    ends_g = np.array([float(np.mean(g[-10:])) for g in gs])
    keep = beta_all != min(betas)
    fits = {
        "all iterations": fit(d_all, g_all),
        f"without beta={min(betas):g}": fit(d_all[keep], g_all[keep]),
        "run end points": fit(ends_d, ends_g),
    }
    ends = [
        {
            "beta": b,
            "end sqrt(KL)": float(d),
            "end KL": float(d * d),
            "end gold - start": float(g),
            "start gold": b0,
        }
        for b, d, g, b0 in zip(betas, ends_d, ends_g, base, strict=True)
    ]
    res = {
        "bins": rows,
        "peak_bin": peak,
        "fits": fits,
        "ends": ends,
        "width": ns.width,
        "base_window": ns.base,
    }
    (out / "gold_sqrtkl.json").write_text(json.dumps(res, indent=1))
    md = [
        "# gold against sqrt(KL), binned",
        "",
        f"Gold minus each run's start (mean of its first {ns.base} iterations); bins of sqrt(KL) of width "
        f"{ns.width}; mean and 95% t-interval over the iterations in the bin "
        "(autocorrelated: optimistic).",
        "",
        "| sqrt(KL) bin | n | gold mean +- 95% | " + " | ".join(f"beta={b:g}" for b in betas) + " |",
        "|---|---|---|" + "---|" * len(betas),
    ]
    for r in rows:
        cells = [
            f"{r['per beta'][f'beta={b:g}']:+.3f}" if f"beta={b:g}" in r["per beta"] else "" for b in betas
        ]
        head = f"| {r['sqrt(KL) bin']} | {r['n']} | {r['gold mean']:+.3f} +- {r['ci95 half']:.3f} | "
        md.append(head + " | ".join(cells) + " |")
    top = f"{peak['sqrt(KL) bin']} (gold {peak['gold mean']:+.3f} +- {peak['ci95 half']:.3f})"
    md += [
        "",
        f"Highest bin with n >= 20: {top}.",
        "",
        "| fit | n | alpha | b | R^2 | d* | KL* (nats/seq) |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, f in fits.items():
        cells = f"{f['alpha']:.3f} | {f['b']:.3f} | {f['r2']:.2f} | {f['d_star']:.2f} | {f['kl_star']:.2f}"
        md.append(f"| {k} | {f['n']} | {cells} |")
    md += ["", "| beta | end sqrt(KL) | end KL | end gold - start | start gold |", "|---|---|---|---|---|"]
    for e in ends:
        cells = f"{e['end sqrt(KL)']:.2f} | {e['end KL']:.2f} | {e['end gold - start']:+.3f}"
        md.append(f"| {e['beta']:g} | {cells} | {e['start gold']:+.3f} |")
    md += ["", "![gold_sqrtkl](gold_sqrtkl.png)"]
    (out / "gold_sqrtkl.md").write_text("\n".join(md) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for d, g, b in zip(ds, gs, betas, strict=True):
        ax.scatter(d, g, s=4, alpha=0.25, label=f"beta={b:g}")
    mid = np.array([(r["lo"] + r["hi"]) / 2 for r in rows])
    ax.errorbar(
        mid,
        [r["gold mean"] for r in rows],
        yerr=[r["ci95 half"] for r in rows],
        color="k",
        fmt="o-",
        capsize=3,
        label="binned mean, 95% (over iterations)",
    )
    x = np.linspace(1e-3, d_all.max(), 200)
    for (k, f), c in zip(fits.items(), ("tab:gray", "tab:red", "tab:purple"), strict=True):
        lab = f"Gao fit, {k} (d*={f['d_star']:.2f})"
        ax.plot(x, x * (f["alpha"] - f["b"] * np.log(x)), color=c, ls="--", label=lab)
    ax.scatter(ends_d, ends_g, marker="*", s=120, color="k", zorder=5, label="run end points")
    ax.set_xlabel("sqrt(KL) [sqrt(nats/sequence)], exact KL")
    ax.set_ylabel(f"gold - start (mean of first {ns.base} iterations)")
    ax.set_ylim(min(-1.6, float(np.nanmin(g_all))), 0.9)
    ax.legend(fontsize=6, ncol=2)
    fig.savefig(out / "gold_sqrtkl.png", dpi=90, bbox_inches="tight")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
