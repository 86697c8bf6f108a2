"""What :func:`klrl.loop.driver.drive` drives: a :class:`Program` (built by
:func:`klrl.loop.build.make_program` for a run and a sweep alike); re-exported by :mod:`klrl.loop.driver`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from klrl.config import RunConfig

__all__ = ["Program"]


@dataclass
class Program:
    """What the loop drives: ``step(state, env) -> (state, metrics)`` over ``len(configs)`` members
    (``stacked``: the state and metrics have a leading member axis)."""

    configs: list[RunConfig]
    stacked: bool
    init: Callable[[], Any]  # the initial state, placed as ``step`` returns it
    step: Callable[[Any, Any], tuple[Any, Any]]
    place: Callable[[Any], Any]  # a host state (restored checkpoint) -> placed like ``init``'s
    env: Any
    task_info: dict[str, Any] = field(default_factory=dict)
    abstract: Any = None  # shapes and dtypes of the state (default: ``jax.eval_shape(init)``)
    # raises klrl.rewards.RewardFunctionError if a host reward function failed (called when an
    # iteration was rejected by the guard); None: the reward cannot fail that way
    reward_check: Callable[[], None] | None = None
    tokenizer: Any = None  # decodes the step's ``_samples/*`` rows (klrl.loop.samples)
    prompt_texts: Any = None  # the prompt pool as text, if the task has it
    # (state, env) -> {name: scalar (or [members])}: the held-out evaluation (klrl.step.evaluate), run on the
    # state after i updates every data.eval_every iterations and merged into row i; None: off
    evaluate: Callable[[Any, Any], Any] | None = None
    heldout_check: Callable[[], None] | None = None  # as reward_check, for the held-out rows' reward
    # the state's shardings on this mesh (a pytree of ``Sharding`` like the state, or one): a checkpoint
    # is restored straight onto them, from whatever mesh it was saved (None: as host arrays, then ``place``)
    shardings: Any = None
    # the frozen reference (a LoRA run's base, a frozen full fine-tuning reference), placed as the state holds
    # it: checkpoints leave ``ref_params`` out and a restore takes it from here (klrl.loop.frozen); None: the
    # reference moves (kl.ref_update_every) and is checkpointed with the rest
    frozen_ref: Callable[[], Any] | None = None
