"""Tests of klrl.shaping: every placement against hand-computed arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo.shaping import last_token_onehot, sequence_returns, shaped_rewards

# row 0 uses all 4 tokens; row 1 ends after 2 (garbage KL after the end must be ignored)
R = jnp.array([1.0, 2.0])
KL = jnp.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 9.0, 9.0]])
MASK = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
BETA = jnp.float32(0.5)

# reward: -beta * kl_t everywhere, + R at the last token
PER_TOKEN = [[-0.05, -0.1, -0.15, 1.0 - 0.2], [-0.25, 2.0 - 0.3, 0.0, 0.0]]
# sequence: R - beta * sum kl at the last token: 1 - 0.5 * 1.0 = 0.5; 2 - 0.5 * 1.1 = 1.45
SEQUENCE = [[0.0, 0.0, 0.0, 0.5], [0.0, 1.45, 0.0, 0.0]]
# loss: R alone at the last token
LOSS = [[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]]
EXPECTED = {"reward": PER_TOKEN, "sequence": SEQUENCE, "loss": LOSS, "reward+loss": PER_TOKEN}


def test_last_token_onehot() -> None:
    m = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(
        np.asarray(last_token_onehot(m)), [[0, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]]
    )


@pytest.mark.parametrize("placement", list(EXPECTED))
def test_shaped_rewards_hand_values(placement: str) -> None:
    out = shaped_rewards(R, KL, MASK, BETA, placement)
    np.testing.assert_allclose(np.asarray(out), EXPECTED[placement], rtol=1e-6, atol=1e-7)
    # beta is traced under jit: same numbers
    jitted = jax.jit(shaped_rewards, static_argnums=4)(R, KL, MASK, BETA, placement)
    np.testing.assert_allclose(np.asarray(jitted), EXPECTED[placement], rtol=1e-6, atol=1e-7)
    returns = sequence_returns(R, KL, MASK, BETA, placement)
    np.testing.assert_allclose(np.asarray(returns), np.sum(EXPECTED[placement], axis=1), rtol=1e-6)


def test_reward_and_sequence_have_the_same_total() -> None:
    a = sequence_returns(R, KL, MASK, BETA, "reward")
    b = sequence_returns(R, KL, MASK, BETA, "sequence")
    np.testing.assert_allclose(np.asarray(a), [0.5, 1.45], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_unknown_placement_raises() -> None:
    with pytest.raises(ValueError, match="kl.placement"):
        shaped_rewards(R, KL, MASK, BETA, "nowhere")


def test_missing_eos_penalty_hand_values() -> None:
    """TRL: ``scores[~any(response == eos)] -= penalty``; here any of several stop ids, valid tokens only."""
    from klrl.algo.shaping import missing_eos_penalty

    stops = (2, 7)
    response = np.array(
        [
            [5, 6, 2, 0],  # stopped by 2 (then PAD)
            [5, 6, 5, 6],  # ran out of budget: penalised
            [5, 6, 5, 7],  # the second stop id in the last slot: not penalised
            [5, 0, 0, 0],  # a stop id value after the mask ends does not count ...
            [3, 3, 3, 3],
        ],
        np.int32,
    )
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    response[3, 2] = 2  # ... (masked out)
    reward = np.array([1.0, 1.0, -0.5, 0.25, 0.0], np.float32)
    got = jax.jit(missing_eos_penalty, static_argnums=(3, 4))(reward, response, mask, stops, 1.5)
    np.testing.assert_allclose(np.asarray(got), [1.0, -0.5, -0.5, 0.25 - 1.5, -1.5])
    np.testing.assert_array_equal(np.asarray(missing_eos_penalty(reward, response, mask, stops, 0.0)), reward)


def test_missing_eos_penalty_config() -> None:
    from klrl.config import ConfigError, RunConfig

    assert RunConfig().reward.missing_eos_penalty == 0.0
    with pytest.raises(ConfigError, match="reward.missing_eos_penalty"):
        RunConfig().replace(reward={"missing_eos_penalty": float("nan")})
