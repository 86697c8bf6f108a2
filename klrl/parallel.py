"""The device mesh, ``shard_map`` wrapping, and the one helper that averages across devices.

The iteration is written per shard: each device holds ``batch / n_data``
sequences and full copies of the parameters. Gradients and statistics are
averaged with named-axis collectives over ``'data'``. A sweep adds a leading
``'sweep'`` axis: members are split over device groups, the batch over the
devices of a group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from klrl.config import ConfigError

DATA = "data"
SWEEP = "sweep"


def make_mesh(n_data: int = 0, n_sweep: int = 1, devices: list | None = None) -> Mesh:
    """A ``(sweep, data)`` mesh over ``devices`` (default: all devices of all processes).

    ``n_data = 0`` uses every device not taken by the sweep axis.
    """
    devices = list(jax.devices() if devices is None else devices)
    total = len(devices)
    if n_sweep < 1 or total % n_sweep:
        raise ConfigError(f"sweep.devices: {n_sweep} sweep groups do not divide {total} devices")
    if n_data == 0:
        n_data = total // n_sweep
    if n_data * n_sweep > total:
        raise ConfigError(f"train.devices: asked for {n_data * n_sweep} devices, {total} available")
    grid = np.array(devices[: n_sweep * n_data]).reshape(n_sweep, n_data)
    return Mesh(grid, (SWEEP, DATA))


def _alone(axis_name: str) -> bool:
    # XLA keeps a collective over a one-device axis as a copy; skip it (benchmarks/NOTES.md)
    return jax.lax.axis_size(axis_name) == 1


def average(tree: Any, axis_name: str = DATA) -> Any:
    """Mean of every leaf over the devices of ``axis_name``: the one gradient/statistic averager."""
    if _alone(axis_name):
        return tree
    return jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), tree)


def total(tree: Any, axis_name: str = DATA) -> Any:
    """Sum of every leaf over the devices of ``axis_name``."""
    if _alone(axis_name):
        return tree
    return jax.tree.map(lambda x: jax.lax.psum(x, axis_name), tree)


def gather(tree: Any, axis_name: str = DATA) -> Any:
    """Concatenate every leaf's leading (batch) axis over the devices of ``axis_name``."""
    if _alone(axis_name):
        return tree
    return jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, tiled=True), tree)


def shard_step(fn: Callable, mesh: Mesh, sweep: bool = False, donate: bool = True) -> Callable:
    """``jit(shard_map(fn))`` for ``fn(state, env) -> (state, metrics)``.

    Without ``sweep`` the state and metrics are replicated and the batch split
    inside ``fn``; with ``sweep`` the state's leading axis is split over ``'sweep'``.
    The environment (prompt pool, frozen reward model) is always replicated.
    """
    spec = P(SWEEP) if sweep else P()
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(spec, P()), out_specs=(spec, spec), check_vma=False)
    return jax.jit(mapped, donate_argnums=(0,) if donate else ())
