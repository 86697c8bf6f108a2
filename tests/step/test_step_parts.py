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


def _policy_critic_tree(separate: bool):
    """Parameters laid out as ``TrainState.params``: the policy (with the value head ``v_head`` on its
    trunk) and no value model, or the policy alone and a separate value model (trunk + head)."""
    k = jax.random.split(jax.random.key(1), 4)
    trunk = {"w": jax.random.normal(k[0], (3, 4)), "b": jax.random.normal(k[1], (4,))}
    head = {"kernel": jax.random.normal(k[2], (4, 1))}
    if separate:
        return {"policy": trunk, "value": {"w": jax.random.normal(k[3], (3, 4)), "v_head": head}}
    return {"policy": {**trunk, "v_head": head}, "value": None}


def _steps(opt, params, n: int = 4):
    """``n`` updates by ``opt`` with gradients that do not depend on where the parameters went (so
    runs with other learning rates see the same gradients, clip factors and Adam moments)."""
    state, p0 = opt.init(params), params
    for i in range(n):
        g = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)) * 3.0, p0)
        u, state = opt.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("separate", [False, True], ids=["head", "separate"])
def test_critic_lr_steps_the_critic_as_its_own_adam_would(separate):
    """``optim.critic_lr``: the critic's parameters (the head on the trunk, or the whole separate value
    model) follow the default optimiser run with ``lr = critic_lr``, the policy's (the trunk included)
    the one with ``lr``: Adam is per element, the clip one global norm over both, the same in all
    three runs (max_grad_norm 0.5: it triggers)."""
    from klrl.step.parts import is_critic

    cfg = RunConfig().replace(
        optim={"lr": 1e-2, "critic_lr": 3e-4, "max_grad_norm": 0.5, "weight_decay": 0.1}
    )
    p0 = _policy_critic_tree(separate)
    got, state = _steps(make_optimizer(cfg), p0)
    policy_like, _ = _steps(make_optimizer(cfg.replace(optim={"critic_lr": 0.0})), p0)
    critic_like, _ = _steps(make_optimizer(cfg.replace(optim={"lr": 3e-4, "critic_lr": 0.0})), p0)
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    assert sum(is_critic(p) for p, _ in flat) == (2 if separate else 1)
    for (path, g), pl, cl in zip(
        flat, jax.tree.leaves(policy_like), jax.tree.leaves(critic_like), strict=True
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(cl if is_critic(path) else pl), rtol=1e-6)
        assert not np.allclose(np.asarray(pl), np.asarray(cl))  # the two learning rates are told apart
    hp = state[-1].hyperparams
    assert float(hp["step_size"]) == pytest.approx(-1e-2) and float(hp["critic_step_size"]) == pytest.approx(
        -3e-4
    )


@pytest.mark.parametrize("separate", [False, True], ids=["head", "separate"])
def test_critic_lr_equal_to_lr_is_the_default_bit_for_bit(separate):
    cfg = RunConfig().replace(optim={"lr": 1e-2, "max_grad_norm": 0.5})
    p0 = _policy_critic_tree(separate)
    want, _ = _steps(make_optimizer(cfg), p0)
    got, _ = _steps(make_optimizer(cfg.replace(optim={"critic_lr": 1e-2})), p0)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_critic_lr_needs_a_critic():
    from klrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^optim.critic_lr: ppo.advantage=grpo has no critic"):
        RunConfig().replace(ppo={"advantage": "grpo", "group_size": 2}, optim={"critic_lr": 1e-5})
    with pytest.raises(ConfigError, match=r"^optim.critic_lr: must be >= 0"):
        RunConfig().replace(optim={"critic_lr": -1e-5})
