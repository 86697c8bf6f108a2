"""Nothing accepted without effect: the fields a run's other fields make irrelevant, in one table.

:data:`IRRELEVANT` holds one :class:`Rule` per (field, condition): the field has no effect on a run
whose config meets the condition, e.g. ``lora.alpha`` without ``lora.rank > 0`` (full fine-tuning),
``lora.critic_rank`` unless ``model.value_model=lora``, a ``ctrl`` knob its controller kind does not
read (:func:`klrl.config.sweep.unread`, the rule sweeps and the study apply to their flags). A field
set to a value other than its default while a condition holds is refused by :func:`check_relevance`
(one :class:`ConfigError` naming both fields); a default never is.

Every field of the schema is in :data:`IRRELEVANT`, :data:`ALWAYS_RELEVANT` (it has an effect whatever
the other fields) or :data:`NOT_REFUSED` (it can be irrelevant, but that is checked elsewhere or
deliberately allowed, with the reason): ``tests/config/test_relevance.py`` walks the schema, so a new field
without a decision fails it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from klrl.config.run import SECTIONS, ConfigError, RunConfig
from klrl.config.sweep import KNOBS, unread
from klrl.registry import ADVANTAGES

__all__ = ["ALWAYS_RELEVANT", "IRRELEVANT", "NOT_REFUSED", "Rule", "check_relevance", "irrelevant"]


class Rule(NamedTuple):
    """``field`` (``section.name``) has no effect on a config for which ``when(cfg)`` is true; ``why``
    (formatted with ``c``, the config) says which other field makes it so."""

    field: str
    when: Callable[[RunConfig], bool]
    why: str
    on_task: bool = False  # the condition is on ``task.name``: not decided for a task given to klrl.run


def _no_critic(c: RunConfig) -> bool:
    return c.ppo.advantage in ADVANTAGES and not ADVANTAGES.meta(c.ppo.advantage).get("critic", True)


def _not_testbed(c: RunConfig) -> bool:
    return c.task.name != "testbed"


_NO_LORA = "without lora.rank > 0 (lora.rank=0 is full fine-tuning)"
_NO_CRITIC = "with ppo.advantage={c.ppo.advantage} (it trains no value function)"
_TEXT = "with task.name=text (the pretrained model.path and the data section set it)"
_CTRL = "with ctrl.kind={c.ctrl.kind} (its controller does not read it)"
_TESTBED = ("rm_pairs", "rm_heldout", "rm_epochs", "rm_lr", "rm_label_temp", "indep_d_model", "rm_scale",
            "gold_quantile", "gold_fluency_weight")  # fmt: skip
_TASK_GPT = ("seed", "prompt_len", "prompt_pool", "pretrain_steps", "pretrain_batch", "pretrain_lr",
             "pretrain_len")  # fmt: skip
_GPT = ("n_layers", "n_heads", "d_model", "mlp_ratio", "tie_embeddings")
_DIAG_ADAPTIVE = ("beta_trend", "trend_window", "settle")
_DATA = [f.name for f in dataclasses.fields(SECTIONS["data"])]

IRRELEVANT: tuple[Rule, ...] = (
    Rule("lora.alpha", lambda c: c.lora.rank == 0, _NO_LORA),
    Rule("lora.targets", lambda c: c.lora.rank == 0, _NO_LORA),
    Rule("lora.critic_rank", lambda c: c.model.value_model != "lora",
         "with model.value_model={c.model.value_model} (the critic has adapters only with lora)"),
    Rule("model.logits_chunk", lambda c: c.model.logits == "full", "with model.logits=full"),
    Rule("model.memory_gb", lambda c: c.model.remat != "auto", "with model.remat={c.model.remat} (it is "
         "model.remat=auto's budget)"),
    *(Rule(f"model.{f}", lambda c: c.task.name == "text", _TEXT, on_task=True) for f in _GPT),
    Rule("kl.beta", lambda c: "kl.beta" in unread(c),
         "with ctrl.warmup_iters={c.ctrl.warmup_iters} (the warm-up starts from ctrl.warmup_beta)"),
    Rule("kl.beta", lambda c: c.kl.placement == "loss",
         "with kl.placement=loss (no KL in the reward; kl.loss_coef weighs the loss term)"),
    Rule("kl.estimator", lambda c: c.kl.placement == "loss", "with kl.placement=loss (no KL in the reward)"),
    Rule("kl.loss_coef", lambda c: c.kl.placement in ("reward", "sequence"),
         "with kl.placement={c.kl.placement} (no KL loss term)"),
    Rule("kl.loss_coef", lambda c: "kl.loss_coef" in unread(c),
         "with ctrl.warmup_iters={c.ctrl.warmup_iters} (the warm-up starts from ctrl.warmup_beta)"),
    Rule("kl.loss_estimator", lambda c: c.kl.placement in ("reward", "sequence"),
         "with kl.placement={c.kl.placement} (no KL loss term)"),
    Rule("kl.loss_agg", lambda c: c.kl.placement in ("reward", "sequence"),
         "with kl.placement={c.kl.placement} (no KL loss term)"),
    Rule("kl.ref_mix", lambda c: c.kl.ref_update_every == 0, "without kl.ref_update_every > 0 (a frozen "
         "reference)"),
    *(Rule(f"ctrl.{k}", (lambda k: lambda c: f"ctrl.{k}" in unread(c))(k), _CTRL) for k in KNOBS),
    Rule("ctrl.warmup_beta", lambda c: c.ctrl.warmup_iters == 0, "without ctrl.warmup_iters > 0"),
    *(Rule(f"ppo.{f}", _no_critic, _NO_CRITIC) for f in ("vf_clip", "vf_coef", "gamma", "lam")),
    Rule("ppo.group_std", lambda c: c.ppo.advantage in ("gae", "rloo"),
         "with ppo.advantage={c.ppo.advantage} (grpo reads it)"),
    *(Rule(f"task.{f}", _not_testbed, "with task.name={c.task.name} (the testbed reads it)", on_task=True)
      for f in _TESTBED),
    *(Rule(f"task.{f}", lambda c: c.task.name == "text", _TEXT, on_task=True) for f in _TASK_GPT),
    Rule("train.devices", lambda c: bool(c.train.mesh), "with train.mesh={c.train.mesh} (it sets the mesh)"),
    Rule("train.rollback_threshold", lambda c: not c.train.rollback_metric,
         "without train.rollback_metric (its guard's ratio; train.rollback_guards name their own)"),
    *(Rule(f"train.{f}", lambda c: not c.train.guards(),
           "without train.rollback_metric or train.rollback_guards (rollback off)")
      for f in ("rollback_factor", "max_rollbacks")),
    Rule("train.samples_n", lambda c: c.train.samples_every == 0, "with train.samples_every=0 (no samples)"),
    *(Rule(f"data.{f}", lambda c: c.task.name != "text", "with task.name={c.task.name} (it generates its "
           "prompts" + ("; its prompt length is task.prompt_len" if f == "prompt_len" else "")
           + "; data.* applies to task.name=text)", on_task=True) for f in _DATA),
    Rule("reward.standardize_samples", lambda c: not c.reward.standardize, "without reward.standardize"),
    Rule("reward.timeout", lambda c: not c.reward.fn.strip(), "without reward.fn (no host reward function "
         "to time)"),
    *(Rule(f"log.{f}", lambda c: not c.log.wandb, "without log.wandb (no W&B run)")
      for f in ("wandb_project", "wandb_name", "wandb_group", "wandb_mode")),
)  # fmt: skip

# fields with an effect whatever the other fields are
ALWAYS_RELEVANT = frozenset({
    "model.dtype", "model.ref_dtype", "model.remat", "model.logits", "model.ref_quant", "model.path",
    "lora.rank",
    "sampling.response_len", "sampling.temperature", "sampling.top_k", "sampling.use_eos",
    "kl.placement", "kl.clamp", "kl.ref_update_every", "kl.exact_metric",
    "ctrl.kind", "ctrl.unit", "ctrl.estimator", "ctrl.drives", "ctrl.warmup_iters", "ctrl.beta_min",
    "ctrl.beta_max",  # every controller reads the bounds; unit and estimator: the ctrl/kl_observed_* metric
    "ppo.epochs", "ppo.minibatches", "ppo.grad_accum", "ppo.shuffle", "ppo.clip", "ppo.ent_coef",
    "ppo.whiten", "ppo.advantage", "ppo.group_size", "ppo.normalize_reward",
    "optim.lr", "optim.b1", "optim.b2", "optim.eps", "optim.weight_decay", "optim.max_grad_norm",
    "optim.schedule", "optim.warmup_steps",
    "task.name", "task.cache_dir",
    "train.iterations", "train.batch_size", "train.seed", "train.mesh", "train.out_dir", "train.name",
    "train.quiet", "train.checkpoint_every", "train.keep_checkpoints", "train.max_consecutive_skips",
    "train.rollback_metric", "train.rollback_guards", "train.metric_aliases",
    "train.samples_every", "train.hooks", "train.metric_fns",
    "reward.missing_eos_penalty", "reward.standardize", "log.wandb",
    *(f"diag.{f.name}" for f in dataclasses.fields(SECTIONS["diag"]) if f.name not in _DIAG_ADAPTIVE),
})  # fmt: skip

# fields that can be irrelevant, refused by another rule (named) or allowed on purpose (why)
NOT_REFUSED = {
    "model.value_model": "checked by RunConfig._check_lora; config.json records the resolved critic (head "
    "with a critic-less ppo.advantage), so --config RUN/config.json must keep working",
    "model.value_path": "klrl.checks.check_model_fields",
    "model.reward_path": "klrl.checks.check_model_fields",
    "model.eval_path": "klrl.checks.check_model_fields",
    "model.adapter": "RunConfig._check_lora (needs lora.rank > 0)",
    "optim.critic_lr": "OptimConfig/RunConfig (refused without a critic)",
    "ppo.whiten_rewards": "PPOConfig (needs ppo.advantage=gae)",
    "reward.fn": "RunConfig (needs task.name=text)",
    "reward.weights": "RewardConfig (needs reward.fn)",
    "reward.completions": "RewardConfig (needs reward.fn)",
    **{
        f"diag.{f}": "adaptive beta only; the diagnosis thresholds are read again by klrl report, whose "
        "sweep may hold adaptive members"
        for f in _DIAG_ADAPTIVE
    },
    "optim.critic_max_grad_norm": "without a critic it clips nothing, but klrl's pretrained recipe (the "
    "experiments/llm_* presets, gae and rloo alike) sets it for every ppo.advantage",
    "train.log_every": "without a terminal only; --quiet with a config file that sets it is not a mistake",
}


def irrelevant(cfg: RunConfig, *, task_given: bool = False) -> list[tuple[str, str]]:
    """``(field, message)`` for every field of ``cfg`` set to a non-default value that has no effect;
    ``task_given``: the task is the caller's (``klrl.run(cfg, task=...)``), whose policy and prompts
    ``task.name`` does not say, so the rules on ``task.name`` are not applied."""
    default = RunConfig().to_dict()
    d = cfg.to_dict()
    out, seen = [], set()
    for rule in IRRELEVANT:
        s, name = rule.field.split(".", 1)
        value = d[s][name]
        if rule.on_task and task_given:
            continue
        if rule.field in seen or value == default[s][name] or not rule.when(cfg):
            continue
        seen.add(rule.field)
        out.append((rule.field, f"{rule.field}={value!r} has no effect {rule.why.format(c=cfg)}"))
    return out


def unread_fields(cfg: RunConfig) -> set[str]:
    """The fields ``cfg`` does not read, whatever their values (a rule of :data:`IRRELEVANT` whose
    condition holds, e.g. ``ctrl.target`` with ``ctrl.kind=fixed``): what a sweep member's name leaves
    out (:func:`klrl.io.results.member_names`)."""
    return {rule.field for rule in IRRELEVANT if rule.when(cfg)}


def check_relevance(
    members: list[RunConfig], only: list[str] | None = None, *, task_given: bool = False
) -> None:
    """A field with no effect in every member (a single run: ``[cfg]``; a sweep: all its members) is a
    :class:`ConfigError` naming it and the field that makes it so; ``only``: the fields to check (a
    resume checks the flags given, not the run's saved config); ``task_given``: see :func:`irrelevant`."""
    found = [dict(irrelevant(m, task_given=task_given)) for m in members]
    for name, message in found[0].items():
        if (only is None or name in only) and all(name in f for f in found):
            raise ConfigError(message)
