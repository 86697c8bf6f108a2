"""klrl.eval.policy: a sweep member's LoRA policy at a step, merged, equals the policy the run saved
(``MEMBER/policy``, written by another path: the trainer's merge and a safetensors round trip); the
steps listed are the checkpoints written; the two members differ."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from klrl.eval.policy import SourceError, checkpoint_steps, policy_at
from klrl.models.pretrained import from_pretrained

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"


@pytest.fixture(scope="module")
def lora_sweep(tmp_path_factory):
    import klrl
    from klrl.config import RunConfig
    from klrl.data.prompts import PromptTruncationWarning

    out = tmp_path_factory.mktemp("lora-sweep")
    base = {
        "model": {"path": str(GGUF)},
        "task": {"name": "text"},
        "lora": {"rank": 4},
        "data": {"prompt_len": 16, "limit": 8},
        "sampling": {"response_len": 4},
        "ppo": {"epochs": 1, "minibatches": 1},
        "optim": {"lr": 1e-2},
        "train": {"iterations": 2, "batch_size": 4, "out_dir": str(out), "name": "s", "quiet": True,
                  "checkpoint_every": 1},
    }  # fmt: skip
    members = [RunConfig.from_dict({**base, "kl": {"beta": b}}) for b in (0.01, 1.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTruncationWarning)
        return list(klrl.sweep(members))


def test_a_members_policy_at_its_last_step_is_the_policy_it_saved(lora_sweep):
    sweep_dir = lora_sweep[0].dir.parent
    assert checkpoint_steps(sweep_dir) == [1, 2] == checkpoint_steps(lora_sweep[0].dir)
    merged = []
    for res in lora_sweep:
        src = policy_at(res.dir, 2)
        assert "iteration 2" in src.what and "LoRA rank 4 merged" in src.what
        _, saved, _ = from_pretrained(res.dir / "policy")
        for a, b in zip(jax.tree.leaves(src.params), jax.tree.leaves(saved), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6)
        merged.append(src.params)
    pairs = zip(jax.tree.leaves(merged[0]), jax.tree.leaves(merged[1]), strict=True)
    diff = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs]
    assert max(diff) > 0  # the members are two policies: the comparison above is not vacuous
    one = policy_at(lora_sweep[0].dir, 1)
    assert any(
        float(np.abs(np.asarray(a) - np.asarray(b)).max()) > 0
        for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(merged[0]), strict=True)
    )


def test_a_missing_step_is_one_error(lora_sweep):
    with pytest.raises(SourceError, match="--step: no checkpoint 7"):
        policy_at(lora_sweep[0].dir, 7)


@pytest.fixture(scope="module")
def dpo_sweep(tmp_path_factory):
    import klrl
    from klrl.config import DataConfig, LoRAConfig, SamplingConfig

    out = tmp_path_factory.mktemp("dpo-sweep") / "run"
    words = "ab cd ef gh ij kl".split()
    recs = [{"prompt": words[i % 6], "chosen": f"yes {words[(i + 1) % 6]}", "rejected": words[(i + 2) % 6]}
            for i in range(20)]  # fmt: skip
    cfg = klrl.DPOConfig(
        lr=1e-2, batch_size=4, iterations=2, eval_every=0, checkpoint_every=1, eval_prompts=0
    )
    text = {"data": DataConfig(chat_template=False, prompt_len=4), "sampling": SamplingConfig(response_len=4)}
    klrl.dpo(recs, model_path=GGUF, cfg=cfg, betas=[0.1, 1.0], lora=LoRAConfig(rank=4), run_dir=out, **text)
    return out


def test_a_dpo_members_policy_at_its_last_step_is_the_policy_it_exported(dpo_sweep):
    members = sorted(p for p in dpo_sweep.iterdir() if p.name.startswith("dpo.beta="))
    assert checkpoint_steps(dpo_sweep) == [1, 2] == checkpoint_steps(members[0])
    last = []
    for d in members:
        src = policy_at(d, 2)
        assert "DPO policy (LoRA rank 4 merged" in src.what and src.data.prompt_len == 4
        _, saved, _ = from_pretrained(d / "policy")  # the driver's own merge and export
        for a, b in zip(jax.tree.leaves(src.params), jax.tree.leaves(saved), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6)
        last.append(src.params)
    differ = lambda x, y: any(
        float(np.abs(np.asarray(a) - np.asarray(b)).max()) > 0
        for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)
    )
    assert differ(last[0], last[1])  # two members, two policies: the comparison is not vacuous
    assert differ(policy_at(members[0], 1).params, last[0])  # step 1 is not step 2
    assert not differ(policy_at(members[0], 1).ref_params, src.ref_params)  # the same base


def test_a_dpo_runs_missing_step_is_one_error(dpo_sweep):
    with pytest.raises(SourceError, match="--step: no checkpoint 7"):
        policy_at(dpo_sweep / "dpo.beta=1,dpo.seed=0", 7)
