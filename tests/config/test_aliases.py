"""klrl.config.aliases: every klrl side is a real config field or a metric klrl writes."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from klrl.config import RunConfig, aliases
from klrl.registry import ESTIMATORS

ROOT = Path(__file__).resolve().parents[2]
METRIC_DICTS = {
    "TRL_METRICS": aliases.TRL_METRICS,
    "TRL_LEGACY_METRICS": aliases.TRL_LEGACY_METRICS,
    "TRL_GRPO_METRICS": aliases.TRL_GRPO_METRICS,
    "VERL_METRICS": aliases.VERL_METRICS,
    "OPENRLHF_METRICS": aliases.OPENRLHF_METRICS,
}


def _config_fields() -> set[str]:
    cfg = RunConfig()
    return {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, s.name))
    }


# the modules of the compiled step that name its metrics
TRAIN_SOURCES = [
    ROOT / "klrl" / "step" / f for f in ("train.py", "stages.py", "context.py", "metrics.py", "update.py")
]


def _source_metric_names() -> tuple[set[str], list[re.Pattern]]:
    """String constants shaped like metric names in the step's modules and the tasks (the literal names), and
    the f-string templates of the step's modules as regexes (``kl/reward_{est}_seq_sum``)."""
    literals, templates = set(), []
    for path in [*TRAIN_SOURCES, *sorted((ROOT / "klrl" / "tasks").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"[a-z]+/[a-z0-9_]+", node.value):
                    literals.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                parts = [
                    re.escape(v.value) if isinstance(v, ast.Constant) else "[a-z0-9_]+" for v in node.values
                ]
                pattern = "".join(parts)
                if re.match(r"[a-z]+/", pattern):
                    templates.append(re.compile(pattern))
    return literals, templates


def test_every_flag_alias_is_a_config_field():
    fields = _config_fields()
    assert "kl.beta" in fields and "ctrl.target" in fields  # the reading of the config works
    bad = {k: v for k, v in aliases.FLAG_ALIASES.items() if v not in fields}
    assert not bad


def test_required_aliases():
    expect = {
        "kl_coef": "kl.beta",
        "init_kl_coef": "kl.beta",
        "target": "ctrl.target",
        "target_kl": "ctrl.target",
        "horizon": "ctrl.horizon",
        "cliprange": "ppo.clip",
        "learning_rate": "optim.lr",
        "num_ppo_epochs": "ppo.epochs",
        "num_mini_batches": "ppo.minibatches",
        "cliprange_value": "ppo.vf_clip",
        "vf_coef": "ppo.vf_coef",
        "model_name_or_path": "model.path",  # transformers / TRL (difflib said model.value_path)
        "sft_model_path": "model.path",
        "reward_model_path": "model.reward_path",
        "gradient_accumulation_steps": "ppo.grad_accum",  # transformers / TRL / verl
        "critic_learning_rate": "optim.critic_lr",  # OpenRLHF
        "critic.optim.lr": "optim.critic_lr",  # verl
    }
    assert {k: aliases.FLAG_ALIASES[k] for k in expect} == expect


@pytest.mark.parametrize("name", list(METRIC_DICTS))
def test_metric_maps_use_klrl_metric_names(name):
    mapping = METRIC_DICTS[name]
    assert mapping and set(mapping) <= aliases.KLRL_METRICS
    assert all(isinstance(v, str) and v for v in mapping.values())


def test_klrl_metrics_are_what_the_source_writes():
    literals, templates = _source_metric_names()
    assert "kl/k1_seq_sum" in literals and templates  # the source scan found something
    for m in aliases.KLRL_METRICS:
        assert m in literals or any(t.fullmatch(m) for t in templates), m
    # and the other way: every literal metric of the metrics dicts of the step is listed
    in_dicts = {
        k.value
        for path in TRAIN_SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Dict)
        for k in node.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str) and "/" in k.value
    }
    assert in_dicts and in_dicts <= aliases.KLRL_METRICS


def test_estimator_names_are_the_registry_s():
    assert aliases.ESTIMATORS == ESTIMATORS.names() and "full" in aliases.ESTIMATORS
    per_estimator = {m for m in aliases.KLRL_METRICS if m.startswith("kl/reward_")}
    assert per_estimator == {f"kl/reward_{e}_{u}" for e in ESTIMATORS for u in ("seq_sum", "token_mean")}
    # a registered estimator is a metric klrl writes (kl/reward_<kl.estimator>_<unit>) until removed
    ESTIMATORS.register("k9", inputs="logp")(len)
    try:
        assert {"kl/reward_k9_seq_sum", "kl/reward_k9_token_mean"} <= aliases.KLRL_METRICS
    finally:
        ESTIMATORS.remove("k9")
    assert "kl/reward_k9_seq_sum" not in aliases.KLRL_METRICS
    with pytest.raises(AttributeError):
        aliases.NOT_A_NAME  # noqa: B018


def test_lookup_normalises():
    assert aliases.lookup("--init-kl-coef") == "kl.beta"
    assert aliases.lookup("--algorithm.kl_ctrl.kl_coef=0.001") == "kl.beta"
    assert aliases.lookup("actor_rollout_ref.actor.kl_loss_coef") == "kl.loss_coef"
    assert aliases.lookup("--Num-PPO-Epochs") == "ppo.epochs"
    assert aliases.lookup("whiten_rewards") is None
    assert aliases.lookup("--Model-Name-Or-Path") == "model.path"
    assert aliases.lookup("--actor_rollout_ref.model.path=/m") == "model.path"  # verl: by role
    assert aliases.lookup("critic.model.path") == "model.value_path"
    assert aliases.lookup("reward_model.model.path") == "model.reward_path"
    # the key matched, for its note: the longest suffix that is a key, not any key it ends with
    assert aliases.matched_key("--lr_warmup_ratio") == "lr_warmup_ratio"
    assert aliases.matched_key("--a.b.kl_loss_coef") == "kl_loss_coef"
    assert aliases.matched_key("--nothing_like_it") is None


def test_no_counterpart_is_not_aliased():
    assert not set(aliases.NO_COUNTERPART) & set(aliases.FLAG_ALIASES)
    assert set(aliases.FLAG_NOTES) <= set(aliases.FLAG_ALIASES)
