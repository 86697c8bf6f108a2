"""reward.standardize (klrl.rewards.standardize): gain and bias from the reference policy's samples,
applied in the step, recorded in task.json, read back bit for bit on resume, shared by a sweep."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import ConfigError, RunConfig
from klrl.rewards import standardize as S

DATA = Path(__file__).parents[1] / "data"


def test_norm_of_is_numpys_mean_and_std_and_rejects_a_constant_or_nan() -> None:
    s = np.array([0.5, -1.25, 2.0, 3.5, -0.75], np.float32)
    mu, sigma = float(np.mean(s.astype(np.float64))), float(np.std(s.astype(np.float64)))
    gain, bias = S.norm_of(s)
    np.testing.assert_allclose([gain, bias], [1 / sigma, -mu / sigma], rtol=1e-6)
    z = gain * s + bias
    np.testing.assert_allclose([z.mean(), z.std()], [0.0, 1.0], atol=1e-6)
    with pytest.raises(ConfigError, match=r"^reward\.standardize: .* all 3 reference samples is 2 \(std 0\)"):
        S.norm_of([2.0, 2.0, 2.0])
    with pytest.raises(ConfigError, match=r"^reward\.standardize: .* 1 of 2 reference samples is NaN"):
        S.norm_of([1.0, np.nan])


def test_standardized_reward_reads_gain_and_bias_from_the_env_and_wraps_once() -> None:
    from klrl.tasks.base import JaxReward

    raw = JaxReward(lambda env, ro: env["w"] * ro, {"w": jnp.float32(3.0)})
    r = S.standardized(raw)
    assert S.standardized(r) is r  # never standardised twice
    np.testing.assert_array_equal(np.asarray(r.params[S.KEY]), [1.0, 0.0])  # identity until set
    env = {**r.params, S.KEY: jnp.array([2.0, -1.0], jnp.float32)}
    got = jax.jit(r.fn)(env, jnp.array([0.0, 1.0, 2.0]))
    np.testing.assert_array_equal(np.asarray(got), [-1.0, 5.0, 11.0])  # 2 * (3 x) - 1
    with pytest.raises(ConfigError, match=r"^reward\.standardize"):
        S.standardized(types.SimpleNamespace(fn=lambda p, c: [0.0] * len(c)))  # (not traced: no kind)


def test_resume_without_the_recorded_norm_is_one_checkpoint_error(tmp_path) -> None:
    from klrl.io.checkpoint import CheckpointError
    from klrl.io.resume import Resume

    cfg = RunConfig().replace(reward={"standardize": True})
    train = types.SimpleNamespace(context=types.SimpleNamespace(cfg=cfg))
    (tmp_path / "task.json").write_text(json.dumps({"model_path": "m"}))
    with pytest.raises(CheckpointError, match=r"task\.json: no reward_norm"):
        S.reward_norm_env(train, {}, seed=0, resume=Resume(tmp_path, 2, {}))
    off = types.SimpleNamespace(context=types.SimpleNamespace(cfg=RunConfig()))
    assert S.reward_norm_env(off, {"a": 1}, seed=0) == ({"a": 1}, {})


def _text_cfg(tmp_path, **train) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {
                "path": str(DATA / "tiny_gguf" / "tiny.gguf"),
                "reward_path": str(DATA / "tiny_llama_cls"),
            },
            "task": {"name": "text"},
            "data": {"prompt_len": 16, "limit": 32},
            "sampling": {"response_len": 4},
            "reward": {"standardize": True, "standardize_samples": 256},
            "ppo": {"epochs": 1, "minibatches": 1},
            "train": {
                "batch_size": 64,
                "out_dir": str(tmp_path),
                "name": "r",
                "quiet": True,
                "samples_every": 1,
                "samples_n": 64,
                **train,
            },  # fmt: skip
        }
    )


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_reward_model_run_is_standardised_on_reference_samples_and_resumes_bit_for_bit(
    tmp_path, monkeypatch, jax_cache
) -> None:
    """A tiny HF reward model: (1) task.json's gain and bias are NumPy's 1/std and -mean/std of the
    raw scores of the 256 reference samples used; (2) Monte-Carlo: 1024 fresh reference samples, and
    the step's own 64 samples at iteration 0 (the policy is still the reference), are standardised to
    mean ~0, std ~1 (tolerances: 4 standard errors of the fresh and the used samples); (3) a resume
    reads the gain and bias back from task.json (sampling again would fail here) and replays the
    undone iteration bit for bit."""
    import klrl
    from klrl.step.train import make_train
    from klrl.tasks.text import make_text_task

    cfg = _text_cfg(tmp_path, iterations=2, checkpoint_every=1, keep_checkpoints=5)
    result = klrl.run(cfg)
    d = result.dir
    entry = json.loads((d / "task.json").read_text())[S.KEY]
    norm = np.array([entry["gain"], entry["bias"]], np.float32)
    assert entry["samples"] == 256 and entry["seed"] == cfg.train.seed

    # (1) the samples used (the same keys) and (2) fresh ones (batches past the first four)
    task = S.standardize_task(make_text_task(cfg))
    train = make_train(cfg, task)
    raw = S.reference_rewards(train, task.env, 256 + 1024, seed=cfg.train.seed).astype(np.float64)
    used, fresh = raw[:256], raw[256:]
    np.testing.assert_allclose([entry["mean"], entry["std"]], [np.mean(used), np.std(used)], rtol=1e-6)
    np.testing.assert_allclose(norm, [1 / np.std(used), -np.mean(used) / np.std(used)], rtol=1e-6)
    assert not 0.8 < np.std(used) < 1.25  # the raw scale is not already ~1: the test can tell
    z = norm[0] * fresh + norm[1]
    assert abs(z.mean()) < 4 * np.sqrt(1 / 1024 + 1 / 256) and abs(z.std() - 1) < 4 * np.sqrt(
        1 / 2048 + 1 / 512
    )
    rows0 = [
        x for x in map(json.loads, (d / "samples.jsonl").read_text().splitlines()) if x["iteration"] == 0
    ]
    z0 = np.array([x["reward"] for x in rows0])
    assert len(z0) == 64
    assert abs(z0.mean()) < 4 * np.sqrt(1 / 64 + 1 / 256) and abs(z0.std() - 1) < 4 * np.sqrt(
        1 / 128 + 1 / 512
    )
    np.testing.assert_allclose(z0.mean(), result.metrics["reward/task"][0], rtol=1e-5)

    # (3) resume from checkpoint 1: the recorded gain and bias, not new samples
    before = {p: (d / p).read_bytes() for p in ("metrics.jsonl", "samples.jsonl", "task.json")}
    shutil.rmtree(d / "checkpoints" / "2")

    def no_sampling(*a, **k):
        raise AssertionError("a resume sampled the reference again")

    monkeypatch.setattr(S, "reference_rewards", no_sampling)
    klrl.run(cfg, resume=d)
    for p, b in before.items():
        assert (d / p).read_bytes() == b, p  # iteration 1 replayed exactly (rows and samples)


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_the_held_out_reward_is_standardised_with_the_same_gain_and_bias(tmp_path) -> None:
    from klrl.models.rollout import Rollout
    from klrl.tasks.text import make_text_task

    cfg = _text_cfg(tmp_path).replace(data={"eval_fraction": 0.25})
    raw = make_text_task(cfg)
    task = S.standardize_task(raw)
    assert task.heldout is not None and S.KEY in task.env
    env = {**task.env, S.KEY: jnp.array([2.0, 1.0], jnp.float32)}
    pool = raw.heldout.prompts
    rng = np.random.default_rng(0)
    ro = Rollout(jnp.asarray(pool.prompts[:3]), jnp.asarray(pool.mask[:3]),
                 jnp.asarray(rng.integers(0, 200, (3, 4)), jnp.int32), jnp.ones((3, 4)), None, None, None,
                 jnp.arange(3, dtype=jnp.int32))  # fmt: skip
    both = jax.jit(lambda e0, e, ro: (raw.heldout.reward.fn(e0, ro), task.heldout.reward.fn(e, ro),
                                      task.reward.fn(e, ro)))  # fmt: skip
    want, held, train_r = (np.asarray(x) for x in both(raw.env, env, ro))
    np.testing.assert_allclose(held, 2 * want + 1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(train_r, 2 * want + 1, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_a_reward_on_the_reference_trunk_is_standardised_on_the_shared_forward(tmp_path) -> None:
    """A reward model on the policy's trunk (``model.reward_path`` empty) is read from the reference's
    forward (``Context.reward_on_reference``); standardised, the scoring's reward is ``gain * r + bias``
    of the raw reward model's own forward."""
    from jax.sharding import PartitionSpec as P

    from klrl.step.train import make_train
    from klrl.tasks.text import make_text_task

    cfg = _text_cfg(tmp_path).replace(model={"reward_path": ""})
    raw = make_text_task(cfg)
    task = S.standardize_task(raw)
    train = make_train(cfg, task)
    assert train.context.reward_on_reference

    def on_mesh(fn):
        return jax.jit(
            lambda *a: jax.shard_map(
                fn, mesh=train.mesh, in_specs=(P(),) * len(a), out_specs=P(), check_vma=False
            )(*a)
        )

    env = {**task.env, S.KEY: jnp.array([2.0, 1.0], jnp.float32)}
    state = train.init(0)
    ro = on_mesh(train.phases.rollout)(state, env)
    got = np.asarray(on_mesh(train.phases.score)(state, env, ro).task_reward)
    want = np.asarray(jax.jit(raw.reward.fn)(raw.env, ro))
    assert float(np.std(want)) > 0
    np.testing.assert_allclose(got, 2 * want + 1, rtol=1e-5, atol=1e-5)
