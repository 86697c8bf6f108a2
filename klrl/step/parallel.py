"""The device mesh, the train state's shardings, the step's wrapping, and the collectives.

The mesh has four named axes, ``(sweep, data, fsdp, tensor)``:

* ``sweep``: members of a sweep (the state's leading axis) split over device groups;
* ``data``: the batch split over devices; the iteration is written per ``data`` shard (each
  device's share of the batch, named-axis collectives for gradients and statistics);
* ``fsdp`` and ``tensor``: parameters, the reference, the optimiser state and the value model
  sharded by each model family's :meth:`~klrl.models.base.CausalLM.partition_rules`
  (:func:`param_specs`), the computation partitioned by XLA's SPMD partitioner (Shardy) from
  those placements.

:func:`shard_step` is ``jax.jit`` with ``NamedSharding`` in/out shardings around a ``shard_map``
that is manual over ``(sweep, data)`` only (``axis_names``): the per-device view of the batch and
the explicit ``pmean`` of the gradients stay as they were, while ``fsdp``/``tensor`` are left to
the compiler. With ``fsdp = tensor = 1`` the program is the data-parallel one of before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from klrl.config import ConfigError, parse_mesh
from klrl.models.base import spec_for
from klrl.models.sharding import split_rows  # noqa: F401  (re-exported: the models' row constraint)

SWEEP = "sweep"
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
AXES = (SWEEP, DATA, FSDP, TENSOR)
MANUAL = frozenset({SWEEP, DATA})  # the axes the step's body sees per device


def make_mesh(
    n_data: int = 0, n_sweep: int = 1, devices: list | None = None, *, fsdp: int = 1, tensor: int = 1
) -> Mesh:
    """A ``(sweep, data, fsdp, tensor)`` mesh over ``devices`` (default: all devices of all processes).

    ``n_data = 0`` (or ``-1``) uses every device not taken by the other axes; ``fsdp = -1`` or
    ``tensor = -1`` likewise (at most one axis fills the rest).
    """
    devices = list(jax.devices() if devices is None else devices)
    total = len(devices)
    if n_sweep < 1 or total % n_sweep:
        raise ConfigError(f"sweep.devices: {n_sweep} sweep groups do not divide {total} devices")
    sizes = [-1 if n_data in (0, -1) else n_data, fsdp, tensor]
    if sizes.count(-1) > 1:
        if sizes[0] == -1 and n_data == 0:  # train.devices = 0 with a -1 in train.mesh: data is 1
            sizes[0] = 1
        else:
            raise ConfigError("train.mesh: at most one axis may be -1")
    known = int(np.prod([s for s in sizes if s != -1])) * n_sweep
    if -1 in sizes:
        if total % known:
            raise ConfigError(f"train.mesh: {known} devices per fill do not divide {total} devices")
        sizes[sizes.index(-1)] = total // known
    used = int(np.prod(sizes)) * n_sweep
    if used > total:
        raise ConfigError(f"train.devices: asked for {used} devices, {total} available")
    grid = np.array(devices[:used]).reshape(n_sweep, *sizes)
    return Mesh(grid, AXES)


def mesh_from_config(train_cfg: Any, n_sweep: int = 1) -> Mesh:
    """The mesh of a ``train`` config section: ``train.mesh`` ('data,fsdp,tensor') if set, else
    ``train.devices`` data devices and ``fsdp = tensor = 1``."""
    spec = getattr(train_cfg, "mesh", "")
    if not spec:
        return make_mesh(train_cfg.devices, n_sweep)
    d, f, t = parse_mesh(spec)
    if train_cfg.devices and d not in (-1, train_cfg.devices):
        raise ConfigError(f"train.devices: {train_cfg.devices} contradicts train.mesh {spec!r}")
    return make_mesh(train_cfg.devices or d, n_sweep, fsdp=f, tensor=t)


# ---- shardings of the train state ----------------------------------------------------------------


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """``spec`` made valid for an array of ``shape`` on ``mesh``: an axis of size 1 (or one the
    mesh lacks) is dropped, a dimension an axis' size does not divide stays replicated (e.g. 9
    heads on ``tensor = 2``), a spec longer than the array is cut."""
    out = []
    for i, name in enumerate(tuple(spec)[: len(shape)]):
        names = name if isinstance(name, tuple) else (name,) if name is not None else ()
        names = tuple(n for n in names if n in mesh.shape and mesh.shape[n] > 1)
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        if not names or shape[i] % size:
            out.append(None)
        else:
            out.append(names[0] if len(names) == 1 else names)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_specs(rules: Any, params: Any, mesh: Mesh) -> Any:
    """A :class:`PartitionSpec` pytree for ``params`` from a family's partition rules (first
    ``re.search`` match on the '/'-joined path; unmatched leaves replicated), fitted to ``mesh``."""
    specs = spec_for(rules, params)
    return jax.tree.map(lambda s, x: fit_spec(s, tuple(np.shape(x)), mesh), specs, params)


def sharded_bytes(tree: Any) -> int:
    """Bytes of ``tree`` held by one device: the largest total over the devices of its arrays'
    addressable shards (abstract leaves with a sharding count their shard shape)."""
    per: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            for s in x.addressable_shards:
                per[s.device] = per.get(s.device, 0) + s.data.nbytes
        else:
            shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
            per[None] = per.get(None, 0) + int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return max(per.values()) if per else 0


# ---- the step ------------------------------------------------------------------------------------


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


def take_rows(tree: Any, idx: Any, axis_name: str = DATA) -> Any:
    """Rows ``idx [m]`` (global row indices over the ``axis_name`` shards, shard ``d`` holding rows
    ``d n_loc ... (d + 1) n_loc - 1``) of every leaf, on each device its own ``idx``, without
    gathering the whole batch: each device puts the rows it owns of every device's request into a
    zero buffer ``[n_dev, m, ...]`` and a reduce-scatter (``psum_scatter``) hands device ``d`` the
    sum over owners of slot ``d``: exactly the requested rows (one owner each, the others add 0).
    Transient memory: one global minibatch, not the global batch."""
    if _alone(axis_name):
        return jax.tree.map(lambda x: x[idx], tree)
    want = jax.lax.all_gather(idx, axis_name)  # [n_dev, m]: what every device asks for (indices only)
    me = jax.lax.axis_index(axis_name)

    def one(x):
        n_loc = x.shape[0]
        local = want - me * n_loc
        mine = ((local >= 0) & (local < n_loc)).reshape(want.shape + (1,) * (x.ndim - 1))
        exact = x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)
        rows = x[jnp.clip(local, 0, n_loc - 1)]  # [n_dev, m, ...]
        buf = jnp.where(mine, rows, 0).astype(jnp.int32 if exact else x.dtype)
        return jax.lax.psum_scatter(buf, axis_name, scatter_dimension=0).astype(x.dtype)

    return jax.tree.map(one, tree)


def shard_step(
    fn: Callable,
    mesh: Mesh,
    sweep: bool = False,
    donate: bool = True,
    state_shardings: Any = None,
    kept: str | None = None,
    kept_shared: bool = False,
) -> Callable:
    """``jit(shard_map(fn))`` for ``fn(state, env) -> (state, metrics)``.

    The ``shard_map`` is manual over ``(sweep, data)`` only. Without ``sweep`` the state and
    metrics are the same on every ``data`` device (the batch is split inside ``fn``); with
    ``sweep`` the state's leading axis is split over ``'sweep'``. ``state_shardings`` (a
    ``NamedSharding`` pytree like the state, default: replicated or split over ``sweep``) are the
    jit's in and out shardings of the state: over ``fsdp``/``tensor`` the compiler partitions.
    The environment (prompt pool, frozen reward model) is replicated. The state is donated.

    ``kept``: the name of a state field (a NamedTuple's) that ``fn`` returns unchanged, e.g. a frozen
    reference: it is passed to the program as its own argument, neither donated nor returned, and
    the returned state holds the very arrays it was given (:class:`KeptStep`). So those arrays may
    be shared with other owners (the task's loaded parameters), where a donated field must be a copy.
    ``kept_shared`` (a sweep): that field has no members' axis, one copy for every member (a frozen
    reference or LoRA base: ``fn`` is then a ``vmap`` that does not map it).
    """
    spec = P(SWEEP) if sweep else P()
    # fsdp/tensor of size 1: the body is manual over every axis, the data-parallel program of before
    manual = {n for n in mesh.axis_names if n in MANUAL or mesh.shape[n] == 1}
    if state_shardings is None:
        state_shardings = NamedSharding(mesh, spec)
    metric = NamedSharding(mesh, spec)
    if kept is None:
        body, in_specs, in_sh, state_out = fn, (spec, P()), (state_shardings, None), state_shardings
    else:

        def body(rest: Any, field: Any, env: Any) -> tuple[Any, Any]:
            new, metrics = fn(rest._replace(**{kept: field}), env)
            return new._replace(**{kept: None}), metrics

        one = isinstance(state_shardings, NamedSharding)
        rest_sh, kept_sh = (state_shardings,) * 2 if one else _split(state_shardings, kept)
        in_specs = (spec, P() if kept_shared else spec, P())
        in_sh, state_out = (rest_sh, kept_sh, None), rest_sh
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(spec, spec), axis_names=manual, check_vma=False
    )
    jitted = jax.jit(
        mapped,
        in_shardings=in_sh,
        out_shardings=(state_out, metric),
        donate_argnums=(0,) if donate else (),
    )
    return jitted if kept is None else KeptStep(jitted, kept)


def _split(state: Any, kept: str) -> tuple[Any, Any]:
    """``(state without its field kept, that field)``."""
    return state._replace(**{kept: None}), getattr(state, kept)


class KeptStep:
    """``step(state, env)`` around ``jitted(state without field, field, env)``: the state's field
    ``kept`` is handed in as its own (not donated) argument and put back, the same arrays, into the
    returned state. ``lower(state, env)`` and its ``compile()`` keep the wrapping (their other
    attributes, e.g. ``memory_analysis``, are the lowered or compiled program's)."""

    def __init__(self, stage: Any, kept: str) -> None:
        self._stage, self._kept = stage, kept

    def __call__(self, state: Any, env: Any) -> tuple[Any, Any]:
        rest, field = _split(state, self._kept)
        new, metrics = self._stage(rest, field, env)
        return new._replace(**{self._kept: field}), metrics

    def lower(self, state: Any, env: Any) -> KeptStep:
        return KeptStep(self._stage.lower(*_split(state, self._kept), env), self._kept)

    def compile(self, *args: Any, **kwargs: Any) -> KeptStep:
        return KeptStep(self._stage.compile(*args, **kwargs), self._kept)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)
