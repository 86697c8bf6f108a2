"""Tables, claims and the figure of ``experiments/llm_overopt.py``, from its stored results alone.

``finish(DIR)`` reads ``study.json``, ``metrics.json.gz`` and ``samples.jsonl.gz`` and writes ``table.md``,
``claims.md``/``claims.json`` (each claim: its per-seed value's mean and 95% Student-t interval over the
seeds, and a verdict), ``samples.md`` (responses at the first and the last iteration of each setting) and
``llm_overopt.png`` (the gold and the proxy against sqrt(KL), as Gao et al. 2023 plot them, and the runs
over iterations, with seed bands). The gold of every response is recomputed here from its text and the
reference's log-probability (:func:`experiments.llm_overopt_gold.gold_parts`).

Windows: *start* is iteration 0 (the rollout of the initial policy, the reference); *end* is the mean of
the last ``max(3, N // 6)`` iterations; the controller is judged on the second half.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

from experiments.llm_overopt_gold import gold_parts
from experiments.study import ci95


def load(res: Path) -> tuple[dict, list[dict], list[dict]]:
    study = json.loads((res / "study.json").read_text())
    with gzip.open(res / "metrics.json.gz", "rt") as f:
        runs = json.load(f)
    with gzip.open(res / "samples.jsonl.gz", "rt") as f:
        samples = [json.loads(x) for x in f if x.strip()]
    return study, runs, samples


def distinct2(texts: list[str]) -> float:
    """Distinct word bigrams over all bigrams of a batch of texts."""
    from klrl.rewards.text import words

    grams = [g for t in texts for g in zip(words(t)[:-1], words(t)[1:], strict=True)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def per_iteration(runs: list[dict], samples: list[dict]) -> list[dict[str, np.ndarray]]:
    """Per member: ``{series: [iterations]}`` from its metrics and its samples' gold."""
    n = len(runs[0]["metrics"]["reward/task"])
    rows: list[list[list[dict]]] = [[[] for _ in range(n)] for _ in runs]
    for s in samples:
        if s["iteration"] < n:
            rows[s["member"]][s["iteration"]].append(s)
    out = []
    for r, by_it in zip(runs, rows, strict=True):
        m = r["metrics"]
        g = [[gold_parts(s["completion"], s["ref_logprob"], s["length"]) for s in it] for it in by_it]

        def avg(key: str, g=g) -> np.ndarray:
            return np.array([np.mean([x[key] for x in it]) if it else np.nan for it in g])

        kl = np.array(m["kl/exact_seq_sum"])
        out.append({"proxy": np.array([np.mean([s["reward"] for s in it]) if it else np.nan for it in by_it]),
                    "gold": avg("gold"), "sentiment": avg("sentiment"), "repeated": avg("repeated"),
                    "nll": avg("nll"), "kl": kl, "sqrt_kl": np.sqrt(np.maximum(kl, 0.0)),
                    "beta": np.array(m["ctrl/beta"]), "ref_ppl": np.array(m["eval/ref_ppl"]),
                    "distinct2": np.array([distinct2([s["completion"] for s in it]) for it in by_it]),
                    "kl_observed": np.array(m.get("ctrl/kl_observed_seq_sum", kl))})  # fmt: skip
    return out


def settings(runs: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in runs:
        if r["label"] not in seen:
            seen.append(r["label"])
    return seen


def stack(runs: list[dict], series: list[dict], lab: str, key: str) -> np.ndarray:
    """``[seeds, iterations]`` of ``key`` for the setting ``lab``."""
    return np.stack([s[key] for r, s in zip(runs, series, strict=True) if r["label"] == lab])


def end_window(n: int) -> slice:
    return slice(n - max(3, n // 6), n)


def q(values: Any) -> dict[str, Any]:
    """Mean, 95% t-interval and the per-seed values."""
    mean, half, n = ci95(values)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n, "seeds": [float(v) for v in values]}


def verdict(x: dict, side: str) -> str:
    """``side`` '>0' / '<0': holds when the interval lies on that side, contradicted on the other;
    'flat': holds when the interval contains 0."""
    if side == "flat":
        return "holds" if x["lo"] <= 0 <= x["hi"] else "not flat"
    lo, hi = (x["lo"], x["hi"]) if side == ">0" else (-x["hi"], -x["lo"])
    return "holds" if lo > 0 else ("contradicted" if hi < 0 else "not shown")


def fixed_betas(runs: list[dict]) -> list[tuple[float, str]]:
    return sorted({(r["beta0"], r["label"]) for r in runs if r["kind"] == "fixed"})


def claim(name: str, x: dict, side: str, unit: str = "") -> dict[str, Any]:
    return {"claim": name, **x, "side": side, "verdict": verdict(x, side), "unit": unit}


def delta(a: np.ndarray, n: int) -> np.ndarray:
    """Per seed: the end window's mean minus iteration 0."""
    return np.nanmean(a[:, end_window(n)], axis=1) - a[:, 0]


def beta_claims(runs: list[dict], series: list[dict]) -> list[dict[str, Any]]:
    """Large beta: KL small, proxy and gold flat. Small beta: the proxy rises, the gold peaks and falls,
    distinct-2 falls, the reference's perplexity rises. Across beta: the smallest beta's gold at the end is
    below the best fixed beta's while its proxy is above (the over-optimisation gap)."""
    fixed = fixed_betas(runs)
    (b_lo, lo), (b_hi, hi) = fixed[0], fixed[-1]
    n = len(series[0]["kl"])
    w = end_window(n)

    def s(lab: str, key: str) -> np.ndarray:
        return stack(runs, series, lab, key)

    out = [claim(f"beta={b_hi:g}: KL at the end", q(np.nanmean(s(hi, "kl")[:, w], 1)), ">0", "nats/seq"),
           claim(f"beta={b_hi:g}: proxy end - start", q(delta(s(hi, "proxy"), n)), "flat"),
           claim(f"beta={b_hi:g}: gold end - start", q(delta(s(hi, "gold"), n)), "flat"),
           claim(f"beta={b_lo:g}: KL at the end", q(np.nanmean(s(lo, "kl")[:, w], 1)), ">0", "nats/seq"),
           claim(f"KL at the end: beta={b_hi:g} - beta={b_lo:g}",
                 q(np.nanmean(s(hi, "kl")[:, w], 1) - np.nanmean(s(lo, "kl")[:, w], 1)), "<0", "nats/seq"),
           claim(f"beta={b_lo:g}: proxy end - start", q(delta(s(lo, "proxy"), n)), ">0"),
           claim(f"beta={b_lo:g}: gold end - start", q(delta(s(lo, "gold"), n)), "<0")]  # fmt: skip
    g = s(lo, "gold")
    sm = np.stack([np.convolve(x, np.ones(3) / 3, mode="same") for x in g])
    peak = int(np.nanargmax(np.nanmean(sm[:, 1:-1], 0))) + 1  # the seeds' mean curve's peak (3-iteration)
    fall = np.nanmean(g[:, max(peak - 1, 0) : peak + 2], 1) - np.nanmean(g[:, w], 1)
    out += [claim(f"beta={b_lo:g}: gold at its peak (iteration {peak}) - gold at the end", q(fall), ">0"),
            claim(f"beta={b_lo:g}: distinct-2 end - start", q(delta(s(lo, "distinct2"), n)), "<0"),
            claim(f"beta={b_lo:g}: ref. perplexity end - start", q(delta(s(lo, "ref_ppl"), n)),
                  ">0")]  # fmt: skip
    ends = {lab: np.nanmean(s(lab, "gold")[:, w], 1) for _, lab in fixed}
    best = max(ends, key=lambda k: float(np.mean(ends[k])))
    if best != lo:
        proxy_gap = np.nanmean(s(lo, "proxy")[:, w], 1) - np.nanmean(s(best, "proxy")[:, w], 1)
        out += [claim(f"gold at the end: beta={b_lo:g} - {best} (the best fixed beta)",
                      q(ends[lo] - ends[best]), "<0"),
                claim(f"proxy at the end: beta={b_lo:g} - {best}", q(proxy_gap), ">0")]  # fmt: skip
    return out


def controller_claims(runs: list[dict], series: list[dict], target: float) -> list[dict[str, Any]]:
    """The PI controller over the second half: its KL's mean within +-25% of the target, the share of
    iterations within +-25%, beta's range."""
    labs = [r["label"] for r in runs if r["kind"] != "fixed"]
    if not labs:
        return []
    lab = labs[0]
    kl = stack(runs, series, lab, "kl_observed")
    n = kl.shape[1]
    half = kl[:, n // 2 :]
    rel = np.nanmean(half, 1) / target - 1.0
    inside = np.mean(np.abs(half / target - 1.0) <= 0.25, 1)
    beta = stack(runs, series, lab, "beta")
    x = q(rel)
    return [claim(f"{lab}: second-half KL mean / target - 1", x, "flat"),
            {**claim(f"{lab}: second-half KL mean within +-25%", x, "flat"),
             "verdict": "holds" if -0.25 <= x["lo"] and x["hi"] <= 0.25 else "not shown"},
            claim(f"{lab}: share of second-half iterations within +-25%", q(inside), ">0"),
            claim(f"{lab}: beta max over the run", q(np.nanmax(beta, 1)), ">0"),
            claim(f"{lab}: beta at the end", q(beta[:, -1]), ">0")]  # fmt: skip


def fmt(x: dict, d: int = 3) -> str:
    return f"{x['mean']:.{d}g} [{x['lo']:.{d}g}, {x['hi']:.{d}g}]"


def claims_markdown(cl: list[dict[str, Any]]) -> str:
    lines = [
        "| claim | mean [95% interval over seeds] | per seed | expected | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in cl:
        seeds = ", ".join(f"{v:.3g}" for v in c["seeds"])
        lines.append(f"| {c['claim']} | {fmt(c)} {c['unit']} | {seeds} | {c['side']} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def table_markdown(runs: list[dict], series: list[dict]) -> str:
    """Per setting: start -> end (mean [95% interval] over seeds) of each series."""
    keys = [("proxy", "proxy"), ("gold", "gold"), ("kl", "KL exact nats/seq"), ("distinct2", "distinct-2"),
            ("ref_ppl", "ref. perplexity"), ("repeated", "repeated words"), ("nll", "ref. NLL/token"),
            ("beta", "beta")]  # fmt: skip
    n = len(series[0]["kl"])
    head = "| setting | " + " | ".join(k[1] for k in keys) + " |"
    lines = [head, "|---" * (len(keys) + 1) + "|"]
    for lab in settings(runs):
        cells = []
        for key, _ in keys:
            a = stack(runs, series, lab, key)
            cells.append(f"{np.nanmean(a[:, 0]):.3g} -> {fmt(q(np.nanmean(a[:, end_window(n)], 1)))}")
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def samples_markdown(runs: list[dict], samples: list[dict], k: int = 3) -> str:
    """For each setting, its first seed's first ``k`` responses at the first and at the last iteration."""
    n = len(runs[0]["metrics"]["reward/task"])
    first = {}
    for j, r in enumerate(runs):
        first.setdefault(r["label"], j)
    out = [
        "Responses of each setting's first seed (proxy score, gold), at the first and the last iteration.\n"
    ]
    for lab, j in first.items():
        out.append(f"## {lab} (seed {runs[j]['seed']})\n")
        for it in (0, n - 1):
            rows = [s for s in samples if s["member"] == j and s["iteration"] == it][:k]
            out.append(f"iteration {it}:\n")
            for s in rows:
                g = gold_parts(s["completion"], s["ref_logprob"], s["length"])["gold"]
                text = " ".join(s["completion"].split()).replace("|", "/")
                out.append(f'- proxy {s["reward"]:.2f}, gold {g:.2f}: "{text}"')
            out.append("")
    return "\n".join(out) + "\n"


def band(ax: Any, x: np.ndarray, a: np.ndarray, label: str, smooth: int = 3) -> None:
    """Seed mean (``smooth``-iteration running mean) with its 95% t-band, against ``x``."""
    from klrl.analysis.aggregate import t_interval

    smooth = max(1, min(smooth, a.shape[1]))
    k = np.ones(smooth) / smooth
    sm = np.stack([np.convolve(np.nan_to_num(r), k, mode="valid") for r in a])
    mean, half, _ = t_interval(sm)
    xs = x[smooth - 1 :] if len(x) == a.shape[1] else x
    (line,) = ax.plot(xs, mean, label=label)
    ax.fill_between(
        xs, mean - np.nan_to_num(half), mean + np.nan_to_num(half), color=line.get_color(), alpha=0.2
    )


def plot(res: Path, runs: list[dict], series: list[dict], target: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(19, 8.5))
    panels = [("gold", "gold vs sqrt(KL)", True), ("proxy", "proxy vs sqrt(KL)", True),
              ("kl", "exact KL, nats/sequence", False), ("beta", "beta", False),
              ("gold", "gold", False), ("proxy", "proxy", False),
              ("distinct2", "distinct-2 (word bigrams)", False),
              ("ref_ppl", "reference perplexity of the samples", False)]  # fmt: skip
    for ax, (key, title, vs_kl) in zip(axes.flat, panels, strict=True):
        for lab in settings(runs):
            a = stack(runs, series, lab, key)
            if vs_kl:
                x = np.nanmean(stack(runs, series, lab, "sqrt_kl"), 0)
                w = min(3, len(x))
                x = np.convolve(x, np.ones(w) / w, mode="valid")
            else:
                x = np.arange(a.shape[1])
            band(ax, x, a, lab)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("sqrt(KL), sqrt(nats/sequence)" if vs_kl else "iteration")
        if key in ("kl", "beta"):
            ax.set_yscale("log")
        if key == "kl":
            ax.axhline(target, color="k", lw=0.8, ls="--")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, PPO against a proxy reward model: seed means (3-iteration running "
                 "means) with 95% bands over seeds")  # fmt: skip
    fig.tight_layout()
    fig.savefig(res / "llm_overopt.png", dpi=80)
    plt.close(fig)
    return "llm_overopt.png"


def finish(res: Path) -> int:
    """Every table, the claims and the figure from ``res``'s stored results (module docstring)."""
    study, runs, samples = load(res)
    series = per_iteration(runs, samples)
    target = float(next((c["ctrl"]["target"] for c in study["configs"] if c["ctrl"]["kind"] != "fixed"), 0.0))
    cl = beta_claims(runs, series) + controller_claims(runs, series, target)
    (res / "claims.json").write_text(json.dumps(cl, indent=1) + "\n")
    (res / "claims.md").write_text(claims_markdown(cl))
    (res / "table.md").write_text(table_markdown(runs, series))
    (res / "samples.md").write_text(samples_markdown(runs, samples))
    plot(res, runs, series, target)
    p = study["proxy"]
    print(
        f"proxy held-out accuracy vs gold {p['heldout_accuracy_vs_gold']:.3f} ({p['pairs']['heldout']} pairs)"
    )
    print(table_markdown(runs, series))
    print(claims_markdown(cl))
    print(f"timing: {json.dumps(study['timing'])}")
    return 0
