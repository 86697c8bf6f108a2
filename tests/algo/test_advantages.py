"""Tests of klrl.advantages against Python-loop / NumPy references and hand-computed values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo import advantages as A


def _gae_reference(rewards, values, lengths, gamma, lam):
    """Plain Python loop over each row's first ``length`` positions; zeros after."""
    b, t = rewards.shape
    adv = np.zeros((b, t))
    ret = np.zeros((b, t))
    for i in range(b):
        n = lengths[i]
        last = 0.0
        for j in reversed(range(n)):
            next_v = values[i, j + 1] if j + 1 < n else 0.0
            delta = rewards[i, j] + gamma * next_v - values[i, j]
            last = delta + gamma * lam * last
            adv[i, j] = last
            ret[i, j] = last + values[i, j]
    return adv, ret


def _random_case(seed: int, b: int = 7, t: int = 9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[:3] = [0, 1, t]  # an empty row, a one-token row and a full row
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    # garbage at masked positions: it must not leak into the result
    rewards = rng.normal(size=(b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    return rewards, values, mask, lengths


gae_jit = jax.jit(A.gae, static_argnums=(3, 4))


@pytest.mark.parametrize("seed,gamma,lam", [(0, 0.9, 0.8), (1, 0.99, 0.5), (2, 0.7, 0.95), (3, 1.0, 1.0)])
def test_gae_matches_python_loop(seed: int, gamma: float, lam: float) -> None:
    rewards, values, mask, lengths = _random_case(seed)
    adv, ret = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    ref_adv, ref_ret = _gae_reference(
        rewards.astype(np.float64), values.astype(np.float64), lengths, gamma, lam
    )
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[mask == 0] == 0) and np.all(np.asarray(ret)[mask == 0] == 0)


def test_gae_hand_values() -> None:
    # one row of length 2 (of 3): r = [1, 2, x], V = [0.5, 1, x], gamma 0.5, lam 0.5
    # delta_1 = 2 - 1 = 1; A_1 = 1
    # delta_0 = 1 + 0.5 * 1 - 0.5 = 1; A_0 = 1 + 0.25 * 1 = 1.25
    r = jnp.array([[1.0, 2.0, 7.0]])
    v = jnp.array([[0.5, 1.0, 9.0]])
    m = jnp.array([[1.0, 1.0, 0.0]])
    adv, ret = A.gae(r, v, m, 0.5, 0.5)
    np.testing.assert_allclose(np.asarray(adv), [[1.25, 1.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), [[1.75, 2.0, 0.0]], rtol=1e-6)


def test_whiten_matches_numpy() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(3.0, 2.0, size=(6, 10)).astype(np.float32)
    lengths = rng.integers(1, 11, size=6)
    mask = (np.arange(10)[None] < lengths[:, None]).astype(np.float32)
    sel = x[mask > 0].astype(np.float64)
    mean, var = sel.mean(), sel.var()
    ref = (x - mean) / np.sqrt(var + 1e-8) * mask
    np.testing.assert_allclose(
        np.asarray(A.whiten(jnp.asarray(x), jnp.asarray(mask))), ref, rtol=1e-5, atol=1e-5
    )
    ref_keep = ((x - mean) / np.sqrt(var + 1e-8) + mean) * mask
    out = A.whiten(jnp.asarray(x), jnp.asarray(mask), shift_mean=False)
    np.testing.assert_allclose(np.asarray(out), ref_keep, rtol=1e-5, atol=1e-5)
    m, v = A.masked_moments(jnp.asarray(x), jnp.asarray(mask))
    np.testing.assert_allclose([float(m), float(v)], [mean, var], rtol=1e-5)


def test_whiten_global_statistics_under_vmap_axis() -> None:
    """With an axis name the moments are over all shards together (here: a vmapped axis)."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)
    mask = (rng.random((4, 3, 5)) < 0.7).astype(np.float32)
    out = jax.vmap(lambda a, m: A.whiten(a, m, axis_name="data"), axis_name="data")(x, mask)
    sel = x[mask > 0].astype(np.float64)
    ref = (x - sel.mean()) / np.sqrt(sel.var() + 1e-8) * mask
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_whiten_rewards_is_trls_masked_whiten_without_the_mean_shift() -> None:
    """TRL's ``masked_whiten(rewards, mask, shift_mean=False)``: torch's unbiased variance (ddof 1) over
    the masked tokens, the mean added back; on one array and across a mapped axis alike."""
    rng = np.random.default_rng(7)
    x = rng.normal(-0.5, 3.0, size=(4, 6)).astype(np.float32)
    mask = (np.arange(6)[None] < np.array([6, 3, 1, 5])[:, None]).astype(np.float32)
    sel = x[mask > 0].astype(np.float64)
    ref = ((x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8) + sel.mean()) * mask
    out = A.whiten_rewards(jnp.asarray(x), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    split = jax.vmap(lambda a, m: A.whiten_rewards(a, m, "data"), axis_name="data")(
        x.reshape(2, 2, 6), mask.reshape(2, 2, 6)
    )
    np.testing.assert_allclose(np.asarray(split).reshape(4, 6), ref, rtol=1e-5, atol=1e-5)


def test_gae_estimator_whitens_the_rewards_first_with_ppo_whiten_rewards() -> None:
    from klrl.config import PPOConfig

    rewards, values, mask, _ = _random_case(8)
    x = A.AdvantageInputs(jnp.asarray(rewards), jnp.zeros(7), jnp.asarray(values), jnp.asarray(mask))
    adv, ret = A.ADVANTAGES.get("gae")(x, PPOConfig(whiten_rewards=True))
    want = A.gae(A.whiten_rewards(x.rewards, x.mask), x.values, x.mask, 1.0, 0.95)
    np.testing.assert_allclose(np.asarray(adv), np.asarray(want[0]), rtol=1e-6)
    plain, _ = A.ADVANTAGES.get("gae")(x, PPOConfig())
    assert not np.allclose(np.asarray(adv), np.asarray(plain))


def test_grpo_hand_values() -> None:
    # groups of 3: [1, 2, 3] (mean 2, population std sqrt(2/3)), [5, 5, 5] (all equal)
    r = jnp.array([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    s = np.sqrt(2.0 / 3.0)
    np.testing.assert_allclose(
        np.asarray(A.grpo(r, 3)), [-1 / (s + 1e-6), 0.0, 1 / (s + 1e-6), 0.0, 0.0, 0.0], rtol=1e-5
    )
    np.testing.assert_allclose(np.asarray(A.grpo(r, 3, use_std=False)), [-1.0, 0.0, 1.0, 0, 0, 0], atol=1e-6)
    # groups of 2: [0, 4] -> mean 2, std 2 -> [-1, 1]; [3, 3] -> zeros
    r2 = jnp.array([0.0, 4.0, 3.0, 3.0])
    np.testing.assert_allclose(np.asarray(A.grpo(r2, 2)), [-2 / (2 + 1e-6), 2 / (2 + 1e-6), 0, 0], rtol=1e-6)


def test_rloo_hand_values() -> None:
    # [1, 2, 3]: baselines (2+3)/2 = 2.5, (1+3)/2 = 2, (1+2)/2 = 1.5 -> [-1.5, 0, 1.5]
    # [5, 5, 5]: zeros; [0, 6, 0]: baselines 3, 0, 3 -> [-3, 6, -3]
    r = jnp.array([1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 0.0, 6.0, 0.0])
    np.testing.assert_allclose(np.asarray(A.rloo(r, 3)), [-1.5, 0, 1.5, 0, 0, 0, -3, 6, -3], atol=1e-6)
    # equals G/(G-1) (R - mean)
    np.testing.assert_allclose(
        np.asarray(A.rloo(r, 3)), 1.5 * np.asarray(A.grpo(r, 3, use_std=False)), atol=1e-6
    )


# ---- the registry: the worked example of docs/extending.md ----------------------------------------


@pytest.fixture
def reinforce():
    """docs/extending.md's new advantage estimator, registered for one test and removed after it."""
    from typing import Any

    from klrl.algo.advantages import ADVANTAGES, AdvantageInputs

    @ADVANTAGES.register("reinforce", critic=False, grouped=False, help="the sequence's return")
    def reinforce_estimator(x: AdvantageInputs, cfg: Any):
        """A_t = R (the sequence's shaped return) on every response token; no value targets."""
        return x.seq_returns[:, None] * x.mask, jnp.zeros_like(x.mask)

    yield reinforce_estimator
    ADVANTAGES.remove("reinforce")


def test_worked_example_reinforce(reinforce):
    from test_tasks import _cfg, _task

    from klrl.algo.advantages import ADVANTAGES, AdvantageInputs, needs_critic
    from klrl.config import ConfigError, PPOConfig
    from klrl.step.train import build_models, make_train

    mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
    x = AdvantageInputs(jnp.zeros((2, 3)), jnp.array([2.0, -1.0]), jnp.zeros((2, 3)), mask)
    adv, ret = ADVANTAGES.get("reinforce")(x, PPOConfig(advantage="reinforce"))
    np.testing.assert_array_equal(np.asarray(adv), [[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]])
    np.testing.assert_array_equal(np.asarray(ret), np.zeros((2, 3)))
    assert not needs_critic("reinforce")
    cfg = _cfg().replace(ppo={"advantage": "reinforce", "whiten": False})  # the config accepts the new name
    assert build_models(cfg, _task(cfg).policy).value_head is None  # no critic is built
    task = _task(cfg)
    train = make_train(cfg, task)
    state, m = train.step(train.init(0), task.env)
    assert np.isfinite(float(m["loss/total"])) and "loss/value" not in m
    ADVANTAGES.remove("reinforce")
    with pytest.raises(ConfigError, match=f"ppo.advantage: must be one of {', '.join(ADVANTAGES.names())} "):
        PPOConfig(advantage="reinforce")
