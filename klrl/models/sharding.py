"""The models' activation sharding constraint (issue 16): the rows of the residual stream on the
mesh's ``fsdp`` axis at the layer boundaries. A leaf module: :mod:`klrl.step.parallel` (which builds
the mesh, and imports the model families' partition rules) re-exports it; the axis names are
:mod:`klrl.step.parallel`'s ``FSDP`` and ``TENSOR``."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

FSDP = "fsdp"
TENSOR = "tensor"


def split_rows(x: Any) -> Any:
    """``x [B, ...]`` (an activation: the residual stream at a layer boundary) with its rows
    constrained to ``fsdp`` (``jax.lax.with_sharding_constraint``), so that the devices of a data
    shard share its rows' compute (ZeRO-3's split: the parameters are gathered, the rows are not
    repeated). Only inside a step whose mesh has an automatic ``fsdp`` axis of size > 1 that
    divides ``B``, and ``tensor = 1`` (a batch constraint with both ``fsdp`` and ``tensor`` > 1
    crashes XLA's SPMD partitioner on jax 0.10.2: docs/sharding.md); otherwise ``x`` unchanged.
    A layout hint only: the values are the same whatever it does."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or FSDP not in mesh.shape or FSDP in getattr(mesh, "manual_axes", ()):
        return x
    f = mesh.shape[FSDP]
    if f == 1 or mesh.shape.get(TENSOR, 1) > 1 or not np.ndim(x) or x.shape[0] % f:
        return x
    return jax.lax.with_sharding_constraint(x, P(FSDP))
