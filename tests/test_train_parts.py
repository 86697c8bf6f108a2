"""klrl.step.parts: the optimiser's global-norm clip against optax's own and against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from klrl.config import RunConfig
from klrl.step.parts import clip_by_global_norm, make_optimizer


def _tree(scale: float):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"a": scale * jax.random.normal(k1, (3, 4)), "b": {"c": scale * jax.random.normal(k2, (5,))}}


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_clip_matches_numpy_and_optax(scale):
    g = _tree(scale)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    norm = np.sqrt(sum((x**2).sum() for x in leaves))
    factor = min(1.0, 1.0 / norm)  # max_norm 1
    ours, _ = clip_by_global_norm(1.0).update(g, optax.EmptyState())
    theirs, _ = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())
    for x, o, t in zip(leaves, jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(o), x * factor, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(o), np.asarray(t), rtol=1e-6)
    if norm < 1.0:  # not triggered: the gradients unchanged, bit for bit
        for o, x in zip(jax.tree.leaves(ours), jax.tree.leaves(g), strict=True):
            np.testing.assert_array_equal(np.asarray(o), np.asarray(x))
    ours_norm = np.sqrt(sum((np.asarray(o, np.float64) ** 2).sum() for o in jax.tree.leaves(ours)))
    assert ours_norm <= 1.0 + 1e-6


def test_optimizer_follows_optax_adam_with_clipping():
    """Five steps of make_optimizer's chain against optax's clip_by_global_norm + adam chain."""
    cfg = RunConfig().replace(optim={"max_grad_norm": 0.5, "lr": 1e-2})
    ours = make_optimizer(cfg)
    o = cfg.optim
    ref = optax.chain(
        optax.clip_by_global_norm(o.max_grad_norm), optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
        optax.scale(-o.lr),
    )  # fmt: skip
    p_ours = p_ref = _tree(1.0)
    s_ours, s_ref = ours.init(p_ours), ref.init(p_ref)
    for i in range(5):
        g = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)) * 3.0, p_ref)
        u, s_ours = ours.update(g, s_ours, p_ours)
        p_ours = optax.apply_updates(p_ours, u)
        u, s_ref = ref.update(g, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
    for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
