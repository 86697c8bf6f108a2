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
from klrl.data.prompts import check_unused
from klrl.data.vocab import WordTokenizer
from klrl.models.base import forward
from klrl.models.gpt import GPT
from klrl.models.heads import ValueHead, attach, detach
from klrl.models.rollout import Rollout, sequence
from klrl.tasks.base import JaxReward, Task, TokenPool, register_task

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
    reward_trunk = GPT(cfg.model, vocab, max_len, lm_head=False)
    head = ValueHead(reward_trunk.hidden_size)
    # one compiled program instead of hundreds of eagerly dispatched ops
    ref_params, reward_params = jax.jit(
        lambda k1, k2: (ref_model.init(k1), attach(reward_trunk.init(k2), head.init(k2)))
    )(k_ref, k_rm)
    prompts = jax.random.randint(k_prompts, (cfg.task.prompt_pool, prompt_len), 2, vocab, jnp.int32)

    def reward_fn(env, ro: Rollout) -> Array:
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        trunk, head_params = detach(env["reward_params"])
        value = head.apply(head_params, forward(reward_trunk, trunk, tokens, key_mask, logits=False).hidden)
        return last_response_value(value, ro.prompt.shape[1], ro.mask)

    words = ("<pad>", "<eos>", *(f"t{i}" for i in range(2, vocab)))
    return Task(
        name="peer",
        tokenizer=WordTokenizer(words, pad_id=PAD, stop_ids=(EOS,)),
        prompts=TokenPool(prompts, jnp.ones(prompts.shape, jnp.float32)),
        prompt_len=prompt_len,
        reward=JaxReward(reward_fn, {"reward_params": reward_params}),
        policy=ref_model,
        policy_params=ref_params,
        info={"reference": "random init", "reward_model": "random init, frozen", "seed": seed},
    )


@register_task("peer")
def make_peer(cfg: RunConfig, log: object = None) -> Task:
    """The peer task of ``cfg`` by name (``task.name=peer``): ``task.prompt_len``, 256 tokens, seed 0;
    it generates its prompts (a ``data`` field set is an error)."""
    check_unused(cfg.data, "peer")
    return make_peer_task(cfg, prompt_len=cfg.task.prompt_len)
