"""A task in parts: a prompt source, a tokenizer, a reward, optional evaluators, a reference policy.

* **Prompt source** (:class:`PromptSource`): what the rollout draws prompts from. Today a pool of
  left-padded token rows (:class:`TokenPool`); a tokenised text dataset comes next, behind the
  same protocol (its ``env()`` arrays are what the step reads).
* **Tokenizer** (:class:`klrl.data.tokenizer.Tokenizer`): encode, decode, a pad id and a *set* of
  stop ids (any of them ends a response).
* **Reward**: :class:`JaxReward`, a traced function ``(env, rollout) -> [B] float32`` with its own
  parameters (they travel in ``env``, so they are arguments of the step, not constants of the
  program). A function of decoded text (:class:`klrl.rewards.host.HostReward`) is one too: the step
  calls it on the host through a callback, and its ``check`` raises if it failed.
* **Evaluators** (:class:`Evaluators`): per-example metrics ``(env, rollout) -> {name: [B]}`` and
  batch metrics over the gathered batch; names starting with ``_`` are handed to the batch
  evaluator and not logged.
* **Reference policy**: any :class:`klrl.models.base.CausalLM` and its pretrained parameters, the
  initial policy and the frozen KL reference.

:func:`klrl.checks.check_parts` checks the parts against each other and against the policy at the
API's entry (``klrl.run``, ``klrl.sweep``): a wrong shape, dtype or vocabulary is a :class:`ConfigError`
naming the part, never a silently wrong run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from klrl.config import RunConfig, TaskShape
from klrl.data.tokenizer import Tokenizer
from klrl.models.base import CausalLM
from klrl.models.pretrained import pretrained_shape
from klrl.registry import TASKS
from klrl.tasks import language

Array = jax.Array

# (env, rollout) -> [B] sequence reward, written in JAX
RewardFn = Callable[[Any, Any], Array]
# (env, rollout) -> {name: [B]} per-example evaluation metrics, averaged over the global batch
EvalFn = Callable[[Any, Any], dict[str, Array]]
# (env, gathered rollout without logits/values, gathered task reward, gathered evals) -> {name: scalar}
BatchEvalFn = Callable[[Any, Any, Array, dict[str, Array]], dict[str, Array]]


def register_task(name: str, **meta: Any) -> Callable:
    """Decorator over a task builder ``(cfg: RunConfig, log=None) -> Task``."""
    return TASKS.register(name, **meta)


# ---- prompt sources ------------------------------------------------------------------------------


@runtime_checkable
class PromptSource(Protocol):
    width: int  # P: every prompt is left-padded to P tokens

    def env(self) -> dict[str, Array]:
        """The arrays the step samples prompts from: ``prompts [N, P]`` int32, ``prompt_mask [N, P]``."""
        ...


@dataclass(frozen=True)
class TokenPool:
    """A pool of pre-tokenised, left-padded prompts: ``prompts [N, P]`` int32, ``mask [N, P]``."""

    prompts: Any
    mask: Any

    @property
    def width(self) -> int:
        return int(np.shape(self.prompts)[-1])

    def env(self) -> dict[str, Array]:
        return {"prompts": self.prompts, "prompt_mask": self.mask}


# ---- rewards and evaluators -----------------------------------------------------------------------


@dataclass(frozen=True)
class JaxReward:
    """``fn(env, rollout) -> [B]`` float32, traced into the step; ``params`` (e.g. a frozen reward
    model's) are merged into ``env`` under their keys."""

    fn: RewardFn
    params: dict[str, Any] = field(default_factory=dict)
    # ``with_metrics(env, rollout) -> ([B] reward, {name: [B]})``: ``fn`` with per-sequence metrics the
    # train step logs as their batch means (a host reward's ``reward/all_none_frac``), in one call; None:
    # ``fn`` alone. A wrapper that changes ``fn`` wraps it alike (klrl.rewards.standardize)
    with_metrics: Callable[[Any, Any], tuple[Array, dict[str, Array]]] | None = None
    # host-side check the run loop calls when an iteration was rejected: raises (one line) if a host
    # reward function failed (:meth:`klrl.rewards.host.HostReward.check`); None for in-graph rewards
    check: Callable[[], None] | None = None
    # A reward model whose trunk is a causal LM's: ``from_hidden(env, rollout, hidden) -> [B]`` is
    # ``fn`` given that trunk's final hidden states ``[B, P + R, D]`` over prompt + response, and
    # ``trunk = (model, parameter tree)`` names the trunk. When it is the train step's frozen
    # reference (the same model and the same parameter arrays, see
    # :attr:`klrl.step.context.Context.reward_on_reference`) the step reads the reward from the
    # reference forward it runs anyway: one trunk forward less per iteration, the same numbers. A
    # wrapper that changes ``fn`` wraps ``from_hidden`` alike (klrl.rewards.standardize) or drops it.
    from_hidden: Callable[[Any, Any, Array], Array] | None = None
    trunk: tuple[Any, Any] | None = None
    kind = "jax"


@dataclass(frozen=True)
class HeldOut:
    """Held-out prompts scored with the policy at temperature 0 (:mod:`klrl.step.evaluate`): their pool
    (its arrays travel in ``env`` as ``heldout_prompts``/``heldout_prompt_mask``), the reward of its
    rows (``ro.prompt_idx`` indexes this pool) and their texts."""

    prompts: TokenPool
    reward: JaxReward
    texts: Sequence[Any] = ()


@dataclass(frozen=True)
class Evaluators:
    per_example: EvalFn | None = None
    batch: BatchEvalFn | None = None
    params: dict[str, Any] = field(default_factory=dict)  # merged into ``env``


# ---- the task -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A task made of parts; ``env`` (a pytree of arrays handed to every step, replicated) is the
    prompt source's arrays plus the reward's and evaluators' parameters."""

    name: str
    tokenizer: Tokenizer
    prompts: PromptSource
    prompt_len: int  # P the task declares; the prompt source must be exactly this wide
    reward: JaxReward
    policy: CausalLM  # the reference policy's model (any family)
    policy_params: Any  # its pretrained parameters: the initial policy and the KL reference
    evaluators: Evaluators = field(default_factory=Evaluators)
    info: dict[str, Any] = field(default_factory=dict)  # e.g. pretraining loss, entropy rate
    prompt_texts: Sequence[str] | None = None  # the pool's prompts as text (samples show them), if known
    heldout: HeldOut | None = None  # held-out prompts for the temperature-0 evaluation (klrl.step.evaluate)

    @property
    def env(self) -> dict[str, Any]:
        reward_params = self.reward.params if isinstance(self.reward, JaxReward) else {}
        env = {**self.prompts.env(), **reward_params, **self.evaluators.params}
        if self.heldout is not None:
            h = self.heldout.prompts.env()
            env.update(
                heldout_prompts=h["prompts"],
                heldout_prompt_mask=h["prompt_mask"],
                **self.heldout.reward.params,
            )
        return env

    # convenient views of the parts
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.stop_ids)

    @property
    def eos_id(self) -> int:
        return self.stop_ids[0]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def max_len(self) -> int:
        return self.policy.max_len

    @property
    def ref_params(self) -> Any:
        return self.policy_params

    @property
    def reward_fn(self) -> RewardFn:
        return self.reward.fn

    @property
    def eval_fn(self) -> EvalFn | None:
        return self.evaluators.per_example

    @property
    def batch_eval_fn(self) -> BatchEvalFn | None:
        return self.evaluators.batch

    def decode(self, tokens: Any, mask: Any = None) -> str:
        """Text of unmasked tokens (one line per row for a 2-D input)."""
        t = np.asarray(tokens)
        m = np.ones(t.shape, bool) if mask is None else np.asarray(mask) > 0
        if t.ndim == 2:
            return "\n".join(self.decode(r, mr) for r, mr in zip(t, m, strict=True))
        return self.tokenizer.decode(
            [int(i) for i, k in zip(t, m, strict=True) if k], skip_special_tokens=False
        )


# the built-in tasks that train klrl's own GPT (sized by the model section) and read no checkpoint: the
# model.* paths mean nothing to them (a pretrained model trains with task.name=text)
OWN_MODEL_TASKS = ("testbed", "wordclass", "peer")


def builtin_task_shape(cfg: RunConfig) -> TaskShape:
    """The shape of the built-in task ``cfg.task.name`` builds, known without building it."""
    if cfg.task.name == "text":  # a pretrained model's: from its config alone (checked again once read)
        shape = pretrained_shape(cfg.model.path) if cfg.model.path else None
        vocab, max_len = shape or (2**31 - 1, 2**31 - 1)  # unreadable: the load says why
        return TaskShape(vocab, cfg.data.prompt_len, max_len)
    # PAD, EOS, the words (they never depend on the seed)
    vocab = 2 + sum(len(words) for words in language._LEXICON.values())
    t = cfg.task
    return TaskShape(vocab, t.prompt_len, max(t.pretrain_len, t.prompt_len + cfg.sampling.response_len))
