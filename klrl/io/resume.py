"""Resuming a run: which config changes a resume allows, the checks that need no compiled code,
and the atomic file replacement used to cut ``metrics.jsonl`` back to a checkpoint.

A run or sweep directory with no complete checkpoint resumes from iteration 0, i.e. the initial
state rebuilt from its config (the seed): the process died before its first checkpoint was committed
(during the state init, the compile, the first iterations or the write of the first checkpoint, which
orbax commits in the background while the next rows are written). Its metrics rows, if any, are
dropped (atomically, :func:`replace_file`) and recomputed: a step is a pure function of the state and
the config, so they come back bit for bit. Likewise rows written after the newest complete checkpoint
(the loop writes them while that checkpoint's save is in flight, or before the next one is due) are
dropped and recomputed from it: every row on disk is either counted by a complete checkpoint or
recomputable, whatever moment a ``kill -9`` came (tests/loop/test_kill_points.py).

A step directory that holds no finished save (empty, foreign files, a copy cut short:
:func:`klrl.io.checkpoint.is_finished`) is not a checkpoint: the run resumes from the newest
complete one before it, and :func:`restore` moves the skipped directories aside
(``checkpoints/<step>.incomplete``, nothing deleted) so the run can write those steps again; the
resume line says so. A finished checkpoint whose files are damaged is refused, never skipped (its
message names the older checkpoints).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klrl import distributed
from klrl.config import ConfigError, RunConfig
from klrl.io import checkpoint as ckpt
from klrl.io import readers
from klrl.io.readers import RESUME_MUTABLE, config_diff  # (RESUME_MUTABLE: read by klrl resume --help)


def check_resumable(saved: RunConfig | dict[str, Any], cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (naming the fields) if ``cfg`` may not continue a run of ``saved``.

    Only :data:`RESUME_MUTABLE` fields, the diagnosis (``diag.*``: read after training, never by the
    step) and the trackers (``log.*``) may change; a field missing from ``saved`` (added to klrl since
    the run was written) is its default, which is the behaviour the run had. ``train.iterations`` may
    change only with the constant learning-rate schedule: a decaying schedule's horizon is
    ``train.iterations``, so changing it would change the updates already made (refused rather than
    silently re-timed).
    """
    if isinstance(saved, dict):  # a field added since the run was written: its default (the old behaviour)
        defaults = RunConfig().to_dict()
        given = {
            sec: {**defaults.get(sec, {}), **v} if isinstance(v, dict) else v for sec, v in saved.items()
        }
        saved = {**defaults, **given}
    diff = config_diff(saved, cfg)
    bad = [f for f in diff if f not in RESUME_MUTABLE and not f.startswith(("diag.", "log."))]
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
    """Write ``data`` to ``path`` atomically: a temporary file, fsync, ``os.replace``. A failed write
    (a full disk) removes the temporary file and raises an ``OSError`` that names ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


@dataclass
class Resume:
    """A valid resume: the run directory, its latest complete checkpoint and that checkpoint's meta."""

    dir: Path
    step: int
    meta: dict[str, Any]
    fresh: bool = False  # no checkpoint yet: start from the initial state (iteration 0)
    skipped: tuple[int, ...] = ()  # step directories that hold no finished save (moved aside by restore)
    moved: list[str] = field(default_factory=list)  # where restore moved them (relative to ``dir``)

    def note(self) -> str:
        """What was skipped, for the resume line ('' when nothing was)."""
        if not self.skipped:
            return ""
        names = ", ".join(f"{ckpt.SUBDIR}/{s}" for s in self.skipped)
        to = f", moved aside to {', '.join(self.moved)}" if self.moved else ""
        return f"; skipped {names}: no finished checkpoint in it{to}"


def _member_dirs(d: Path, sweep: bool) -> list[Path]:
    return [d / n for n in readers.read_sweep_members(d)] if sweep else [d]


def _fresh(cfg: RunConfig | list[RunConfig], d: Path, sweep: bool) -> Resume | None:
    """The plan for a run (or sweep) directory with no complete checkpoint (its rows, if any, are
    recomputed from iteration 0), else None."""
    if ckpt.complete_steps(d):
        return None
    dirs = _member_dirs(d, sweep)
    members = list(cfg) if sweep else [cfg]
    if len(dirs) != len(members):
        raise ConfigError(f"sweep: {len(members)} members given, the sweep in {d} has {len(dirs)}")
    saved = [readers.read_json(p / "config.json") for p in dirs]
    for s, m in zip(saved, members, strict=True):
        if not isinstance(s, dict):
            raise ckpt.CheckpointError(f"{d}/config.json: not a JSON object")
        check_resumable(s, m)
    meta = {"config": saved[0], "version": ckpt.version(), "iteration": 0, "metrics_lines": 0, "rollbacks": 0}
    if sweep:
        meta["members"] = saved
    return Resume(d, 0, meta, fresh=True, skipped=tuple(ckpt.incomplete_steps(d)))


def _older(d: Path, step: int) -> str:
    """A hint for a damaged checkpoint ``step``: the complete ones before it."""
    older = [s for s in ckpt.complete_steps(d) if s < step]
    if not older:
        return ""
    return (
        f" (older checkpoints: {', '.join(map(str, older))}; move {ckpt.SUBDIR}/{step} out of "
        f"{d} to resume from {older[-1]})"
    )


def restore(plan: Resume, abstract_state: Any, init: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """The state and meta ``plan`` resumes from: its checkpoint, or ``init()`` for a fresh one. The
    step directories ``plan`` skipped are moved aside first (process 0; :func:`klrl.io.checkpoint.set_aside`),
    so the run can write those steps again."""
    if plan.skipped:
        if distributed.is_main():
            plan.moved = ckpt.set_aside(plan.dir, list(plan.skipped))
        distributed.sync("klrl-resume-set-aside")
    if plan.fresh:
        if distributed.is_main() and (plan.dir / "config.json").is_file():
            (plan.dir / "metrics.jsonl").touch()  # (it may not exist yet; creating it loses nothing)
        return init(), plan.meta
    mgr = ckpt.manager(plan.dir, read_only=True)
    try:
        return ckpt.restore(mgr, abstract_state, plan.step)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"{e}{_older(plan.dir, plan.step)}") from e
    finally:
        mgr.close()


def prepare(cfg: RunConfig | list[RunConfig], run_dir: str | Path) -> Resume:
    """Every check of a resume that needs no compiled code; nothing on disk is changed.

    ``cfg`` is a run's config (``run_dir`` a run directory) or a sweep's member configs (a list;
    ``run_dir`` the sweep directory, whose member directories ``sweep.json`` lists). Checked: the
    directory, its latest complete checkpoint and its meta (klrl version, iteration), that ``cfg``
    may continue the saved config(s) (:func:`check_resumable`), ``train.iterations``, and that every
    ``metrics.jsonl`` holds the lines the checkpoint counts. A run or sweep directory with nothing
    done yet resumes fresh; step directories that hold no finished save are skipped (see the module
    docstring)."""
    d = Path(run_dir)
    sweep = isinstance(cfg, list | tuple)
    marker = "sweep.json" if sweep else "config.json"
    if not (d / marker).is_file():
        raise ckpt.CheckpointError(f"{d}: not a klrl {'sweep' if sweep else 'run'} directory (no {marker})")
    readers.read_task_info(d)  # a damaged task.json: one line naming it
    fresh = _fresh(cfg, d, sweep)
    if fresh is not None:
        return fresh
    mgr = ckpt.manager(d, read_only=True)
    try:
        done = ckpt.complete_steps(d)
        step = done[-1]
        try:
            meta = ckpt.read_meta(mgr, step)
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(f"{e}{_older(d, step)}") from e
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
    return Resume(d, step, meta, skipped=tuple(ckpt.incomplete_steps(d)))
