"""``klrl.rewards.running`` (``ppo.normalize_reward``): the running moments of the task reward against
NumPy's mean and std of every reward so far, across a mapped axis as on one array, kept in the
optimiser state (read, written, per sweep member under vmap)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from klrl.rewards import running


def _batches():
    rng = np.random.default_rng(0)
    # shifting scale and mean, as a policy's rewards move; one constant batch
    return [rng.normal(3.0 * i, 1.0 + i, size=8).astype(np.float32) for i in range(4)] + [
        np.full(8, 2.0, np.float32)
    ]


def test_running_moments_match_numpy_over_all_rewards_so_far():
    m = running.init()
    seen = []
    for x in _batches():
        seen.append(x)
        m = running.update(m, jnp.asarray(x))
        every = np.concatenate(seen).astype(np.float64)
        assert float(m.count) == every.size
        np.testing.assert_allclose(float(m.mean), every.mean(), rtol=1e-5)
        np.testing.assert_allclose(float(m.var), every.var(), rtol=1e-5)
        want = (x - every.mean()) / np.sqrt(every.var() + 1e-8)
        np.testing.assert_allclose(
            np.asarray(running.normalize(m, jnp.asarray(x))), want, rtol=1e-4, atol=1e-5
        )


def test_first_batch_is_standardised_by_itself_and_a_constant_one_gives_zeros():
    x = jnp.array([0.0, 1.0, 0.0, 3.0])
    r, m = running.normalized_reward((running.init(),), x)
    ref = np.array([0.0, 1.0, 0.0, 3.0])
    np.testing.assert_allclose(np.asarray(r), (ref - ref.mean()) / ref.std(), rtol=1e-5)
    r, _ = running.normalized_reward((running.init(),), jnp.full(4, 5.0))
    np.testing.assert_array_equal(np.asarray(r), np.zeros(4))


def test_across_an_axis_each_device_its_rows_is_one_array():
    """Two 'devices' of 4 rows each (vmap with an axis name, psum inside) give the moments of all 8."""
    m0 = running.update(running.init(), jnp.asarray(_batches()[0]))
    x = jnp.asarray(_batches()[1])
    split = jax.vmap(lambda r: running.update(m0, r, "d"), axis_name="d")(x.reshape(2, 4))
    whole = running.update(m0, x)
    for a, b in zip(split, whole, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.full(2, float(b)), rtol=1e-6)


def test_the_moments_live_in_the_optimiser_state():
    """The holder leaves the updates as they are; read/write find its state in the chain's, and under
    vmap (a sweep) each member keeps its own moments."""
    opt = optax.chain(running.holder(), optax.adam(0.1))
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    ref_u, _ = optax.adam(0.1).update({"w": jnp.arange(3.0)}, optax.adam(0.1).init(params), params)
    u, state = opt.update({"w": jnp.arange(3.0)}, state, params)
    np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(ref_u["w"]))
    m = running.update(running.read(state), jnp.array([1.0, 2.0]))
    state = running.write(state, m)
    assert float(running.read(state).count) == 2.0 and float(running.read(state).mean) == 1.5

    members = jax.vmap(lambda _: opt.init(params))(jnp.arange(2))
    members = jax.vmap(lambda s, x: running.write(s, running.update(running.read(s), x)))(
        members, jnp.array([[0.0, 2.0], [10.0, 30.0]])
    )
    np.testing.assert_allclose(np.asarray(running.read(members).mean), [1.0, 20.0])
    with pytest.raises(ValueError, match="no reward moments"):
        running.read(optax.adam(0.1).init(params))
