"""``optim.critic_max_grad_norm``: the policy's and the critic's gradients clipped apart
(:func:`klrl.step.parts.clip_by_global_norm`), checked against NumPy on hand gradients and against
optax's Adam run on each part alone; the pre-clip norms the update logs
(:func:`klrl.step.update.policy_critic_norms`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from klrl.config import ConfigError, RunConfig
from klrl.step.parts import clip_by_global_norm, make_optimizer
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
