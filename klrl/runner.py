"""``klrl.run(config)``: a training run from Python; the command line is a thin layer over it."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from klrl.config import RunConfig, check_devices
from klrl.io import checkpoint as ckpt
from klrl.io.logging import MetricsWriter, Progress, hparams_of, new_run_dir, read_jsonl
from klrl.parallel import make_mesh
from klrl.tasks.base import Task

SUMMARY_KEYS = (
    "reward/task",
    "kl/seq_sum",
    "kl/token_mean",
    "kl/exact_seq_sum",
    "ctrl/beta",
    "response/length",
)


@dataclass
class RunResult:
    """What a run leaves: ``metrics[name]`` is a NumPy array over iterations."""

    config: RunConfig
    dir: Path | None
    metrics: dict[str, np.ndarray]
    state: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for k in SUMMARY_KEYS:
            if k in self.metrics and len(self.metrics[k]):
                v = self.metrics[k]
                n = max(1, min(5, len(v) // 5))
                out[k] = {"start": float(np.mean(v[:n])), "end": float(np.mean(v[-n:]))}
        return out


def build_task(cfg: RunConfig, log: Any = None) -> Task:
    from klrl.tasks.wordclass import make_task

    return make_task(cfg, log)


def columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    keys = [k for k in rows[0] if k != "iteration"] if rows else []
    return {k: np.array([float(r.get(k, np.nan)) for r in rows]) for k in keys}


def run(
    cfg: RunConfig,
    *,
    task: Task | None = None,
    run_dir: str | Path | None = None,
    write: bool = True,
    log: Any = None,
) -> RunResult:
    """Train ``cfg`` to the end and return its metrics, final state and run directory.

    ``write=False`` keeps everything in memory (no run directory).
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    mesh = make_mesh(cfg.train.devices)
    check_devices(cfg, mesh.shape["data"])
    task = task or build_task(cfg, log if not cfg.train.quiet else None)
    from klrl.train import make_train

    train = make_train(cfg, task, mesh)
    out: Path | None = None
    writer = None
    if write:
        out = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        (out / "task.json").write_text(json.dumps(task.info, indent=1, default=str))
        writer = MetricsWriter(out, hparams=hparams_of(cfg))
    state = train.init(cfg.train.seed)
    progress = Progress(cfg.train.iterations, cfg.train.log_every, cfg.train.quiet)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    pending = None  # metrics of the previous iteration, fetched while the next one runs

    def flush(i, m):
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        rows.append({"iteration": i, **m})
        if writer:
            writer.write(i, m)
        progress.update(i, m)

    for i in range(cfg.train.iterations):
        state, metrics = train.step(state, task.env)
        if pending is not None:
            flush(*pending)
        pending = (i, metrics)
    flush(*pending)
    elapsed = time.time() - t0
    info = {"train_s": elapsed, "task": task.info}
    if write and out is not None:
        mgr = ckpt.manager(out, keep=1, async_save=False)
        meta = {
            "config": cfg.to_dict(),
            "version": ckpt.VERSION,
            "iteration": cfg.train.iterations,
            "metrics_lines": len(rows),
        }
        ckpt.save(mgr, cfg.train.iterations, state, meta)
        mgr.wait_until_finished()
        mgr.close()
        writer.close({k: rows[-1][k] for k in SUMMARY_KEYS if k in rows[-1]})
    result = RunResult(cfg, out, columns(rows), state, info)
    if write and out is not None:
        (out / "summary.json").write_text(json.dumps(result.summary(), indent=1))
    return result


def load_run(run_dir: str | Path) -> RunResult:
    """Read a finished or running run from disk (config and metrics; no state)."""
    d = Path(run_dir)
    cfg = RunConfig.from_dict(json.loads((d / "config.json").read_text()))
    rows = read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").exists() else []
    return RunResult(cfg, d, columns(rows))
