"""Frozen, keyword-only configuration dataclasses, validated in ``__post_init__``.

Every field carries a ``help`` string in its metadata; the command line
(:mod:`klrl.cli.args`) is generated from these classes, so ``--kl.beta 0.05`` sets
``RunConfig.kl.beta``. A bad value raises :class:`ConfigError` (a ``ValueError``)
whose message starts with the dotted field name, before anything compiles.

KL units are explicit everywhere: ``seq_sum`` is the per-sequence sum of the
per-token estimate over response tokens (nats per sequence), ``token_mean`` is
that sum divided by the number of response tokens (nats per token).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from klrl.config.fields import (
    KL_UNITS,
    PLACEMENTS,
    ControllerConfig,
    Help,
    KLConfig,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    SamplingConfig,
    TrainConfig,
    _check,
    _choice,
    _f,
    parse_mesh,
)
from klrl.config.inputs import FORMATS, TRUNCATE, DataConfig, RewardConfig
from klrl.config.schema import ConfigError, UnknownFieldError, section, short, strict_init, unknown_field
from klrl.registry import ADVANTAGES, TASKS, is_adaptive  # names are checked against these

__all__ = [
    "FORMATS", "TRUNCATE", "KL_UNITS", "PLACEMENTS", "ConfigError", "ControllerConfig", "DataConfig",
    "DiagnosisConfig",
    "KLConfig", "LogConfig",
    "LoRAConfig", "ModelConfig", "OptimConfig", "PPOConfig", "RewardConfig", "RunConfig",
    "SamplingConfig",
    "TaskConfig", "TaskShape", "TrainConfig", "UnknownFieldError", "config_warnings", "field_names",
    "parse_mesh",
]  # fmt: skip


@section("task")
class TaskConfig:
    """The built-in task: a synthetic language, a pretrained reference, a reward."""

    name: str = _f("testbed", Help(lambda: f"task: {TASKS.describe()}"))
    seed: int = _f(0, "seed of the synthetic language")
    prompt_len: int = _f(8, "prompt length in tokens (left-padded)")
    prompt_pool: int = _f(4096, "number of distinct prompts sampled from the language")
    pretrain_steps: int = _f(600, "reference pretraining steps")
    pretrain_batch: int = _f(64, "reference pretraining batch (sequences)")
    pretrain_lr: float = _f(3e-3, "reference pretraining learning rate")
    pretrain_len: int = _f(32, "reference pretraining sequence length")
    cache_dir: str = _f("", "where pretrained models are cached ('' = $KLRL_CACHE or ~/.cache/klrl)")
    rm_pairs: int = _f(4096, "testbed: Bradley-Terry preference pairs of reference responses")
    rm_heldout: int = _f(512, "testbed: held-out pairs for the reward model's accuracy")
    rm_epochs: int = _f(6, "testbed: reward model epochs over the pairs")
    rm_lr: float = _f(1e-3, "testbed: reward model learning rate")
    rm_label_temp: float = _f(0.1, "testbed: label noise, P(a > b) = sigmoid((gold_a - gold_b) / temp)")
    indep_d_model: int = _f(48, "testbed: width of the independent evaluator LM")
    rm_scale: float = _f(
        0.3, "testbed: proxy reward standardised to this std (mean 0) on reference responses"
    )
    gold_quantile: float = _f(
        0.001, "testbed: gold fluency threshold = this quantile of real per-token log-lik"
    )
    gold_fluency_weight: float = _f(1.0, "testbed: gold penalty per nat/token below the fluency threshold")

    def __post_init__(self) -> None:
        _choice(self.name, "task.name", TASKS)
        _check(self.seed >= 0, "task.seed", "must be >= 0")
        _check(self.prompt_len >= 1, "task.prompt_len", "must be >= 1")
        _check(self.prompt_pool >= 1, "task.prompt_pool", "must be >= 1")
        _check(self.pretrain_steps >= 0, "task.pretrain_steps", "must be >= 0")
        _check(self.pretrain_batch >= 1, "task.pretrain_batch", "must be >= 1")
        _check(self.pretrain_lr > 0, "task.pretrain_lr", "must be > 0")
        _check(self.pretrain_len >= 2, "task.pretrain_len", "must be >= 2")
        _check(self.rm_pairs >= 64, "task.rm_pairs", "must be >= 64")
        _check(self.rm_heldout >= 1, "task.rm_heldout", "must be >= 1")
        _check(self.rm_epochs >= 1, "task.rm_epochs", "must be >= 1")
        _check(self.rm_lr > 0, "task.rm_lr", "must be > 0")
        _check(self.rm_label_temp > 0, "task.rm_label_temp", "must be > 0")
        _check(self.indep_d_model >= 1, "task.indep_d_model", "must be >= 1")
        _check(self.rm_scale > 0, "task.rm_scale", "must be > 0")
        _check(0 < self.gold_quantile < 1, "task.gold_quantile", "must be in (0, 1)")
        _check(self.gold_fluency_weight >= 0, "task.gold_fluency_weight", "must be >= 0")


@section("diag")
class DiagnosisConfig:
    """Thresholds of the regime diagnosis (frozen / hacking / healthy), over a trailing window."""

    window: int = _f(20, "iterations in the trailing window")
    kl_floor: float = _f(0.1, "frozen: mean KL (exact, nats/sequence) under this")
    proxy_min_gain: float = _f(0.05, "frozen: and the proxy improved by less than this across the window")
    trend_min: float = _f(0.05, "hacking: proxy up and gold down by more than this across the window")
    ppl_margin: float = _f(
        0.5,
        "hacking: oracle (else independent; text runs: else reference) perplexity this fraction above "
        "its start",
    )
    distinct_drop: float = _f(
        0.5, "hacking (text runs): text/distinct_2 over the window this fraction below its start"
    )
    beta_trend: float = _f(0.1, "adaptive beta: change of log beta across the window that counts as a trend")
    trend_t: float = _f(3.0, "hacking: both trends must also exceed this many standard errors")
    persist: int = _f(10, "a new regime or beta trend is reported once it has held this many iterations")
    baseline: int = _f(20, "a run's start (perplexity, diversity, proxy, gold): median of this many first")
    gold_drop: float = _f(0.5, "hacking: gold this fraction of its rise below its peak, the proxy held")
    exit_frac: float = _f(0.5, "hysteresis: a regime is kept while its evidence holds at this x its entry")
    trend_window: int = _f(50, "adaptive beta: a trend must hold this long (> controller time constant)")
    settle: int = _f(200, "adaptive beta: no trend until the KL first reaches its target, at most this")

    def __post_init__(self) -> None:
        _check(self.window >= 4, "diag.window", "must be >= 4")
        _check(self.kl_floor >= 0, "diag.kl_floor", "must be >= 0")
        _check(self.proxy_min_gain >= 0, "diag.proxy_min_gain", "must be >= 0")
        _check(self.trend_min >= 0, "diag.trend_min", "must be >= 0")
        _check(self.ppl_margin > 0, "diag.ppl_margin", "must be > 0")
        _check(0 < self.distinct_drop < 1, "diag.distinct_drop", "must be in (0, 1)")
        _check(self.beta_trend > 0, "diag.beta_trend", "must be > 0")
        _check(self.trend_t >= 0, "diag.trend_t", "must be >= 0")
        _check(self.persist >= 1, "diag.persist", "must be >= 1")
        _check(self.baseline >= 1, "diag.baseline", "must be >= 1")
        _check(self.gold_drop > 0, "diag.gold_drop", "must be > 0")
        _check(0 < self.exit_frac <= 1, "diag.exit_frac", "must be in (0, 1]")
        _check(self.trend_window >= 4, "diag.trend_window", "must be >= 4")
        _check(self.settle >= 0, "diag.settle", "must be >= 0")


WANDB_MODES = ("auto", "online", "offline", "disabled")


@section("log")
class LogConfig:
    """Experiment trackers beside metrics.jsonl and TensorBoard (klrl.loop.trackers)."""

    wandb: bool = _f(
        False,
        "also log to Weights & Biases (pip install 'klrl[wandb]'): the config, every metrics row, "
        "the samples as a table, the summary; a sweep: one W&B run per member",
    )
    wandb_project: str = _f("klrl", "W&B project")
    wandb_name: str = _f("", "W&B run name ('' = the run directory's name; a sweep member's: its own)")
    wandb_group: str = _f("", "W&B group ('' = none for a run; a sweep: the sweep directory's name)")
    wandb_mode: str = _f(
        "auto",
        "auto (online with WANDB_API_KEY or a `wandb login`, else offline; $WANDB_MODE wins), "
        "online, offline (files under the run directory's wandb/, `wandb sync` uploads them) or disabled",
    )

    def __post_init__(self) -> None:
        _choice(self.wandb_mode, "log.wandb_mode", WANDB_MODES)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a run needs. Cross-field rules are checked here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    ctrl: ControllerConfig = field(default_factory=ControllerConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diag: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            want = type(f.default_factory())  # type: ignore[misc]
            if not isinstance(getattr(self, f.name), want):
                raise ConfigError(f"{f.name}: expected a {want.__name__}, got {short(getattr(self, f.name))}")
        if self.reward.fn.strip():
            _check(
                self.task.name == "text",
                "reward.fn",
                f"host text rewards need task.name=text (got task.name={self.task.name})",
            )
        b = self.train.batch_size
        _check(
            b % self.ppo.minibatches == 0,
            "ppo.minibatches",
            f"must divide train.batch_size ({b} % {self.ppo.minibatches} != 0)",
        )
        _check(
            b % self.ppo.group_size == 0,
            "ppo.group_size",
            f"must divide train.batch_size ({b} % {self.ppo.group_size} != 0)",
        )
        if self.ppo.group_size > 1:
            mb = b // self.ppo.minibatches
            _check(mb >= 1, "ppo.minibatches", "leaves empty minibatches")
        mb, k = b // self.ppo.minibatches, self.ppo.grad_accum
        _check(mb % k == 0, "ppo.grad_accum", f"must divide the minibatch, train.batch_size / ppo.minibatches"
               f" = {b} / {self.ppo.minibatches} = {mb} sequences ({mb} % {k} != 0)")  # fmt: skip
        if self.optim.critic_lr > 0:
            _check(
                bool(ADVANTAGES.meta(self.ppo.advantage)["critic"]),
                "optim.critic_lr",
                f"ppo.advantage={self.ppo.advantage} has no critic to give a learning rate",
            )
        critic = dataclasses.replace(self.model, value_model=resolve_value_model(self))  # auto: chosen here
        object.__setattr__(self, "model", critic)
        self._check_lora()
        c = self.ctrl
        start = ("kl.beta", self.kl.beta) if c.drives == "reward" else ("kl.loss_coef", self.kl.loss_coef)
        if c.warmup_iters == 0:  # the controller would clip the starting value to the bounds silently
            _check(
                c.beta_min <= start[1] <= c.beta_max,
                start[0],
                f"must be in [ctrl.beta_min, ctrl.beta_max] = [{c.beta_min}, {c.beta_max}] "
                f"(ctrl.drives={c.drives}), got {start[1]}",
            )

    def _check_lora(self) -> None:
        """Adapters, the shared frozen base and a quantised reference: the combinations that work."""
        lo, m = self.lora, self.model
        frozen = self.kl.ref_update_every <= 0
        if lo.rank > 0:
            _check(frozen, "lora.rank", "the reference is the base with the adapters off: it cannot be "
                   f"refreshed (kl.ref_update_every={self.kl.ref_update_every}; use 0, or "
                   "full fine-tuning)")  # fmt: skip
        if m.adapter:
            _check(lo.rank > 0, "model.adapter", "a PEFT adapter is the initial policy of a LoRA run: set "
                   "lora.rank > 0 (the adapter's own rank and alpha are then used)")  # fmt: skip
        if m.value_model == "lora":
            _check(
                lo.rank > 0 or lo.critic_rank > 0,
                "model.value_model",
                "lora: the critic's adapters need lora.critic_rank > 0 (or lora.rank > 0)",
            )
            _check(frozen, "model.value_model", "lora: the critic's base is the frozen reference "
                   f"(kl.ref_update_every={self.kl.ref_update_every}; use 0, or head/separate)")  # fmt: skip
        if m.ref_quant != "none":
            _check(
                frozen,
                "model.ref_quant",
                f"a quantised reference is frozen (kl.ref_update_every={self.kl.ref_update_every}; use 0)",
            )
            _check(m.ref_dtype == "float32", "model.ref_quant", "replaces model.ref_dtype (leave it float32)")

    # ---- helpers -------------------------------------------------------
    def replace(self, **sections: Any) -> RunConfig:
        """``cfg.replace(kl={'beta': 0.1})`` returns a new, re-validated config.

        An unknown section or field raises :class:`UnknownFieldError` naming it and the valid names."""
        new = {}
        for name, value in sections.items():
            if name not in SECTIONS:
                raise UnknownFieldError(_unknown_section(name))
            if isinstance(value, dict):
                value = dataclasses.replace(getattr(self, name), **value)
            new[name] = value
        return dataclasses.replace(self, **new)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        """The inverse of :meth:`to_dict`; a missing section or field takes its default.

        Anything else than ``{section: {field: value}}`` with known names raises :class:`ConfigError`."""
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected an object of sections, got {type(d).__name__}")
        model = d.get("model")
        if isinstance(model, dict) and isinstance(model.get("lora"), dict):  # model: {lora: {...}} spelling
            d = {
                **d,
                "model": {k: v for k, v in model.items() if k != "lora"},
                "lora": {**d.get("lora", {}), **model["lora"]},
            }
        kwargs = {}
        for name, sub in d.items():
            if name not in SECTIONS:
                raise UnknownFieldError(_unknown_section(str(name)))
            if not isinstance(sub, dict):
                raise ConfigError(f"{name}: expected an object of fields, got {type(sub).__name__}")
            kwargs[name] = SECTIONS[name](**{str(k): v for k, v in sub.items()})
        return cls(**kwargs)

    def hash(self, *sections: str) -> str:
        """A stable short hash of the named sections (all if none)."""
        d = self.to_dict()
        if sections:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


strict_init(RunConfig, "", "config section")


class AutoValueModel(str):
    """The critic ``model.value_model=auto`` chose (a ``str``, equal to that name wherever it is read and
    written: config.json records the choice). It stays marked as chosen, so a config derived from this
    one (:meth:`RunConfig.replace`, ``dataclasses.replace``) chooses again for its own model.path and
    lora.rank; a name read back from a config.json is explicit and kept (a resume keeps its critic).
    A copy (:meth:`RunConfig.to_dict`'s) is the plain ``str``: JSON, YAML and TOML write it as a name."""

    def __deepcopy__(self, memo: dict) -> str:
        return str(self)


def resolve_value_model(cfg: RunConfig) -> str:
    """``model.value_model`` of ``cfg``, ``auto`` (or an earlier choice of it) resolved: ``lora`` (the
    frozen base with the critic's own adapters) when ``lora.rank > 0``; ``separate`` (its own copy of the
    pretrained trunk) with ``model.path``; else ``head`` (klrl's GPT tasks: the testbed's tuned setting).
    Why not the head on a pretrained model: the value loss's gradient then moves the policy's own trunk,
    and under an adaptive controller the returns it regresses on grow with beta (FINDINGS.md, SmolLM2)."""
    vm = cfg.model.value_model
    if vm != "auto" and not isinstance(vm, AutoValueModel):
        return vm
    if cfg.lora.rank > 0:
        return AutoValueModel("lora")
    return AutoValueModel("separate" if cfg.model.path else "head")


# the section classes (the default factories are the classes: nothing is instantiated at import,
# when the registries that validate names may not be filled yet)
SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(RunConfig)
}


def _unknown_section(name: str) -> str:
    return unknown_field("", name, SECTIONS, "config section")


def field_names() -> list[str]:
    """Every ``section.field`` name, in order."""
    return [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)]


class TaskShape(NamedTuple):
    """What :func:`klrl.checks.check_task` needs of a task (a :class:`klrl.tasks.base.Task` has these too)."""

    vocab_size: int
    prompt_len: int
    max_len: int


def config_warnings(cfg: RunConfig) -> list[str]:
    """Known-bad or suspicious combinations: legal, but usually a mistake. One line each."""
    out = []
    k, c = cfg.kl, cfg.ctrl
    in_loss = k.placement in ("loss", "reward+loss")
    in_reward = k.placement in ("reward", "sequence", "reward+loss")
    if in_loss and k.loss_estimator == "k1":
        out.append(
            "kl.loss_estimator=k1: as a loss term k1's expected gradient on-policy is zero; "
            "use k2 (its gradient is that of KL(pi||ref)) or k3"
        )
    if in_loss and k.loss_estimator == "k3":
        out.append(
            "kl.loss_estimator=k3: as a loss term its expected gradient is that of the forward KL(ref||pi), "
            "not of KL(pi||ref); k2 gives the reverse-KL gradient"
        )
    if is_adaptive(c.kind):
        if c.drives == "loss" and not in_loss:
            out.append(
                f"ctrl.drives=loss but kl.placement={k.placement} has no KL loss term: nothing uses beta"
            )
        if c.drives == "reward" and not in_reward:
            out.append(f"ctrl.drives=reward but kl.placement={k.placement} puts no KL in the reward")
        if c.unit == "token_mean" and c.target >= 1.0:
            out.append(
                f"ctrl.target={c.target} nats/token with ctrl.unit=token_mean looks like a per-sequence "
                "target (lm-human-preferences' 6 nats is a per-sequence sum)"
            )
        if c.unit == "seq_sum" and c.target < 0.2 and cfg.sampling.response_len >= 8:
            out.append(
                f"ctrl.target={c.target} nats/sequence with ctrl.unit=seq_sum looks like a per-token target "
                "(verl and OpenRLHF feed the controller per-token means)"
            )
    out += _pretrained_warnings(cfg)
    if cfg.model.ref_quant != "none" and cfg.lora.rank == 0:  # the policy float, its reference quantised
        shift = "15-18" if cfg.model.ref_quant == "int4" else "0.13-0.16 (negligible from ~3 nats)"
        out.append(
            f"model.ref_quant={cfg.model.ref_quant} with full fine-tuning: the KL is measured against a "
            f"quantised copy of the policy's start, which adds ~{shift} nats/sequence on SmolLM2 "
            "(docs/ref_quant.md); with lora.rank > 0 policy and reference share the quantised base"
        )
    return out


def _pretrained_warnings(cfg: RunConfig) -> list[str]:
    """An adaptive controller on a pretrained ``model.path`` with the klrl GPT's settings: the critic on
    the policy's trunk, or a full fine-tuning learning rate above the anchors' range (the KL of one update
    can then exceed the target, and the controller raises beta without bound; notes/anchors.md)."""
    out: list[str] = []
    m, o = cfg.model, cfg.optim
    if not m.path or not is_adaptive(cfg.ctrl.kind):
        return out
    if bool(ADVANTAGES.meta(cfg.ppo.advantage)["critic"]) and m.value_model == "head":
        out.append(
            f"model.value_model=head with ctrl.kind={cfg.ctrl.kind} on model.path: the value loss trains the "
            "policy's own trunk and its returns grow with beta, so raising beta can raise the KL (SmolLM2: "
            "beta 280, KL 32 nats/seq); use separate or lora"
        )
    if cfg.lora.rank == 0 and o.lr > 1e-5:
        out.append(
            f"optim.lr={o.lr:g} for full fine-tuning of model.path under ctrl.kind={cfg.ctrl.kind}: one Adam "
            "step moves every weight by about lr, and the KL of one update may exceed ctrl.target (SmolLM2 "
            "at 1e-4: 3.3 nats/seq); TRL, verl and OpenRLHF use 1e-6 to 1e-5, LoRA (lora.rank) ~1e-4"
        )
    return out
