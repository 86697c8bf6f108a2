"""The session's cached reference policy, read to host memory: for multi-process test drivers.

``klrl.tasks.pretrain.cached`` restores a cache entry with the single-device sharding it was saved
with, which a multi-process run cannot address (orbax: 'Device cpu:0 was not found in
jax.local_devices()'); until it restores to host NumPy itself, :func:`install` replaces it (in
``pretrain`` and ``wordclass``) by a reader of the same files to host arrays (same values). The
entry must exist (the session's ``tiny_task`` fixture builds it before the drivers start).
Used by ``tests/sharding_run.py`` and the driver of ``tests/distributed/test_distributed.py``.
"""

from __future__ import annotations

import json


def cached(name, payload, build, cache_dir="", log=None):
    """``pretrain.cached``'s signature; reads the existing entry ``name`` to host NumPy arrays."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from klrl.tasks import pretrain

    path = pretrain.cache_root(cache_dir) / f"{name}-{pretrain.cache_key(payload)}"
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata((path / "params").absolute())
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
    params = ckptr.restore((path / "params").absolute(), target)
    return params, json.loads((path / "info.json").read_text())


def install() -> None:
    from klrl.tasks import pretrain, wordclass

    pretrain.cached = wordclass.cached = cached
