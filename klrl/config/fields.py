"""The training sections of the configuration (model, LoRA, sampling, KL, controller, PPO, optimiser, the
outer loop ``train``) and the field helpers every section uses; :mod:`klrl.config.run` re-exports them with
the run's other sections (task, diagnosis, log; reward and data from :mod:`klrl.config.inputs`) and
:class:`RunConfig`. Conventions: see :mod:`klrl.config.run`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from klrl.config.schema import ConfigError, section
from klrl.registry import ADVANTAGES, CONTROLLERS, ESTIMATORS  # names are checked against these

KL_UNITS = ("seq_sum", "token_mean")
PLACEMENTS = ("reward", "sequence", "loss", "reward+loss")


class Help:
    """A help string that names a registry's entries, written when read (``str``, ``format``): a
    registry imports its implementations on first lookup, which must not happen while the config
    is being imported (they import the config)."""

    def __init__(self, text: Callable[[], str]):
        self.text = text

    def __str__(self) -> str:
        return self.text()

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __repr__(self) -> str:
        return repr(str(self))


def _f(default: Any, help: str | Help, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


def grouped_advantages() -> tuple[str, ...]:
    """The advantage estimators that compare the responses to one prompt (``grouped=True``):
    they need ``ppo.group_size >= 2``."""
    return ADVANTAGES.names(where=lambda m: m.get("grouped", False))


def _check(cond: bool, name: str, rule: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {rule}")


def parse_mesh(spec: str) -> tuple[int, int, int]:
    """``train.mesh``: ``'data,fsdp,tensor'`` sizes, e.g. ``'-1,2,2'`` (``-1``: the devices left)."""
    try:
        sizes = tuple(int(p) for p in spec.split(","))
    except ValueError:
        raise ConfigError(f"train.mesh: expected three integers data,fsdp,tensor (got {spec!r})") from None
    ok = len(sizes) == 3 and all(s >= 1 or s == -1 for s in sizes) and sizes.count(-1) <= 1
    _check(ok, "train.mesh", f"expected data,fsdp,tensor sizes >= 1, at most one -1 (got {spec!r})")
    return sizes  # type: ignore[return-value]


def _choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, name, f"must be one of {', '.join(choices)} (got {value!r})")


@dataclass(frozen=True)
class Guard:
    """One guard of the quality rollback: roll back when ``metric`` crosses ``ratio`` x its value at
    iteration 0 (``ratio > 1``: rising above it is bad; ``ratio < 1``: falling below it is bad).
    ``spec``: the guard as written in ``train.rollback_guards`` (``''``: ``train.rollback_metric`` with
    ``train.rollback_threshold``)."""

    metric: str
    ratio: float
    spec: str = ""


_GUARD = re.compile(r"([^<>\s]+)\s*([<>])\s*([^<>\s]+)")


def parse_guards(text: str) -> tuple[Guard, ...]:
    """``train.rollback_guards``: comma-separated ``metric>ratio`` (bad when the metric rises above
    ``ratio`` x its iteration-0 value, ``ratio > 1``) or ``metric<ratio`` (bad when it falls below,
    ``0 < ratio < 1``), e.g. ``'eval/oracle_ppl_floored>1.5,text/distinct_2<0.7'``."""
    out: list[Guard] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = _GUARD.fullmatch(item)
        _check(m is not None, "train.rollback_guards", f"expected metric>ratio or metric<ratio, got {item!r}")
        metric, op, num = m.groups()  # type: ignore[union-attr]
        try:
            ratio = float(num)
        except ValueError:
            ratio = math.nan
        ok = math.isfinite(ratio) and (ratio > 1 if op == ">" else 0 < ratio < 1)
        want = "a number > 1 after '>'" if op == ">" else "a number in (0, 1) after '<'"
        _check(ok, "train.rollback_guards", f"{item!r}: expected {want}")
        spec = f"{metric}{op}{num}"
        dup = any(g.metric == metric and (g.ratio > 1) == (op == ">") for g in out)
        _check(not dup, "train.rollback_guards", f"{spec!r}: {metric} already has a '{op}' guard")
        out.append(Guard(metric, ratio, spec))
    return tuple(out)


# the fields of klrl's built-in GPT (the testbed tasks): a pretrained model.path has its own (config.json,
# the GGUF header) and never reads these; the help groups them apart and report.md leaves them out
GPT_ONLY = ("n_layers", "n_heads", "d_model", "mlp_ratio", "tie_embeddings")


@section("model")
class ModelConfig:
    """The policy, its critic and reference: a pretrained model.path, or klrl's built-in GPT-2-style decoder
    (learned positions, pre-LayerNorm blocks, GELU MLP) for the testbed tasks."""

    n_layers: int = _f(2, "number of transformer blocks")
    n_heads: int = _f(4, "attention heads per block")
    d_model: int = _f(64, "residual stream width")
    mlp_ratio: int = _f(4, "MLP hidden width as a multiple of d_model")
    tie_embeddings: bool = _f(True, "share the token embedding with the output projection")
    value_model: str = _f(
        "auto",
        "value function: 'head' (scalar head on the policy trunk), 'separate' model, or 'lora' (the frozen "
        "base with the critic's own adapters, lora.critic_rank, and a value head); 'auto' = lora when "
        "lora.rank > 0, else separate with model.path, else head (klrl's GPT); config.json records the "
        "choice. The shared trunk's head is risky on a pretrained model under an adaptive controller",
    )
    dtype: str = _f("float32", "compute dtype: float32 or bfloat16 (parameters stay float32)")
    ref_dtype: str = _f(
        "float32",
        "storage dtype of the frozen KL reference's parameters in the train state: float32 or bfloat16 "
        "(half the bytes; its forward runs in model.dtype from the rounded weights)",
    )
    path: str = _f(
        "", "pretrained policy and reference: an HF model directory or a .gguf file ('' = the built-in GPT)"
    )
    value_path: str = _f(
        "", "model.value_model=separate with model.path: the value trunk's checkpoint ('' = model.path)"
    )
    reward_path: str = _f(
        "",
        "task text: the frozen reward model, an HF *ForSequenceClassification directory (its score head) "
        "or a causal LM (a fresh scalar head); '' = model.path's trunk with a fresh scalar head",
    )
    eval_path: str = _f(
        "",
        "task text: an independent evaluator LM (HF directory or .gguf, the policy's tokenizer) whose "
        "perplexity of the samples is logged as eval/independent_ppl ('' = none)",
    )
    remat: str = _f(
        "none",
        "rematerialisation in the PPO update: none, block (each block keeps only its matmul outputs "
        "without batch dimensions), dots (every matmul output, the attention's too) "
        "or full (each block keeps only its input; klrl.models.remat); auto: the first of none, dots, "
        "block, full whose compiled step fits model.memory_gb (klrl.step.train.auto_remat)",
    )
    memory_gb: float = _f(
        0.0,
        "model.remat=auto: the memory (GB, 10^9 bytes) the compiled step must fit; 0 = what the device "
        "has free when the step is built (on a CPU the host's MemAvailable)",
    )
    logits: str = _f(
        "auto",
        "logit-derived quantities (token log-probs, entropy, exact KL): full ([B, T, V] logits), chunked "
        "(the LM head applied to model.logits_chunk positions at a time; no [B, T, V] buffer) or auto "
        "(chunked for vocabularies of 32768 or more; klrl.step.chunked)",
    )
    logits_chunk: int = _f(128, "model.logits=chunked: positions per chunk ([chunk, V] logits at a time)")
    adapter: str = _f(
        "",
        "a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) on model.path's "
        "base: the initial policy's adapters (needs lora.rank > 0; its rank and alpha are used)",
    )
    ref_quant: str = _f(
        "none",
        "the frozen reference (and with lora.rank > 0 the shared base) weight-only quantised: none, "
        "int8 or int4 (qwix; klrl.models.quant; measured in docs/ref_quant.md)",
    )

    def __post_init__(self) -> None:
        _check(self.n_layers >= 1, "model.n_layers", "must be >= 1")
        _check(self.n_heads >= 1, "model.n_heads", "must be >= 1")
        _check(self.d_model >= 1, "model.d_model", "must be >= 1")
        _check(self.d_model % self.n_heads == 0, "model.d_model", "must be divisible by model.n_heads")
        _check(self.mlp_ratio >= 1, "model.mlp_ratio", "must be >= 1")
        _choice(self.value_model, "model.value_model", ("auto", "head", "separate", "lora"))
        _choice(self.ref_quant, "model.ref_quant", ("none", "int8", "int4"))
        _check(self.adapter.strip() == self.adapter, "model.adapter", "must not have surrounding spaces")
        _check(not self.adapter or self.path, "model.adapter", "needs model.path (the adapter's base)")
        _choice(self.dtype, "model.dtype", ("float32", "bfloat16"))
        _choice(self.ref_dtype, "model.ref_dtype", ("float32", "bfloat16"))
        for name in ("path", "value_path", "reward_path"):
            v = getattr(self, name)
            _check(v.strip() == v, f"model.{name}", "must not have surrounding spaces")
        _check(not self.value_path or self.path, "model.value_path", "needs model.path")
        _choice(self.remat, "model.remat", ("none", "block", "dots", "full", "auto"))
        _check(self.memory_gb >= 0, "model.memory_gb", "must be >= 0 (0 = what the device has free)")
        _choice(self.logits, "model.logits", ("auto", "full", "chunked"))
        _check(self.logits_chunk >= 1, "model.logits_chunk", "must be >= 1")


@section("lora")
class LoRAConfig:
    """LoRA adapters on the frozen base (klrl.models.lora)."""

    rank: int = _f(
        0,
        "adapter rank of the policy: 0 = full fine-tuning; > 0 = the policy is the frozen "
        "base plus adapters, the reference the base with them off",
    )
    alpha: float = _f(16.0, "adapter scale numerator: the update is (alpha / rank) x A B (PEFT's lora_alpha)")
    targets: str = _f(
        "",
        "regex searched in the module paths that get adapters, as PEFT's target_modules (e.g. "
        "'q_proj|v_proj'); '' = every linear layer of the blocks (attention and MLP)",
    )
    critic_rank: int = _f(0, "model.value_model=lora: the critic's adapter rank (0 = lora.rank)")

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "lora.rank", "must be >= 0 (0 = full fine-tuning)")
        _check(self.critic_rank >= 0, "lora.critic_rank", "must be >= 0 (0 = lora.rank)")
        _check(self.alpha > 0, "lora.alpha", "must be > 0")
        try:
            re.compile(self.targets)
        except re.error as e:
            raise ConfigError(f"lora.targets: {self.targets!r} is not a regular expression ({e})") from None


@section("sampling")
class SamplingConfig:
    """How responses are sampled in the rollout."""

    response_len: int = _f(16, "maximum number of response tokens")
    temperature: float = _f(1.0, "sampling temperature; log-probs for PPO and KL use the same temperature")
    top_k: int = _f(
        0, "sample from the k most likely tokens only (0 = off); log-probs stay those of the full policy"
    )
    use_eos: bool = _f(
        True, "an EOS token ends a response; if false every response has exactly response_len tokens"
    )

    def __post_init__(self) -> None:
        _check(self.response_len >= 1, "sampling.response_len", "must be >= 1")
        _check(self.temperature > 0, "sampling.temperature", "must be > 0")
        _check(self.top_k >= 0, "sampling.top_k", "must be >= 0")


@section("kl")
class KLConfig:
    """Where the KL to the reference enters, with which estimator and coefficient."""

    beta: float = _f(0.05, "initial KL coefficient in the reward (the controller starts here)")
    estimator: str = _f("k1", Help(lambda: f"per-token estimator in the reward: {ESTIMATORS.describe()}"))
    placement: str = _f("reward", "reward (per token), sequence (sum at last token), loss, or reward+loss")
    loss_coef: float = _f(0.0, "initial coefficient of the KL term in the policy loss")
    loss_estimator: str = _f(
        "k3", Help(lambda: f"per-token estimator of the loss term: {ESTIMATORS.describe()}")
    )
    loss_agg: str = _f("token_mean", "aggregation of the loss term: token_mean or seq_mean")
    clamp: float = _f(0.0, "clamp log-ratios and estimates to +-clamp (0 = off)")
    ref_update_every: int = _f(
        0, "move the reference towards the policy every M iterations (0 = frozen reference)"
    )
    ref_mix: float = _f(
        1.0, "reference update weight alpha: ref <- (1 - alpha) ref + alpha policy (1 = copy)"
    )
    exact_metric: bool = _f(
        True,
        "log kl/exact_* (the exact full-vocabulary KL); false saves its cost: [B, R, V] logits kept by the "
        "rollout (model.logits=full) or one more LM-head product over the responses (chunked)",
    )

    def __post_init__(self) -> None:
        _check(math.isfinite(self.beta) and self.beta >= 0, "kl.beta", "must be >= 0")
        _choice(self.estimator, "kl.estimator", ESTIMATORS)
        _choice(self.placement, "kl.placement", PLACEMENTS)
        _check(math.isfinite(self.loss_coef) and self.loss_coef >= 0, "kl.loss_coef", "must be >= 0")
        _choice(self.loss_estimator, "kl.loss_estimator", ESTIMATORS)
        _choice(self.loss_agg, "kl.loss_agg", ("token_mean", "seq_mean"))
        _check(self.clamp >= 0, "kl.clamp", "must be >= 0")
        _check(self.ref_update_every >= 0, "kl.ref_update_every", "must be >= 0")
        _check(0 < self.ref_mix <= 1, "kl.ref_mix", "must be in (0, 1]")


@section("ctrl")
class ControllerConfig:
    """The beta controller. Its state (beta included) lives in the train state."""

    kind: str = _f("fixed", Help(CONTROLLERS.describe))
    target: float = _f(6.0, "KL target, in the unit named by ctrl.unit")
    unit: str = _f(
        "seq_sum",
        "KL unit the controller sees and targets: seq_sum (nats/sequence) or token_mean (nats/token)",
    )
    estimator: str = _f(
        "k1",
        Help(lambda: f"per-token estimator whose aggregate feeds the controller: {ESTIMATORS.describe()}"),
    )
    drives: str = _f(
        "reward", "which coefficient the controller drives: reward (kl.beta) or loss (kl.loss_coef)"
    )
    horizon: float = _f(10000.0, "proportional: horizon in sequences")
    clip: float = _f(0.2, "proportional: clip of the relative error")
    band: float = _f(1.5, "band: KL above target*band doubles beta, below target/band halves it")
    factor: float = _f(2.0, "band: multiplicative factor")
    kp: float = _f(0.1, "pi: proportional gain on e = (KL - target)/target")
    ki: float = _f(0.01, "pi: integral gain")
    integral_max: float = _f(10.0, "pi: anti-windup clamp of the error integral")
    step_clip: float = _f(0.5, "pi: clip of each multiplicative step |Kp e + Ki sum e|")
    lr: float = _f(0.01, "dual: dual-ascent step size eta")
    warmup_iters: int = _f(0, "hold beta fixed at warmup_beta for this many iterations, then hand over")
    warmup_beta: float = _f(0.1, "beta during warm-up (also the handed-over starting value)")
    beta_min: float = _f(0.0, "lower bound on beta")
    beta_max: float = _f(1e6, "upper bound on beta")

    def __post_init__(self) -> None:
        _choice(self.kind, "ctrl.kind", CONTROLLERS)
        _check(math.isfinite(self.target) and self.target > 0, "ctrl.target", "must be > 0")
        _choice(self.unit, "ctrl.unit", KL_UNITS)
        _choice(self.estimator, "ctrl.estimator", ESTIMATORS)
        _choice(self.drives, "ctrl.drives", ("reward", "loss"))
        _check(self.horizon > 0, "ctrl.horizon", "must be > 0")
        _check(self.clip > 0, "ctrl.clip", "must be > 0")
        _check(self.band > 1, "ctrl.band", "must be > 1")
        _check(self.factor > 1, "ctrl.factor", "must be > 1")
        _check(self.kp >= 0, "ctrl.kp", "must be >= 0")
        _check(self.ki >= 0, "ctrl.ki", "must be >= 0")
        _check(self.integral_max > 0, "ctrl.integral_max", "must be > 0")
        _check(0 < self.step_clip < 1, "ctrl.step_clip", "must be in (0, 1)")
        _check(self.lr > 0, "ctrl.lr", "must be > 0")
        _check(self.warmup_iters >= 0, "ctrl.warmup_iters", "must be >= 0")
        _check(self.warmup_beta >= 0, "ctrl.warmup_beta", "must be >= 0")
        _check(self.beta_min >= 0, "ctrl.beta_min", "must be >= 0")
        _check(self.beta_max >= self.beta_min, "ctrl.beta_max", "must be >= ctrl.beta_min")
        if self.warmup_iters > 0:  # the controller would clip it to the bounds without a word
            bounds = f"[ctrl.beta_min, ctrl.beta_max] = [{self.beta_min}, {self.beta_max}]"
            inside = self.beta_min <= self.warmup_beta <= self.beta_max
            _check(inside, "ctrl.warmup_beta", f"must be in {bounds} (got {self.warmup_beta})")


@section("ppo")
class PPOConfig:
    """PPO update and advantage estimation."""

    epochs: int = _f(4, "PPO epochs over each batch")
    minibatches: int = _f(4, "minibatches per epoch (must divide the batch)")
    grad_accum: int = _f(
        1,
        "gradient accumulation: each minibatch is processed in this many micro-batches (must divide the "
        "minibatch) whose gradients are summed into one optimiser update, the same update as the whole "
        "minibatch at once, with the activations of one micro-batch in memory",
    )
    shuffle: str = _f(
        "global",
        "minibatch shuffling: global (over the whole batch, the same maths on any device count) "
        "or shard (within each data shard: no rows move between devices)",
    )
    clip: float = _f(0.2, "policy ratio clip range")
    vf_clip: float = _f(0.2, "value clip range")
    vf_coef: float = _f(0.1, "value loss coefficient")
    ent_coef: float = _f(0.0, "entropy bonus coefficient")
    gamma: float = _f(1.0, "discount")
    lam: float = _f(0.95, "GAE lambda")
    whiten: bool = _f(True, "whiten advantages (masked, over the global batch)")
    advantage: str = _f("gae", Help(ADVANTAGES.describe))
    group_size: int = _f(
        1, Help(lambda: f"responses per prompt ({' and '.join(grouped_advantages())} need >= 2)")
    )
    group_std: bool = _f(True, "grpo: divide by the group's standard deviation")
    normalize_reward: bool = _f(
        False,
        "the task reward as (r - mean) / std, the running mean and std of every task reward so far, "
        "this batch's included (trlx's RunningMoments; OpenRLHF's normalize_reward fixes them in the reward "
        "model); the moments live in the optimiser state: per sweep member, kept on resume "
        "(klrl.rewards.running)",
    )
    whiten_rewards: bool = _f(
        False,
        "gae: the shaped per-token rewards (task reward and KL penalty) scaled to std 1 over the "
        "batch's response tokens, their mean kept, before GAE (TRL's whiten_rewards; "
        "klrl.algo.advantages.whiten_rewards)",
    )

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "ppo.epochs", "must be >= 1")
        _check(self.minibatches >= 1, "ppo.minibatches", "must be >= 1")
        _check(self.grad_accum >= 1, "ppo.grad_accum", "must be >= 1")
        _choice(self.shuffle, "ppo.shuffle", ("global", "shard"))
        _check(self.clip > 0, "ppo.clip", "must be > 0")
        _check(self.vf_clip > 0, "ppo.vf_clip", "must be > 0")
        _check(self.vf_coef >= 0, "ppo.vf_coef", "must be >= 0")
        _check(self.ent_coef >= 0, "ppo.ent_coef", "must be >= 0")
        _check(0 <= self.gamma <= 1, "ppo.gamma", "must be in [0, 1]")
        _check(0 <= self.lam <= 1, "ppo.lam", "must be in [0, 1]")
        _choice(self.advantage, "ppo.advantage", ADVANTAGES)
        _check(self.group_size >= 1, "ppo.group_size", "must be >= 1")
        if self.whiten_rewards:
            _check(
                self.advantage == "gae",
                "ppo.whiten_rewards",
                f"needs ppo.advantage=gae (got {self.advantage})",
            )
        if self.advantage in grouped_advantages():
            _check(self.group_size >= 2, "ppo.group_size", f"must be >= 2 for ppo.advantage={self.advantage}")


@section("optim")
class OptimConfig:
    """optax Adam(W) with global-norm clipping and a learning-rate schedule."""

    lr: float = _f(
        1e-4,
        "peak learning rate; 1e-4 suits klrl's GPT and LoRA adapters (PEFT/QLoRA use 1e-4 to 2e-4); "
        "full fine-tuning of a pretrained model.path wants 1e-6 to 1e-5 (TRL 3e-6, verl and OpenRLHF 1e-6)",
    )
    critic_lr: float = _f(
        0.0,
        "peak learning rate of the critic: the value head (model.value_model=head) or the whole separate "
        "value model (separate), same schedule; 0 = optim.lr",
    )
    b1: float = _f(0.9, "Adam beta1")
    b2: float = _f(0.95, "Adam beta2")
    eps: float = _f(
        1e-5,
        "Adam epsilon (1e-5 as in PPO2 baselines: Adam would amplify float noise in near-zero gradients)",
    )
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(
        1.0, "global-norm gradient clip (0 = off); with optim.critic_max_grad_norm > 0 the policy's alone"
    )
    critic_max_grad_norm: float = _f(
        0.0,
        "the critic's own gradient-norm clip (value head or value model, as optim.critic_lr): its "
        "gradient clipped apart from the policy's, so a large value loss cannot shrink the policy's step "
        "(verl, OpenRLHF: one optimiser and clip each); 0 = one global clip over both (TRL)",
    )
    schedule: str = _f("constant", "constant, linear (decay to 0) or cosine, after warm-up")
    warmup_steps: int = _f(0, "linear learning-rate warm-up, in optimiser steps")

    def __post_init__(self) -> None:
        _check(math.isfinite(self.lr) and self.lr > 0, "optim.lr", "must be > 0")
        _check(
            math.isfinite(self.critic_lr) and self.critic_lr >= 0,
            "optim.critic_lr",
            "must be >= 0 (0 = optim.lr)",
        )
        _check(0 <= self.b1 < 1, "optim.b1", "must be in [0, 1)")
        _check(0 <= self.b2 < 1, "optim.b2", "must be in [0, 1)")
        _check(self.eps > 0, "optim.eps", "must be > 0")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(self.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0")
        ok = math.isfinite(self.critic_max_grad_norm) and self.critic_max_grad_norm >= 0
        _check(ok, "optim.critic_max_grad_norm", "must be >= 0 (0 = one global clip, optim.max_grad_norm)")
        _choice(self.schedule, "optim.schedule", ("constant", "linear", "cosine"))
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")


@section("train")
class TrainConfig:
    """The outer loop."""

    iterations: int = _f(100, "PPO iterations")
    batch_size: int = _f(64, "global batch: sequences sampled per iteration (prompts x group_size)")
    seed: int = _f(0, "seed of the run (parameters of a fresh value model, sampling, minibatch order)")
    devices: int = _f(0, "devices on the 'data' mesh axis (0 = all local devices)")
    mesh: str = _f(
        "",
        "mesh axis sizes data,fsdp,tensor, e.g. -1,2,2 (-1: the devices left; '' = train.devices x 1 x 1)",
    )
    out_dir: str = _f("runs", "parent directory of new run directories")
    name: str = _f("", "run directory name ('' = timestamp)")
    log_every: int = _f(1, "print a progress line every this many iterations when not on a terminal")
    quiet: bool = _f(False, "print only the summary")
    checkpoint_every: int = _f(
        10, "save a checkpoint every this many iterations (0 = only at the end and on SIGTERM/SIGINT)"
    )
    keep_checkpoints: int = _f(3, "keep the newest this many checkpoints")
    max_consecutive_skips: int = _f(
        5, "stop the run after this many consecutive iterations skipped by the non-finite guard (0 = never)"
    )
    rollback_metric: str = _f(
        "", "metric watched for quality rollback, e.g. 'eval/oracle_ppl_floored' ('' = rollback off)"
    )
    rollback_threshold: float = _f(
        1.1,
        "roll back when rollback_metric crosses this ratio to its iteration-0 value "
        "(> 1: rising above it is bad; < 1: falling below it is bad)",
    )
    rollback_guards: str = _f(
        "",
        "more quality-rollback guards, comma-separated metric>ratio or metric<ratio (ratio to the metric's "
        "iteration-0 value), e.g. 'eval/oracle_ppl_floored>1.5,text/distinct_2<0.7' ('' = none)",
    )
    rollback_factor: float = _f(2.0, "on a rollback, beta = this x max(restored beta, failing beta) (> 1)")
    max_rollbacks: int = _f(
        3, "stop the run instead of rolling back more than this many times (all guards together)"
    )
    metric_aliases: str = _f(
        "", "also log metrics under another framework's names: trl, verl or '' (metrics.jsonl, TensorBoard)"
    )
    samples_every: int = _f(
        10,
        "write decoded samples (samples.jsonl, TensorBoard text, report) every this many iterations, "
        "also at the first and last (0 = off)",
    )
    samples_n: int = _f(4, "samples written per iteration (the first rows of the batch)")
    hooks: str = _f(
        "",
        "user hooks, comma-separated module:function, each called as fn(loop, row) after every row "
        "(klrl.loop.user; '' = none)",
    )
    metric_fns: str = _f(
        "",
        "user metric functions, comma-separated module:function, fn(row, samples) -> {name: float}, "
        "logged as user/<name> (klrl.loop.user; '' = none)",
    )

    def __post_init__(self) -> None:
        _check(self.iterations >= 1, "train.iterations", "must be >= 1")
        for name in ("hooks", "metric_fns"):
            for spec in filter(None, (x.strip() for x in getattr(self, name).split(","))):
                where, _, attr = spec.rpartition(":")
                _check(
                    bool(where) and attr.isidentifier(),
                    f"train.{name}",
                    f"expected module:function, got {spec!r}",
                )
        _choice(self.metric_aliases, "train.metric_aliases", ("", "trl", "verl"))
        _check(self.seed >= 0, "train.seed", "must be >= 0")
        _check(self.out_dir != "", "train.out_dir", "must not be empty")
        bad_name = "/" in self.name or "\\" in self.name or self.name in (".", "..")
        _check(not bad_name, "train.name", f"must be a single directory name (got {self.name!r})")
        _check(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        _check(self.devices >= 0, "train.devices", "must be >= 0")
        if self.mesh:
            parse_mesh(self.mesh)
        _check(self.log_every >= 1, "train.log_every", "must be >= 1")
        _check(self.samples_every >= 0, "train.samples_every", "must be >= 0")
        _check(self.samples_n >= 1, "train.samples_n", "must be >= 1")
        _check(self.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
        _check(self.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
        _check(self.max_consecutive_skips >= 0, "train.max_consecutive_skips", "must be >= 0")
        _check(
            math.isfinite(self.rollback_threshold)
            and self.rollback_threshold > 0
            and self.rollback_threshold != 1,
            "train.rollback_threshold",
            "must be > 0 and != 1",
        )
        factor_ok = math.isfinite(self.rollback_factor) and self.rollback_factor > 1
        _check(factor_ok, "train.rollback_factor", "must be > 1")
        _check(self.max_rollbacks >= 0, "train.max_rollbacks", "must be >= 0")
        _check(
            self.rollback_metric.strip() == self.rollback_metric,
            "train.rollback_metric",
            "must not have surrounding spaces",
        )
        parse_guards(self.rollback_guards)

    def guards(self) -> tuple[Guard, ...]:
        """The quality rollback's guards: ``rollback_metric``'s (with ``rollback_threshold``) first,
        then ``rollback_guards``' in order (none: rollback off)."""
        first = (Guard(self.rollback_metric, self.rollback_threshold),) if self.rollback_metric else ()
        return first + parse_guards(self.rollback_guards)
