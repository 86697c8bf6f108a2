"""Checkpoints with orbax: the whole train state plus a JSON record of the run.

Layout: ``<run_dir>/checkpoints/<step>/{state,meta}``, ``<step>`` = the number of
iterations done (``state.iteration``). orbax writes each step to a temporary
directory (``<step>.orbax-checkpoint-tmp-*``) and renames it when complete, so a
half-written checkpoint is never listed: :func:`latest_step` only sees finalized
steps. Saves are asynchronous (the state is copied to host memory first, so the
donated device buffers can be reused at once); the last ``keep`` steps are kept.

``meta`` holds the run config, the klrl version, the iteration, the number of
``metrics.jsonl`` lines written up to that state and the rollback count.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

SUBDIR = "checkpoints"


def version() -> str:
    """The running klrl's version (``klrl.__version__``), recorded in every checkpoint."""
    from klrl import __version__

    return __version__


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, corrupt or incompatible."""


def directory(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / SUBDIR


def manager(
    run_dir: str | Path, keep: int = 3, async_save: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
    """The run's checkpoint manager. ``read_only`` touches nothing on disk (and needs the directory)."""
    path = directory(run_dir)
    if read_only and not path.is_dir():
        raise CheckpointError(f"no checkpoint directory {path}")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        enable_async_checkpointing=async_save,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,  # leftovers of a killed save
    )
    if not read_only:
        return ocp.CheckpointManager(path, options=options)
    with _quiet_absl():  # orbax warns that a read-only manager is read-only
        return ocp.CheckpointManager(path, options=options)


@contextlib.contextmanager
def _quiet_absl():
    from absl import logging as absl_logging

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


def host_copy(state: Any) -> Any:
    """NumPy copies of every leaf: safe from buffer donation while an async save runs."""
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(state))


def save(mgr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Start saving ``state`` and ``meta`` as ``step`` (returns before the write ends if async)."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(host_copy(state)), meta=ocp.args.JsonSave(meta))
    mgr.save(int(step), args=args, force=True)


def latest_step(mgr: ocp.CheckpointManager) -> int | None:
    """The newest *complete* step (orbax lists finalized steps only)."""
    return mgr.latest_step()


def steps(mgr: ocp.CheckpointManager) -> list[int]:
    return sorted(int(s) for s in mgr.all_steps())


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON record of ``step`` alone (cheap; no arrays are read)."""
    try:
        out = mgr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = out["meta"]
    except Exception as e:  # orbax raises many types for a damaged directory
        raise CheckpointError(f"checkpoint {step} in {mgr.directory} is unreadable: {_why(e)}") from e
    if not isinstance(meta, dict) or not {"config", "version", "iteration", "metrics_lines"} <= set(meta):
        raise CheckpointError(f"checkpoint {step} in {mgr.directory} has no valid meta record")
    return meta


def restore(mgr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restore ``step`` (default: the latest complete one) onto the structure of ``abstract_state``.

    Every leaf must match the abstract state's shape and dtype, else :class:`CheckpointError`.
    """
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no complete checkpoint in {mgr.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), target)  # host numpy
    try:
        out = mgr.restore(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
        )
    except Exception as e:
        raise CheckpointError(f"checkpoint {step} in {mgr.directory} is unreadable: {_why(e)}") from e
    state = out["state"]
    got_leaves = jax.tree.leaves(state)
    want_leaves = jax.tree.leaves(target)
    if len(got_leaves) != len(want_leaves) or any(
        tuple(np.shape(g)) != tuple(w.shape) or np.asarray(g).dtype != w.dtype
        for g, w in zip(got_leaves, want_leaves, strict=False)
    ):
        raise CheckpointError(f"checkpoint {step} in {mgr.directory} does not match this model's state")
    return state, out["meta"]


def _why(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:200]}"
