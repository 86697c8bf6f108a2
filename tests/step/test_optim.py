"""klrl.step.optim: the global-norm clip against optax's own and against NumPy, the optimiser against
optax's Adam; ``optim.critic_max_grad_norm``: the policy's and the critic's gradients clipped apart
(:func:`klrl.step.optim.clip_by_global_norm`), checked against NumPy on hand gradients and against
optax's Adam run on each part alone; the pre-clip norms the update logs
(:func:`klrl.step.update.policy_critic_norms`); ``optim.critic_lr``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from klrl.config import ConfigError, RunConfig
from klrl.step.optim import clip_by_global_norm, make_optimizer
from klrl.step.update import policy_critic_norms


def _grads(critic_scale: float, separate: bool) -> dict:
    """Hand gradients laid out as ``TrainState.params``: the policy trunk (norm 5: 3-4-0 and 0), and the
    critic (a head on the trunk, or a separate value model) of norm 13 x ``critic_scale``."""
    trunk = {"w": jnp.array([[3.0, 0.0], [0.0, 4.0]]), "b": jnp.zeros(2)}
    head = {"kernel": jnp.array([5.0, 12.0]) * critic_scale}
    if separate:
        return {"policy": trunk, "value": {"w": jnp.zeros((2, 2)), "v_head": head}}
    return {"policy": {**trunk, "v_head": head}, "value": None}


@pytest.mark.parametrize("separate", [False, True], ids=["head", "separate"])
@pytest.mark.parametrize(
    ("c_p", "c_v", "f_p", "f_v"),
    [
        (1.0, 2.0, 1 / 5, 2 / 13),  # both clipped, each by its own norm
        (10.0, 2.0, 1.0, 2 / 13),  # the policy's under its clip: untouched
        (0.0, 26.0, 1.0, 1.0),  # no policy clip; the critic's under its own
        (0.0, 1.0, 1.0, 1 / 13),
    ],
)
def test_separate_clip_matches_numpy(separate, c_p, c_v, f_p, f_v):
    g = _grads(1.0, separate)
    out, _ = clip_by_global_norm(c_p, c_v).update(g, optax.EmptyState())
    head = out["value"]["v_head"] if separate else out["policy"]["v_head"]
    np.testing.assert_allclose(np.asarray(out["policy"]["w"]), np.array([[3, 0], [0, 4]]) * f_p, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(head["kernel"]), np.array([5, 12]) * f_v, rtol=1e-6)


def test_without_a_critic_clip_it_is_the_one_global_clip():
    """``critic_max_norm`` 0: one norm over both parts (sqrt(25 + 169) = sqrt(194)), as optax."""
    g = _grads(1.0, False)
    ours, _ = clip_by_global_norm(1.0).update(g, optax.EmptyState())
    theirs, _ = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())
    np.testing.assert_allclose(
        np.asarray(ours["policy"]["w"]), np.array([[3, 0], [0, 4]]) / np.sqrt(194.0), rtol=1e-6
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), ours, theirs)


def _adam_steps(opt, grads, n: int = 3):
    params = jax.tree.map(jnp.zeros_like, grads)
    state = opt.init(params)
    for _ in range(n):
        u, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, u)
    return params


@pytest.mark.parametrize("separate", [False, True], ids=["head", "separate"])
def test_a_huge_critic_gradient_no_longer_shrinks_the_policy_update(separate):
    """With one global clip a critic gradient 1e6 times larger shrinks the policy's clipped gradient to
    ~4e-7 and so its Adam step (``g / (|g| + eps)``, eps 1e-5) to ~4% of its size; with separate clips
    the policy's parameters move exactly as optax's clip + Adam on the policy's gradient alone moves them."""
    base = RunConfig().replace(optim={"lr": 0.1, "max_grad_norm": 1.0})
    split = base.replace(optim={"critic_max_grad_norm": 1.0})
    g = _grads(1e6, separate)
    alone = _adam_steps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-5),
                    optax.scale(-0.1)),
        {"w": g["policy"]["w"], "b": g["policy"]["b"]},
    )  # fmt: skip
    got = _adam_steps(make_optimizer(split), g)["policy"]
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(alone["w"]), rtol=1e-6)
    one = _adam_steps(make_optimizer(base), g)["policy"]
    assert np.max(np.abs(np.asarray(one["w"]))) < 0.1 * np.max(np.abs(np.asarray(got["w"])))


@pytest.mark.parametrize("separate", [False, True], ids=["head", "separate"])
def test_policy_and_critic_norms(separate):
    p, v = policy_critic_norms(_grads(2.0, separate))
    assert float(p) == pytest.approx(5.0) and float(v) == pytest.approx(26.0)
    p, v = policy_critic_norms({"policy": {"w": jnp.full((3,), 2.0)}, "value": None})
    assert float(p) == pytest.approx(np.sqrt(12.0)) and float(v) == 0.0


def test_critic_max_grad_norm_is_checked():
    with pytest.raises(ConfigError, match="optim.critic_max_grad_norm"):
        RunConfig().replace(optim={"critic_max_grad_norm": -1.0})


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
    from klrl.step.optim import is_critic

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
