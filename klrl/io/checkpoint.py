"""Checkpoints with orbax: the whole train state plus a JSON record of the run.

Layout: ``<run_dir>/checkpoints/<step>/{state,meta}``. orbax writes each step to
a temporary directory and renames it when complete (a half-written checkpoint is
never listed), keeps the last ``keep`` steps, and saves asynchronously.
``meta`` holds the config, the klrl version, the iteration and the number of
``metrics.jsonl`` lines written up to that state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

VERSION = "0.1.0"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, corrupt or incompatible."""


def manager(run_dir: str | Path, keep: int = 3, async_save: bool = True, read_only: bool = False):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, enable_async_checkpointing=async_save, read_only=read_only
    )
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def save(mgr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
    state = jax.device_get(state)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def latest_step(mgr: ocp.CheckpointManager) -> int | None:
    return mgr.latest_step()


def restore(mgr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restore ``step`` (default: the latest complete one) onto the structure of ``abstract_state``."""
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no complete checkpoint in {mgr.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    try:
        out = mgr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        )
    except Exception as e:  # orbax raises many types for a damaged directory
        raise CheckpointError(
            f"checkpoint {step} in {mgr.directory} is unreadable: {type(e).__name__}: {e}"
        ) from e
    return out["state"], out["meta"]
