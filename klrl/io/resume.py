"""Resuming a run: which config changes a resume allows, the checks that need no compiled code,
and the atomic file replacement used to cut ``metrics.jsonl`` back to a checkpoint.

A run directory with no complete checkpoint and no complete ``metrics.jsonl`` line (the process
died after creating it, before its first iteration: during the state init or the compile) resumes
from iteration 0, i.e. the initial state rebuilt from the seed: nothing was done, so nothing is
lost. With metrics lines but no checkpoint, a resume is refused (it would drop those lines).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klrl.config import ConfigError, RunConfig
from klrl.io import checkpoint as ckpt
from klrl.io import readers
from klrl.io.readers import config_diff

# fields a resume may change: none of them changes the model, the batch or the maths of an iteration
RESUME_MUTABLE = frozenset(
    {
        "train.iterations",
        "train.quiet",
        "train.log_every",
        "train.samples_every",
        "train.samples_n",
        "train.out_dir",
        "train.name",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.max_consecutive_skips",
        "train.rollback_metric",
        "train.rollback_threshold",
        "train.rollback_factor",
        "train.max_rollbacks",
    }
)


def check_resumable(saved: RunConfig | dict[str, Any], cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (naming the fields) if ``cfg`` may not continue a run of ``saved``.

    Only :data:`RESUME_MUTABLE` fields may change. ``train.iterations`` may change only with the
    constant learning-rate schedule: a decaying schedule's horizon is ``train.iterations``, so
    changing it would change the updates already made (refused rather than silently re-timed).
    """
    diff = config_diff(saved, cfg)
    bad = [f for f in diff if f not in RESUME_MUTABLE]
    if bad:
        raise ConfigError(
            f"{', '.join(bad)}: differ from the run's config; a resume may change only "
            "train.iterations and the logging, checkpoint and rollback knobs"
        )
    if "train.iterations" in diff and cfg.optim.schedule != "constant":
        raise ConfigError(
            f"train.iterations: cannot change on resume with optim.schedule={cfg.optim.schedule} "
            "(the schedule's horizon is train.iterations)"
        )


def complete_lines(path: Path) -> list[bytes]:
    """The newline-terminated lines of ``path`` (a torn last line is left out)."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    return [line + b"\n" for line in lines[:-1]]


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file, fsync, ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Resume:
    """A valid resume: the run directory, its latest complete checkpoint and that checkpoint's meta."""

    dir: Path
    step: int
    meta: dict[str, Any]
    fresh: bool = False  # no checkpoint yet: start from the initial state (iteration 0)


def _fresh(cfg: RunConfig, d: Path) -> Resume | None:
    """The plan for a directory that holds a config and nothing done yet, else None."""
    if ckpt.complete_steps(d) or complete_lines(d / "metrics.jsonl"):
        return None
    try:
        saved = json.loads((d / "config.json").read_text())
    except ValueError as e:
        raise ckpt.CheckpointError(f"{d}/config.json is not valid JSON: {e}") from e
    check_resumable(saved, cfg)
    meta = {"config": saved, "version": ckpt.version(), "iteration": 0, "metrics_lines": 0, "rollbacks": 0}
    return Resume(d, 0, meta, fresh=True)


def restore(plan: Resume, abstract_state: Any, init: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """The state and meta ``plan`` resumes from: its checkpoint, or ``init()`` for a fresh one."""
    if plan.fresh:
        (plan.dir / "metrics.jsonl").touch()  # (it may not exist yet; creating it loses nothing)
        return init(), plan.meta
    mgr = ckpt.manager(plan.dir, read_only=True)
    try:
        return ckpt.restore(mgr, abstract_state, plan.step)
    finally:
        mgr.close()


def prepare(cfg: RunConfig | list[RunConfig], run_dir: str | Path) -> Resume:
    """Every check of a resume that needs no compiled code; nothing on disk is changed.

    ``cfg`` is a run's config (``run_dir`` a run directory) or a sweep's member configs (a list;
    ``run_dir`` the sweep directory, whose member directories ``sweep.json`` lists). Checked: the
    directory, its latest complete checkpoint and its meta (klrl version, iteration), that ``cfg``
    may continue the saved config(s) (:func:`check_resumable`), ``train.iterations``, and that every
    ``metrics.jsonl`` holds the lines the checkpoint counts. A run directory with nothing done yet
    resumes fresh (see the module docstring)."""
    d = Path(run_dir)
    sweep = isinstance(cfg, list | tuple)
    marker = "sweep.json" if sweep else "config.json"
    if not (d / marker).is_file():
        raise ckpt.CheckpointError(f"{d}: not a klrl {'sweep' if sweep else 'run'} directory (no {marker})")
    if not sweep:
        fresh = _fresh(cfg, d)
        if fresh is not None:
            return fresh
    mgr = ckpt.manager(d, read_only=True)
    try:
        step = ckpt.latest_step(mgr)
        if step is None:
            raise ckpt.CheckpointError(f"{d}: no complete checkpoint to resume from")
        meta = ckpt.read_meta(mgr, step)
    finally:
        mgr.close()
    if meta["version"] != ckpt.version():
        raise ckpt.CheckpointError(
            f"{d} was written by klrl {meta['version']}; this is klrl {ckpt.version()}"
        )
    if int(meta["iteration"]) != step:
        raise ckpt.CheckpointError(f"checkpoint {step} in {d} records iteration {meta['iteration']}")
    members = list(cfg) if sweep else [cfg]
    saved = (meta.get("members") or []) if sweep else [meta["config"]]
    if len(saved) != len(members):
        raise ConfigError(f"sweep: {len(members)} members given, the sweep in {d} has {len(saved)}")
    for s, m in zip(saved, members, strict=True):
        check_resumable(s, m)
    if members[0].train.iterations < step:
        raise ConfigError(
            f"train.iterations: {members[0].train.iterations} is below the checkpoint's iteration {step}"
        )
    dirs = [d]
    if sweep:
        names = readers.read_sweep_members(d)
        if len(names) != len(members):
            msg = f"{d}/sweep.json lists {len(names)} members, the sweep has {len(members)}"
            raise ckpt.CheckpointError(msg)
        dirs = [d / n for n in names]
    for p in dirs:
        n = len(complete_lines(p / "metrics.jsonl"))
        if n < int(meta["metrics_lines"]):
            raise ckpt.CheckpointError(
                f"{p}/metrics.jsonl has {n} complete lines; checkpoint {step} needs {meta['metrics_lines']}"
            )
    return Resume(d, step, meta)
