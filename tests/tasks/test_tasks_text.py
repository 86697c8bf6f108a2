"""task text: a pretrained model through ``--model.path``, its reward model, bad input as one line, and
the final policy written with ``save_pretrained`` (reloaded, it holds the trained parameters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_line_error

from klrl.cli import legacy_main
from klrl.config import DataConfig, ModelConfig, RunConfig
from klrl.models.heads import detach
from klrl.models.rollout import Rollout
from klrl.tasks.text import model_reward, reward_model

DATA = Path(__file__).parents[1] / "data"
GGUF = DATA / "tiny_gguf" / "tiny.gguf"


def _error(capsys, argv) -> str:
    return one_line_error(capsys, legacy_main, argv)


def test_missing_model_path_is_one_line(capsys, tmp_path):
    line = _error(capsys, ["--task.name", "text", "--model.path", str(tmp_path / "nope"),
                           "--train.out_dir", str(tmp_path / "runs")])  # fmt: skip
    assert line.startswith("error: model.path:") and "nope" in line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_text_task_without_model_path_is_one_line(capsys, tmp_path):
    line = _error(capsys, ["--task.name", "text", "--train.out_dir", str(tmp_path)])
    assert line.startswith("error: model.path:")


def test_bad_model_dir_is_one_line(capsys, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(DATA / "tiny_llama", bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "nonesuch"}))
    line = _error(capsys, ["--task.name", "text", "--model.path", str(bad), "--train.out_dir", str(tmp_path)])
    assert "config.json" in line and "nonesuch" in line


def test_reward_model_reads_score_head_like_transformers():
    """The JaxReward of a ForSequenceClassification directory gives transformers' scores (golden)."""
    cfg = RunConfig(model=ModelConfig(reward_path=str(DATA / "tiny_llama_cls")))
    model, params = reward_model(cfg)
    g = np.load(DATA / "tiny_llama_cls" / "golden.npz")
    tokens, mask = g["tokens"].astype(np.int32), g["mask"].astype(np.float32)
    p = 6
    assert mask[:, p:].min() == 1  # left padding only: the response part is all real tokens
    ro = Rollout(tokens[:, :p], mask[:, :p], tokens[:, p:], mask[:, p:], None, None, None)
    r = model_reward(model, params)
    got = jax.jit(r.fn)(r.params, ro)
    np.testing.assert_allclose(np.asarray(got), g["scores"][:, 0], atol=1e-5)


def test_tiny_pretrained_end_to_end_saves_trained_policy(tiny_gguf_run):
    """The 2-iteration run of conftest.tiny_gguf_run: its policy/ directory holds the trained parameters."""
    from klrl.models import from_pretrained

    result = tiny_gguf_run
    assert isinstance(result.config.data, DataConfig)
    out = result.dir / "policy"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    _, start, _ = from_pretrained(GGUF)
    _, saved, tok = from_pretrained(out)
    trained = detach(jax.device_get(result.state.params["policy"]))[0]
    assert jax.tree.structure(saved) == jax.tree.structure(trained)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(start), strict=True)
    )
    assert moved > 0  # the saved policy is the trained one, not the initial one
    assert tuple(tok.stop_ids) == (254, 252)


def test_host_reward_sees_each_rows_prompt(tmp_path):
    """reward.fn: the host function gets the prompt of each row (by the rollout's prompt_idx) and the
    response text."""
    from klrl.data.prompts import load_prompts
    from klrl.tasks.text import make_text_task

    f = tmp_path / "rew.py"
    f.write_text(
        "def fn(prompts, completions):\n"
        "    return [len(p) + 1000 * len(c) for p, c in zip(prompts, completions)]\n"
    )
    cfg = RunConfig.from_dict(
        {"model": {"path": str(GGUF)}, "task": {"name": "text"}, "data": {"prompt_len": 48, "limit": 6},
         "reward": {"fn": f"{f}:fn", "weights": "2"}}
    )  # fmt: skip
    task = make_text_task(cfg)
    tok = task.tokenizer
    pool = load_prompts(cfg.data, tok).train
    rows = np.array([3, 0, 5])
    env = task.env
    response = np.array([tok.encode("hi")[:2] + [0, 0]] * 3, np.int32)
    mask = np.array([[1, 1, 0, 0]] * 3, np.float32)
    ro = Rollout(env["prompts"][rows], env["prompt_mask"][rows], response, mask, None, None, None, rows)
    got = np.asarray(jax.jit(task.reward.fn)(env, ro))
    text = tok.decode([int(t) for t in response[0, :2]], skip_special_tokens=True)
    want = [2.0 * (len(pool.prompts[i]) + 1000 * len(text)) for i in rows]
    np.testing.assert_allclose(got, want)


def test_text_task_counts_templated_and_truncated_prompts_in_a_log_line_not_a_warning(tmp_path):
    """On the tiny GGUF (its template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, 8 tokens around
    the content): a templated prompt is encoded as it is, a long one keeps the user header and the end
    of turn and fills the budget exactly; the counts are in one log line, task.json's info and the
    metrics, and no Python warning is emitted."""
    import warnings

    from klrl.tasks.text import make_text_task

    templated = "<|im_start|>user\nName a fruit.<|im_end|>\n"
    long = "Describe a rainy afternoon in a few calm sentences, then say why it was lovely. " * 3
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (templated, "Say hi.", long)))
    P = 24
    cfg = RunConfig.from_dict(
        {"model": {"path": str(GGUF)}, "task": {"name": "text"}, "data": {"path": str(path), "prompt_len": P}}
    )
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task = make_text_task(cfg, log=lines.append)
    assert not any("data.prompt_len" in x for x in lines)  # logged by the run, once its checks passed
    tok = task.tokenizer
    tokens, mask = np.asarray(task.env["prompts"]), np.asarray(task.env["prompt_mask"])
    rows = [[int(t) for t, k in zip(r, m, strict=True) if k] for r, m in zip(tokens, mask, strict=True)]
    assert rows[0] == tok.encode(templated)  # once, not wrapped in a second user turn
    assert rows[1] == tok.encode("<|im_start|>user\nSay hi.<|im_end|>\n")
    head, tail = tok.encode("<|im_start|>user\n"), tok.encode("<|im_end|>\n")
    assert len(rows[2]) == P and rows[2] == head + tok.encode(long)[-(P - len(head) - len(tail)) :] + tail
    assert task.info["data/prompts_templated"] == 1 and task.info["data/prompts_truncated"] == 1
    assert task.info["notes"] == [
        f"prompts {path}: 1 of 3 already carry the chat template (not wrapped again); 1 of 3 longer than "
        f"data.prompt_len = {P} tokens were cut to it inside the user content (its first tokens dropped; "
        "the chat template kept)"
    ]
    out = task.evaluators.batch(
        None, Rollout(tokens, mask, tokens[:, :4], mask[:, :4], None, None, None), None, {}
    )
    assert float(out["data/prompts_templated"]) == 1.0 and float(out["data/prompts_truncated"]) == 1.0


def test_the_run_logs_the_prompt_note_once_its_checks_have_passed(capsys, tmp_path, monkeypatch):
    """The note of the prompts cut to the budget is logged by make_program after check_program and
    make_train's adapter checks (not with train.quiet), so a user error found by the checks stays the
    one line on stderr."""
    import klrl.api
    import klrl.loop.build
    from klrl.config import ConfigError
    from klrl.data.prompts import FILES

    class Built(Exception):
        pass

    def stop(*a, **k):
        raise Built

    monkeypatch.setattr(klrl.loop.build, "Program", stop)  # what follows the notes: not needed here
    cfg = RunConfig.from_dict(
        {"model": {"path": str(GGUF)}, "task": {"name": "text"}, "data": {"prompt_len": 16, "limit": 4}}
    )
    note = (
        f"prompts {FILES / 'instructions.jsonl'}: 4 of 4 longer than "
        "data.prompt_len = 16 tokens were cut to it inside the user content (its first tokens dropped; the "
        "chat template kept)"
    )
    for quiet, want in ((False, [note]), (True, [])):
        lines = []
        with pytest.raises(Built):
            klrl.loop.build.make_program(
                [cfg.replace(train={"quiet": quiet})], stacked=False, log=lines.append
            )
        assert [x for x in lines if x.startswith("prompts ")] == want
    with pytest.raises(Built):  # no log given: stderr
        klrl.loop.build.make_program([cfg], stacked=False)
    assert note in capsys.readouterr().err

    def bad(*a, **k):
        raise ConfigError("sampling.top_k: a check that fails")

    monkeypatch.setattr(klrl.api, "check_program", bad)
    line = _error(capsys, ["--task.name", "text", "--model.path", str(GGUF), "--data.prompt_len", "16",
                           "--data.limit", "4", "--train.out_dir", str(tmp_path / "runs")])  # fmt: skip
    assert line == "error: sampling.top_k: a check that fails"


def test_data_split_on_a_jsonl_file_is_one_line_before_the_model_is_read(capsys, tmp_path, monkeypatch):
    from klrl.tasks import text

    monkeypatch.setattr(text, "_load", lambda *a, **k: pytest.fail("the model was read before the check"))
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Say hi."}\n')
    line = _error(capsys, ["--task.name", "text", "--model.path", str(GGUF), "--data.path", str(path),
                           "--data.split", "nosuch", "--data.prompt_len", "16",  # (fits the 64-token model)
                           "--train.out_dir", str(tmp_path / "runs")])  # fmt: skip
    assert line == (
        f"error: data.split: 'nosuch' is read only from a saved datasets.DatasetDict directory; {path} is a "
        ".jsonl file, which has no splits"
    )


def test_bad_reward_fn_is_one_line(capsys, tmp_path):
    line = _error(capsys, ["--task.name", "text", "--model.path", str(GGUF), "--reward.fn", "nonesuch_reward",
                           "--data.prompt_len", "16", "--train.out_dir", str(tmp_path)])  # fmt: skip
    assert "nonesuch_reward" in line


def test_separate_value_model_is_the_pretrained_trunk_with_a_fresh_head():
    from klrl.models.heads import HEAD_KEY
    from klrl.tasks.text import make_text_task, value_models

    cfg = RunConfig.from_dict(
        {"model": {"path": str(GGUF), "value_model": "separate"}, "task": {"name": "text"},
         "data": {"prompt_len": 16, "limit": 4}}
    )  # fmt: skip
    task = make_text_task(cfg)
    got = value_models(cfg, task)
    trunk, head = detach(got["value_params"])
    for a, b in zip(jax.tree.leaves(trunk), jax.tree.leaves(task.policy_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert head["kernel"].shape == (task.policy.hidden_size, 1) and HEAD_KEY not in trunk
    assert value_models(cfg.replace(model={"value_model": "head"}), task) == {}


def test_text_evaluators_match_python_loop_references():
    from test_textmetrics import ref_distinct, ref_rep

    from klrl.tasks.text import text_evaluators

    rng = np.random.default_rng(0)
    resp = rng.integers(0, 5, (6, 8)).astype(np.int32)
    mask = (np.arange(8)[None] < rng.integers(1, 9, (6, 1))).astype(np.float32)
    ro = Rollout(np.zeros((6, 2), np.int32), np.ones((6, 2), np.float32), resp, mask, None, None, None)
    ev = text_evaluators(8)
    assert ev.per_example(None, ro) == {}
    got = jax.jit(lambda r: ev.batch(None, r, jnp.zeros(6), {}))(ro)
    want = {"text/distinct_1": ref_distinct(resp, mask, 1), "text/distinct_2": ref_distinct(resp, mask, 2),
            "text/rep_4": ref_rep(resp, mask, 4)}  # fmt: skip
    for k in ("text/distinct_1", "text/distinct_2", "text/rep_4"):
        np.testing.assert_allclose(float(got[k]), want[k], rtol=1e-6)
    short = ro._replace(response=resp[:, :3], mask=mask[:, :3])
    assert "text/rep_4" not in text_evaluators(3).batch(None, short, None, {})


def test_text_run_logs_text_metrics_and_the_evaluator_lms_perplexity(tmp_path):
    """With the reference itself as the evaluator LM (``model.eval_path`` = ``model.path``), its
    perplexity of the samples is the reference's (``eval/ref_ppl``) at every iteration."""
    import klrl

    cfg = RunConfig.from_dict(
        {"model": {"path": str(GGUF), "eval_path": str(GGUF)}, "task": {"name": "text"},
         "data": {"prompt_len": 16, "limit": 8}, "sampling": {"response_len": 6},
         "ppo": {"epochs": 1, "minibatches": 2}, "reward": {"fn": "positivity"},
         "train": {"iterations": 2, "batch_size": 4, "quiet": True}}
    )  # fmt: skip
    m = klrl.run(cfg, write=False).metrics
    np.testing.assert_allclose(m["eval/independent_ppl"], m["eval/ref_ppl"], rtol=1e-4)
    for k in ("text/distinct_1", "text/distinct_2", "text/rep_4"):
        assert ((m[k] >= 0) & (m[k] <= 1)).all(), (k, m[k])
    assert (m["text/distinct_1"] > 0).all()
    # every one of the 8 prompts is longer than 16 tokens with the template: a constant of the run
    np.testing.assert_array_equal(m["data/prompts_truncated"], [8.0, 8.0])
    np.testing.assert_array_equal(m["data/prompts_templated"], [0.0, 0.0])


def test_the_two_guard_recipe_of_a_text_run_is_its_metrics(tmp_path):
    """docs/reliability.md's recipe (issue 47): a guard on the judge's perplexity and one on distinct-2 name
    metrics of a text run with an evaluator LM (refused before training otherwise: test_reliability), and
    the checkpoint keeps both references, each the metric at iteration 0."""
    import klrl
    from klrl.io import checkpoint as ckpt

    cfg = RunConfig.from_dict(
        {"model": {"path": str(GGUF), "eval_path": str(GGUF)}, "task": {"name": "text"},
         "data": {"prompt_len": 16, "limit": 8}, "sampling": {"response_len": 6},
         "ppo": {"epochs": 1, "minibatches": 2}, "reward": {"fn": "positivity"},
         "train": {"iterations": 2, "batch_size": 4, "quiet": True, "checkpoint_every": 1,
                   "rollback_guards": "eval/independent_ppl>100, text/distinct_2<0.01"}}
    )  # fmt: skip
    m = klrl.run(cfg, run_dir=tmp_path / "r").metrics
    mgr = ckpt.manager(tmp_path / "r", read_only=True)
    try:
        saved = ckpt.read_meta(mgr, 2)["rollback_base"]
    finally:
        mgr.close()
    assert saved["metric"] == "eval/independent_ppl" and saved["value"] == pytest.approx(
        m["eval/independent_ppl"][0]
    )
    assert saved["others"]["text/distinct_2"] == [pytest.approx(m["text/distinct_2"][0])]


def test_model_path_on_the_default_task_selects_the_text_task():
    import argparse

    from klrl.cli.args import config_from_args

    def cfg(**kw):
        return config_from_args(argparse.Namespace(config=None, **kw))

    assert cfg(**{"model.path": str(GGUF)}).task.name == "text"
    assert cfg(**{"model.path": str(GGUF), "task.name": "wordclass"}).task.name == "wordclass"
    assert cfg().task.name == "testbed"


def _text_cfg(**model) -> RunConfig:
    return RunConfig.from_dict(
        {"model": {"path": str(GGUF), **model}, "task": {"name": "text"},
         "data": {"prompt_len": 16, "limit": 8}, "sampling": {"response_len": 4}, "train": {"batch_size": 4}}
    )  # fmt: skip


def _n_dots(fn, *args) -> int:
    """The matmuls of ``fn``'s program (its jaxpr's ``dot_general`` equations, every sub-jaxpr too)."""
    from jax.extend.core import jaxprs_in_params

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name == "dot_general"
            for sub in jaxprs_in_params(eqn.params):
                n += count(sub)
        return n

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("logits", ["full", "chunked"])
def test_reward_on_the_policy_trunk_is_read_from_the_reference_forward(logits):
    """A reward model on the policy's trunk (``model.reward_path`` empty): the scoring reads it from
    the reference's forward, with one trunk's matmuls fewer than when the reward runs its own
    forward, and gives what the reward model's own forward (``JaxReward.fn``) gives on the rollout."""
    import dataclasses

    from jax.sharding import PartitionSpec as P

    from klrl.step.train import make_train
    from klrl.tasks.text import make_text_task

    cfg = _text_cfg(logits=logits)
    task = make_text_task(cfg)
    train = make_train(cfg, task)
    own = make_train(cfg, task, reward=dataclasses.replace(task.reward, trunk=None))
    assert train.context.reward_on_reference and not own.context.reward_on_reference

    def on_mesh(tr, fn):
        return lambda *a: jax.shard_map(
            fn, mesh=tr.mesh, in_specs=(P(),) * len(a), out_specs=P(), check_vma=False
        )(*a)

    state, env = train.init(0), task.env
    ro = jax.jit(on_mesh(train, train.phases.rollout))(state, env)
    got = jax.jit(on_mesh(train, train.phases.score))(state, env, ro).task_reward
    want = jax.jit(task.reward.fn)(env, ro)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(np.std(np.asarray(want))) > 0  # the rows differ: the comparison says something
    shared = _n_dots(on_mesh(train, train.phases.score), state, env, ro)
    separate = _n_dots(on_mesh(own, own.phases.score), state, env, ro)
    assert separate - shared >= 7  # q, k, v, o, gate, up, down of the reward trunk's (scanned) layer


def test_reward_reads_the_reference_only_when_it_is_the_same_frozen_trunk():
    """The shared forward is taken only when the reward's trunk is the reference: not when the
    reference is refreshed, stored in bfloat16, or starts from other parameters; ``model.reward_path``
    naming the policy's own file shares the policy's arrays."""
    from klrl.step.train import make_train
    from klrl.tasks.text import make_text_task

    cfg = _text_cfg()
    task = make_text_task(cfg)
    assert make_train(cfg, task).context.reward_on_reference
    same_file = make_text_task(cfg.replace(model={"reward_path": str(GGUF)}))
    assert make_train(cfg, same_file).context.reward_on_reference
    assert not make_train(cfg.replace(kl={"ref_update_every": 2}), task).context.reward_on_reference
    assert not make_train(cfg.replace(model={"ref_dtype": "bfloat16"}), task).context.reward_on_reference
    other = jax.tree.map(jnp.copy, task.policy_params)
    assert not make_train(cfg, task, policy_params=other).context.reward_on_reference
