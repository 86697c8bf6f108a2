"""docs/extending.md, recipe by recipe: a throw-away beta controller, KL estimator, advantage
estimator, built-in reward and model family, each registered from outside klrl (as a user's module
would), checked through the config (validation, help, the places that list names) and removed
after; the controller, the estimator and the advantage estimator then run together in one compiled
iteration, and a logits estimator without a chunked form is refused on the chunked path before
anything compiles."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo import control
from klrl.algo import kl as kl_lib
from klrl.algo.advantages import AdvantageInputs, needs_critic
from klrl.config import ConfigError, ControllerConfig, KLConfig, PPOConfig, RewardConfig, RunConfig, aliases
from klrl.registry import ADVANTAGES, CONTROLLERS, ESTIMATORS, FAMILIES, REWARDS

DATA = Path(__file__).parents[1] / "data"


def _help(section: type, name: str) -> str:
    return str({f.name: f for f in dataclasses.fields(section)}[name].metadata["help"])


# ---- the recipes, as a user's module would write them ----------------------------------------------


@pytest.fixture
def doubling():
    """A beta controller: one lax.switch branch ``(beta, integral, kl, n, params) -> (beta, integral)``."""

    @CONTROLLERS.register("doubling", label=lambda c: "x2 per iteration", help="beta x2 each update")
    def _b_doubling(beta, integral, kl, n, p):
        return 2.0 * beta, integral

    yield _b_doubling
    CONTROLLERS.remove("doubling")


@pytest.fixture
def squared():
    """A KL estimator of the sampled tokens' log-probs: ``lr^2`` (twice k2)."""

    @ESTIMATORS.register("sq", inputs="logp")
    def sq(logp, ref_logp, mask, clamp=0.0):
        valid = jnp.asarray(mask) > 0
        lr = kl_lib.log_ratio(jnp.where(valid, logp, 0.0), jnp.where(valid, ref_logp, 0.0), clamp)
        return jnp.where(valid, jnp.square(lr), 0.0)

    yield sq
    ESTIMATORS.remove("sq")


@pytest.fixture
def total_variation():
    """A KL-like estimator of the full logits with no chunked form."""

    @ESTIMATORS.register("tv", inputs="logits")
    def tv(logits, ref_logits, mask, clamp=0.0):
        p, q = jax.nn.softmax(logits, -1), jax.nn.softmax(ref_logits, -1)
        return 0.5 * jnp.sum(jnp.abs(p - q), -1) * mask

    yield tv
    ESTIMATORS.remove("tv")


@pytest.fixture
def centred():
    """A grouped advantage estimator: the sequence return minus its group's mean, no critic."""

    @ADVANTAGES.register("centred", critic=False, grouped=True, help="return minus the group mean")
    def centred_estimator(x: AdvantageInputs, cfg: Any):
        r = x.seq_returns.reshape(-1, cfg.group_size)
        a = (r - r.mean(axis=1, keepdims=True)).reshape(-1)
        return a[:, None] * x.mask, jnp.zeros_like(x.mask)

    yield centred_estimator
    ADVANTAGES.remove("centred")


@pytest.fixture
def shouting():
    """A built-in text reward: the fraction of upper-case letters of each completion."""

    @REWARDS.register("shouting")
    def shouting(prompts, completions, **columns):
        return [sum(ch.isupper() for ch in c) / max(sum(ch.isalpha() for ch in c), 1) for c in completions]

    yield shouting
    REWARDS.remove("shouting")


# ---- each recipe through the config ----------------------------------------------------------------


def test_controller_recipe(doubling):
    from klrl.analysis import plots

    assert ControllerConfig(kind="doubling").kind == "doubling"  # the config accepts the new kind
    assert "doubling (beta x2 each update)" in _help(ControllerConfig, "kind")
    cfg = RunConfig().replace(ctrl={"kind": "doubling", "target": 2.0})
    assert "x2 per iteration" in plots.label(cfg)  # the plots read its label
    ctrl = control.from_config(cfg.ctrl)
    state = ctrl.update(ctrl.init(0.25), 1.0, 8)
    assert float(state.beta) == 0.5 and control.kind_name(state) == "doubling"
    assert control.kind_name(ctrl.update(ctrl.init(0.25), 1.0, 8)) == "doubling"
    CONTROLLERS.remove("doubling")
    with pytest.raises(ConfigError, match="^ctrl.kind: must be one of fixed, proportional, band, pi, dual "):
        ControllerConfig(kind="doubling")


def test_kl_estimator_recipe(squared):
    assert KLConfig(estimator="sq", loss_estimator="sq").estimator == "sq"
    assert ControllerConfig(estimator="sq").estimator == "sq"
    assert "sq" in _help(KLConfig, "estimator") and "sq" in _help(ControllerConfig, "estimator")
    assert {"kl/reward_sq_seq_sum", "kl/reward_sq_token_mean"} <= aliases.KLRL_METRICS
    rng = np.random.default_rng(0)
    logp, ref = (jnp.asarray(rng.normal(size=(3, 5)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((3, 5)) > 0.3, jnp.float32)
    got = kl_lib.estimate("sq", logp, ref, mask)
    np.testing.assert_allclose(np.asarray(got), 2 * np.asarray(kl_lib.k2(logp, ref, mask)), rtol=1e-6)
    ESTIMATORS.remove("sq")
    with pytest.raises(ConfigError, match="^kl.estimator: must be one of k1, k2, k3, abs, full "):
        KLConfig(estimator="sq")


def test_advantage_estimator_recipe(centred):
    assert needs_critic("centred") is False
    assert "centred (return minus the group mean)" in _help(PPOConfig, "advantage")
    assert "centred need >= 2" in _help(PPOConfig, "group_size")  # the group-size rule reads grouped=True
    with pytest.raises(ConfigError, match="^ppo.group_size: must be >= 2 for ppo.advantage=centred"):
        PPOConfig(advantage="centred")
    cfg = PPOConfig(advantage="centred", group_size=2)
    x = AdvantageInputs(
        jnp.zeros((4, 2)), jnp.array([1.0, 3.0, -2.0, 0.0]), jnp.zeros((4, 2)), jnp.ones((4, 2))
    )
    adv, _ = ADVANTAGES.get("centred")(x, cfg)
    np.testing.assert_array_equal(np.asarray(adv)[:, 0], [-1.0, 1.0, -1.0, 1.0])


def test_built_in_reward_recipe(shouting):
    from klrl.data.vocab import WordTokenizer
    from klrl.rewards import get, load_reward_fn, make_host_reward, parse_specs

    assert "shouting" in _help(RewardConfig, "fn")  # reward.fn's help lists the built-ins
    assert get("shouting") is shouting and load_reward_fn("shouting") is shouting
    cfg = RunConfig().replace(task={"name": "text"}, reward={"fn": "shouting,positivity", "weights": "1,0"})
    tok = WordTokenizer(("<pad>", "<eos>", "HEY", "hey"), pad_id=0, stop_ids=(1,))
    host = make_host_reward(*parse_specs(cfg.reward.fn, cfg.reward.weights), tok, ["a", "b"])
    response = np.array([[2, 2, 1], [3, 2, 1]], np.int32)
    scores = host.score_numpy(np.array([0, 1], np.int32), response, np.ones((2, 3), np.float32))[0]
    np.testing.assert_allclose(scores, [1.0, 0.5])  # "HEY HEY", "hey HEY"
    REWARDS.remove("shouting")
    with pytest.raises(KeyError, match="no built-in reward 'shouting'"):
        get("shouting")


def test_model_family_recipe(tmp_path):
    from klrl.models.base import forward
    from klrl.models.gpt2 import GPT2, config_from_hf
    from klrl.models.hf import CheckpointFormatError, load_hf
    from klrl.models.peft import layout
    from klrl.models.pretrained import from_pretrained
    from klrl.models.registry import get_family, register_family

    d = tmp_path / "tinyfam"
    shutil.copytree(DATA / "tiny_gpt2", d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "model_type": "tinyfam"}))
    unsupported = r"model_type 'tinyfam' is not supported \(gemma3_text, gpt2, llama,"
    with pytest.raises(CheckpointFormatError, match=unsupported):
        from_pretrained(d)

    @register_family("tinyfam", hf=("tinyfam",), hf_config=config_from_hf)
    class TinyFam(GPT2):  # a new family: its CausalLM class and its registration
        pass

    try:
        assert get_family("tinyfam") is TinyFam and "tinyfam" in FAMILIES
        model, params, _ = from_pretrained(d)
        ref, ref_params = load_hf(DATA / "tiny_gpt2")
        assert type(model) is TinyFam
        tokens = jnp.array([[1, 2, 3, 4]], jnp.int32)
        mask = jnp.ones((1, 4), jnp.float32)
        np.testing.assert_array_equal(
            np.asarray(forward(model, params, tokens, mask).logits),
            np.asarray(forward(ref, ref_params, tokens, mask).logits),
        )
        # what the rest of klrl reads of a family is declared on its class: sharding, PEFT layout
        assert model.partition_rules() is GPT2.PARTITION_RULES and layout(model, d) is GPT2.PEFT
        no_peft = type("NoPeft", (TinyFam,), {"PEFT": None})(model.config)
        with pytest.raises(
            CheckpointFormatError, match="NoPeft declares no Hugging Face layout .*gpt2, llama"
        ):
            layout(no_peft, d)
    finally:
        FAMILIES.remove("tinyfam")
    with pytest.raises(CheckpointFormatError, match="model_type 'tinyfam' is not supported"):
        from_pretrained(d)
    with pytest.raises(ValueError, match="hf and hf_config go together"):
        register_family("half", hf=("half",))(GPT2)


# ---- one compiled iteration, and the chunked path's refusal ------------------------------------------


def test_the_new_entries_run_in_one_compiled_iteration(doubling, squared, centred):
    from test_tasks import _cfg, _task

    from klrl.step.train import make_train

    cfg = _cfg().replace(
        ctrl={"kind": "doubling"}, kl={"estimator": "sq", "beta": 0.05},
        ppo={"advantage": "centred", "group_size": 2},
    )  # fmt: skip
    task = _task(cfg)
    train = make_train(cfg, task)
    assert train.context.critic is False  # critic=False: no value function is built
    state, m = train.step(train.init(0), task.env)
    assert float(m["ctrl/beta"]) == pytest.approx(0.1)  # the new controller moved beta
    assert np.isfinite(float(m["kl/reward_sq_seq_sum"])) and float(m["kl/reward_sq_seq_sum"]) >= 0
    assert np.isfinite(float(m["loss/total"])) and "loss/value" not in m


def test_a_logits_estimator_without_chunked_form_is_refused_before_compiling(total_variation):
    from test_tasks import _cfg, _task

    import klrl
    from klrl.step.train import make_train

    z, zr = (jax.random.normal(jax.random.key(i), (2, 3, 7)) for i in range(2))
    tv = kl_lib.estimate("tv", None, None, jnp.ones((2, 3)), z, zr)  # the full path reads the logits
    assert tv.shape == (2, 3) and bool(jnp.all(tv >= 0))
    cfg = _cfg().replace(kl={"estimator": "tv"}, model={"logits": "chunked"})
    task = _task(cfg)
    with pytest.raises(ConfigError, match="^kl.estimator: the KL estimator 'tv' reads the full"):
        klrl.run(cfg, task=task, write=False)  # at the API entry (klrl.checks.check_program)
    train = make_train(cfg, task)  # make_train trusts its input; the step's trace refuses it all the same
    with pytest.raises(ConfigError, match="'tv' reads the full"):
        train.step(train.init(0), task.env)


# ---- the "yours" column of docs/extending.md: each addition in a module outside klrl, run ---------------


def _module(tmp_path: Path, monkeypatch: Any, name: str, text: str) -> Any:
    """``text`` as the module ``name`` in ``tmp_path`` (a user's module: no file of klrl changed),
    imported."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


CONTROLLERS_MODULE = """
from klrl.registry import CONTROLLERS


def register(*names):
    for name in names:  # the one update rule each: "up" doubles beta, "down" halves it
        f = 2.0 if name == "up" else 0.5
        CONTROLLERS.register(name, label=lambda c: "x2 or /2", knobs=(), help="doubles or halves")(
            lambda beta, integral, kl, n, p, f=f: (beta * f, integral)
        )
"""


def test_an_old_checkpoint_resumes_after_controllers_are_registered(tmp_path, monkeypatch):
    """A checkpoint holds the kind by its name's code: written while ``up`` was registered before
    ``down``, it resumes with ``up`` after they were registered the other way round (a kind's place in
    the ``lax.switch`` changed), and its sweep knobs come from its registration."""
    from test_tasks import _cfg, _task

    import klrl
    from klrl.config.sweep import ctrl_knobs, unread
    from klrl.io.readers import read_jsonl

    mod = _module(tmp_path, monkeypatch, "klrl_test_user_controllers", CONTROLLERS_MODULE)
    mod.register("up", "down")
    try:
        cfg = _cfg().replace(
            ctrl={"kind": "up"}, kl={"beta": 0.05},
            train={"out_dir": str(tmp_path), "name": "run", "checkpoint_every": 1, "iterations": 2},
        )  # fmt: skip
        assert ctrl_knobs("up") == () and "ctrl.target" in unread(cfg)  # knobs=(): reads no knob
        task = _task(cfg)
        run_dir = klrl.run(cfg, task=task).dir
        assert [r["ctrl/beta"] for r in read_jsonl(run_dir / "metrics.jsonl")] == pytest.approx([0.1, 0.2])
        CONTROLLERS.remove("up")
        CONTROLLERS.remove("down")
        mod.register("down", "up")  # another process, another import order: "up" has another branch
        assert control.kinds()[-2:] == ("down", "up")
        klrl.run(cfg.replace(train={"iterations": 3}), task=task, resume=run_dir)
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert [r["ctrl/beta"] for r in rows] == pytest.approx([0.1, 0.2, 0.4])  # doubled, not halved
    finally:
        CONTROLLERS.remove("up")
        CONTROLLERS.remove("down")


TASK_MODULE = """
import jax.numpy as jnp
from test_tasks import _task

from klrl.tasks.base import Evaluators, JaxReward, register_task


def length_reward(env, ro):  # a reward in the graph: the fraction of the response before the stop
    return jnp.mean(ro.mask, axis=-1) * env["reward_scale"]


def first_token(env, ro):  # a metric in the graph, per example
    return {"toy/first_token_mean": ro.response[:, 0].astype(jnp.float32)}


@register_task("toy_task", help="a throw-away task")
def build(cfg, log=None):
    reward = JaxReward(length_reward, {"reward_scale": jnp.float32(2.0)})
    return _task(cfg, name="toy_task", reward=reward, evaluators=Evaluators(per_example=first_token))


def host_metric(row, samples):  # a metric on the host, by module:function
    return {"beta_x10": 10 * row["ctrl/beta"]}
"""


def test_a_task_its_reward_and_its_metrics_from_a_module_of_their_own(tmp_path, monkeypatch):
    """A task registered in a user's module, named by ``task.name``, with an in-graph reward and metric;
    two host-side metrics, one given to ``klrl.run`` and one named by ``train.metric_fns``."""
    from test_tasks import _cfg

    import klrl
    from klrl.config import TaskConfig
    from klrl.registry import TASKS

    _module(tmp_path, monkeypatch, "klrl_test_user_task", TASK_MODULE)
    try:
        assert "toy_task (a throw-away task)" in _help(TaskConfig, "name")
        cfg = _cfg().replace(
            task={"name": "toy_task"}, train={"metric_fns": "klrl_test_user_task:host_metric"}
        )
        seen = []
        result = klrl.run(
            cfg, write=False, metrics=[lambda row, samples: seen.append(row) or {"rows": len(seen)}]
        )
        m = result.metrics
        assert len(m["reward/task"]) == 2 and len(seen) == 2
        assert all(0.0 < r <= 2.0 for r in m["reward/task"])  # 2 x the fraction of real tokens
        assert all(0 <= t < 11 for t in m["toy/first_token_mean"])  # token ids of the toy vocabulary
        np.testing.assert_allclose(m["user/beta_x10"], 10 * np.asarray(m["ctrl/beta"]), rtol=1e-6)
        assert list(m["user/rows"]) == [1.0, 2.0]
    finally:
        TASKS.remove("toy_task")
    with pytest.raises(ConfigError, match="^task.name: must be one of"):
        TaskConfig(name="toy_task")


REWARD_MODULE = """
def shouting(prompts, completions, **columns):  # a host text reward: the upper-case fraction
    return [sum(ch.isupper() for ch in c) / max(sum(ch.isalpha() for ch in c), 1) for c in completions]
"""


def test_a_host_text_reward_by_module_and_function_runs_in_a_compiled_iteration(tmp_path, monkeypatch):
    from test_tasks import _cfg, _task

    from klrl.data.vocab import WordTokenizer
    from klrl.step.train import make_train
    from klrl.tasks.text import host_text_reward

    _module(tmp_path, monkeypatch, "klrl_test_user_reward", REWARD_MODULE)
    cfg = _cfg().replace(task={"name": "text"}, reward={"fn": "klrl_test_user_reward:shouting"})
    words = ("<pad>", "<eos>", *(f"W{i}" if i % 2 else f"w{i}" for i in range(2, 11)))
    tok = WordTokenizer(words, pad_id=0, stop_ids=(1,))
    texts = [f"prompt {i}" for i in range(16)]
    task = _task(cfg, tokenizer=tok, reward=host_text_reward(cfg, tok, texts, {}), prompt_texts=texts)
    train = make_train(cfg, task)
    state, m = train.step(train.init(0), task.env)
    assert 0.0 <= float(m["reward/task"]) <= 1.0  # the mean fraction of upper-case words
    task.reward.check()  # the host function did not fail
