"""Fixed beta in {0.001, 0.01, 0.1, 1.0} on the testbed: the two failure modes side by side.

``python experiments/beta_grid.py [--iterations 500] [--section.field value ...]``
Writes ``table.md`` (final and peak proxy, gold at its peak and at the end, exact KL, perplexities,
distinct-2, diagnosis), ``table.json`` and PNG plots into a new run directory, and checks the
testbed's design requirement (both failure modes visible). With ``--seeds 0,1,2`` every beta runs
once per seed (one sweep) and the table gives each beta's mean over seeds with a 95% t-interval
beside the per-seed rows; the requirement is checked on every seed.
Starts are means of the first 10 iterations, peaks and ends 10-iteration trailing means.
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
    diagnosis_of,
    first,
    last,
    markdown,
    parser,
    proxy_key,
    run_study,
    save_plots,
    settings_markdown,
    smooth,
    write_table,
)

BETAS = (0.001, 0.01, 0.1, 1.0)


def rows(results):
    out = []
    for r in results:
        px = smooth(r.metrics[proxy_key(r)])
        gold = smooth(r.metrics["reward/gold"]) if "reward/gold" in r.metrics else np.full_like(px, np.nan)
        ig = int(np.nanargmax(gold)) if np.isfinite(gold).any() else 0
        out.append({
            "beta": r.config.kl.beta,
            "seed": r.config.train.seed,
            "proxy start": first(r, proxy_key(r)),
            "proxy end": float(px[-1]),
            "proxy peak": float(px.max()),
            "gold start": first(r, "reward/gold"),
            "gold peak": float(gold[ig]),
            "gold peak iter": ig,
            "proxy at gold peak": float(px[ig]),
            "gold end": float(gold[-1]),
            "KL exact (nats/seq) end": last(r, "kl/exact_seq_sum"),
            "oracle ppl (floored) end": last(r, "eval/oracle_ppl_floored"),
            "floored-token frac end": last(r, "eval/oracle_floored_frac"),
            "indep ppl end": last(r, "eval/independent_ppl"),
            "ref ppl end": last(r, "eval/ref_ppl"),
            "distinct-2 end": last(r, "eval/distinct_2"),
            "diagnosis": diagnosis_of(r),
        })  # fmt: skip
    return out


def requirement(table):
    """The testbed's design requirement, measured (not asserted)."""
    by = {r["beta"]: r for r in table}
    out = {}
    if 1.0 in by and 0.01 in by:
        big, mid = by[1.0], by[0.01]
        gain_big = big["proxy end"] - big["proxy start"]
        gain_mid = mid["proxy end"] - mid["proxy start"]
        out["beta=1: exact KL < 0.1 nats/seq"] = big["KL exact (nats/seq) end"] < 0.1
        out["beta=1: proxy gain < 1/5 of beta=0.01's"] = gain_big < gain_mid / 5
    if 0.001 in by:
        s = by[0.001]
        rise = s["gold peak"] - s["gold start"]
        fall = s["gold peak"] - s["gold end"]
        out["beta=0.001: gold falls >= 20% of its rise from the peak"] = bool(rise > 0 and fall >= 0.2 * rise)
        out["beta=0.001: proxy rises while gold falls (proxy end > proxy at gold's peak)"] = bool(
            s["proxy end"] - s["proxy at gold peak"] > 0.05
        )
    return out


def main(argv=None):
    p = parser(__doc__.splitlines()[0], 500)
    ns = p.parse_args(argv)
    base = base_config(ns, "beta_grid")
    members = [base.replace(kl={"beta": b}, ctrl={"kind": "fixed"}) for b in BETAS]
    results, out = run_study(members, ns.replay, ns.seeds)
    table = rows(results)
    agg = by_setting(results, table, ["beta"])
    seeds = sorted({row["seed"] for row in table})
    per_seed = {s: requirement([row for row in table if row["seed"] == s]) for s in seeds}
    req = {k: sum(per_seed[s][k] for s in seeds) == len(seeds) for k in per_seed[seeds[0]]}
    notes = f"Design requirement (measured on each of seeds {', '.join(map(str, seeds))}):\n\n" + "\n".join(
        f"- {k}: **{'yes' if v else 'NO'}** ({sum(per_seed[s][k] for s in seeds)}/{len(seeds)} seeds)"
        for k, v in req.items()
    )
    plots = save_plots(results, out, ["beta_kl", "frontier", "perplexity_diversity", "overoptimization"])
    body = "\n\n".join(["## Per beta, over seeds", settings_markdown(agg), SEEDS_NOTE,
                         "## Per member", markdown(table)])  # fmt: skip
    extra = {"seeds": seeds, "settings": agg, "rows": table, "requirement": req,
             "requirement_per_seed": {str(s): v for s, v in per_seed.items()}}  # fmt: skip
    path = write_table(out, "beta_grid: fixed beta", body, plots, notes, extra)
    print(settings_markdown(agg))
    print(notes)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
