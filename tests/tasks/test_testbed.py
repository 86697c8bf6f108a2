"""The testbed task: a Bradley-Terry proxy that beats chance, the gold/perplexity metrics wired in."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    from conftest import tiny_config

    from klrl.tasks.testbed import make_testbed

    # the default model width (the tiny one is too weak a reference for the reward model to learn from)
    cfg = tiny_config(str(tmp_path_factory.mktemp("testbed-cache"))).replace(
        model={"n_layers": 2, "d_model": 64, "n_heads": 4},
        sampling={"response_len": 16},
        task={"name": "testbed", "rm_pairs": 2048, "rm_heldout": 256, "rm_epochs": 6, "prompt_len": 8,
              "pretrain_steps": 400, "pretrain_batch": 64, "pretrain_len": 24, "indep_d_model": 32},
    )  # fmt: skip
    return cfg, make_testbed(cfg)


def test_reward_model_beats_chance(testbed):
    _, task = testbed
    info = task.info
    # held-out pairs of reference responses, judged against the noise-free gold preference
    assert info["rm_heldout_accuracy"] > 0.6, info
    assert info["rm_label_accuracy"] > 0.8  # the BT-noisy labels mostly agree with gold
    assert info["reference_loss"] - info["entropy_rate"] < 1.0  # the reference learned the language


def test_testbed_step_reports_gold_and_perplexities(testbed):
    import jax

    from klrl.step.train import make_train

    cfg, task = testbed
    train = make_train(cfg, task)
    state, m = train.step(train.init(0), task.env)
    m = jax.device_get(m)
    names = "reward/proxy reward/gold eval/oracle_ppl_floored eval/independent_ppl eval/ref_ppl"
    names += " eval/distinct_1 eval/distinct_2 eval/oracle_floored_frac eval/oracle_zero_prob_token_frac"
    names += " reward/proxy_gold_spearman kl/exact_seq_sum"
    for k in names.split():
        assert k in m and np.isfinite(m[k]), k
    assert not any(k.startswith("_") for k in m)
    assert 1.0 < m["eval/oracle_ppl_floored"] < 100 and 1.0 < m["eval/independent_ppl"] < 100
    assert 0 < m["eval/distinct_1"] <= m["eval/distinct_2"] <= 1
    assert m["reward/proxy"] == pytest.approx(m["reward/task"])


@pytest.mark.parametrize(
    "flags, field",
    [(["--data.path", "p.jsonl"], "data.path"), (["--data.split", "nosuch"], "data.split"),
     (["--data.prompt_len", "8", "--data.seed", "2"], "data.prompt_len, data.seed")],
)  # fmt: skip
def test_data_flags_on_the_testbed_are_one_line_before_anything_is_built(
    capsys, tmp_path, monkeypatch, flags, field
):
    """The testbed generates its prompts: a ``data`` field is refused (exit 2, one line naming it)
    before the reference is pretrained (pretraining here fails the test)."""
    from conftest import one_line_error

    from klrl.cli import main
    from klrl.tasks import wordclass

    monkeypatch.setattr(wordclass, "pretrain", lambda *a, **k: pytest.fail("pretrained before the check"))
    argv = ["train", "--task.name", "testbed", *flags, "--train.out_dir", str(tmp_path / "runs"),
            "--task.cache_dir", str(tmp_path / "cache")]  # fmt: skip
    line = one_line_error(capsys, main, argv)
    # the first data field set (klrl.config.relevance's table), named with the field that makes it idle
    first, value = field.split(", ")[0], flags[1]
    value = int(value) if value.isdigit() else value
    assert line == (f"error: {first}={value!r} has no effect with task.name=testbed (it generates its prompts"
                    + ("; its prompt length is task.prompt_len" if first == "data.prompt_len" else "")
                    + "; data.* applies to task.name=text)")  # fmt: skip
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
