"""``ppo.normalize_reward``: the task reward normalised by the running mean and std of every task reward
seen so far, this batch's included.

``r' = (r - mu_n) / sqrt(var_n + eps)``, ``mu_n`` and ``var_n`` (population, ddof 0) the mean and
variance of all ``n`` task rewards of the iterations so far, this one's included (updated first, then
applied, as trlx's ``RunningMoments``; trlx's ``scale_reward="running"`` divides by the std only).
The moments merge batch by batch (Chan, Golub and LeVeque 1979): for a batch of ``b`` rewards with mean
``m_b`` and sum of squared deviations ``M_b``, ``n' = n + b``, ``delta = m_b - mu``,
``mu' = mu + delta b / n'``, ``M' = M + M_b + delta^2 n b / n'``, ``var = M / n``.
Unlike ``reward.standardize`` (:mod:`klrl.rewards.standardize`: a gain and bias fixed once from the
reference policy's samples, lm-human-preferences' and OpenRLHF's reward-model normalisation), the scale
follows the policy's rewards as they move.

Where the moments live: :class:`RewardMoments` (float32 scalars) is the state of :func:`holder`, an
identity element of the optimiser chain (:func:`klrl.step.optim.make_optimizer` adds it with
``ppo.normalize_reward``), so they are part of ``TrainState.opt_state``: a sweep's members each have
their own, checkpoints hold them and a resume continues them bit for bit. :func:`read` and
:func:`write` find and replace them there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

Array = jax.Array

EPS = 1e-8


class RewardMoments(NamedTuple):
    """Running moments of the task reward: count ``n``, mean ``mu``, sum of squared deviations ``M``."""

    count: Array  # float32 scalar
    mean: Array
    m2: Array

    @property
    def var(self) -> Array:
        """The population variance ``M / n`` (0 before any reward)."""
        return self.m2 / jnp.maximum(self.count, 1.0)


def init() -> RewardMoments:
    """No reward seen: ``n = mu = M = 0``."""
    # three buffers, not one three times: the train step donates the state, each leaf on its own
    return RewardMoments(*(jnp.zeros((), jnp.float32) for _ in range(3)))


def update(m: RewardMoments, x: Array, axis_name: str | None = None) -> RewardMoments:
    """``m`` with the rewards ``x`` (any shape; across ``axis_name`` when given, each device its rows)
    merged in (module docstring)."""
    x = jnp.asarray(x, jnp.float32).reshape(-1)
    s = jnp.stack([jnp.float32(x.size), jnp.sum(x)])
    if axis_name is not None:
        s = jax.lax.psum(s, axis_name)
    b, m_b = s[0], s[1] / jnp.maximum(s[0], 1.0)
    sq = jnp.sum(jnp.square(x - m_b))
    if axis_name is not None:
        sq = jax.lax.psum(sq, axis_name)
    n = m.count + b
    delta = m_b - m.mean
    mean = m.mean + delta * b / jnp.maximum(n, 1.0)
    m2 = m.m2 + sq + jnp.square(delta) * m.count * b / jnp.maximum(n, 1.0)
    return RewardMoments(n, mean, m2)


def normalize(m: RewardMoments, x: Array) -> Array:
    """``(x - mu) / sqrt(var + 1e-8)`` with ``m``'s mean and population variance."""
    return ((x - m.mean) * jax.lax.rsqrt(m.var + EPS)).astype(jnp.float32)


def holder() -> optax.GradientTransformation:
    """An optimiser-chain element that leaves the updates as they are and holds :class:`RewardMoments`
    (:func:`init`) as its state, written by :func:`write`."""

    def update_fn(updates: Any, state: RewardMoments, params: Any = None) -> tuple[Any, RewardMoments]:
        del params
        return updates, state

    return optax.GradientTransformation(lambda params: init(), update_fn)


def _index(opt_state: Any) -> int:
    found = [i for i, s in enumerate(opt_state) if isinstance(s, RewardMoments)]
    if len(found) != 1:
        raise ValueError(
            "the optimiser state holds no reward moments (make_optimizer with ppo.normalize_reward)"
        )
    return found[0]


def read(opt_state: Any) -> RewardMoments:
    """The :class:`RewardMoments` of an optimiser chain's state (``TrainState.opt_state``)."""
    return opt_state[_index(opt_state)]


def write(opt_state: Any, m: RewardMoments) -> Any:
    """``opt_state`` with its :class:`RewardMoments` replaced by ``m``."""
    i = _index(opt_state)
    return (*opt_state[:i], m, *opt_state[i + 1 :])


def normalized_reward(opt_state: Any, x: Array, axis_name: str | None = None) -> tuple[Array, RewardMoments]:
    """``(normalize(m', x), m')``: the moments of ``opt_state`` with this batch's rewards ``x`` merged in
    (:func:`update`), and ``x`` normalised by them: the step's ``ppo.normalize_reward``, whose new state
    is ``write(opt_state, m')`` once the iteration is applied."""
    m = update(read(opt_state), x, axis_name)
    return normalize(m, x), m
