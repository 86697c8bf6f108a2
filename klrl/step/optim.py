"""The optimiser: Adam(W) with a global-norm clip as one scalar factor, separate policy and critic
learning rates and clips, and the peak learning rate as an injected hyper-parameter (a sweep member's
``optim.lr`` lives in its optimiser state)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from klrl.config import RunConfig
from klrl.models.heads import HEAD_KEY
from klrl.rewards import running

Array = jax.Array


def clip_by_global_norm(max_norm: float, critic_max_norm: float = 0.0) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` with the clip as one scalar factor: ``g * min(1, c / ||g||)``
    (optax computes ``g / ||g|| * c`` per element; the two differ by float32 rounding when the clip
    triggers and not at all when it does not). XLA counts a division as expensive and so wrote optax's
    clipped gradients into buffers of their own (1.0 GiB on SmolLM2 with a separate value model) for
    Adam's two moment updates to read; a multiplication by a scalar is fused into each of them. The
    step's peak then lies elsewhere: its temporaries fell by 0.25 GiB with ``model.remat=block`` and
    by less than 0.01 GiB with ``none`` (``benchmarks/step_memory.py --compile-only``).

    ``critic_max_norm > 0`` (``optim.critic_max_grad_norm``): the critic's parameters (:func:`is_critic`)
    and the policy's are clipped apart, ``g_p * min(1, c / ||g_p||)`` and ``g_v * min(1, c_v / ||g_v||)``
    (``max_norm`` 0: the policy's unclipped), as two optimisers with a clip each would (verl, OpenRLHF):
    a large value-loss gradient no longer shrinks the policy's."""

    def factor(norm, c):
        return jnp.where(norm < c, 1.0, c / norm) if c > 0 else jnp.float32(1.0)

    def update_fn(updates, state, params=None):
        del params
        if critic_max_norm <= 0:
            f = factor(optax.tree.norm(updates), max_norm)
            return jax.tree.map(lambda t: t * f.astype(t.dtype), updates), state
        leaves = jax.tree_util.tree_leaves_with_path(updates)
        sq = lambda critic: sum(
            jnp.sum(jnp.square(g.astype(jnp.float32))) for p, g in leaves if is_critic(p) == critic
        )
        f_p, f_v = factor(jnp.sqrt(sq(False)), max_norm), factor(jnp.sqrt(sq(True)), critic_max_norm)
        scale = lambda p, g: g * (f_v if is_critic(p) else f_p).astype(g.dtype)
        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def is_critic(path: tuple) -> bool:
    """Whether the parameter at ``path`` (a key path into ``TrainState.params``) is the critic's: the
    value head on the policy trunk (``params['policy'][HEAD_KEY]``, ``model.value_model=head``) or the
    separate value model (``params['value']``: its trunk and head). The shared trunk is the policy's."""
    keys = [getattr(k, "key", None) for k in path[:2]]
    return keys[0] == "value" or keys == ["policy", HEAD_KEY]


def scale_policy_critic(step_size: Array, critic_step_size: Array) -> optax.GradientTransformation:
    """``optax.scale`` with its own factor for the critic's parameters (:func:`is_critic`): the policy's
    updates times ``step_size``, the critic's times ``critic_step_size`` (each ``step_size * g``, as
    ``optax.scale`` computes it, so equal factors give its result bit for bit)."""

    def update_fn(updates, state, params=None):
        del params
        scaled = jax.tree_util.tree_map_with_path(
            lambda p, g: (critic_step_size if is_critic(p) else step_size) * g, updates
        )
        return scaled, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """Adam(W) with global-norm clipping and a schedule; the peak learning rate is an
    injected hyper-parameter (``opt_state[-1].hyperparams['step_size']`` = -lr) so a
    sweep can give each member its own.

    ``optim.critic_lr > 0``: the critic's parameters (:func:`is_critic`) step by ``critic_lr``
    instead (``hyperparams['critic_step_size']`` = -critic_lr, :func:`scale_policy_critic`), as a
    second Adam(W) with that learning rate would: Adam and the schedule are per element, only the
    final scale differs. The clip is one global norm over all parameters (one optimiser, as TRL's PPO),
    or with ``optim.critic_max_grad_norm > 0`` one norm each for the policy's and the critic's
    (:func:`clip_by_global_norm`; verl and OpenRLHF clip the critic's optimiser on its own)."""
    o = cfg.optim
    total_steps = cfg.train.iterations * cfg.ppo.epochs * cfg.ppo.minibatches
    decay = max(total_steps - o.warmup_steps, 1)
    if o.schedule == "constant":
        shape = optax.constant_schedule(1.0)
    elif o.schedule == "linear":
        shape = optax.linear_schedule(1.0, 0.0, decay)
    else:
        shape = optax.cosine_decay_schedule(1.0, decay)
    if o.warmup_steps:
        shape = optax.join_schedules(
            [optax.linear_schedule(0.0, 1.0, o.warmup_steps), shape], [o.warmup_steps]
        )
    clip = o.max_grad_norm > 0 or o.critic_max_grad_norm > 0
    parts = [clip_by_global_norm(o.max_grad_norm, o.critic_max_grad_norm)] if clip else []
    if cfg.ppo.normalize_reward:  # the task reward's running moments (klrl.rewards.running): state only
        parts = [running.holder(), *parts]
    parts += [optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)]
    if o.weight_decay > 0:
        parts += [optax.add_decayed_weights(o.weight_decay)]
    parts += [optax.scale_by_schedule(shape)]
    if o.critic_lr > 0:
        scale = optax.inject_hyperparams(scale_policy_critic)(step_size=-o.lr, critic_step_size=-o.critic_lr)
    else:
        scale = optax.inject_hyperparams(optax.scale)(step_size=-o.lr)
    return optax.chain(*parts, scale)


def set_learning_rate(opt_state: Any, lr: Array | float) -> Any:
    """Return ``opt_state`` with the peak learning rate replaced (see :func:`make_optimizer`)."""
    last = opt_state[-1]
    hp = dict(last.hyperparams, step_size=-jnp.asarray(lr, jnp.float32))
    return (*opt_state[:-1], last._replace(hyperparams=hp))
