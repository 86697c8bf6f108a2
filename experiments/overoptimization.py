"""Gold and proxy reward against d = sqrt(KL) across runs, with Gao et al. (2023)'s RL form fitted.

``python experiments/overoptimization.py [--iterations 500] [--betas 0.001,0.003,0.01,0.03,0.1,1]``
Every iteration of every run is a point (d, gold, proxy), KL being the exact per-sequence KL
(nats/sequence). R(d) = d (alpha - b log d) is fitted to gold by least squares; its peak is at
d* = exp(alpha / b - 1) when b > 0. Gao et al. measure d from the initial policy, as here; rewards
are relative to each run's start, the mean of its first 10 iterations (one batch is too noisy).
With ``--seeds 0,1,2`` every beta runs once per seed (one sweep): the fit is made on every point of
every seed and on each seed alone (d* as a mean over seeds with a 95% t-interval), and the table
gives each beta's mean over seeds beside the per-seed rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

if not __package__:  # run by path (python experiments/NAME.py): experiments.* from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.study import (  # noqa: E402
    SEEDS_NOTE,
    base_config,
    by_setting,
    ci95,
    diagnosis_of,
    first,
    last,
    markdown,
    parser,
    proxy_key,
    run_study,
    save_plots,
    settings_markdown,
    write_table,
)
from klrl.analysis.plots import fit_gao  # noqa: E402


def gao(results) -> dict:
    """Gao et al.'s RL form fitted to every iteration of ``results`` (rewards minus each run's start)."""
    d = np.concatenate([np.sqrt(np.maximum(r.metrics["kl/exact_seq_sum"], 0)) for r in results])
    gold = np.concatenate([r.metrics["reward/gold"] - first(r, "reward/gold") for r in results])
    proxy = np.concatenate([r.metrics[proxy_key(r)] - first(r, proxy_key(r)) for r in results])
    alpha, b = fit_gao(d, gold)
    pred = d * (alpha - b * np.log(np.maximum(d, 1e-12)))
    r2 = 1 - np.sum((gold - pred) ** 2) / np.sum((gold - gold.mean()) ** 2)
    d_star = float(np.exp(alpha / b - 1)) if b > 0 else float("inf")
    return {"alpha": float(alpha), "b": float(b), "r2": float(r2), "d_star": d_star,
            "kl_star_nats_per_seq": d_star**2, "d_max_observed": float(d.max()),
            "rise_then_fall": bool(b > 0 and d_star < d.max()),
            "proxy_gold_corr": float(np.corrcoef(proxy, gold)[0, 1]), "points": int(len(d))}  # fmt: skip


def main(argv=None):
    p = parser(__doc__.splitlines()[0], 500)
    p.add_argument("--betas", default="0.001,0.003,0.01,0.03,0.1,1", help="comma-separated fixed betas")
    ns = p.parse_args(argv)
    base = base_config(ns, "overoptimization")
    members = [base.replace(kl={"beta": float(b)}, ctrl={"kind": "fixed"}) for b in ns.betas.split(",")]
    results, out = run_study(members, ns.replay, ns.seeds)
    seeds = sorted({r.config.train.seed for r in results})
    fit = gao(results)
    fits = {str(s): gao([r for r in results if r.config.train.seed == s]) for s in seeds}
    over = {}
    for k in ("alpha", "b", "r2", "d_star", "kl_star_nats_per_seq"):
        mean, half, n = ci95([f[k] for f in fits.values()])
        over[k] = {"mean": mean, "half": half, "n": n}
    table = [
        {
            "beta": r.config.kl.beta,
            "seed": r.config.train.seed,
            "final sqrt(KL)": float(np.sqrt(max(last(r, "kl/exact_seq_sum"), 0))),
            "final gold": last(r, "reward/gold"),
            "final gold - start": last(r, "reward/gold") - first(r, "reward/gold"),
            "final proxy": last(r, proxy_key(r)),
            "diagnosis": diagnosis_of(r),
        }
        for r in results
    ]
    agg = by_setting(results, table, ["beta"])
    notes = (
        f"Gao et al. RL form fitted to gold (every iteration of seeds {', '.join(map(str, seeds))}, gold "
        "minus each run's 10-iteration start): " + ", ".join(f"{k} = {v:.4g}" for k, v in fit.items())
    )
    if len(seeds) > 1:
        notes += "\n\nFitted on each seed alone (mean over seeds ± 95% t-interval): " + ", ".join(
            f"{k} = {v['mean']:.4g} ± {v['half']:.3g}" for k, v in over.items()
        )
        notes += "; per seed d* = " + ", ".join(f"{f['d_star']:.3g} (seed {s})" for s, f in fits.items())
    plots = save_plots(results, out, ["overoptimization", "frontier"])
    body = "\n\n".join(["## Per beta, over seeds", settings_markdown(agg), SEEDS_NOTE,
                         "## Per member", markdown(table)])  # fmt: skip
    extra = {"seeds": seeds, "settings": agg, "rows": table, "fit": fit, "fit_per_seed": fits,
             "fit_over_seeds": over}  # fmt: skip
    path = write_table(out, "overoptimization", body, plots, notes, extra)
    print(settings_markdown(agg))
    print(notes)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
