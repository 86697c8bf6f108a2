"""klrl.dpo / ``klrl dpo`` on the tiny GGUF with LoRA: a 2-beta sweep trains (the loss falls, the reward
accuracy rises, the exact KL to the reference grows from 0), resumes bit for bit (``metrics.jsonl``
and the final state, from a checkpoint with rows after it), exports a merged HF policy and a PEFT
adapter that peft's ``AutoPeftModelForCausalLM`` loads with klrl's logits; bad input is one line."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_import, one_line_error

import klrl
from klrl.cli import main as klrl_main
from klrl.config import DataConfig, LoRAConfig, SamplingConfig
from klrl.models.base import forward

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
WORDS = "ab cd ef gh ij kl mn op".split()
TEXT = dict(data=DataConfig(chat_template=False, prompt_len=4), sampling=SamplingConfig(response_len=6))
CFG = klrl.DPOConfig(
    lr=1e-2,
    batch_size=8,
    minibatches=2,
    iterations=8,
    eval_every=4,
    checkpoint_every=4,
    eval_prompts=4,
    eval_fraction=0.2,
)


def marker_pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        filler = [rng.choice(WORDS) for _ in range(2)]
        chosen = list(filler)
        chosen.insert(rng.randrange(3), "yes")
        rej = [*filler, rng.choice(WORDS)]
        rows.append({"prompt": rng.choice(WORDS), "chosen": " ".join(chosen), "rejected": " ".join(rej)})
    return rows


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in marker_pairs(40)))
    return f


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, pairs_file):
    out = tmp_path_factory.mktemp("dpo") / "run"
    r = klrl.dpo(
        pairs_file,
        model_path=GGUF,
        cfg=CFG,
        betas=[0.1, 1.0],
        lora=LoRAConfig(rank=4, alpha=8.0),
        run_dir=out,
        **TEXT,
    )
    return r, out


def test_a_sweep_trains(sweep):
    r, out = sweep
    assert len(r) == 2 and [m.beta for m in r.members] == [0.1, 1.0]
    for j in range(2):
        _, loss = r.metric("dpo/loss", j)
        _, acc = r.metric("dpo/reward_accuracy", j)
        its, kl = r.metric("kl/exact_seq_sum", j)
        assert list(its) == [0, 4, 8]
        _, held_loss = r.metric("eval/dpo/loss", j)
        assert (
            abs(held_loss[0] - np.log(2)) < 1e-4 and held_loss[-1] < held_loss[0] - 0.1
        )  # log 2 at the start
        assert loss[-3:].mean() < loss[0] - 0.1
        assert acc[-3:].mean() > acc[0]
        assert abs(kl[0]) < 1e-5 and kl[-1] > 0.05  # the policy starts at the reference and leaves it
        _, held = r.metric("eval/dpo/reward_accuracy", j)
        assert held[-1] >= 0.75
    rows = [json.loads(x) for x in (r.members[1].dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in rows] == list(range(9)) and rows[0]["dpo/beta"] == 1.0
    assert {
        "dpo/loss",
        "dpo/rewards_chosen",
        "dpo/rewards_rejected",
        "dpo/reward_margin",
        "dpo/reward_accuracy",
        "kl/exact_seq_sum",
    } <= set(rows[0])
    assert json.loads((out / "sweep.json").read_text())["members"] == [m.dir.name for m in r.members]


def test_resume_is_bit_for_bit(sweep, pairs_file, tmp_path):
    r, out = sweep
    cut = tmp_path / "run"
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("policy", "base"))
    shutil.rmtree(cut / "checkpoints" / "8")  # killed after checkpoint 4 and 4 more rows
    with pytest.raises(klrl.ConfigError, match="dpo.lr"):
        klrl.dpo(
            pairs_file,
            model_path=GGUF,
            cfg=klrl.DPOConfig(**{**CFG.__dict__, "lr": 0.5}),
            betas=[0.1, 1.0],
            lora=LoRAConfig(rank=4, alpha=8.0),
            run_dir=cut,
            resume=True,
            **TEXT,
        )
    klrl_main(["dpo", "--resume", str(cut), "--pairs", str(pairs_file)])
    for m in r.members:
        a = (m.dir / "metrics.jsonl").read_bytes()
        b = (cut / m.dir.name / "metrics.jsonl").read_bytes()
        assert a == b
    got = json.loads((cut / r.members[0].dir.name / "policy" / "adapter" / "adapter_config.json").read_text())
    assert got["r"] == 4


def test_export_loads_in_peft_with_klrl_logits(sweep):
    r, _ = sweep
    torch, peft = hf_import("torch"), hf_import("peft")
    model, params = r.policy(1)
    tokens = jnp.array([[0, 72, 73, 88, 68], [74, 75, 76, 77, 220]], jnp.int32)
    mask = jnp.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.float32)
    want = np.asarray(forward(model, params, tokens, mask).logits)
    base_logits = np.asarray(forward(model, r.base, tokens, mask).logits)
    m = np.asarray(mask) > 0
    assert np.abs(want - base_logits)[m].max() > 1e-3  # the adapters changed the function
    adapter = r.members[1].dir / "policy" / "adapter"
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(
        adapter, dtype=torch.float32, attn_implementation="eager"
    )
    tf = hf_import("transformers")
    merged = tf.AutoModelForCausalLM.from_pretrained(
        r.members[1].dir / "policy", dtype=torch.float32, attn_implementation="eager"
    )
    kw = dict(
        input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
        attention_mask=torch.tensor(m.astype(np.int64)),
        position_ids=torch.tensor(np.maximum(np.cumsum(m, axis=1) - 1, 0)),
    )
    with torch.no_grad():
        for hf in (pm.eval(), merged.eval()):
            assert np.abs(hf(**kw).logits.numpy() - want)[m].max() < 1e-4
    leaves = jax.tree.leaves(r.members[1].state.params)
    assert all(x.dtype == np.float32 for x in leaves)


def test_bad_input_is_one_line(capsys, pairs_file, tmp_path):
    base = ["dpo", "--model.path", str(GGUF), "--pairs", str(pairs_file)]
    assert "error: dpo.beta: must be > 0" in one_line_error(
        capsys, klrl_main, [*base, "--out", str(tmp_path / "a"), "--dpo.beta", "0"]
    )
    assert "error: dpo.loss" in one_line_error(
        capsys, klrl_main, [*base, "--out", str(tmp_path / "a"), "--dpo.loss", "kto"]
    )
    assert "--out" in one_line_error(capsys, klrl_main, base)
    assert "--dpo.betas" in one_line_error(
        capsys, klrl_main, [*base, "--out", str(tmp_path / "a"), "--dpo.betas", "0.1,x"]
    )
    err = one_line_error(
        capsys,
        klrl_main,
        [
            "dpo",
            "--model.path",
            str(tmp_path / "none.gguf"),
            "--pairs",
            str(pairs_file),
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert "error: model.path: " in err and "no such file" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "error: pairs: " in one_line_error(
        capsys,
        klrl_main,
        ["dpo", "--model.path", str(GGUF), "--pairs", str(empty), "--out", str(tmp_path / "c")],
    )
    assert "error: resume: " in one_line_error(
        capsys, klrl_main, ["dpo", "--pairs", str(pairs_file), "--resume", str(tmp_path)]
    )
