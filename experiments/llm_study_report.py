"""The claims and the figure of ``experiments/llm_study.py`` from its stored files alone (``--replay``).

``python experiments/llm_study_report.py [DIR]`` (default ``experiments/results/llm_study``) writes
``claims.md``, ``claims.json`` and ``llm_study.png`` in DIR. Every number is recomputed from the per-response
files: intervals resample the held-out prompts (the unit that varies;
:func:`klrl.analysis.overopt.prompt_bootstrap`),
or are t-intervals over seeds where seeds are the unit (a controller's tracking). A stage not run yet is
left out of the claims ("not run").
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if not __package__:
    sys.path.insert(0, str(HERE.parent))

N_BOOT = 1000


def load(path: Path) -> Any:
    with gzip.open(path, "rt") as f:
        text = f.read()
    return (
        [json.loads(x) for x in text.splitlines() if x]
        if path.name.endswith(".jsonl.gz")
        else json.loads(text)
    )


# ---- best-of-n (stored by the prepare stage) ---------------------------------------------------------
def best_of_n(rows: list[dict], tags: list[str], k: int) -> dict[str, Any]:
    """Per proxy, n = 1, 2, 4, ..., k and prompt: the unbiased best-of-n estimate of the gold and the proxy of
    the proxy's pick (:func:`klrl.analysis.overopt.bon_expectation`), at ``KL_bon(n)``; per prompt, so a
    bootstrap resamples prompts."""
    from klrl.analysis.overopt import bon_expectation, kl_bon

    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["prompt_idx"], []).append(r)
    groups = [g[:k] for g in by.values() if len(g) >= k]
    ns = sorted({2**e for e in range(int(np.log2(k)) + 1)} | {k})
    out: dict[str, Any] = {
        "n": ns,
        "kl": kl_bon(np.array(ns)).tolist(),
        "prompts": [g[0]["prompt_idx"] for g in groups],
    }
    for tag in tags:
        sel = np.array([[r[f"proxy_{tag}"] for r in g] for g in groups])
        for key in ("gold", f"proxy_{tag}"):
            val = np.array([[r[key] for r in g] for g in groups])
            out[f"{tag}/{key}"] = np.stack(
                [bon_expectation(sel, val, n) for n in ns]
            ).tolist()  # [n, prompts]
    return out


# ---- curves from the stored evaluations ---------------------------------------------------------------
def table(evals: list[dict], key: str) -> tuple[list[int], list[int], np.ndarray]:
    """``(members, steps, values [members, steps, prompts])`` of ``key``, the mean over each prompt's samples
    (NaNs left out; the prompt is the unit a bootstrap resamples), step 0 the base's row for every member."""
    members = sorted({r["member"] for r in evals if r["member"] >= 0})
    steps = sorted({r["step"] for r in evals})
    prompts = sorted({r["prompt_idx"] for r in evals})
    pos = {p: i for i, p in enumerate(prompts)}
    tot = np.zeros((len(members), len(steps), len(prompts)))
    cnt = np.zeros_like(tot)
    for r in evals:
        if not np.isfinite(r[key]):
            continue
        for j in members if r["member"] < 0 else [r["member"]]:
            at = (members.index(j), steps.index(r["step"]), pos[r["prompt_idx"]])
            tot[at] += r[key]
            cnt[at] += 1
    with np.errstate(invalid="ignore"):
        return members, steps, np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)


def gao_turn(kl: np.ndarray, gain: np.ndarray, form: str) -> float:
    """The KL at which Gao et al.'s form fitted to ``(sqrt(KL), gain)`` peaks (inf: no interior peak)."""
    from klrl.analysis.aggregate import fit_gao
    from klrl.analysis.overopt import fit_bon, turn

    d, r = np.sqrt(np.maximum(kl, 0)).ravel(), gain.ravel()
    ok = np.isfinite(d) & np.isfinite(r) & (d > 0)
    if ok.sum() < 3:
        return float("nan")
    a, b = (fit_bon if form == "bon" else fit_gao)(d[ok], r[ok])
    return float(turn(a, b, form)) ** 2


def seed_interval(x: np.ndarray) -> tuple[float, float, float]:
    """``(mean, lo, hi)`` of ``x`` over seeds: the t-interval (:func:`klrl.analysis.aggregate.t_interval`,
    which returns the mean and the half-width), the mean three times for one seed."""
    from klrl.analysis.aggregate import t_interval

    m, half, _ = (float(v) for v in t_interval(x))
    return (m, m - half, m + half) if len(x) > 1 else (m, m, m)


def boot(values: np.ndarray, stat: Any, seed: int = 0) -> dict[str, float]:
    """``stat`` of ``values [..., prompts]`` and its 95% interval over resampled prompts (the last axis)."""
    from klrl.analysis.overopt import prompt_bootstrap

    groups = list(range(values.shape[-1]))
    return prompt_bootstrap(groups, lambda g: stat(values[..., np.asarray(g)]), N_BOOT, seed)


# ---- the claims ---------------------------------------------------------------------------------------
def proxy_claims(study: dict) -> list[dict]:
    sep = study["separation"]
    f = lambda s: f"{s['value']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}]"
    d = sep["difference"]
    verdict = "**separated**" if d["separated"] else "**not separated**: the weak-proxy comparison is dropped"
    return [
        {
            "claim": "the two proxies differ on the evaluation pool (within-prompt pair accuracy vs gold)",
            "measured": f"strong {f(sep['strong'])}, weak {f(sep['weak'])}, difference {f(d)} "
            f"({d['pairs']} pairs, {d['n_prompts']} prompts)",
            "verdict": verdict,
        }
    ]


def bon_claims(bon: dict, tags: list[str]) -> tuple[list[dict], dict]:
    out, fits = [], {}
    kl = np.asarray(bon["kl"])
    for tag in tags:
        g = np.asarray(bon[f"{tag}/gold"])  # [n, prompts]
        gain = lambda v: v.mean(-1) - v.mean(-1)[0]
        kstar = boot(g, lambda v: gao_turn(kl, gain(v), "bon"))
        pg = gain(np.asarray(bon[f"{tag}/proxy_{tag}"]))
        fits[tag] = {
            "kl": kl.tolist(),
            "gold_gain": gain(g).tolist(),
            "proxy_gain": pg.tolist(),
            "turn_kl": kstar,
        }
        reached = np.isfinite(kstar["value"]) and kstar["hi"] <= kl.max()
        out.append(
            {
                "claim": f"best-of-n by the {tag} proxy turns within n = {bon['n'][-1]} (KL {kl.max():.2f})",
                "measured": f"KL* {kstar['value']:.2f} [{kstar['lo']:.2f}, {kstar['hi']:.2f}]; gold gain at "
                f"n = {bon['n'][-1]}: {gain(g)[-1]:+.3f}",
                "verdict": "**reached**" if reached else "**not shown**",
            }
        )
    return out, fits


def falls(gold: np.ndarray) -> tuple[list[float], list[bool]]:
    """Per member of ``gold [members, steps, prompts]``: the fall of the prompts' mean gold from its peak to
    the last step, and whether it exceeds 2 SE of the per-prompt falls (paired: common random numbers)."""
    mg, out, shown = np.nanmean(gold, -1), [], []
    for j in range(len(gold)):
        p = int(np.nanargmax(mg[j]))
        diff = gold[j, p] - gold[j, -1]
        se = np.nanstd(diff) / np.sqrt(max(1, np.isfinite(diff).sum()))
        out.append(mg[j, p] - mg[j, -1])
        shown.append(bool(out[-1] > 2 * se))
    return out, shown


def peak_kl(gold: np.ndarray, kl: np.ndarray) -> np.ndarray:
    """Per member: the prompts' mean KL at the step where the prompts' mean gold peaks."""
    p = np.nanargmax(np.nanmean(gold, -1), 1)
    return np.nanmean(kl, -1)[np.arange(len(p)), p]


def turn_claims(evals: list[dict]) -> tuple[list[dict], dict]:
    """Per seed the gold's peak against its end (beyond 2 SE of the per-prompt fall), the KL reached, and the
    RL form's turn fitted to every seed's points with a prompt-bootstrap interval."""
    members, steps, gold = table(evals, "gold")
    _, _, kl = table(evals, "kl")
    _, _, proxy = table(evals, "proxy_strong")
    mg, mk = np.nanmean(gold, -1), np.nanmean(kl, -1)  # [members, steps]
    fall, shown = falls(gold)
    kstar = boot(
        np.concatenate([gold, kl], 0),
        lambda v: gao_turn(
            np.nanmean(v[len(members) :], -1),
            np.nanmean(v[: len(members)], -1) - np.nanmean(v[: len(members), :1], -1),
            "rl",
        ),
    )
    out = [
        {
            "claim": "the small-beta arm: the gold falls from its peak by more than 2 SE (paired, prompts)",
            "measured": f"falls {', '.join(f'{x:+.3f}' for x in fall)} at KL "
            f"{', '.join(f'{x:.1f}' for x in mk[:, -1])}",
            "verdict": f"**shown on {sum(shown)} of {len(shown)} seeds**" if any(shown) else "**not shown**",
        },
        {
            "claim": "Gao's RL form d(a - b log d) turns inside the data (prompt bootstrap)",
            "measured": f"KL* {kstar['value']:.1f} [{kstar['lo']:.1f}, {kstar['hi']:.1f}]; "
            f"max KL {np.nanmax(mk):.1f}",
            "verdict": "**inside**" if kstar["hi"] <= np.nanmax(mk) else "**not shown**: extrapolated",
        },
    ]
    curves = {"kl": mk.tolist(), "gold": mg.tolist(), "proxy": np.nanmean(proxy, -1).tolist()}
    peak = boot(
        np.concatenate([gold, kl], 0), lambda v: np.mean(peak_kl(v[: len(members)], v[len(members) :]))
    )
    each = peak_kl(gold, kl)
    out.append({
        "claim": "the KL at the gold's peak (each seed's checkpoint of highest prompt-mean gold; mean over "
        "seeds, prompt bootstrap with the argmax recomputed)",
        "measured": f"{', '.join(f'{x:.1f}' for x in each)}; mean {peak['value']:.1f} "
        f"[{peak['lo']:.1f}, {peak['hi']:.1f}]; RL form's KL* {kstar['value']:.1f}",
        "verdict": "measured" + (" (the peak is the last checkpoint on some seed: a lower bound)"
                                 if any(np.nanargmax(mg, 1) == mg.shape[1] - 1) else ""),
    })  # fmt: skip
    return out, {**curves, "turn_kl": kstar, "steps": steps, "peak_kl": peak}


def dpo_claims(evals: list[dict], runs: list[dict], turn: dict | None) -> tuple[list[dict], dict]:
    """Per beta: on how many seeds the gold peaks and falls (:func:`falls`, as the turn arm), and the KL at
    the gold's peak (:func:`peak_kl`), its mean over seeds with a t-interval over seeds and a prompt
    bootstrap (the argmax recomputed in each resample), against the PPO turn arm's peak KL (the same
    statistic) and its RL-form turn when that arm was run. A seed "peaks and falls" when its fall is shown
    and its peak is past the base (step 0); without one, the peak KL is the last checkpoint's or the base's
    and is not compared."""
    from klrl.analysis.aggregate import t_interval

    members, steps, gold = table(evals, "gold")
    _, _, kl = table(evals, "kl")
    _, _, proxy = table(evals, "proxy_strong")
    fall, shown = falls(gold)
    top = np.nanargmax(np.nanmean(gold, -1), 1)  # the peak's step index per member
    ppo = (turn or {}).get("peak_kl")
    out, by = [], {}
    for j, r in enumerate(runs):
        by.setdefault(r["beta"], []).append(j)
    f = lambda d: f"{d['value']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"
    for beta, js in by.items():
        pk = peak_kl(gold[js], kl[js])
        m, half, _ = (float(x) for x in t_interval(pk))
        spread = f"+- {half:.2f} (seeds)" if np.isfinite(half) else "(one seed)"
        b = boot(
            np.concatenate([gold[js], kl[js]], 0), lambda v: np.mean(peak_kl(v[: len(js)], v[len(js) :]))
        )
        n = sum(shown[j] and top[j] > 0 for j in js)
        vs = "no PPO turn arm to compare" if n else "not compared (no peak)"
        if ppo and n:
            lower, higher = b["hi"] < ppo["lo"], b["lo"] > ppo["hi"]
            vs = (
                "**below** PPO's"
                if lower
                else "**above** PPO's"
                if higher
                else "**not separated** from PPO's"
            )
            vs += f" (PPO's peak KL {f(ppo)}, RL-form turn {turn['turn_kl']['value']:.1f})"
        out.append(
            {
                "claim": f"DPO beta={beta:g}: the gold peaks and falls against KL (paired, prompts, per "
                "seed); the KL at its peak",
                "measured": f"falls {', '.join(f'{fall[j]:+.3f}' for j in js)} at KL "
                f"{', '.join(f'{np.nanmean(kl[j, -1]):.1f}' for j in js)}; KL at the peak {m:.2f} "
                f"{spread}, prompt bootstrap {f(b)}; peak at step "
                f"{', '.join(str(steps[top[j]]) for j in js)}",
                "verdict": (f"**peaks and falls on {n} of {len(js)} seeds**" if n else "**not shown**")
                + f"; peak KL {vs}",
            }
        )
    curves = {"kl": np.nanmean(kl, -1).tolist(), "gold": np.nanmean(gold, -1).tolist(), "steps": steps,
              "proxy": np.nanmean(proxy, -1).tolist(), "beta": [r["beta"] for r in runs]}  # fmt: skip
    return out, curves


def at_kl(kl: np.ndarray, value: np.ndarray, target: float) -> float:
    """``value`` where the curve ``(kl[s], value[s])`` over checkpoints ``s`` (step 0 the base, KL 0) first
    reaches ``target`` KL, linear between the two checkpoints around it (NaN: never reached)."""
    for s in range(len(kl) - 1):
        a, b = kl[s], kl[s + 1]
        if min(a, b) <= target <= max(a, b) and a != b:
            return float(value[s] + (target - a) / (b - a) * (value[s + 1] - value[s]))
    return float("nan")


def matched_claims(dpo_ev: list[dict], runs: list[dict], turn_ev: list[dict]) -> list[dict]:
    """Per DPO beta: its gold at its last checkpoint against PPO's (the turn arm) at the same KL: each PPO
    seed's prompt-mean gold at the DPO seed's prompt-mean KL (:func:`at_kl`), averaged over the PPO seeds,
    then over the DPO seeds; the difference with a prompt bootstrap (both arms answer the same held-out
    prompts with the same keys, so the prompts are resampled together)."""
    from klrl.analysis.overopt import prompt_bootstrap

    (_, _, dg), (_, _, dk) = table(dpo_ev, "gold"), table(dpo_ev, "kl")
    (_, _, pg), (_, _, pk) = table(turn_ev, "gold"), table(turn_ev, "kl")
    if {r["prompt_idx"] for r in dpo_ev} != {r["prompt_idx"] for r in turn_ev}:
        return []
    by: dict[float, list[int]] = {}
    for j, r in enumerate(runs):
        by.setdefault(r["beta"], []).append(j)

    def gap(js: list[int], g: list[int]) -> tuple[float, float, float]:
        c = np.asarray(g)
        kd, gd = np.nanmean(dk[js][..., c], -1)[:, -1], np.nanmean(dg[js][..., c], -1)[:, -1]
        mk, mg = np.nanmean(pk[..., c], -1), np.nanmean(pg[..., c], -1)
        ppo = np.array([[at_kl(mk[i], mg[i], k) for i in range(len(mk))] for k in kd])
        return float(np.mean(gd)), float(np.mean(ppo)), float(np.mean(kd))  # NaN if PPO never got there

    out, prompts = [], list(range(dg.shape[-1]))
    first = np.nanmean(pk, -1)[:, 1]  # below PPO's first checkpoints: the line from the base (KL 0)
    lo1, hi1 = np.min(first), np.max(first)
    below = f"; PPO's first checkpoints at KL {lo1:.1f}-{hi1:.1f} (below: linear from the base)"
    for beta, js in by.items():
        d, p, k = gap(js, prompts)
        b = prompt_bootstrap(prompts, lambda g, js=js: np.subtract(*gap(js, g)[:2]), N_BOOT, 0)
        lo, hi = b["lo"], b["hi"]
        verdict = (
            "**not compared** (PPO's checkpoints never at this KL)" if not np.isfinite(p)
            else "**DPO higher**" if lo > 0 else "**PPO higher**" if hi < 0 else "**not separated**"
        )  # fmt: skip
        out.append({
            "claim": f"DPO beta={beta:g} against PPO (turn arm) at matched KL: the gold at DPO's last "
            "checkpoint minus PPO's at the same KL (prompt bootstrap)",
            "measured": f"KL {k:.1f}: DPO {d:+.3f}, PPO {p:+.3f}; difference {d - p:+.3f} "
            f"[{lo:+.3f}, {hi:+.3f}]" + (below if k < hi1 else ""),
            "verdict": verdict,
        })  # fmt: skip
    return out


def ctrl_claims(evals: list[dict], runs: list[dict]) -> list[dict]:
    """Tracking over the second half of the evaluations: the held-out exact KL's mean over prompts against
    the target (``KL / target - 1`` and the share of evaluations within +-25%), per controller and start,
    t-intervals over seeds, beside the fixed beta it should settle at."""

    members, steps, kl = table(evals, "kl")
    mk = np.nanmean(kl, -1)[:, len(steps) // 2 :]
    groups: dict[str, list[int]] = {}
    for j, r in enumerate(runs):
        groups.setdefault(r["label"], []).append(j)
    out = []
    for lab, js in groups.items():
        target = runs[js[0]]["config"]["ctrl"]["target"]
        err = mk[js].mean(1) / target - 1
        within = (np.abs(mk[js] / target - 1) <= 0.25).mean(1)
        m, lo, hi = seed_interval(err)
        ok = len(js) > 1 and -0.25 <= lo and hi <= 0.25
        out.append(
            {
                "claim": f"{lab}: the held-out KL tracks {target:g} nats/seq within +-25% (second half)",
                "measured": f"KL/target - 1 {m:+.0%} [{lo:+.0%}, {hi:+.0%}]; share within +-25% "
                f"{', '.join(f'{x:.2f}' for x in within)}",
                "verdict": "**tracks**" if ok else "**tracking not shown**",
            }
        )
    return out


def grpo_claims(evals: list[dict], runs: list[dict]) -> list[dict]:
    """GRPO with the KL in the loss: the held-out KL at the last evaluation and its rise over the second
    half (nats per evaluation), per coefficient over seeds."""

    members, steps, kl = table(evals, "kl")
    mk = np.nanmean(kl, -1)
    half = len(steps) // 2
    groups: dict[str, list[int]] = {}
    for j, r in enumerate(runs):
        groups.setdefault(r["label"], []).append(j)
    out = []
    for lab, js in groups.items():
        slope = (
            np.array([np.polyfit(steps[half:], mk[j, half:], 1)[0] for j in js])
            if len(steps) - half > 1
            else np.zeros(len(js))
        )
        m, lo, hi = seed_interval(slope)
        out.append(
            {
                "claim": f"{lab}: the KL keeps rising (runs away) by iteration {steps[-1]}",
                "measured": f"KL at the end {', '.join(f'{x:.1f}' for x in mk[js, -1])}; second-half slope "
                f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}] nats/seq per iteration",
                "verdict": "**rising**" if len(js) > 1 and lo > 0 else "**not shown**",
            }
        )
    return out


def duplicate_claims(arms: dict[str, list[dict]]) -> list[dict]:
    from klrl.eval.diversity import duplicate_share

    out = []
    for arm, evals in arms.items():
        last = max(r["step"] for r in evals)
        shares = []
        for j in sorted({r["member"] for r in evals if r["member"] >= 0}):
            rows = [r for r in evals if r["member"] == j and r["step"] == last]
            shares.append(duplicate_share([r["completion"] for r in rows], [r["prompt_idx"] for r in rows]))
        base = [r for r in evals if r["step"] == 0]
        b = duplicate_share([r["completion"] for r in base], [r["prompt_idx"] for r in base])
        out.append(
            {
                "claim": f"{arm}: cross-prompt near-duplicates (similarity >= 0.7) at iteration {last}",
                "measured": f"base {b:.2f}; members {', '.join(f'{x:.2f}' for x in shares)}",
                "verdict": "measured",
            }
        )
    return out


# ---- the figure and the files -------------------------------------------------------------------------
def _fitted(
    ax: Any, d: np.ndarray, gain: np.ndarray, form: str, color: str, label: str | None = None
) -> None:
    """Gao et al.'s ``form`` fitted to ``(d, gain)`` drawn over ``[0, max d]`` (dotted)."""
    from klrl.analysis.aggregate import fit_gao
    from klrl.analysis.overopt import fit_bon

    ok = np.isfinite(d) & np.isfinite(gain)
    if (ok & (d > 0)).sum() < 3:
        return
    a, b = (fit_bon if form == "bon" else fit_gao)(d[ok], gain[ok])
    x = np.linspace(1e-6, d[ok].max(), 100)
    ax.plot(x, x * (a - b * (x if form == "bon" else np.log(x))), ":", color=color, lw=1.2, label=label)


def figure(res: Path, bon: dict, turn: dict | None, grpo: dict | None, dpo: dict | None = None) -> str:
    """Two panels against sqrt(KL): the gold's gain and the optimised proxy's gain over the reference, for
    best-of-n (each proxy's picks by that proxy), PPO, GRPO and DPO (each member, the strong proxy: for DPO
    the proxy trained on DPO's own pairs; DPO's members coloured by beta, one label per beta); Gao et
    al.'s best-of-n and RL forms fitted (dotted: best-of-n per proxy, PPO pooled over members), the PPO
    turn's KL by the RL form (dashed, its prompt-bootstrap interval shaded) and the KL at PPO's gold peak
    (dash-dot, the seeds' mean; its prompt-bootstrap interval hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 6.5))
    for i, (key, bkey) in enumerate((("gold", "gold_gain"), ("proxy", "proxy_gain"))):
        ax = axes[i]
        for tag, f in bon.items():
            if bkey in f:
                line = ax.plot(np.sqrt(f["kl"]), f[bkey], "o-", ms=3, label=f"best-of-n ({tag} proxy)")
                if key == "gold":
                    _fitted(ax, np.sqrt(f["kl"]), np.asarray(f[bkey]), "bon", line[0].get_color())
        for name, cur, style in (("PPO ", turn, "s-"), ("", grpo, "^-")):
            for lab, k, g in zip(cur["labels"], cur["kl"], cur.get(key, []), strict=False) if cur else []:
                ax.plot(np.sqrt(k), np.asarray(g) - g[0], style, ms=3, alpha=0.7, label=f"{name}{lab}")
        betas = sorted(set(dpo["beta"])) if dpo else []
        for j, (b, k, g) in enumerate(zip(dpo["beta"], dpo["kl"], dpo[key], strict=True) if dpo else []):
            first = dpo["beta"].index(b) == j
            ax.plot(np.sqrt(k), np.asarray(g) - g[0], "v-", ms=3, alpha=0.6, label=f"DPO beta={b:g}" if first
                    else None, color=plt.cm.plasma(betas.index(b) / max(1, len(betas))))  # fmt: skip
        if turn and key == "gold":
            d, g = np.sqrt(np.asarray(turn["kl"])), np.asarray(turn["gold"])
            _fitted(ax, d.ravel(), (g - g[:, :1]).ravel(), "rl", "k", "RL form fitted to PPO (all seeds)")
        t = (turn or {}).get("turn_kl")
        if t and np.isfinite(t["value"]) and key == "gold":
            ax.axvline(np.sqrt(t["value"]), color="k", ls="--", lw=1,
                       label=f"PPO turn (RL form), KL {t['value']:.1f}")  # fmt: skip
            if np.isfinite(t["lo"]) and np.isfinite(t["hi"]):
                ax.axvspan(np.sqrt(t["lo"]), np.sqrt(t["hi"]), color="k", alpha=0.08)
        pk = (turn or {}).get("peak_kl")
        if pk and np.isfinite(pk["value"]) and key == "gold":
            ax.axvline(np.sqrt(pk["value"]), color="k", ls="-.", lw=1,
                       label=f"PPO gold's peak (seeds' mean), KL {pk['value']:.1f}")  # fmt: skip
            ax.axvspan(
                *np.sqrt([pk["lo"], pk["hi"]]), facecolor="none", edgecolor="k", hatch="//", alpha=0.3, lw=0
            )
        ax.set_xlabel("sqrt(KL) to the reference, sqrt(nats/seq) (held-out, exact)")
        ax.set_ylabel(f"{'gold' if key == 'gold' else 'the proxy optimised'} - that of the reference")
        ax.set_title("Gold against sqrt(KL)" if key == "gold" else "The proxy each method optimised")
    handles, names = axes[0].get_legend_handles_labels()  # below the panels, clear of the curves
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.022 * ((len(names) + 3) // 4), 1, 1))
    fig.savefig(res / "llm_study.png", dpi=110)
    plt.close(fig)
    return "llm_study.png"


def finish(res: Path) -> int:
    """``claims.md``, ``claims.json`` and the figure from ``res``'s stored files."""
    study = json.loads((res / "study.json").read_text())
    claims = proxy_claims(study)
    bon_rows, bon = bon_claims(load(res / "bon.json.gz"), list(study["proxies"]))
    claims += bon_rows
    arms = {
        a: load(res / f"{a}_eval.jsonl.gz")
        for a in ("turn", "ctrl", "grpo", "dpo")
        if (res / f"{a}_eval.jsonl.gz").is_file()
    }
    runs = {a: load(res / f"{a}_runs.json.gz")["runs"] for a in arms}
    turn = grpo = dpo = None
    labels = {a: [f"{r['label']} seed {r['seed']}" for r in runs[a]] for a in arms}
    if "turn" in arms:
        rows, turn = turn_claims(arms["turn"])
        claims += rows
        turn["labels"] = labels["turn"]
    if "ctrl" in arms:
        claims += ctrl_claims(arms["ctrl"], runs["ctrl"])
    if "grpo" in arms:
        claims += grpo_claims(arms["grpo"], runs["grpo"])
        _, _, gk = table(arms["grpo"], "kl")
        _, _, gg = table(arms["grpo"], "gold")
        _, _, gp = table(arms["grpo"], "proxy_strong")
        grpo = {
            "kl": np.nanmean(gk, -1).tolist(),
            "gold": np.nanmean(gg, -1).tolist(),
            "proxy": np.nanmean(gp, -1).tolist(),
            "labels": labels["grpo"],
        }
    if "dpo" in arms:
        rows, dpo = dpo_claims(arms["dpo"], runs["dpo"], turn)
        claims += rows + (matched_claims(arms["dpo"], runs["dpo"], arms["turn"]) if turn else [])
    claims += duplicate_claims(arms)
    missing = [a for a in ("turn", "ctrl", "grpo", "dpo") if a not in arms]
    name = figure(res, bon, turn, grpo, dpo)
    lines = ["| claim | measured | verdict |", "|---|---|---|"]
    lines += [f"| {c['claim']} | {c['measured']} | {c['verdict']} |" for c in claims]
    lines += [f"| {a} arm | - | not run |" for a in missing]
    (res / "claims.md").write_text("\n".join(lines) + f"\n\n![]({name})\n")
    (res / "claims.json").write_text(
        json.dumps({"claims": claims, "bon": bon, "turn": turn, "dpo": dpo}, indent=1, default=float) + "\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(finish(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "llm_study"))
