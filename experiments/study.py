"""Shared pieces of the testbed experiments: run a grid as one sweep, tabulate, plot, diagnose.

Each experiment script builds a list of member configs, calls :func:`run_study`, and gets back the
results plus a run directory holding ``table.md``, PNG plots and one sub-directory per member.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import klrl
from klrl.analysis.diagnosis import final_regime, timeline
from klrl.cli.args import build_parser, config_from_args, fail
from klrl.config import ConfigError
from klrl.io.logging import new_run_dir


def parser(description: str, iterations: int) -> argparse.ArgumentParser:
    def extra(p):
        p.add_argument("--iterations", type=int, default=iterations, help="PPO iterations per member")
        p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
        p.add_argument("--replay", metavar="DIR", default=None,
                       help="re-tabulate a finished run (its metrics; current diagnosis)")  # fmt: skip
        p.add_argument("--seeds", default=None, metavar="S0,S1,...",
                       help="train.seed as a sweep axis (one vmapped program): every configuration once "
                            "per seed; default: train.seed alone")  # fmt: skip

    return build_parser(description, extra)


def base_config(ns: argparse.Namespace, name: str) -> klrl.RunConfig:
    cfg = config_from_args(ns)
    upd: dict[str, dict[str, Any]] = {"train": {"iterations": ns.iterations, "name": cfg.train.name or name}}
    if ns.quick:
        upd["model"] = {"n_layers": 1, "d_model": 32, "n_heads": 2}
        upd["task"] = {
            "pretrain_steps": 60,
            "rm_pairs": 128,
            "rm_heldout": 64,
            "rm_epochs": 1,
            "prompt_pool": 64,
        }
        upd["train"].update(batch_size=16)
        upd["ppo"] = {"minibatches": 2, "epochs": 1}
    return cfg.replace(**upd)


def parse_seeds(spec: str | None) -> list[int] | None:
    """``'0,1,2'`` -> ``[0, 1, 2]`` (distinct non-negative integers); ``None`` -> ``None``.
    A bad value is one line on stderr and exit status 2 (:func:`klrl.cli.args.fail`)."""
    if spec is None:
        return None
    try:
        seeds = [int(v) for v in spec.split(",")]
    except ValueError:
        fail(f"--seeds: expected comma-separated integers, got {spec!r}")
    if len(set(seeds)) != len(seeds):
        fail(f"--seeds: seeds must be distinct, got {spec!r}")
    return seeds


def with_seeds(members: list[klrl.RunConfig], seeds: list[int] | None) -> list[klrl.RunConfig]:
    """Each member once per seed (configuration-major, seeds in the given order); a seed that
    ``train.seed`` refuses is one line on stderr and exit status 2."""
    if seeds is None:
        return list(members)
    try:
        return [m.replace(train={"seed": s}) for m in members for s in seeds]
    except ConfigError as e:
        fail(f"--seeds: {e}")


def smooth(x: np.ndarray, w: int = 10) -> np.ndarray:
    """Trailing mean over ``w`` iterations (the same window the tables use)."""
    c = np.cumsum(np.insert(np.asarray(x, float), 0, 0.0))
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - w, 0)
    return (c[n] - c[lo]) / (n - lo)


def last(r: klrl.RunResult, key: str, w: int = 10) -> float:
    return float(np.mean(r.metrics[key][-w:])) if key in r.metrics else float("nan")


def first(r: klrl.RunResult, key: str, w: int = 10) -> float:
    """Mean of the first ``w`` iterations (a start baseline: one 64-sequence batch is too noisy)."""
    return float(np.mean(r.metrics[key][:w])) if key in r.metrics else float("nan")


def ci95(values: Any) -> tuple[float, float, int]:
    """``(mean, half, n)`` of the finite ``values`` (one per seed): the mean and the half-width of its
    95% Student-t interval ``t_{0.975, n-1} s / sqrt(n)`` (:func:`klrl.analysis.aggregate.t_interval`)."""
    from klrl.analysis.aggregate import t_interval

    mean, half, n = t_interval(np.asarray(values, float)[:, None])
    return float(mean[0]), float(half[0]), int(n[0])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def by_setting(results: list[klrl.RunResult], table: list[dict[str, Any]], keys: list[str]) -> list[dict]:
    """One row per setting (members whose configs differ only in ``train.seed``,
    :func:`klrl.analysis.aggregate.seed_groups`), from the per-member ``table`` (same order as ``results``).

    ``keys`` are the columns naming the setting (copied from its first member). Every other column:
    numbers as ``{"mean", "half", "n", "values"}``, the mean over seeds and the half-width of its 95%
    Student-t interval (``t_{0.975, n-1} s / sqrt(n)``, :func:`klrl.analysis.aggregate.t_interval`;
    NaN for one
    seed), ``values`` per seed in ``seeds`` order; anything else (a diagnosis, ``never``) as the list
    of per-seed values (also when only some are numbers). A NaN is a missing value (``n`` counts the
    rest).
    """
    from klrl.analysis.aggregate import setting_key

    index: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        index.setdefault(setting_key(r.config), []).append(i)
    out = []
    for idx in index.values():
        rows = [table[i] for i in idx]
        agg: dict[str, Any] = {k: rows[0][k] for k in keys}
        agg["seeds"] = [results[i].config.train.seed for i in idx]
        for col in rows[0]:
            if col in keys or col == "seed":
                continue
            vals = [row[col] for row in rows]
            if all(_is_number(v) for v in vals):
                mean, half, n = ci95([float(v) for v in vals])
                agg[col] = {"mean": mean, "half": half, "n": n, "values": [_plain(v) for v in vals]}
            else:
                agg[col] = vals
        out.append(agg)
    return out


def _plain(v: Any) -> Any:
    return float(v) if isinstance(v, (float, np.floating)) else int(v) if isinstance(v, np.integer) else v


def pm(cell: Any, digits: int = 3) -> str:
    """A :func:`by_setting` cell as text: ``mean ± half`` (the mean alone for one seed)."""
    if isinstance(cell, dict):
        m, h = cell["mean"], cell["half"]
        f = lambda v: f"{v:.{digits}g}"
        return f"{f(m)} ± {f(h)}" if np.isfinite(h) else f(m)
    if isinstance(cell, list) and all(isinstance(v, str) for v in cell):  # labels: counted
        short = [v.split(" (")[0] for v in cell]
        return ", ".join(f"{k} x{short.count(k)}" if len(short) > 1 else k for k in dict.fromkeys(short))
    if isinstance(cell, list):  # mixed (e.g. a settling iteration or "never"): per seed, in order
        return " / ".join(f"{v:.{digits}g}" if _is_number(v) else str(v) for v in cell)
    return f"{cell:g}" if _is_number(cell) else str(cell)


def settings_markdown(agg: list[dict[str, Any]], digits: int = 3) -> str:
    """:func:`by_setting` rows as a markdown table (seeds named in their own column)."""
    if not agg:
        return ""
    head = list(agg[0])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in agg:
        cells = [", ".join(map(str, row[h])) if h == "seeds" else pm(row[h], digits) for h in head]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


SEEDS_NOTE = (
    "Settings table: each cell is the mean over the seeds named in `seeds` ± the half-width of its "
    "95% Student-t interval (t_{0.975, n-1} s / sqrt(n), n seeds; with 3 seeds t = 4.30); a mean alone "
    "where a setting has one seed. Text cells (diagnosis) count the seeds' final labels. Starts are "
    "means of the first 10 iterations; ends, peaks and curves 10-iteration (trailing) means. The "
    "per-member table below has one row per seed."
)


def proxy_key(r: klrl.RunResult) -> str:
    return "reward/proxy" if "reward/proxy" in r.metrics else "reward/task"


def markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    head = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(fmt(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(out)


def run_study(
    members: list[klrl.RunConfig], replay: str | None = None, seeds: str | None = None
) -> tuple[list[klrl.RunResult], Path]:
    """Run the members as one sweep in a new run directory (with ``seeds``, ``'0,1,2'``, each member
    once per seed: :func:`with_seeds`), or, with ``replay``, load a finished one (metrics as they
    were run, diagnosis thresholds as configured today)."""
    members = with_seeds(members, parse_seeds(seeds))
    if replay:
        import dataclasses

        from klrl.analysis.results import load_sweep
        from klrl.config import DiagnosisConfig

        out = Path(replay)
        results = [dataclasses.replace(r, config=dataclasses.replace(r.config, diag=DiagnosisConfig()))
                   for r in load_sweep(out)]  # fmt: skip
        return results, out
    out = new_run_dir(members[0])
    results = klrl.sweep(members, out_dir=out)
    stopped = results[0].info.get("stopped") if results else None
    if stopped:  # SIGTERM/SIGINT: checkpointed, nothing to tabulate yet
        n = len(results[0].metrics.get("reward/gold", ()))
        print(f"stopped ({stopped}) after {n} iterations; continue with: klrl resume {out}", file=sys.stderr)
        raise SystemExit(0)
    return results, out


def diagnosis_of(r: klrl.RunResult) -> str:
    cfg = r.config
    events = timeline(r.metrics, cfg.diag, adaptive=cfg.ctrl.kind != "fixed")
    label = lambda e: e["regime"] if e["event"] == "regime" else "beta " + e["message"].split()[1]
    changes = ", ".join(f"{label(e)}@{e['iteration']}" for e in events)
    return (
        f"{final_regime(r.metrics, cfg.diag)} ({changes})" if changes else final_regime(r.metrics, cfg.diag)
    )


def save_plots(results: list[klrl.RunResult], out: Path, names: list[str]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    from klrl.analysis import plots

    files = []
    for name in names:
        fig = getattr(plots, name)(results)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")
        files.append(path.name)
    return files


def write_table(
    out: Path, title: str, table: str, plots: list[str], notes: str = "", extra: Any = None
) -> Path:
    body = [f"# {title}", "", table, ""]
    if notes:
        body += [notes, ""]
    body += [f"![{p}]({p})" for p in plots]
    path = out / "table.md"
    path.write_text("\n".join(body) + "\n")
    if extra is not None:
        (out / "table.json").write_text(json.dumps(extra, indent=1, default=float))
    return path
