"""A benchmark task shaped like a typical RLHF PPO setup, with no language in it.

* Vocabulary: ``vocab`` token ids; ``0`` is PAD, ``1`` is EOS, ``[2, vocab)`` are ordinary tokens.
* Prompts: a pool of ``cfg.task.prompt_pool`` rows of ``prompt_len`` uniform random tokens in
  ``[2, vocab)`` with a full prompt mask (no padding).
* Reference policy: a *randomly initialised* GPT of ``cfg.model`` (no pretraining); it is the
  initial policy and the frozen KL reference.
* Reward: a separate, frozen, randomly initialised reward model of the same architecture with a
  scalar head and no LM head (sequence-classification shape). It reads prompt + response and the
  reward is its scalar output at the last real response token. Its parameters live in
  ``task.env['reward_params']``, so they are an argument of every step rather than a constant
  baked into the compiled program.

Nothing here is meant to be learned or to mean anything: the task exists to put the same work
(policy rollout, reference, value model, reward model, PPO update) on the machine as
a peer framework's PPO trainer does, for throughput comparisons (``benchmarks/throughput.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from klrl.config import RunConfig
from klrl.model import GPT, forward, init_params
from klrl.rollout import Rollout, sequence
from klrl.tasks.base import Task

Array = jax.Array

PAD = 0
EOS = 1


def last_response_value(value: Array, prompt_len: int, mask: Array) -> Array:
    """``[B]``: ``value[b, prompt_len + n_b - 1]`` with ``n_b`` real response tokens.

    An empty response (``n_b = 0``) reads the last prompt position.
    """
    n = jnp.sum(mask, axis=-1).astype(jnp.int32)
    idx = prompt_len + n - 1
    return jnp.take_along_axis(value, idx[:, None], axis=-1)[:, 0]


def make_peer_task(cfg: RunConfig, *, prompt_len: int, vocab: int = 256, seed: int = 0) -> Task:
    """The peer-comparison task for ``cfg`` (model shape, response length, prompt pool size)."""
    if vocab < 3:
        raise ValueError(f"vocab must be >= 3 (PAD, EOS and one ordinary token), got {vocab}")
    max_len = prompt_len + cfg.sampling.response_len
    k_ref, k_rm, k_prompts = jax.random.split(jax.random.key(seed), 3)
    ref_model = GPT(cfg.model, vocab, max_len)
    reward_model = GPT(cfg.model, vocab, max_len, lm_head=False, scalar_head=True)
    # one compiled program instead of hundreds of eagerly dispatched ops
    ref_params, reward_params = jax.jit(
        lambda k1, k2: (init_params(ref_model, k1, max_len), init_params(reward_model, k2, max_len))
    )(k_ref, k_rm)
    prompts = jax.random.randint(k_prompts, (cfg.task.prompt_pool, prompt_len), 2, vocab, jnp.int32)
    env = {
        "prompts": prompts,
        "prompt_mask": jnp.ones(prompts.shape, jnp.float32),
        "reward_params": reward_params,
    }

    def reward_fn(env, ro: Rollout) -> Array:
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        out = forward(reward_model, env["reward_params"], tokens, key_mask)
        return last_response_value(out.value, ro.prompt.shape[1], ro.mask)

    return Task(
        name="peer",
        vocab_size=vocab,
        eos_id=EOS,
        pad_id=PAD,
        prompt_len=prompt_len,
        max_len=max_len,
        env=env,
        ref_params=ref_params,
        reward_fn=reward_fn,
        info={"reference": "random init", "reward_model": "random init, frozen", "seed": seed},
    )
