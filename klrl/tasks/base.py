"""What a task gives the trainer: a vocabulary, prompts, a reference policy, a reward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

Array = jax.Array

# (env, rollout) -> [B] sequence reward, written in JAX
RewardFn = Callable[[Any, Any], Array]
# (env, rollout) -> {name: [B]} per-example evaluation metrics, averaged over the global batch
EvalFn = Callable[[Any, Any], dict[str, Array]]
# (env, gathered rollout without logits/values, gathered task reward, gathered evals) -> {name: scalar}
BatchEvalFn = Callable[[Any, Any, Array, dict[str, Array]], dict[str, Array]]


@dataclass(frozen=True)
class Task:
    """A task. ``env`` is a pytree of arrays handed to every step (replicated on
    every device); it must hold ``prompts [N, P]`` and ``prompt_mask [N, P]``."""

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    prompt_len: int
    max_len: int  # position-embedding size of the reference policy
    env: dict[str, Any]
    ref_params: Any  # pretrained policy parameters: the initial policy and the reference
    reward_fn: RewardFn
    eval_fn: EvalFn | None = None
    batch_eval_fn: BatchEvalFn | None = None
    info: dict[str, Any] = field(default_factory=dict)  # e.g. pretraining loss, entropy rate
    decode: Callable[..., str] | None = None
