"""Claims, tables and the figure of ``experiments/llm_turn.py``, from its stored results alone.

``finish(DIR)`` reads ``study.json``, ``bon.json``, ``pool_heldout.jsonl.gz`` and each arm's
``ARM_metrics.json.gz`` and writes ``claims.md``/``claims.json`` (per-seed values: mean and 95% Student-t
interval over seeds; "flat" by TOST at a margin fixed here before any data: :data:`MARGIN_SD` standard
deviations of the gold (proxy) over the reference's own samples), ``table.md`` and ``llm_turn.png`` (gold and
proxy against sqrt(KL) for best-of-n and PPO, with Gao et al.'s fitted forms; the exact KL over iterations).

The held-out evaluation's point at iteration 0 is the reference: the first draw of every held-out prompt
in the best-of-n pool (KL 0 by definition).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

from klrl.analysis.aggregate import fit_gao, gao_curve, t_interval
from klrl.analysis.overopt import bon_curve, fit_bon, tost, turn

MARGIN_SD = 0.2  # "flat": |change| < 0.2 reference standard deviations (a small effect, Cohen 1988)
TURN_KL = 50.0  # nats/seq the small-beta arm is to reach (issue 38)


def load_gz(path: Path, lines: bool = False) -> Any:
    with gzip.open(path, "rt") as f:
        return [json.loads(x) for x in f if x.strip()] if lines else json.load(f)


def q(values: Any) -> dict[str, Any]:
    """Mean and 95% t-interval over seeds of per-seed values."""
    v = np.asarray(values, float)
    m, h, n = t_interval(v[:, None])
    return {
        "mean": float(m[0]),
        "lo": float(m[0] - h[0]),
        "hi": float(m[0] + h[0]),
        "n": int(n[0]),
        "values": [round(float(x), 4) for x in v],
    }


def fmt(x: dict[str, Any], d: int = 3) -> str:
    return f"{x['mean']:.{d}f} [{x['lo']:.{d}f}, {x['hi']:.{d}f}]"


def curves(arm: dict[str, Any], ref: dict[str, float]) -> dict[int, dict[str, np.ndarray]]:
    """Per member: its held-out evaluations by step (step 0: the reference under the same key; older
    results without it get ``ref``, the best-of-n pool's first draws, prepended)."""
    out: dict[int, dict[str, list[float]]] = {}
    for e in sorted(arm["evals"], key=lambda e: (e["member"], e["step"])):
        if e["member"] not in out:
            out[e["member"]] = {k: [] for k in ("step", *ref)}
            if e["step"] != 0:
                for k, v in {"step": 0, **ref}.items():
                    out[e["member"]][k].append(v)
        for k, c in out[e["member"]].items():
            c.append(e.get(k, np.nan))
    return {j: {k: np.asarray(v, float) for k, v in c.items()} for j, c in out.items()}


def reference_point(pool: list[dict[str, Any]]) -> dict[str, float]:
    first = [s for s in pool if s["draw"] == 0]
    ref = {
        k: float(np.mean([s[k] for s in first])) for k in ("gold", "judge_nll", "proxy_strong", "proxy_weak")
    }
    return {**ref, "kl": 0.0}


def by_label(runs: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for j, r in enumerate(runs):
        out.setdefault(r["label"], []).append(j)
    return out


def turn_claims(arm: dict, cur: dict, sd: dict[str, float]) -> list[dict[str, Any]]:
    """The small-beta arm: the KL reached, the gold's peak against its end (the fall beyond the evaluation's
    noise), the proxy's rise, and the RL form's turn fitted over seeds."""
    out = []
    for lab, members in by_label(arm["runs"]).items():
        c = [cur[j] for j in members]
        kl_max = q([x["kl"].max() for x in c])
        fall = q([x["gold"].max() - x["gold"][-1] for x in c])
        rise = q([x["proxy_strong"][-1] - x["proxy_strong"][0] for x in c])
        noise = 2 * sd["gold"] / np.sqrt(max(int(arm["evals"][0]["n"]), 1))
        out.append(
            {
                "claim": f"{lab}: exact KL reached (nats/seq, held-out)",
                "value": kl_max,
                "verdict": "reached" if kl_max["mean"] >= TURN_KL else f"below {TURN_KL:g}",
            }
        )
        out.append(
            {
                "claim": f"{lab}: the gold falls from its peak (peak - end)",
                "value": fall,
                "verdict": "shown" if fall["lo"] > noise else f"not shown (noise {noise:.3f})",
            }
        )
        out.append(
            {
                "claim": f"{lab}: the proxy rises (end - start)",
                "value": rise,
                "verdict": "shown" if rise["lo"] > 0 else "not shown",
            }
        )
        d = np.concatenate([np.sqrt(np.maximum(x["kl"], 0)) for x in c])
        g = np.concatenate([x["gold"] - x["gold"][0] for x in c])
        try:
            a, b = fit_gao(d, g)
            dstar = turn(a, b, "rl")
            boot = []
            rng = np.random.default_rng(0)
            for _ in range(500):
                pick = rng.integers(0, len(c), len(c))
                dd = np.concatenate([np.sqrt(np.maximum(c[i]["kl"], 0)) for i in pick])
                gg = np.concatenate([c[i]["gold"] - c[i]["gold"][0] for i in pick])
                boot.append(turn(*fit_gao(dd, gg), "rl") ** 2)
            lo, hi = np.percentile(boot, [2.5, 97.5])
            val = {"mean": dstar**2, "lo": float(lo), "hi": float(hi), "n": len(c), "alpha": a, "b": b}
            ok = np.isfinite(dstar) and dstar**2 <= np.nanmax(d) ** 2 * 1.5
            out.append(
                {
                    "claim": f"{lab}: the RL form's turn, KL* = d*^2 (seed bootstrap)",
                    "value": val,
                    "verdict": "inside the data" if ok else "extrapolated / no interior peak",
                }
            )
        except ValueError as e:
            out.append({"claim": f"{lab}: the RL form's turn", "value": None, "verdict": f"no fit: {e}"})
    return out


def frozen_claims(arm: dict, cur: dict, sd: dict[str, float], turn_kl: float | None) -> list[dict[str, Any]]:
    """Large beta at the small learning rate: the KL against the same arm's smallest beta (the control: same
    lr and steps, so a KL gap is the penalty's doing, not the step's), and the gold and proxy flat by TOST."""
    groups = by_label(arm["runs"])
    beta = {lab: arm["runs"][m[0]]["beta0"] for lab, m in groups.items()}
    control = min(beta, key=beta.get) if len(groups) > 1 else None
    ctl_kl = float(np.mean([cur[j]["kl"][-1] for j in groups[control]])) if control else turn_kl
    out = []
    for lab, members in groups.items():
        c = [cur[j] for j in members]
        kl = q([x["kl"][-1] for x in c])
        if lab == control:
            out.append({"claim": f"{lab} (control, same lr): exact KL at the end (nats/seq, held-out)",
                        "value": kl, "verdict": "measured"})  # fmt: skip
            for key in ("gold", "proxy_strong"):  # what "flat" is measured against: the control's move
                v = q([x[key][-1] - x[key][0] for x in c])
                moved = "rises" if v["lo"] > 0 else "not shown to rise"
                out.append({"claim": f"{lab} (control, same lr): {key} end - start", "value": v,
                            "verdict": moved})  # fmt: skip
            continue
        ratio = f"; {kl['mean'] / ctl_kl:.1%} of {control or 'the small-beta arm'}'s" if ctl_kl else ""
        out.append({"claim": f"{lab}: exact KL at the end (nats/seq, held-out)", "value": kl,
                    "verdict": f"measured{ratio}"})  # fmt: skip
        for key in ("gold", "proxy_strong"):
            margin = MARGIN_SD * sd[key]
            t = tost([x[key][-1] - x[key][0] for x in c], margin)
            val = {
                "mean": t["mean"],
                "lo": t["lo90"],
                "hi": t["hi90"],
                "n": t["n"],
                "p": t["p"],
                "margin": margin,
            }
            out.append(
                {
                    "claim": f"{lab}: {key} flat (end - start, 90% interval, TOST margin {margin:.3f})",
                    "value": val,
                    "verdict": "flat (equivalent)" if t["equivalent"] else "not shown flat",
                }
            )
    return out


def ctrl_claims(arm: dict) -> list[dict[str, Any]]:
    """Controllers against the fixed settle beta: second-half tracking of the exact KL and where beta goes."""
    out = []
    for lab, members in by_label(arm["runs"]).items():
        runs = [arm["runs"][j] for j in members]
        target = next(r["target"] for r in arm["runs"] if r["kind"] != "fixed")  # the fixed one's baseline
        kl = [np.asarray(r["metrics"]["kl/exact_seq_sum"]) for r in runs]
        half = len(kl[0]) // 2
        err = q([k[half:].mean() / target - 1 for k in kl])
        within = q([np.mean(np.abs(k[half:] / target - 1) <= 0.25) for k in kl])
        beta = q([np.mean(r["metrics"]["ctrl/beta"][half:]) for r in runs])
        out.append(
            {
                "claim": f"{lab}: second-half KL / target - 1 (target {target:g})",
                "value": err,
                "verdict": "tracks (+-25%)" if -0.25 <= err["lo"] and err["hi"] <= 0.25 else "not shown",
            }
        )
        out.append(
            {
                "claim": f"{lab}: share of second-half iterations within +-25%",
                "value": within,
                "verdict": "measured",
            }
        )
        out.append({"claim": f"{lab}: second-half mean beta", "value": beta, "verdict": "measured"})
    return out


def grid_rows(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The recipe's coarse grid as the run saw it (per beta: gold gain, judge NLL ratio, KL), its choice."""
    out = []
    for b, r in choice["grid"].items():
        for key, what in (("gold_gain", "held-out gold gain"), ("judge_ratio", "judge NLL / reference's"),
                          ("kl", "exact KL (nats/seq)")):  # fmt: skip
            out.append({"claim": f"grid beta={float(b):g} ({r['arm']} arm): {what} at the grid's end",
                        "value": q(r[key]), "verdict": "measured"})  # fmt: skip
    out.append({"claim": "recipe: the grid's choice", "value": None,
                "verdict": f"warm-up beta {choice['beta']:g}, PI target {choice['target']:g} nats/seq "
                           f"({choice['rule']})"})  # fmt: skip
    return out


def recipe_claims(arm: dict, cur: dict, study: dict, fixed: tuple[dict, dict] | None) -> list[dict[str, Any]]:
    """The seeds' recipe: the grid and its choice, second-half tracking of the exact KL (as the controllers'),
    the rollbacks, and the held-out end state against the fixed grid beta continued (paired by seed)."""
    choice = study["timing"]["recipe"]["choice"]
    out = grid_rows(choice) + ctrl_claims(arm)
    n_rb = [sum(e["event"] == "rollback" for e in r.get("events", [])) for r in arm["runs"]]
    out.append({"claim": "recipe: rollbacks on a judge-NLL breach", "value": q(n_rb),
                "verdict": "none" if not any(n_rb) else "measured"})  # fmt: skip
    if fixed is None:
        return out
    f_arm, step = fixed[0], max(e["step"] for e in arm["evals"])
    at = lambda a: {(e["member"], e["step"]): e for e in a["evals"]}  # noqa: E731
    mine, theirs = at(arm), at(f_arm)
    seed_of = {r["seed"]: j for j, r in enumerate(f_arm["runs"]) if r["beta0"] == choice["beta"]}
    pairs = [
        ((j, step), (seed_of[r["seed"]], step)) for j, r in enumerate(arm["runs"]) if r["seed"] in seed_of
    ]
    pairs = [(a, b) for a, b in pairs if a in mine and b in theirs]
    for key in ("kl", "gold", "proxy_strong", "distinct2", "repeated", "judge_nll"):
        d = [mine[a][key] - theirs[b][key] for a, b in pairs]
        if len(d) < 2:
            continue
        v = q(d)
        verdict = "higher" if v["lo"] > 0 else "lower" if v["hi"] < 0 else "not shown to differ"
        out.append({"claim": f"recipe - fixed beta={choice['beta']:g} at iteration {step}: {key} "
                             "(held-out, paired by seed)", "value": v, "verdict": verdict})  # fmt: skip
    return out


def bon_claims(bon: dict, study: dict) -> list[dict[str, Any]]:
    out = []
    for tag, p in study["proxies"].items():
        acc = {
            "mean": p["heldout_accuracy_vs_gold"],
            "lo": p["wilson95"][0],
            "hi": p["wilson95"][1],
            "n": p["pairs_heldout"],
        }
        out.append(
            {
                "claim": f"proxy {tag} ({p['pairs_train']} pairs): held-out accuracy vs gold (Wilson)",
                "value": acc,
                "verdict": "in 0.65-0.75" if 0.65 <= acc["mean"] <= 0.75 else "outside 0.65-0.75",
            }
        )
        d = np.sqrt(np.asarray(bon["kl"]))
        g = np.asarray(bon[f"{tag}/gold"]) - bon[f"{tag}/gold"][0]
        se = np.asarray(bon[f"{tag}/gold_se"])
        a, b = fit_bon(d, g)
        rng = np.random.default_rng(1)
        boot = [turn(*fit_bon(d, g + rng.normal(0, se)), "bon") ** 2 for _ in range(500)]
        lo, hi = np.percentile(boot, [2.5, 97.5], method="nearest")  # inf: no turn in that draw
        dstar = turn(a, b, "bon")
        inside = np.isfinite(dstar) and dstar <= d.max()
        out.append(
            {
                "claim": f"best-of-n, proxy {tag}: the gold's turn KL* = d*^2 (fit d(a - b d))",
                "value": {
                    "mean": dstar**2,
                    "lo": float(lo),
                    "hi": float(hi),
                    "n": bon["prompts"],
                    "alpha": a,
                    "b": b,
                },
                "verdict": "inside the data (n <= k)" if inside else "beyond the largest n",
            }
        )
    return out


def claims_markdown(cl: list[dict[str, Any]]) -> str:
    lines = ["| claim | measured (mean [95% interval]; n) | verdict |", "|---|---|---|"]
    for c in cl:
        v = c["value"]
        val = "-" if v is None else f"{fmt(v)}; n={v['n']}"
        lines.append(f"| {c['claim']} | {val} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def plot(res: Path, bon: dict, arms: dict[str, dict], curs: dict[str, dict], study: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    d = np.sqrt(np.asarray(bon["kl"]))
    xs = np.linspace(0, max(d.max(), 1e-3), 50)
    for tag, col in (("strong", "C0"), ("weak", "C1")):
        g = np.asarray(bon[f"{tag}/gold"]) - bon[f"{tag}/gold"][0]
        ax[0].errorbar(d, g, yerr=bon[f"{tag}/gold_se"], fmt="o", color=col, label=f"best-of-n, proxy {tag}")
        ax[0].plot(xs, bon_curve(xs, *fit_bon(d, g)), color=col, lw=1.5)  # d(a - b d)
        ax[1].plot(
            d,
            np.asarray(bon[f"{tag}/proxy"]) - bon[f"{tag}/proxy"][0],
            "o-",
            color=col,
            label=f"best-of-n, proxy {tag}",
        )
    k = 1
    for name, cur in curs.items():
        configs = study.get("timing", {}).get(name, {}).get("configs", [])
        for lab0, members in by_label(arms[name]["runs"]).items():
            k += 1
            col = plt.cm.tab20((k + 2) % 20)  # (blue/orange: best-of-n; 12 PPO labels need > 10 colours)
            lr = configs[members[0]]["optim"]["lr"] if len(configs) > members[0] else None
            lab = f"{name}: {lab0}" + (f", lr {lr:g}" if lr else "")
            for i, j in enumerate(members):
                c = cur[j]
                dd = np.sqrt(np.maximum(c["kl"], 0))
                ax[0].plot(
                    dd,
                    c["gold"] - c["gold"][0],
                    ".-",
                    color=col,
                    alpha=0.6,
                    label=f"PPO {lab}" if i == 0 else None,
                )
                ax[1].plot(
                    dd,
                    c["proxy_strong"] - c["proxy_strong"][0],
                    ".-",
                    color=col,
                    alpha=0.6,
                    label=f"PPO {lab}" if i == 0 else None,
                )
                ax[2].plot(c["step"], c["kl"], ".-", color=col, alpha=0.6, label=f"{lab}" if i == 0 else None)
    if "turn" in curs:  # Gao et al.'s RL form d(a - b log d), fitted to the small-beta arm's seeds pooled
        c = list(curs["turn"].values())
        dd = np.concatenate([np.sqrt(np.maximum(x["kl"], 0)) for x in c])
        gg = np.concatenate([x["gold"] - x["gold"][0] for x in c])
        a, b = fit_gao(dd, gg)
        xr = np.linspace(1e-3, dd.max(), 80)
        ax[0].plot(xr, gao_curve(xr, a, b), "k--", lw=1.2, label="RL form d(a - b log d), turn arm")
    ax[0].set(xlabel="sqrt(KL) (nats^0.5)", ylabel="gold - gold(reference)", title="gold (held-out)")
    ax[1].set(xlabel="sqrt(KL) (nats^0.5)", ylabel="proxy - proxy(reference)", title="strong proxy")
    ax[2].set(xlabel="iteration", ylabel="exact KL (nats/seq, held-out)", title="KL over training (symlog)")
    ax[2].set_yscale("symlog", linthresh=0.1)  # the frozen arm's tenths of a nat beside the turn's tens
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M vs proxy; gold judged by {Path(study['gold']['judge']).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(res / "llm_turn.png", dpi=110)
    plt.close(fig)
    return "llm_turn.png"


def finish(res: Path) -> int:
    study = json.loads((res / "study.json").read_text())
    bon = json.loads((res / "bon.json").read_text())
    pool = load_gz(res / "pool_heldout.jsonl.gz", lines=True)
    first = [s for s in pool if s["draw"] == 0]
    sd = {k: float(np.std([s[k] for s in first])) for k in ("gold", "proxy_strong")}
    ref = reference_point(pool)
    arms = {
        n: load_gz(res / f"{n}_metrics.json.gz")
        for n in ("turn", "frozen", "ctrl", "grid", "recipe")
        if (res / f"{n}_metrics.json.gz").is_file()
    }
    curs = {n: curves(a, ref) for n, a in arms.items() if a["evals"]}
    cl = bon_claims(bon, study)
    turn_kl = None
    if "turn" in curs:
        cl += turn_claims(arms["turn"], curs["turn"], sd)
        turn_kl = float(np.mean([c["kl"][-1] for c in curs["turn"].values()]))
    if "frozen" in curs:
        cl += frozen_claims(arms["frozen"], curs["frozen"], sd, turn_kl)
    if "ctrl" in arms:
        cl += ctrl_claims(arms["ctrl"])
    if "recipe" in curs and "choice" in study["timing"].get("recipe", {}):
        ch = study["timing"]["recipe"]["choice"]
        src = next(
            (n for n in ("turn", "ctrl", "grid") if n == ch["grid"].get(str(ch["beta"]), {}).get("arm")), None
        )
        fixed = (arms[src], curs[src]) if src in curs else None
        cl += recipe_claims(arms["recipe"], curs["recipe"], study, fixed)
    (res / "claims.json").write_text(json.dumps(cl, indent=1, default=float) + "\n")
    (res / "claims.md").write_text(claims_markdown(cl))
    print(claims_markdown(cl))
    print("figure:", res / plot(res, bon, arms, curs, study))
    return 0
