"""Nothing accepted without effect (issue 41, item 2): every field has a decision in
:mod:`klrl.config.relevance`, every rule refuses a non-default value in one line naming both fields,
defaults never trigger one, and LoRA ranks are checked against the adapted layers' widths."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from klrl.config import SECTIONS, ConfigError, RunConfig, field_names
from klrl.config.relevance import ALWAYS_RELEVANT, IRRELEVANT, NOT_REFUSED, check_relevance, irrelevant

DATA = Path(__file__).parents[1] / "data"

# configs in which some rule's condition holds, every field at its default otherwise
CONTEXTS = [
    {},  # lora.rank 0, ctrl.kind fixed, testbed, frozen reference, rollback off, placement reward
    {"kl": {"placement": "loss"}},
    {"ppo": {"advantage": "grpo", "group_size": 2}},
    {"ppo": {"advantage": "rloo", "group_size": 2}},
    {"model": {"logits": "full"}},
    {"ctrl": {"warmup_iters": 3}},
    {"ctrl": {"warmup_iters": 3, "drives": "loss"}, "kl": {"placement": "loss", "loss_coef": 0.1}},
    {"train": {"mesh": "1,1,1", "samples_every": 0}},
    {"task": {"name": "wordclass"}},
    {"task": {"name": "text"}, "model": {"path": "some/model"}},
    {"lora": {"rank": 4}, "model": {"value_model": "head"}},
]
STRINGS = {"lora.targets": "qkv", "kl.estimator": "k2", "kl.loss_estimator": "k2", "kl.loss_agg": "seq_mean",
           "data.path": "p.jsonl", "data.format": "jsonl", "data.field": "text", "data.split": "test",
           "data.truncate": "error", "data.eval_path": "e.jsonl", "log.wandb_mode": "offline"}  # fmt: skip


def _values(name: str, default):
    """Non-default values to try for ``name``: the schema picks which are valid."""
    if isinstance(default, str):
        return [STRINGS.get(name, "x")]
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, default * 2]
    return [default * 2, default / 2, 0.5, default + 0.1] if default else [0.5, 0.05]


def _triggered(rule) -> RunConfig | None:
    s, f = rule.field.split(".", 1)
    default = getattr(RunConfig(), s).__getattribute__(f)
    for ctx in CONTEXTS:
        for v in _values(rule.field, default):
            try:
                cfg = RunConfig().replace(**{**ctx, s: {**ctx.get(s, {}), f: v}})
            except ConfigError:
                continue
            if rule.when(cfg):
                return cfg
    return None


def test_every_field_is_decided_once():
    """A new field fails here until it is in the table, always relevant, or not refused with a reason."""
    ruled = {r.field for r in IRRELEVANT}
    fields = set(field_names())
    decided = ruled | ALWAYS_RELEVANT | set(NOT_REFUSED)
    assert fields - decided == set(), f"fields without a relevance decision: {sorted(fields - decided)}"
    assert decided - fields == set(), f"decisions for fields that do not exist: {sorted(decided - fields)}"
    assert not (ruled & ALWAYS_RELEVANT) and not (ruled & set(NOT_REFUSED))
    assert not (ALWAYS_RELEVANT & set(NOT_REFUSED))
    assert all(NOT_REFUSED.values())


@pytest.mark.parametrize("rule", IRRELEVANT, ids=[f"{r.field}:{r.why[:30]}" for r in IRRELEVANT])
def test_each_rule_refuses_a_non_default_value_naming_both_fields(rule):
    cfg = _triggered(rule)
    assert cfg is not None, f"no context makes {rule.field} irrelevant: add one to CONTEXTS"
    found = dict(irrelevant(cfg))
    assert rule.field in found
    line = found[rule.field]
    assert line.startswith(f"{rule.field}=") and "has no effect" in line and "\n" not in line
    others = [n for n in field_names() if n != rule.field and n in line]
    assert others, f"{line!r} names no other field"
    with pytest.raises(ConfigError, match=f"^{rule.field}="):
        check_relevance([cfg])


@pytest.mark.parametrize("ctx", CONTEXTS, ids=[str(c) for c in CONTEXTS])
def test_defaults_never_trigger(ctx):
    cfg = RunConfig().replace(**ctx)
    set_by_ctx = {f"{s}.{f}" for s, fs in ctx.items() for f in fs}
    assert [n for n, _ in irrelevant(cfg) if n not in set_by_ctx] == []


def test_the_known_cases():
    cases = [
        ({"lora": {"alpha": 32.0}}, "lora.alpha=32.0 has no effect without lora.rank > 0"),
        ({"lora": {"targets": "qkv"}}, "lora.targets='qkv' has no effect without lora.rank > 0"),
        ({"lora": {"rank": 4, "critic_rank": 2}, "model": {"value_model": "head"}},
         "lora.critic_rank=2 has no effect with model.value_model=head"),
        ({"ctrl": {"kp": 0.3}}, "ctrl.kp=0.3 has no effect with ctrl.kind=fixed"),
        ({"ctrl": {"kind": "band", "kp": 0.3}}, "ctrl.kp=0.3 has no effect with ctrl.kind=band"),
    ]  # fmt: skip
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            check_relevance([RunConfig().replace(**fields)])
    for used in ({"lora": {"rank": 4, "alpha": 32.0, "targets": "qkv"}}, {"ctrl": {"kind": "pi", "kp": 0.3}},
                 {"lora": {"rank": 4, "critic_rank": 2}}):  # fmt: skip
        check_relevance([RunConfig().replace(**used)])


def test_rollback_knobs_with_guards_alone():
    """train.rollback_guards alone turns the rollback on: its factor and limit count, rollback_threshold
    (train.rollback_metric's ratio) does not."""
    guards = {"rollback_guards": "text/distinct_2<0.7"}
    check_relevance([RunConfig().replace(train={**guards, "rollback_factor": 3.0, "max_rollbacks": 1})])
    off = r"^train\.rollback_factor=3\.0 has no effect without train\.rollback_metric or "
    with pytest.raises(ConfigError, match=off + r"train\.rollback_guards \(rollback off\)"):
        check_relevance([RunConfig().replace(train={"rollback_factor": 3.0})])
    with pytest.raises(ConfigError, match=r"^train\.rollback_threshold=1\.5 has no effect without "
                       r"train\.rollback_metric"):  # fmt: skip
        check_relevance([RunConfig().replace(train={**guards, "rollback_threshold": 1.5})])


def test_a_sweep_refuses_only_what_no_member_reads_and_a_resume_only_the_flags():
    fixed = RunConfig().replace(ctrl={"kp": 0.3})
    pi = fixed.replace(ctrl={"kind": "pi"})
    check_relevance([fixed, pi])  # the pi member reads it
    with pytest.raises(ConfigError, match="ctrl.kp=0.3 has no effect"):
        check_relevance([fixed, fixed.replace(kl={"beta": 0.5})])
    check_relevance([fixed], only=["kl.beta"])  # a resume: the run's own config.json is not refused


def test_the_api_refuses_before_anything_is_built():
    from klrl.checks import check_config

    with pytest.raises(ConfigError, match="lora.alpha=8.0 has no effect"):
        check_config([RunConfig().replace(lora={"alpha": 8.0})], stacked=False)
    check_config([RunConfig().replace(lora={"alpha": 8.0})], stacked=False, resume="r")  # its own config


# ---- LoRA ranks against the layers' widths -----------------------------------------------------------
def test_adapted_widths_are_the_layers_in_and_out():
    """Widths against the checkpoints' config.json (tiny_llama: hidden 32, intermediate 64, 2 of 4 heads of
    8 for k and v; tiny_gpt2: n_embd 32, 3 x 32 for c_attn, 4 x 32 for the MLP), at a rank equal to the
    layer count (2) as well: a layer axis is not taken for the rank's."""
    from klrl.models import lora
    from klrl.models.pretrained import from_pretrained

    want = {
        "tiny_llama": {"layers/q_proj": (32, 32), "layers/k_proj": (32, 16), "layers/v_proj": (32, 16),
                       "layers/o_proj": (32, 32), "layers/gate_proj": (32, 64), "layers/up_proj": (32, 64),
                       "layers/down_proj": (64, 32)},
        "tiny_gpt2": {"h/c_attn": (32, 96), "h/c_proj": (32, 32), "h/c_fc": (32, 128),
                      "h/mlp_c_proj": (128, 32)},
    }  # fmt: skip
    for name, widths in want.items():
        model, params, _ = from_pretrained(DATA / name)
        for r in (2, 3):
            assert lora.adapted_widths(lora.LoRA(model, r, 4.0), params) == widths
        assert lora.check(lora.LoRA(model, 16, 4.0), params)  # the narrowest layer's width: accepted
        with pytest.raises(ValueError, match=r"^lora.rank: (17|33) exceeds the width of the adapted layer "
                           r"(layers/k_proj|h/c_proj|h/c_attn)"):  # fmt: skip
            lora.check(lora.LoRA(model, 17 if name == "tiny_llama" else 33, 4.0), params, "lora.rank")


def test_a_huge_rank_is_refused_from_the_shapes_alone():
    from klrl.checks import check_lora_widths

    cfg = RunConfig().replace(model={"d_model": 32, "n_heads": 2}, task={"name": "wordclass"})
    with pytest.raises(ConfigError, match=r"^lora.rank: 1000000 exceeds the width of the adapted layer "
                       r"h0/\w+ \(min\(in, out\) = min\(\d+, \d+\) = 32\)"):  # fmt: skip
        check_lora_widths(cfg.replace(lora={"rank": 1_000_000}))
    with pytest.raises(ConfigError, match="^lora.critic_rank: 33 exceeds"):
        check_lora_widths(cfg.replace(lora={"rank": 4, "critic_rank": 33}))
    check_lora_widths(cfg.replace(lora={"rank": 32}))


def test_every_section_is_walked():
    assert {s for s in SECTIONS} == {n.split(".")[0] for n in field_names()}
    assert len(field_names()) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values())
