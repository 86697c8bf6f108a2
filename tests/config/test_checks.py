"""klrl.checks: every rule of a run or sweep that needs no compiled code raises ConfigError naming the field
or the part; klrl.run / klrl.sweep check at their entry, before anything is built or compiled."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from test_tasks import P, R, V, _cfg, _task  # the toy task of tests/tasks/test_tasks.py

from klrl.checks import (
    check_config,
    check_device_count,
    check_devices,
    check_export,
    check_model_fields,
    check_parts,
    check_program,
    check_task,
)
from klrl.config import ConfigError, RunConfig, TaskShape
from klrl.data.vocab import WordTokenizer
from klrl.models.gpt import GPT
from klrl.tasks.base import JaxReward, Task, TokenPool


# ---- 1. the configuration -------------------------------------------------------------------------------
def test_check_config_members_resume_and_rollback() -> None:
    cfg = RunConfig()
    check_config([cfg], stacked=False)
    with pytest.raises(ConfigError, match="^sweep: no members$"):
        check_config([], stacked=True)
    with pytest.raises(ConfigError, match=r"^sampling\.response_len: cannot differ between sweep members"):
        check_config([cfg, cfg.replace(sampling={"response_len": 8})], stacked=True)
    check_config([cfg, cfg.replace(kl={"beta": 1.0}, train={"seed": 3})], stacked=True, sweep_devices=2)
    with pytest.raises(ConfigError, match="^sweep: 3 members do not split over 2 sweep device groups$"):
        check_config([cfg] * 3, stacked=True, sweep_devices=2)
    with pytest.raises(ConfigError, match=r"^resume: a resumed run writes to its run directory \(write=True"):
        check_config([cfg], stacked=False, write=False, resume="R")
    with pytest.raises(ConfigError, match=r"^resume: a resumed sweep writes to its sweep directory"):
        check_config([cfg], stacked=True, write=False, resume="R")
    check_config([cfg], stacked=False, write=True, resume="R")
    rollback = cfg.replace(train={"rollback_metric": "reward/task"})
    with pytest.raises(ConfigError, match=r"^train\.rollback_metric: the quality rollback needs checkpoints"):
        check_config([rollback], stacked=False, write=False)
    check_config([rollback], stacked=False, write=True)
    guards = cfg.replace(train={"rollback_guards": "text/distinct_2<0.7"})  # guards alone: the same rule
    with pytest.raises(ConfigError, match=r"^train\.rollback_guards: the quality rollback needs checkpoints"):
        check_config([guards], stacked=False, write=False)


@pytest.mark.parametrize("task", ["testbed", "wordclass", "peer"])
@pytest.mark.parametrize("field", ["path", "reward_path", "eval_path"])
def test_a_model_path_the_task_does_not_read_is_an_error(task, field) -> None:
    """The built-in tasks that train klrl's own GPT read no checkpoint: model.path there trained the GPT
    and crashed at the end (``'GPT' object has no attribute 'params_to_hf'``); refused at the entry."""
    cfg = RunConfig().replace(task={"name": task}, model={field: "m.gguf"})
    want = rf"^model\.{field}: task {task} does not read it \(it trains klrl's own GPT.*task\.name=text$"
    with pytest.raises(ConfigError, match=want):
        check_config([cfg], stacked=False)
    with pytest.raises(ConfigError, match=want):
        check_config([cfg, cfg.replace(kl={"beta": 1.0})], stacked=True)
    check_model_fields(cfg.replace(task={"name": "text"}))  # the text task reads them


def test_model_paths_that_would_be_ignored_are_errors() -> None:
    text = RunConfig().replace(task={"name": "text"}, model={"path": "m.gguf"})
    check_config([text], stacked=False)
    cases = [
        (text.replace(model={"reward_path": "rm"}, reward={"fn": "positivity"}),
         False, r"^model\.reward_path: not read when reward\.fn is given"),
        (text.replace(model={"value_path": "v", "value_model": "head"}), False,
         r"^model\.value_path: read only with model\.value_model=separate \(got head\)$"),
        (text.replace(model={"value_path": "v", "value_model": "separate"},
                      ppo={"advantage": "grpo", "group_size": 2}),
         False, r"^model\.value_path: ppo\.advantage=grpo trains no value model$"),
        (text.replace(model={"value_path": "v", "value_model": "separate"}), True,
         r"^model\.value_path: a sweep's members draw a fresh value model each"),
    ]  # fmt: skip
    for cfg, stacked, want in cases:
        with pytest.raises(ConfigError, match=want):
            check_config([cfg] * (2 if stacked else 1), stacked=stacked)
    check_config([text.replace(model={"value_path": "v", "value_model": "separate"})], stacked=False)


def test_a_policy_that_cannot_be_written_back_is_refused_before_compiling() -> None:
    """A task with ``model.path`` whose policy klrl cannot write back as an HF directory (its own GPT, a
    tokenizer without ``save``): a :class:`ConfigError` from :func:`check_program`, not a crash after the
    last iteration; a pretrained policy with its tokenizer passes."""
    from pathlib import Path

    from klrl.models.pretrained import from_pretrained

    cfg = _cfg()
    task = _task(cfg)
    check_program([cfg], task, 1)  # no model.path: nothing is written back
    with_path = cfg.replace(model={"path": "m.gguf"})
    want = (
        r"^model\.path: task toy trains a GPT policy, not the model of model\.path, and it cannot be "
        r"written back as an HF directory \(no params_to_hf\)"
    )
    with pytest.raises(ConfigError, match=want):
        check_program([with_path], task, 1)
    model, params, tok = from_pretrained(Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf")
    with pytest.raises(ConfigError, match=r"\(no a tokenizer with save\(\)\)"):
        check_export(dataclasses.replace(task, policy=model, policy_params=params), model)
    check_export(dataclasses.replace(task, policy=model, policy_params=params, tokenizer=tok), model)


# ---- 2. the task and the models against the policy ------------------------------------------------------
def test_check_task_against_the_vocabulary_and_lengths() -> None:
    from klrl.tasks.base import builtin_task_shape
    from klrl.tasks.language import make_language

    cfg = RunConfig()
    shape = builtin_task_shape(cfg)
    assert shape.vocab_size == make_language(3).vocab_size == 147  # the language the task builds
    assert shape.max_len == max(cfg.task.pretrain_len, cfg.task.prompt_len + cfg.sampling.response_len)
    check_task(cfg.replace(sampling={"top_k": 147}), shape)  # k = V is the whole vocabulary
    with pytest.raises(ConfigError, match="^sampling.top_k: must be <= the task's vocabulary size 147"):
        check_task(cfg.replace(sampling={"top_k": 148}), shape)
    check_task(cfg, TaskShape(vocab_size=200, prompt_len=8, max_len=24))
    with pytest.raises(ConfigError, match="^sampling.response_len:"):
        check_task(cfg, TaskShape(vocab_size=200, prompt_len=8, max_len=23))


@dataclasses.dataclass(frozen=True)
class _Ids:
    """A tokenizer's ids only (what the check reads), free of WordTokenizer's own validation."""

    vocab_size: int
    pad_id: int
    stop_ids: tuple[int, ...]


def _parts(task: Task, batch: int = 8) -> None:
    check_parts(task, task.policy, R, batch)


def test_prompt_source_wider_than_prompt_len_is_an_error():
    cfg = _cfg()
    _parts(_task(cfg))
    with pytest.raises(
        ConfigError, match=r"prompts: the prompt source is 12 tokens wide, the task's prompt_len is 8"
    ):
        _parts(_task(cfg, width=12))
    with pytest.raises(ConfigError, match="prompts: the prompt source is 5 tokens wide"):
        _parts(_task(cfg, width=5))
    bad_mask = dataclasses.replace(
        _task(cfg), prompts=TokenPool(jnp.zeros((16, P), jnp.int32), jnp.ones((16, 3)))
    )
    with pytest.raises(
        ConfigError, match=r"prompts: expected prompts \[N, P\] and prompt_mask of the same shape"
    ):
        _parts(bad_mask)
    floats = dataclasses.replace(_task(cfg), prompts=TokenPool(jnp.zeros((16, P)), jnp.ones((16, P))))
    with pytest.raises(ConfigError, match="prompts: token ids must be integers"):
        _parts(floats)


@pytest.mark.parametrize(
    "fn,got",
    [
        (lambda env, ro: jnp.mean(ro.mask, axis=-1, keepdims=True), r"\(8, 1\) float32"),
        (lambda env, ro: jnp.sum(ro.response, axis=-1), r"\(8,\) int32"),
        (lambda env, ro: jnp.mean(ro.mask), r"\(\) float32"),
    ],
)
def test_reward_of_the_wrong_shape_or_dtype_is_an_error(fn, got):
    cfg = _cfg()
    with pytest.raises(
        ConfigError, match=rf"reward: must return \[B\] = \(8,\) float32 per batch, got {got}"
    ):
        _parts(_task(cfg, reward=JaxReward(fn)))


def test_vocabulary_mismatch_is_an_error():
    cfg = _cfg()
    with pytest.raises(ConfigError, match=r"tokenizer: 40 token ids, the policy's vocabulary has only 11"):
        _parts(_task(cfg, vocab=40))
    stops = dataclasses.replace(
        _task(cfg), tokenizer=WordTokenizer(tuple(f"w{i}" for i in range(V)), pad_id=0, stop_ids=(1, 10))
    )
    _parts(stops)  # in range: fine
    for pad, stop_ids in ((0, (1, 11)), (-1, (1,)), (0, ())):  # outside [0, 11), or no stop id at all
        tok = _Ids(vocab_size=V, pad_id=pad, stop_ids=stop_ids)
        want = rf"tokenizer: pad id {pad} and stop ids .* must be .*\[0, 11\)"
        with pytest.raises(ConfigError, match=want):
            _parts(dataclasses.replace(stops, tokenizer=tok))
    with pytest.raises(ConfigError, match="policy: 10 positions"):
        _parts(_task(cfg, policy=GPT(cfg.model, V, P + R - 2)))


def test_check_program_checks_the_policy_and_reward_that_train():
    """``policy=`` and ``reward=`` (what make_train gets instead of the task's) are the ones checked;
    the reward is traced on one device's share of the batch."""
    cfg = _cfg()
    task = _task(cfg)
    check_program([cfg], task, 1)
    with pytest.raises(ConfigError, match="policy: 10 positions"):
        check_program([cfg], task, 1, policy=GPT(cfg.model, V, P + R - 2))
    bad = JaxReward(lambda env, ro: jnp.mean(ro.mask))
    with pytest.raises(ConfigError, match=r"reward: must return \[B\] = \(4,\) float32 per batch"):
        check_program([cfg], task, 2, reward=bad)  # 8 rows over 2 devices: 4 per device
    with pytest.raises(ConfigError, match="^sampling.top_k:"):
        check_program([cfg, cfg.replace(sampling={"top_k": 12})], task, 1)
    # the devices before the parts: 3 devices cannot split 8 rows, whatever the reward does
    with pytest.raises(ConfigError, match=r"^train\.batch_size: must be divisible by the device count"):
        check_program([cfg], task, 3, reward=bad)


# ---- 3. the devices ------------------------------------------------------------------------------------
def test_check_devices() -> None:
    cfg = RunConfig().replace(train={"batch_size": 16}, ppo={"minibatches": 2})
    check_devices(cfg, 1)
    check_devices(cfg, 4)  # 16 / 4 and minibatch 8 / 4
    with pytest.raises(ConfigError, match=r"^train\.batch_size:"):
        check_devices(cfg, 3)
    with pytest.raises(ConfigError, match=r"^ppo\.minibatches:"):
        check_devices(cfg, 16)  # minibatch of 8 cannot split over 16 devices
    grouped = RunConfig().replace(train={"batch_size": 16}, ppo={"minibatches": 1, "group_size": 8})
    check_devices(grouped, 2)
    with pytest.raises(ConfigError, match=r"^ppo\.group_size:"):
        check_devices(grouped, 4)  # 4 per device cannot hold a group of 8


def test_check_device_count() -> None:
    n = jax.device_count()
    cfg = RunConfig().replace(train={"batch_size": 16 * n, "devices": n}, ppo={"minibatches": 1})
    check_device_count(cfg)
    with pytest.raises(ConfigError, match=rf"^train\.devices: asked for {n + 1} devices, {n} available$"):
        check_device_count(cfg.replace(train={"devices": n + 1}))
    check_device_count(cfg.replace(train={"devices": 0}))  # all the devices there are
    check_device_count(cfg.replace(train={"devices": 0, "mesh": f"{n},1,1"}))  # train.mesh's data axis


def test_preflight_checks_each_members_model_fields_once(monkeypatch) -> None:
    """``check_model_fields`` ran twice on member 0 (``check_config`` and ``preflight``'s loop); once per
    member now (issue 50)."""
    import klrl.checks as checks
    from klrl.checks import preflight

    seen = []
    real = checks.check_model_fields
    monkeypatch.setattr(checks, "check_model_fields", lambda cfg, **k: seen.append(cfg) or real(cfg, **k))
    cfg = RunConfig()
    members = [cfg.replace(kl={"beta": b}) for b in (0.1, 1.0)]
    preflight(members, "sweep", write=False)
    assert seen == members
    seen.clear()
    preflight([cfg], "run", write=False)
    assert seen == [cfg]
