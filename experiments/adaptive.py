"""Adaptive beta on the testbed: KL targets x controllers, each with and without a warm-up.

``python experiments/adaptive.py [--iterations 500] [--targets 2,6] [--warmup 200] [...]``
Controllers: proportional (Ziegler et al. 2019), band (PPO paper), PI with Kp in {0.1, 0.2, 0.4}.
Every run starts at beta = 0.1; the warm-up variant holds beta = 0.1 for ``--warmup`` iterations.
Reports, per run: tracking error over the second half (mean |KL/target - 1|), settling time
(first iteration after which the 10-iteration mean KL stays within +-10% of target), the
oscillation of log beta over the second half (total variation), the final beta, and early
stability: the peak of the 10-iteration mean KL over target and the total variation of log beta in
the 100 iterations after the controller takes over (iteration 0, or the end of the warm-up).
KL here is what the controller saw: per-sequence sum of k1 (nats/sequence). With ``--seeds 0,1,2``
every setting runs once per seed (one sweep); the table gives each setting's mean over seeds with a
95% t-interval beside the per-seed rows.
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
    markdown,
    parser,
    run_study,
    save_plots,
    settings_markdown,
    smooth,
    write_table,
)

CONTROLLERS = {
    "proportional": {"kind": "proportional", "horizon": 1000.0},
    "band": {"kind": "band"},
    "pi kp=0.1": {"kind": "pi", "kp": 0.1, "ki": 0.0},
    "pi kp=0.2": {"kind": "pi", "kp": 0.2, "ki": 0.0},
    "pi kp=0.4": {"kind": "pi", "kp": 0.4, "ki": 0.0},
}


def settling(kl: np.ndarray, target: float, start: int = 0, tol: float = 0.1) -> int | None:
    ok = np.abs(smooth(kl)[start:] / target - 1) <= tol
    bad = np.nonzero(~ok)[0]
    if len(bad) == 0:
        return start
    return start + int(bad[-1]) + 1 if bad[-1] + 1 < len(ok) else None


def name_of(c) -> str:
    return c.kind if c.kind != "pi" else f"pi kp={c.kp:g}"


def rows(results):
    out = []
    for r in results:
        c = r.config.ctrl
        name = name_of(c)
        kl = r.metrics[f"ctrl/kl_observed_{c.unit}"]
        half = len(kl) // 2
        logb = np.log(np.maximum(r.metrics["ctrl/beta"], 1e-12))
        w = c.warmup_iters
        s = settling(kl, c.target, start=w)
        out.append({
            "controller": name,
            "target (nats/seq)": c.target,
            "warm-up": c.warmup_iters,
            "seed": r.config.train.seed,
            "tracking error 2nd half": float(np.mean(np.abs(kl[half:] / c.target - 1))),
            "settling iter": "never" if s is None else s,
            "TV log beta 2nd half": float(np.sum(np.abs(np.diff(logb[half:])))),
            "early max KL/target": float(smooth(kl)[w : w + 100].max() / c.target),
            "early TV log beta": float(np.sum(np.abs(np.diff(logb[w : w + 100])))),
            "final beta": float(r.metrics["ctrl/beta"][-1]),
            "diagnosis": diagnosis_of(r),
        })  # fmt: skip
    return out


def main(argv=None):
    p = parser(__doc__.splitlines()[0], 500)
    p.add_argument("--targets", default="2,6", help="comma-separated KL targets, nats/sequence")
    p.add_argument("--warmup", type=int, default=200, help="warm-up iterations at beta = 0.1")
    ns = p.parse_args(argv)
    base = base_config(ns, "adaptive").replace(kl={"beta": 0.1}, ctrl={"unit": "seq_sum", "warmup_beta": 0.1})
    members = []
    for target in (float(t) for t in ns.targets.split(",")):
        for ctrl in CONTROLLERS.values():
            for w in (0, ns.warmup):
                members.append(base.replace(ctrl={**ctrl, "target": target, "warmup_iters": w}))
    results, out = run_study(members, ns.replay, ns.seeds)
    table = rows(results)
    agg = by_setting(results, table, ["controller", "target (nats/seq)", "warm-up"])
    plots = save_plots(results, out, ["controller_comparison", "beta_kl"])
    body = "\n\n".join(["## Per setting, over seeds", settings_markdown(agg), SEEDS_NOTE,
                         "## Per member", markdown(table)])  # fmt: skip
    extra = {"seeds": sorted({row["seed"] for row in table}), "settings": agg, "rows": table}
    path = write_table(out, "adaptive: controllers x targets x warm-up", body, plots, extra=extra)
    print(settings_markdown(agg))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
