"""Tests of klrl.config.run: every rule raises ConfigError naming its field; replace; round trips."""

from __future__ import annotations

import dataclasses
import json

import pytest

from klrl.config import (
    ConfigError,
    ControllerConfig,
    KLConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    TrainConfig,
)

nan, inf = float("nan"), float("inf")

# (section class, bad keyword arguments, field the message must start with)
RULES = [
    (ModelConfig, {"n_layers": 0}, "model.n_layers"),
    (ModelConfig, {"n_heads": 0}, "model.n_heads"),
    (ModelConfig, {"d_model": 0}, "model.d_model"),
    (ModelConfig, {"d_model": 30, "n_heads": 4}, "model.d_model"),
    (ModelConfig, {"mlp_ratio": 0}, "model.mlp_ratio"),
    (ModelConfig, {"value_model": "both"}, "model.value_model"),
    (ModelConfig, {"dtype": "float16"}, "model.dtype"),
    (SamplingConfig, {"response_len": 0}, "sampling.response_len"),
    (SamplingConfig, {"temperature": 0.0}, "sampling.temperature"),
    (SamplingConfig, {"top_k": -1}, "sampling.top_k"),
    (KLConfig, {"beta": -0.1}, "kl.beta"),
    (KLConfig, {"beta": nan}, "kl.beta"),
    (KLConfig, {"beta": inf}, "kl.beta"),
    (KLConfig, {"estimator": "k4"}, "kl.estimator"),
    (KLConfig, {"placement": "advantage"}, "kl.placement"),
    (KLConfig, {"loss_coef": -1.0}, "kl.loss_coef"),
    (KLConfig, {"loss_estimator": "k9"}, "kl.loss_estimator"),
    (KLConfig, {"loss_agg": "sum"}, "kl.loss_agg"),
    (KLConfig, {"clamp": -1.0}, "kl.clamp"),
    (KLConfig, {"ref_update_every": -1}, "kl.ref_update_every"),
    (KLConfig, {"ref_mix": 0.0}, "kl.ref_mix"),
    (KLConfig, {"ref_mix": 1.5}, "kl.ref_mix"),
    (ControllerConfig, {"kind": "pid"}, "ctrl.kind"),
    (ControllerConfig, {"target": 0.0}, "ctrl.target"),
    (ControllerConfig, {"target": -1.0}, "ctrl.target"),
    (ControllerConfig, {"target": nan}, "ctrl.target"),
    (ControllerConfig, {"unit": "nats"}, "ctrl.unit"),
    (ControllerConfig, {"estimator": "k0"}, "ctrl.estimator"),
    (ControllerConfig, {"drives": "both"}, "ctrl.drives"),
    (ControllerConfig, {"horizon": 0.0}, "ctrl.horizon"),
    (ControllerConfig, {"horizon": -5.0}, "ctrl.horizon"),
    (ControllerConfig, {"clip": 0.0}, "ctrl.clip"),
    (ControllerConfig, {"band": 1.0}, "ctrl.band"),
    (ControllerConfig, {"factor": 1.0}, "ctrl.factor"),
    (ControllerConfig, {"kp": -0.1}, "ctrl.kp"),
    (ControllerConfig, {"ki": -0.1}, "ctrl.ki"),
    (ControllerConfig, {"integral_max": 0.0}, "ctrl.integral_max"),
    (ControllerConfig, {"step_clip": 1.0}, "ctrl.step_clip"),
    (ControllerConfig, {"step_clip": 0.0}, "ctrl.step_clip"),
    (ControllerConfig, {"lr": 0.0}, "ctrl.lr"),
    (ControllerConfig, {"warmup_iters": -1}, "ctrl.warmup_iters"),
    (ControllerConfig, {"warmup_beta": -1.0}, "ctrl.warmup_beta"),
    (ControllerConfig, {"beta_min": -1.0}, "ctrl.beta_min"),
    (ControllerConfig, {"beta_min": 2.0, "beta_max": 1.0}, "ctrl.beta_max"),
    (PPOConfig, {"epochs": 0}, "ppo.epochs"),
    (PPOConfig, {"minibatches": 0}, "ppo.minibatches"),
    (PPOConfig, {"grad_accum": 0}, "ppo.grad_accum"),
    (PPOConfig, {"clip": 0.0}, "ppo.clip"),
    (PPOConfig, {"vf_clip": 0.0}, "ppo.vf_clip"),
    (PPOConfig, {"vf_coef": -1.0}, "ppo.vf_coef"),
    (PPOConfig, {"gamma": 1.5}, "ppo.gamma"),
    (PPOConfig, {"lam": -0.1}, "ppo.lam"),
    (PPOConfig, {"advantage": "vtrace"}, "ppo.advantage"),
    (PPOConfig, {"group_size": 0}, "ppo.group_size"),
    (PPOConfig, {"advantage": "grpo", "group_size": 1}, "ppo.group_size"),
    (PPOConfig, {"advantage": "rloo", "group_size": 1}, "ppo.group_size"),
    (OptimConfig, {"lr": 0.0}, "optim.lr"),
    (OptimConfig, {"lr": nan}, "optim.lr"),
    (OptimConfig, {"critic_lr": -1e-5}, "optim.critic_lr"),
    (OptimConfig, {"critic_lr": nan}, "optim.critic_lr"),
    (OptimConfig, {"b1": 1.0}, "optim.b1"),
    (OptimConfig, {"b2": -0.1}, "optim.b2"),
    (OptimConfig, {"eps": 0.0}, "optim.eps"),
    (OptimConfig, {"weight_decay": -1.0}, "optim.weight_decay"),
    (OptimConfig, {"max_grad_norm": -1.0}, "optim.max_grad_norm"),
    (OptimConfig, {"schedule": "step"}, "optim.schedule"),
    (OptimConfig, {"warmup_steps": -1}, "optim.warmup_steps"),
    (TaskConfig, {"name": "chess"}, "task.name"),
    (TaskConfig, {"prompt_len": 0}, "task.prompt_len"),
    (TaskConfig, {"prompt_pool": 0}, "task.prompt_pool"),
    (TaskConfig, {"pretrain_steps": -1}, "task.pretrain_steps"),
    (TaskConfig, {"pretrain_batch": 0}, "task.pretrain_batch"),
    (TaskConfig, {"pretrain_lr": 0.0}, "task.pretrain_lr"),
    (TaskConfig, {"pretrain_len": 1}, "task.pretrain_len"),
    (TrainConfig, {"iterations": 0}, "train.iterations"),
    (TrainConfig, {"batch_size": 0}, "train.batch_size"),
    (TrainConfig, {"batch_size": -4}, "train.batch_size"),
    (TrainConfig, {"devices": -1}, "train.devices"),
    (TrainConfig, {"log_every": 0}, "train.log_every"),
    *((TrainConfig, {"rollback_guards": g}, "train.rollback_guards")
      for g in ("ppl", "ppl>", ">1.5", "ppl=1.5", "ppl>0.9", "ppl>1", "ppl<1.2", "ppl<0", "ppl>nan",
                "ppl>inf", "ppl>x", "a<b<0.5", "ppl>1.5,ppl>2", "ppl>1.5,d2<0.7,d2<0.5")),
]  # fmt: skip


@pytest.mark.parametrize("cls,kwargs,name", RULES, ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(RULES)])
def test_rule_names_field(cls, kwargs, name) -> None:
    with pytest.raises(ConfigError) as e:
        cls(**kwargs)
    assert str(e.value).startswith(name + ":"), str(e.value)
    assert isinstance(e.value, ValueError)


def test_rollback_guards_parse_after_rollback_metric() -> None:
    """train.guards(): rollback_metric's guard (with rollback_threshold) first, then rollback_guards' in
    order, each a metric, its ratio to the metric's iteration-0 value and its spec; a bad one is one line."""
    from klrl.config.fields import Guard

    assert TrainConfig().guards() == ()
    tc = TrainConfig(rollback_guards=" eval/oracle_ppl_floored > 1.5 ,text/distinct_2<0.7,,")
    assert tc.guards() == (Guard("eval/oracle_ppl_floored", 1.5, "eval/oracle_ppl_floored>1.5"),
                           Guard("text/distinct_2", 0.7, "text/distinct_2<0.7"))  # fmt: skip
    tc = TrainConfig(rollback_metric="m", rollback_threshold=0.5, rollback_guards="m>2,x<0.9")
    assert [(g.metric, g.ratio, g.spec) for g in tc.guards()] == [("m", 0.5, ""), ("m", 2.0, "m>2"),
                                                                  ("x", 0.9, "x<0.9")]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        TrainConfig(rollback_guards="text/distinct_2<1.3")
    assert (
        str(e.value) == "train.rollback_guards: 'text/distinct_2<1.3': expected a number in (0, 1) after '<'"
    )


def test_every_section_default_is_valid_and_every_field_has_help() -> None:
    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no help"


@pytest.mark.parametrize(
    "sections,name",
    [
        ({"train": {"batch_size": 6}}, "ppo.minibatches"),  # 6 % 4 != 0
        ({"train": {"batch_size": 8}, "ppo": {"minibatches": 3}}, "ppo.minibatches"),
        ({"train": {"batch_size": 8}, "ppo": {"minibatches": 2, "group_size": 3}}, "ppo.group_size"),
        ({"train": {"batch_size": 8}, "ppo": {"minibatches": 2, "grad_accum": 3}}, "ppo.grad_accum"),
        ({"train": {"batch_size": 8}, "ppo": {"minibatches": 4, "grad_accum": 4}}, "ppo.grad_accum"),
        ({"ppo": {"advantage": "rloo", "group_size": 2}, "optim": {"critic_lr": 1e-5}}, "optim.critic_lr"),
    ],
)
def test_cross_field_rules(sections, name) -> None:
    with pytest.raises(ConfigError) as e:
        RunConfig().replace(**sections)
    assert str(e.value).startswith(name + ":"), str(e.value)


def test_replace_revalidates_and_is_pure() -> None:
    cfg = RunConfig()
    new = cfg.replace(kl={"beta": 0.2}, train={"batch_size": 32})
    assert new.kl.beta == 0.2 and new.train.batch_size == 32
    assert new.kl.estimator == cfg.kl.estimator  # other fields kept
    assert cfg.kl.beta == 0.05 and cfg.train.batch_size == 64  # the original is untouched
    with pytest.raises(ConfigError, match=r"^kl\.beta:"):
        cfg.replace(kl={"beta": -1.0})
    with pytest.raises(ConfigError, match=r"^ctrl\.horizon:"):
        cfg.replace(ctrl={"horizon": 0.0})
    # a whole section object is accepted too, and the cross-field rules still run
    with pytest.raises(ConfigError, match=r"^ppo\.minibatches:"):
        cfg.replace(ppo=PPOConfig(minibatches=5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kl.beta = 1.0  # type: ignore[misc]


def test_dict_round_trip() -> None:
    cfg = RunConfig().replace(
        kl={"beta": 0.3, "placement": "sequence"},
        ctrl={"kind": "pi", "target": 2.5},
        ppo={"advantage": "rloo", "group_size": 4},
        sampling={"use_eos": False, "top_k": 5},
        task={"cache_dir": "/tmp/x"},
    )
    d = cfg.to_dict()
    back = RunConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg
    assert back.hash() == cfg.hash() and back.hash("kl") == cfg.hash("kl")
    assert cfg.hash("kl") != RunConfig().hash("kl")
    assert RunConfig.from_dict({}) == RunConfig()  # missing sections take defaults
    assert RunConfig.from_dict({"kl": {"beta": 0.1}}).kl.beta == 0.1


def test_from_dict_rejects_unknown_and_bad_fields() -> None:
    with pytest.raises(ConfigError, match=r"^kl\.betta:"):
        RunConfig.from_dict({"kl": {"betta": 0.1}})
    with pytest.raises(ConfigError, match=r"^kl\.beta:"):
        RunConfig.from_dict({"kl": {"beta": -0.1}})


def test_config_warnings_flag_known_bad_combinations():
    from klrl.config import RunConfig, config_warnings

    assert config_warnings(RunConfig()) == []
    k1_loss = RunConfig().replace(kl={"placement": "loss", "loss_estimator": "k1", "loss_coef": 0.1})
    assert any("zero" in w and "kl.loss_estimator=k1" in w for w in config_warnings(k1_loss))
    unit = RunConfig().replace(ctrl={"kind": "proportional", "unit": "token_mean", "target": 6.0})
    assert any("per-sequence" in w for w in config_warnings(unit))
    unit2 = RunConfig().replace(ctrl={"kind": "proportional", "unit": "seq_sum", "target": 0.05})
    assert any("per-token" in w for w in config_warnings(unit2))
    idle = RunConfig().replace(ctrl={"kind": "pi", "drives": "loss"})
    assert any("nothing uses beta" in w for w in config_warnings(idle))


# ---- generic field checks, unknown names, the task-dependent rules ---------------------------------
FLOAT_FIELDS = [
    (cls, f.name)
    for cls in (SamplingConfig, KLConfig, ControllerConfig, PPOConfig, OptimConfig, TaskConfig, TrainConfig)
    for f in dataclasses.fields(cls)
    if type(f.default) is float
]


@pytest.mark.parametrize("value", [nan, inf, -inf])
@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS])
def test_every_float_field_must_be_finite(cls, name, value) -> None:
    with pytest.raises(ConfigError, match="must be a finite number"):
        cls(**{name: value})


def test_field_types_are_checked_and_ints_become_floats() -> None:
    assert KLConfig(beta=1).beta == 1.0 and type(KLConfig(beta=1).beta) is float
    for kwargs, name in [
        ({"beta": "0.1"}, "kl.beta"),
        ({"beta": True}, "kl.beta"),
        ({"estimator": 3}, "kl.estimator"),
        ({"ref_update_every": 1.0}, "kl.ref_update_every"),
        ({"ref_update_every": True}, "kl.ref_update_every"),
    ]:
        with pytest.raises(ConfigError, match=f"^{name}:"):
            KLConfig(**kwargs)
    with pytest.raises(ConfigError, match="^sampling.use_eos:"):
        SamplingConfig(use_eos="false")
    with pytest.raises(ConfigError, match=r"^train.seed: must fit in int32"):
        TrainConfig(seed=2**31)
    with pytest.raises(ConfigError, match=r"^train.seed: must be >= 0"):
        TrainConfig(seed=-1)
    TrainConfig(seed=2**31 - 1)  # the largest seed is valid
    with pytest.raises(ConfigError, match="^kl:"):
        RunConfig(kl={"beta": 0.1})  # a section must be its dataclass (replace takes dicts)


def test_unknown_names_say_which_and_what_is_valid() -> None:
    from klrl.config import UnknownFieldError

    for make in (lambda: KLConfig(betta=1), lambda: RunConfig().replace(kl={"betta": 1})):
        with pytest.raises(UnknownFieldError) as e:
            make()
        msg = str(e.value)
        assert msg.startswith("kl.betta: unknown field; did you mean kl.beta?"), msg
        assert "estimator" in msg and "ref_mix" in msg  # the valid names
        assert isinstance(e.value, TypeError) and isinstance(e.value, ConfigError)  # both contracts
    with pytest.raises(UnknownFieldError, match=r"^kll: unknown config section; did you mean kl\?"):
        RunConfig().replace(kll={"beta": 1})
    with pytest.raises(UnknownFieldError, match="^kll:"):
        RunConfig(kll=KLConfig())
    with pytest.raises(UnknownFieldError, match="keyword arguments only"):
        KLConfig(0.1)


@pytest.mark.parametrize(
    "doc,name",
    [([], "config"), (None, "config"), ("x", "config"), ({"kl": [1]}, "kl"), ({"kll": {}}, "kll"),
     ({"kl": {"beta": "1"}}, "kl.beta"), ({"train": {"iterations": 2.5}}, "train.iterations")],
)  # fmt: skip
def test_from_dict_rejects_what_is_not_a_config(doc, name) -> None:
    with pytest.raises(ConfigError, match=f"^{name}:"):
        RunConfig.from_dict(doc)


def test_beta_bounds_are_checked_instead_of_clipped() -> None:
    with pytest.raises(ConfigError, match="^kl.beta: must be in"):
        RunConfig().replace(kl={"beta": 2.0}, ctrl={"beta_max": 1.0})
    with pytest.raises(ConfigError, match="^kl.loss_coef: must be in"):
        RunConfig().replace(kl={"loss_coef": 0.0}, ctrl={"drives": "loss", "beta_min": 0.1})
    with pytest.raises(ConfigError, match="^ctrl.warmup_beta: must be in"):
        ControllerConfig(warmup_iters=2, warmup_beta=5.0, beta_max=1.0)
    RunConfig().replace(kl={"beta": 2.0}, ctrl={"beta_max": 1.0, "warmup_iters": 3, "warmup_beta": 0.5})


def test_names_md_lists_every_config_field_with_its_default() -> None:
    """docs/names.md's config table is the config: every section, field (in order) and default."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "names.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (`\w+`=.*) \|$", text, flags=re.M))
    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        # the declared default (what a user leaves unset; ``value_model``'s 'auto' resolves in __post_init__)
        declared = lambda f, s=sub: f.default if f.default is not dataclasses.MISSING else getattr(s, f.name)
        want = ", ".join(f"`{f.name}`={declared(f)!r}" for f in dataclasses.fields(sub))
        assert rows.get(section.name) == want, (
            f"docs/names.md, section {section.name}: write\n| `{section.name}` | {want} |"
        )


def test_value_model_auto_keeps_the_critic_off_a_pretrained_policy_s_trunk():
    """``model.value_model=auto``: head for klrl's GPT, separate with model.path, lora with lora.rank;
    config.json records the choice, a config derived by replace chooses again, an explicit name (a
    config.json read back) is kept."""
    base = RunConfig()
    declared = {f.name: f.default for f in dataclasses.fields(ModelConfig)}["value_model"]
    assert base.model.value_model == "head" and declared == "auto"
    path = base.replace(model={"path": "m.gguf"})
    assert path.model.value_model == "separate"
    assert path.replace(lora={"rank": 8}).model.value_model == "lora"
    assert path.replace(model={"path": ""}).model.value_model == "head"
    assert type(path.to_dict()["model"]["value_model"]) is str  # yaml.safe_dump writes it
    assert json.loads(json.dumps(path.to_dict()))["model"]["value_model"] == "separate"
    saved = RunConfig.from_dict({"model": {"path": "m.gguf", "value_model": "head"}})
    assert saved.model.value_model == "head"
    assert saved.replace(lora={"rank": 8}).model.value_model == "head"  # explicit: kept


def test_warnings_for_a_pretrained_model_with_the_testbed_s_settings():
    """Under an adaptive controller on model.path: one line for the head critic, one for a full
    fine-tuning lr above the anchors' 1e-5; none for the recipe (separate critic, or LoRA at 1e-4), none
    with a fixed beta."""
    from klrl.config import config_warnings

    risky = RunConfig.from_dict({"model": {"path": "m.gguf", "value_model": "head"}, "optim": {"lr": 3e-6},
                                 "ctrl": {"kind": "pi", "target": 3.0}})  # fmt: skip
    (line,) = config_warnings(risky)
    assert line.startswith("model.value_model=head with ctrl.kind=pi on model.path:") and "beta" in line
    assert config_warnings(risky.replace(ctrl={"kind": "fixed"})) == []
    assert config_warnings(risky.replace(model={"value_model": "separate"})) == []
    (lr,) = config_warnings(risky.replace(model={"value_model": "separate"}, optim={"lr": 1e-4}))
    assert lr.startswith("optim.lr=0.0001 for full fine-tuning of model.path under ctrl.kind=pi")
    assert config_warnings(risky.replace(model={"value_model": "separate"}, optim={"lr": 1e-4},
                                         ctrl={"kind": "fixed"})) == []  # fmt: skip
    assert config_warnings(risky.replace(model={"value_model": "lora"}, lora={"rank": 8},
                                         optim={"lr": 1e-4})) == []  # fmt: skip


def test_reward_whitening_and_normalisation_fields():
    with pytest.raises(ConfigError, match=r"^ppo\.whiten_rewards: needs ppo\.advantage=gae"):
        RunConfig().replace(ppo={"whiten_rewards": True, "advantage": "grpo", "group_size": 2})
    assert RunConfig().replace(ppo={"whiten_rewards": True}).ppo.whiten_rewards
    assert RunConfig().replace(ppo={"normalize_reward": True}).ppo.normalize_reward


def test_a_quantised_reference_under_full_fine_tuning_warns_with_the_measured_shift():
    from klrl.config import config_warnings

    (w,) = config_warnings(RunConfig().replace(model={"ref_quant": "int4"}))
    assert w.startswith("model.ref_quant=int4 with full fine-tuning") and "15-18 nats/sequence" in w
    assert config_warnings(RunConfig().replace(model={"ref_quant": "int4"}, lora={"rank": 4})) == []
