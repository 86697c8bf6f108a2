"""Other frameworks' names for klrl's metrics and config knobs: data for ``train.metric_aliases`` and
for "did you mean" hints. Imports nothing of klrl but :mod:`klrl.registry`: the KL estimators'
names (in ``kl/reward_<estimator>_<unit>``) are the registry's, read when :data:`ESTIMATORS` or
:data:`KLRL_METRICS` is first asked for (the registry then imports :mod:`klrl.algo.kl`).

Read from each framework's source (``docs/names.md`` has the table, the differences in meaning and
the defaults):

* TRL ``trl/experimental/ppo/ppo_trainer.py`` and ``ppo_config.py``, ``trl/trainer/grpo_*.py``,
  ``trl/trainer/rloo_*.py`` at v1.9.0-26-gf2cd577; the 0.x ``PPOTrainer`` at tag v0.11.4
  (``trl/trainer/ppo_trainer.py``, ``ppo_config.py``).
* verl ``verl/trainer/config/_generated_ppo_trainer.yaml``, ``verl/trainer/ppo/ray_trainer.py``,
  ``metric_utils.py``, ``core_algos.py``, ``verl/workers/actor/dp_actor.py``,
  ``verl/workers/critic/dp_critic.py`` at v0.7.0-125-gb178a3c.
* OpenRLHF ``openrlhf/cli/train_ppo_ray.py``, ``openrlhf/trainer/ppo_trainer.py``,
  ``openrlhf/trainer/ray/ppo_actor.py``, ``ppo_critic.py``, ``ppo_utils/experience_maker.py`` at
  v0.11.0 (3c3be62); the flat flag names at v0.9.10.

A metric is listed only where the quantity is the same up to what ``docs/names.md`` notes
(estimator, aggregation, the value before or after the controller's update).
"""

from __future__ import annotations

from typing import Any

from klrl import registry

UNITS = ("seq_sum", "token_mean")
LOSS_AGGS = ("token_mean", "seq_mean")

# The metric names klrl writes (klrl/step/metrics.py's metrics dict, klrl/step/update.py's statistics, the
# tasks' evaluations, the non-finite guard); templated names expanded over their allowed values.
_FIXED_METRICS: frozenset[str] = frozenset(
    {
        "reward/task",
        "reward/shaped_mean",
        "reward/proxy",
        "reward/gold",
        "reward/proxy_gold_spearman",
        "kl/k1_seq_sum",
        "kl/k1_seq_token_mean",
        "kl/k1_token_mean",
        "kl/beta_x_k1_seq_sum",
        "kl/exact_seq_sum",
        "kl/exact_token_mean",
        "ctrl/beta",
        "ctrl/loss_coef",
        "ctrl/target",
        "response/length",
        "response/eos_frac",
        "value/explained_variance",
        "value/clipfrac",
        "eval/ref_ppl",
        "eval/oracle_ppl_floored",
        "eval/independent_ppl",
        "eval/oracle_floored_frac",
        "eval/oracle_zero_prob_token_frac",
        "eval/distinct_1",
        "eval/distinct_2",
        "loss/policy",
        "loss/value",
        "loss/total",
        "policy/clipfrac",
        "policy/approx_kl",
        "policy/entropy",
        "grad/norm",
        "guard/skipped",
        "guard/consecutive_skips",
        "guard/minibatches_applied",
    }
    | {f"ctrl/kl_observed_{u}" for u in UNITS}
    | {f"kl/loss_{a}" for a in LOSS_AGGS}
)


def klrl_metrics() -> frozenset[str]:
    """The metric names klrl writes: the fixed ones and ``kl/reward_<estimator>_<unit>`` over every
    registered KL estimator."""
    est = registry.ESTIMATORS.names()
    return _FIXED_METRICS | {f"kl/reward_{e}_{u}" for e in est for u in UNITS}


def __getattr__(name: str) -> Any:
    """``ESTIMATORS`` (the KL estimators' names) and ``KLRL_METRICS``, read from the registry when
    asked for, not at import (the config imports this module before the estimators exist)."""
    if name == "ESTIMATORS":
        return registry.ESTIMATORS.names()
    if name == "KLRL_METRICS":
        return klrl_metrics()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# trl.experimental.ppo.PPOTrainer (TRL 1.x; the PPOTrainer of 0.12 onwards used the same names)
TRL_METRICS: dict[str, str] = {
    "kl/k1_seq_sum": "objective/kl",  # sum over tokens of TRL's kl_estimator (k1 default), batch mean
    "reward/task": "objective/scores",  # TRL's includes missing_eos_penalty
    "reward/shaped_mean": "objective/rlhf_reward",  # scores + sum of -kl_coef * kl
    "policy/entropy": "policy/entropy_avg",  # TRL: unmasked mean over the microbatch's positions
    "policy/clipfrac": "policy/clipfrac_avg",
    "policy/approx_kl": "policy/approxkl_avg",  # TRL: k2, 0.5 (log ratio)^2; klrl: k3
    "loss/policy": "loss/policy_avg",
    "loss/value": "loss/value_avg",
    "value/clipfrac": "val/clipfrac_avg",
}

# trl.PPOTrainer 0.11.x (the pre-December-2024 trainer with the adaptive controller)
TRL_LEGACY_METRICS: dict[str, str] = {
    "kl/k1_seq_sum": "objective/kl",  # sum over tokens of kl_penalty ('kl' = k1), batch mean
    "ctrl/beta": "objective/kl_coef",  # TRL logs the coefficient used this step; klrl the updated one
    "reward/task": "ppo/mean_scores",
    "policy/entropy": "ppo/policy/entropy",
    "policy/approx_kl": "ppo/policy/approxkl",  # TRL: k2; its ppo/policy/policykl is k1
    "policy/clipfrac": "ppo/policy/clipfrac",
    "loss/policy": "ppo/loss/policy",
    "loss/value": "ppo/loss/value",
    "loss/total": "ppo/loss/total",
    "value/clipfrac": "ppo/val/clipfrac",
    "value/explained_variance": "ppo/val/var_explained",
    "response/length": "tokens/responses_len_mean",
}

# trl.GRPOTrainer and trl.RLOOTrainer (TRL 1.x): the same keys in both
TRL_GRPO_METRICS: dict[str, str] = {
    # GRPO: k3 in the loss, token-weighted; RLOO: k1 in the reward, token-weighted
    "kl/loss_token_mean": "kl",
    "reward/task": "reward",
    "response/length": "completions/mean_length",
    "policy/entropy": "entropy",
    "policy/clipfrac": "clip_ratio/region_mean",
}

# verl (ray_trainer.apply_kl_penalty, metric_utils.compute_data_metrics, dp_actor, dp_critic, core_algos)
VERL_METRICS: dict[str, str] = {
    # the per-sequence token mean of algorithm.kl_penalty (k1 default), batch mean
    "kl/k1_seq_token_mean": "actor/reward_kl_penalty",
    "ctrl/beta": "actor/reward_kl_penalty_coeff",  # verl: the coefficient used this step
    "ctrl/loss_coef": "actor/kl_coef",  # actor.kl_loss_coef (fixed)
    # kl_loss_type (low_var_kl = k3 clamped to +-10) aggregated by loss_agg_mode
    "kl/loss_token_mean": "actor/kl_loss",
    "loss/policy": "actor/pg_loss",
    "policy/clipfrac": "actor/pg_clipfrac",
    "policy/approx_kl": "actor/ppo_kl",  # verl: k1 mean of old - new log-prob; klrl: k3
    "policy/entropy": "actor/entropy",
    "grad/norm": "actor/grad_norm",  # klrl: policy and value together; verl: actor alone
    "loss/value": "critic/vf_loss",
    "value/clipfrac": "critic/vf_clipfrac",
    "value/explained_variance": "critic/vf_explained_var",
    "reward/task": "critic/score/mean",
    "reward/shaped_mean": "critic/rewards/mean",
    "response/length": "response_length/mean",
}

# OpenRLHF (experience_maker, ray/ppo_actor, ray/ppo_critic)
OPENRLHF_METRICS: dict[str, str] = {
    "kl/k1_seq_token_mean": "kl",  # per-sequence token mean of algo.kl.estimator (k1); use_loss: loss KL
    "reward/task": "reward",
    "reward/shaped_mean": "return",  # sum over tokens of the shaped reward
    "response/length": "response_length",
    "loss/policy": "policy_loss",
    "policy/clipfrac": "ppo_clip_ratio",
    "policy/approx_kl": "ppo_kl",  # OpenRLHF: k1 of old - new; klrl: k3
    "loss/value": "critic_loss",
    "grad/norm": "actor_grad_norm",
}

# Their config knob -> klrl's ``section.field``. Keys: lower case, '_' for '-', dots for nesting;
# :func:`lookup` tries the full key, then its last dotted component.
FLAG_ALIASES: dict[str, str] = {
    "missing_eos_penalty": "reward.missing_eos_penalty",  # TRL PPO / RLOO
    # KL coefficient, controller, estimator, placement
    "kl_coef": "kl.beta", "init_kl_coef": "kl.beta", "init_coef": "kl.beta", "algo.kl.init_coef": "kl.beta",
    "algorithm.kl_ctrl.kl_coef": "kl.beta",
    "adap_kl_ctrl": "ctrl.kind", "kl_ctrl.type": "ctrl.kind", "algorithm.kl_ctrl.type": "ctrl.kind",
    "target": "ctrl.target", "target_kl": "ctrl.target", "kl_target": "ctrl.target",
    "algo.kl.target": "ctrl.target", "algorithm.kl_ctrl.target_kl": "ctrl.target",
    "horizon": "ctrl.horizon", "kl_horizon": "ctrl.horizon", "algo.kl.horizon": "ctrl.horizon",
    "algorithm.kl_ctrl.horizon": "ctrl.horizon",
    "kl_penalty": "kl.estimator", "kl_estimator": "kl.estimator", "algorithm.kl_penalty": "kl.estimator",
    "algo.kl.estimator": "kl.estimator",
    "use_kl_in_reward": "kl.placement", "use_kl_loss": "kl.placement", "algo.kl.use_loss": "kl.placement",
    "kl_loss_coef": "kl.loss_coef", "kl_loss_type": "kl.loss_estimator", "loss_agg_mode": "kl.loss_agg",
    "ref_model_sync_steps": "kl.ref_update_every", "ref_model_mixup_alpha": "kl.ref_mix",
    # PPO
    "cliprange": "ppo.clip", "clip_ratio": "ppo.clip", "eps_clip": "ppo.clip", "epsilon": "ppo.clip",
    "actor.eps_clip": "ppo.clip",
    "cliprange_value": "ppo.vf_clip", "value_clip": "ppo.vf_clip", "critic.value_clip": "ppo.vf_clip",
    "vf_coef": "ppo.vf_coef",
    "entropy_coef": "ppo.ent_coef", "entropy_coeff": "ppo.ent_coef", "entropy_loss_coef": "ppo.ent_coef",
    "gamma": "ppo.gamma", "lam": "ppo.lam", "lambd": "ppo.lam",
    "num_ppo_epochs": "ppo.epochs", "ppo_epochs": "ppo.epochs", "max_epochs": "ppo.epochs",
    "train.max_epochs": "ppo.epochs",
    "num_mini_batches": "ppo.minibatches", "mini_batch_size": "ppo.minibatches",
    "ppo_mini_batch_size": "ppo.minibatches",
    "adv_estimator": "ppo.advantage", "advantage_estimator": "ppo.advantage",
    "algo.advantage.estimator": "ppo.advantage",
    "num_generations": "ppo.group_size", "n_samples_per_prompt": "ppo.group_size",
    "rollout.n": "ppo.group_size",
    "rollout.n_samples_per_prompt": "ppo.group_size",
    "scale_rewards": "ppo.group_std", "norm_adv_by_std_in_grpo": "ppo.group_std",
    "no_advantage_std_norm": "ppo.group_std", "normalize_advantages": "ppo.whiten",
    # optimiser
    "learning_rate": "optim.lr", "lr": "optim.lr", "actor_learning_rate": "optim.lr",
    "actor.adam.lr": "optim.lr",
    "critic_learning_rate": "optim.critic_lr", "critic.optim.lr": "optim.critic_lr",
    "gradient_accumulation_steps": "ppo.grad_accum",
    "adam_beta1": "optim.b1", "adam_beta2": "optim.b2", "adam_betas": "optim.b1", "betas": "optim.b1",
    "adam_epsilon": "optim.eps", "adam.eps": "optim.eps", "eps": "optim.eps",
    "weight_decay": "optim.weight_decay", "l2": "optim.weight_decay",
    "max_grad_norm": "optim.max_grad_norm", "max_norm": "optim.max_grad_norm",
    "clip_grad": "optim.max_grad_norm",
    "grad_clip": "optim.max_grad_norm",
    "lr_scheduler_type": "optim.schedule", "lr_scheduler": "optim.schedule",
    "warmup_steps": "optim.warmup_steps", "lr_warmup_steps": "optim.warmup_steps",
    "warmup_ratio": "optim.warmup_steps", "lr_warmup_ratio": "optim.warmup_steps",
    "lr_warmup_steps_ratio": "optim.warmup_steps",
    # sampling
    "temperature": "sampling.temperature", "top_k": "sampling.top_k",
    "response_length": "sampling.response_len", "max_new_tokens": "sampling.response_len",
    "max_completion_length": "sampling.response_len", "max_response_length": "sampling.response_len",
    "generate_max_len": "sampling.response_len",
    # outer loop
    "batch_size": "train.batch_size", "rollout_batch_size": "train.batch_size",
    "train_batch_size": "train.batch_size",
    "rollout.batch_size": "train.batch_size",
    "total_episodes": "train.iterations", "steps": "train.iterations", "seed": "train.seed",
    # models (transformers' and TRL's model_name_or_path, TRL PPO's *_model_path, OpenRLHF's *pretrain,
    # verl's <role>.model.path)
    "model_name_or_path": "model.path", "sft_model_path": "model.path", "pretrain": "model.path",
    "actor_rollout_ref.model.path": "model.path",
    "reward_model_path": "model.reward_path", "reward_pretrain": "model.reward_path",
    "reward_model.model.path": "model.reward_path",
    "value_model_path": "model.value_path", "critic_pretrain": "model.value_path",
    "critic.model.path": "model.value_path",
    # LoRA (PEFT's LoraConfig r / lora_alpha / target_modules, OpenRLHF's --lora_rank, verl's model.lora_rank)
    "lora_r": "lora.rank", "lora_rank": "lora.rank", "actor_rollout_ref.model.lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha", "actor_rollout_ref.model.lora_alpha": "lora.alpha",
    "target_modules": "lora.targets", "lora_target_modules": "lora.targets",
    "actor_rollout_ref.model.target_modules": "lora.targets", "load_in_4bit": "model.ref_quant",
    "load_in_8bit": "model.ref_quant",
}  # fmt: skip

# Keys whose value must be converted (unit, meaning or a pair), for hints and for docs/names.md.
FLAG_NOTES: dict[str, str] = {
    "load_in_4bit": "value int4: the frozen base (QLoRA with --lora.rank) or reference quantised",
    "load_in_8bit": "value int8: the frozen base (QLoRA with --lora.rank) or reference quantised",
    "adap_kl_ctrl": "true -> --ctrl.kind proportional (klrl's default is fixed)",
    "target_kl": "verl: the controller target (nats/token: add --ctrl.unit token_mean); TRL 0.11: an "
    "early-stopping threshold on the policy change, which klrl does not have",
    "kl_target": "OpenRLHF: nats/token (add --ctrl.unit token_mean)",
    "init_kl_coef": "lm-human-preferences / TRL 0.11: nats/sequence target; OpenRLHF: nats/token target",
    "kl_penalty": "TRL 0.11 / verl 'kl' = k1, 'mse' = k2, 'low_var_kl' = k3 clamped to +-10",
    "use_kl_loss": "true -> --kl.placement loss (or reward+loss)",
    "use_kl_in_reward": "true -> --kl.placement reward",
    "loss_agg_mode": "verl applies it to the policy loss too; klrl's policy loss is always a token mean",
    "epsilon": "TRL GRPO's clip range (not Adam's epsilon)",
    "eps": "Adam epsilon (OpenRLHF --actor.adam.eps), not the clip range",
    "mini_batch_size": "a size: --ppo.minibatches is a count, batch_size / mini_batch_size",
    "ppo_mini_batch_size": "verl: prompts per minibatch; --ppo.minibatches = train_batch_size / this",
    "critic_learning_rate": "OpenRLHF's critic has its own optimiser; klrl's critic shares Adam and the "
    "gradient clip (one joint norm), its step scaled by --optim.critic_lr",
    "gradient_accumulation_steps": "micro-batches per minibatch; verl's ppo_micro_batch_size_per_gpu is a "
    "size: --ppo.grad_accum = minibatch rows per device / that size",
    "adam_betas": "a pair: --optim.b1 and --optim.b2",
    "betas": "a pair: --optim.b1 and --optim.b2",
    "warmup_ratio": "a fraction of all steps; klrl counts optimiser steps: iterations x epochs x minibatches",
    "lr_warmup_ratio": "a fraction of all steps (see warmup_ratio)",
    "lr_warmup_steps_ratio": "a fraction of all steps (see warmup_ratio)",
    "scale_rewards": "TRL GRPO 'group' -> --ppo.group_std true, 'none' -> false ('batch' has no counterpart)",
    "no_advantage_std_norm": "inverted: true -> --ppo.group_std false",
    "rollout_batch_size": "prompts; klrl's batch is sequences = prompts x --ppo.group_size",
    "train_batch_size": "verl: prompts per iteration (x rollout.n); OpenRLHF: the training minibatch",
    "total_episodes": "episodes = sequences: --train.iterations = total_episodes / batch_size",
    "steps": "TRL 0.11: PPO steps = iterations",
    "lr_scheduler_type": "klrl: constant, linear, cosine (OpenRLHF's cosine_with_min_lr has no floor here)",
    "model_name_or_path": "a local HF model directory, a .gguf file, or a Hub name (read from the local "
    "Hugging Face cache, fetched there when it is not); `klrl models` lists what it can see",
    "value_model_path": "with --model.value_model separate",
    "critic_pretrain": "with --model.value_model separate",
    "critic.model.path": "with --model.value_model separate",
}

# Their knobs with no klrl counterpart, and why.
NO_COUNTERPART: dict[str, str] = {
    "whiten_rewards": "TRL PPO: scale per-token rewards by their std; klrl whitens advantages (--ppo.whiten)",
    "early_stopping": "TRL 0.11: stop the epochs when the policy KL exceeds 1.5 target_kl; no such knob",
    "normalize_reward": "OpenRLHF: running reward normalisation; no such knob",
    "reward_clip_range": "OpenRLHF: clip rewards to (-10, 10); no such knob",
    "clip_ratio_c": "verl dual-clip PPO (3.0); no such knob",
    "top_p": "nucleus sampling; klrl has top-k only",
    "use_bias_correction_kl": "TRL GRPO: importance-weighted k3 in the loss; not implemented",
}


def normalise(name: str) -> str:
    """'--Init-KL-Coef' -> 'init_kl_coef'; '--actor_rollout_ref.actor.clip_ratio=0.2' -> without '=...'."""
    return name.split("=", 1)[0].lstrip("-").strip().lower().replace("-", "_")


def matched_key(name: str) -> str | None:
    """The key of :data:`FLAG_ALIASES` that :func:`lookup` matches ``name`` with, or None."""
    parts = normalise(name).split(".")
    return next((k for i in range(len(parts)) if (k := ".".join(parts[i:])) in FLAG_ALIASES), None)


def lookup(name: str) -> str | None:
    """klrl's ``section.field`` for another framework's knob, or None: the full key first, then its
    trailing dotted components (``actor_rollout_ref.actor.kl_loss_coef`` -> ``kl_loss_coef``)."""
    key = matched_key(name)
    return None if key is None else FLAG_ALIASES[key]
