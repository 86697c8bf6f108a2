"""Shared pieces of the testbed experiments: run a grid as one sweep, tabulate, plot, diagnose.

Each experiment script builds a list of member configs, calls :func:`run_study`, and gets back the
results plus a run directory holding ``table.md``, PNG plots and one sub-directory per member.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import klrl  # noqa: E402
from klrl.cli import build_parser, config_from_args  # noqa: E402
from klrl.diagnosis import final_regime, timeline  # noqa: E402
from klrl.io.logging import new_run_dir  # noqa: E402
from klrl.sweep import sweep  # noqa: E402


def parser(description: str, iterations: int) -> argparse.ArgumentParser:
    def extra(p):
        p.add_argument("--iterations", type=int, default=iterations, help="PPO iterations per member")
        p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
        p.add_argument("--replay", metavar="DIR", default=None,
                       help="re-tabulate a finished run (its metrics; current diagnosis)")  # fmt: skip

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


def smooth(x: np.ndarray, w: int = 10) -> np.ndarray:
    """Trailing mean over ``w`` iterations (the same window the tables use)."""
    c = np.cumsum(np.insert(np.asarray(x, float), 0, 0.0))
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - w, 0)
    return (c[n] - c[lo]) / (n - lo)


def last(r: klrl.RunResult, key: str, w: int = 10) -> float:
    return float(np.mean(r.metrics[key][-w:])) if key in r.metrics else float("nan")


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


def run_study(members: list[klrl.RunConfig], replay: str | None = None) -> tuple[list[klrl.RunResult], Path]:
    """Run the members as one sweep in a new run directory, or, with ``replay``, load a finished one
    (metrics as they were run, diagnosis thresholds as configured today)."""
    if replay:
        import dataclasses

        from klrl.config import DiagnosisConfig
        from klrl.results import load_sweep

        out = Path(replay)
        results = [dataclasses.replace(r, config=dataclasses.replace(r.config, diag=DiagnosisConfig()))
                   for r in load_sweep(out)]  # fmt: skip
        return results, out
    out = new_run_dir(members[0])
    return sweep(members, out_dir=out), out


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
    from klrl import plots

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
