"""``klrl export`` (issue 17): a run's policy out of a checkpoint; and ``klrl train --config
RUN_DIR/config.json`` reproduces the run (``metrics.jsonl`` byte for byte; wall-clock rows live in
``timing.jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import base_config  # noqa: E402  (jax_cache: a conftest fixture)

DATA = Path(__file__).parents[1] / "data"
GGUF = DATA / "tiny_gguf" / "tiny.gguf"


def _klrl(argv: list[str], capsys) -> tuple[int, str, str]:
    from klrl.cli.commands import main

    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def _equal_trees(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.astype(np.float32).tobytes() == y.astype(np.float32).tobytes()


@pytest.fixture(scope="module")
def gpt_run(tiny_task, cache_dir, jax_cache, tmp_path_factory):
    import klrl

    d = tmp_path_factory.mktemp("export") / "run"
    cfg = base_config(cache_dir, iterations=2, checkpoint_every=1)
    return klrl.run(cfg, task=tiny_task, run_dir=d)


def test_train_config_of_a_run_reproduces_it(gpt_run, tmp_path, capsys):
    d = gpt_run.dir
    status, _, err = _klrl(
        ["train", "--config", str(d / "config.json"), "--train.out_dir", str(tmp_path)], capsys
    )
    assert status == 0, err
    (again,) = [p for p in tmp_path.iterdir() if (p / "metrics.jsonl").is_file()]
    first = (d / "metrics.jsonl").read_bytes()
    assert first.count(b"\n") == 2 and b"iteration_s" not in first  # (timing rows: timing.jsonl)
    assert (again / "metrics.jsonl").read_bytes() == first


def test_export_gpt_policy(gpt_run, tmp_path, capsys):
    from klrl.cli.export import FORMAT, load_gpt
    from klrl.io import checkpoint as ckpt
    from klrl.models.heads import detach

    out = tmp_path / "policy"
    status, stdout, err = _klrl(["export", str(gpt_run.dir), str(out)], capsys)
    assert status == 0, err
    assert "iteration 2" in stdout and "GPT" in stdout and stdout.count("\n") == 1
    doc, params = load_gpt(out)
    assert doc["format"] == FORMAT and doc["iteration"] == 2
    assert doc["model"] == gpt_run.config.to_dict()["model"] and doc["run_config"] == gpt_run.config.to_dict()
    _equal_trees(params, detach(jax.device_get(gpt_run.state.params["policy"]))[0])  # value head dropped
    # --step: an earlier checkpoint, read independently of klrl.cli.export
    status, stdout, err = _klrl(["export", str(gpt_run.dir), str(tmp_path / "one"), "--step", "1"], capsys)
    assert status == 0 and "iteration 1" in stdout, err
    mgr = ckpt.manager(gpt_run.dir, read_only=True)
    try:
        state, _ = ckpt.restore(mgr, ckpt.saved_structure(mgr, 1), 1)
    finally:
        mgr.close()
    _equal_trees(load_gpt(tmp_path / "one")[1], detach(state["params"]["policy"])[0])


def test_export_bad_input_is_one_line_and_writes_nothing(gpt_run, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    cases = {
        "no_run": ([str(tmp_path / "nowhere"), str(tmp_path / "o1")], "not a klrl run directory"),
        "no_step": ([str(gpt_run.dir), str(tmp_path / "o2"), "--step", "7"], "no checkpoint 7"),
        "busy_out": ([str(gpt_run.dir), str(busy)], "not an empty directory"),
        "no_args": ([str(gpt_run.dir)], "OUT_DIR"),
    }
    for name, (args, words) in cases.items():
        status, _, err = _klrl(["export", *args], capsys)
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and lines[0].startswith("error:"), (name, err)
        assert words in lines[0], (name, lines[0])
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_export_sweep_member(tiny_task, cache_dir, jax_cache, tmp_path, capsys):
    from klrl.api import sweep
    from klrl.cli.export import load_gpt
    from klrl.models.heads import detach

    base = base_config(cache_dir, iterations=2)
    members = [base.replace(kl={"beta": b}) for b in (0.1, 1.0)]
    results = sweep(members, task=tiny_task, out_dir=tmp_path / "sweep")
    member = results[1].dir
    status, _, err = _klrl(["export", str(member.parent), str(tmp_path / "x")], capsys)
    assert status == 2 and "export one member" in err
    status, stdout, err = _klrl(["export", str(member), str(tmp_path / "m1")], capsys)
    assert status == 0, err
    _equal_trees(load_gpt(tmp_path / "m1")[1], detach(jax.device_get(results[1].state.params["policy"]))[0])


def test_export_pretrained_policy_as_hf_directory(tiny_gguf_run, tmp_path, capsys):
    from klrl.io import checkpoint as ckpt
    from klrl.models import from_pretrained
    from klrl.models.heads import detach

    result = tiny_gguf_run  # the text task on the tiny GGUF, 2 iterations, checkpointed every iteration
    status, stdout, err = _klrl(["export", str(result.dir), str(tmp_path / "hf")], capsys)
    assert status == 0, err
    assert "HF directory" in stdout
    # the latest checkpoint is the final state: the same files as the run's own policy/ directory
    for f in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "hf" / f).read_bytes() == (result.dir / "policy" / f).read_bytes(), f
    status, _, err = _klrl(["export", str(result.dir), str(tmp_path / "hf1"), "--step", "1"], capsys)
    assert status == 0, err
    _, got, _ = from_pretrained(tmp_path / "hf1")
    mgr = ckpt.manager(result.dir, read_only=True)
    try:
        state, _ = ckpt.restore(mgr, ckpt.saved_structure(mgr, 1), 1)
    finally:
        mgr.close()
    _equal_trees(got, detach(state["params"]["policy"])[0])


def test_export_skips_a_step_directory_without_a_finished_save(gpt_run, tmp_path, capsys):
    """An empty ``checkpoints/3`` (no finished save in it) does not block the export: the newest complete
    checkpoint is exported and the one line says what was skipped; the run directory is left as it is."""
    import shutil

    d = shutil.copytree(gpt_run.dir, tmp_path / "run")
    (d / "checkpoints" / "3").mkdir()
    status, stdout, err = _klrl(["export", str(d), str(tmp_path / "out")], capsys)
    assert status == 0, err
    assert "iteration 2" in stdout and "skipped checkpoints/3" in stdout and stdout.count("\n") == 1, stdout
    assert (d / "checkpoints" / "3").is_dir() and not (d / "checkpoints" / "3.incomplete").exists()


def test_exported_model_files_follow_the_umask(gpt_run, tiny_gguf_run, tmp_path, capsys):
    """``model.safetensors`` gets the mode of any new file, as ``config.json`` beside it (the safetensors
    library creates 0600 files): the policy a run saves at its end and both kinds of export."""
    import os

    def mode(p):
        return p.stat().st_mode & 0o777

    policy = tiny_gguf_run.dir / "policy"  # klrl.tasks.text.save_policy at the end of the run
    assert mode(policy / "model.safetensors") == mode(policy / "config.json")
    old = os.umask(0o027)
    try:
        for run, out in ((gpt_run.dir, tmp_path / "gpt"), (tiny_gguf_run.dir, tmp_path / "hf")):
            status, _, err = _klrl(["export", str(run), str(out)], capsys)
            assert status == 0, err
            assert mode(out / "model.safetensors") == mode(out / "config.json") == 0o640
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run (rank 2, alpha 6: scale 3; adapters on q, v and up only) of the text task on
    tests/data/tiny_gguf/tiny.gguf (a float32 GGUF), one iteration, checkpointed."""
    import warnings

    import klrl
    from klrl.config import RunConfig
    from klrl.data.prompts import PromptTruncationWarning

    tmp = tmp_path_factory.mktemp("lora-run")
    base = GGUF
    cfg = RunConfig.from_dict(
        {
            "model": {"path": str(base)},
            "lora": {"rank": 2, "alpha": 6.0, "targets": "q_proj|v_proj|up_proj"},
            "task": {"name": "text"},
            "data": {"prompt_len": 16, "limit": 8},
            "sampling": {"response_len": 4},
            "ppo": {"epochs": 1, "minibatches": 2},
            "optim": {"lr": 1e-2},
            "train": {"iterations": 1, "batch_size": 4, "out_dir": str(tmp / "runs"), "name": "r",
                      "quiet": True, "checkpoint_every": 1},
        }
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTruncationWarning)
        return klrl.run(cfg), base


def test_export_lora_run_merged_and_as_peft_adapter(lora_run, tmp_path, capsys):
    """``klrl export`` of a LoRA run: OUT_DIR is the merged model, whose logits are the LoRA policy's
    (base + (alpha/r) x A B at every use); OUT_DIR/adapter is the adapters in PEFT's format, which
    load_adapter reads back to the checkpoint's adapters (bit for bit) with the run's rank and alpha."""
    import jax.numpy as jnp

    from klrl.models import from_pretrained, lora
    from klrl.models.base import forward
    from klrl.models.heads import detach
    from klrl.models.peft import load_adapter

    result, base_dir = lora_run
    out = tmp_path / "hf"
    status, stdout, err = _klrl(["export", str(result.dir), str(out)], capsys)
    assert status == 0, err
    assert "HF directory" in stdout and "rank 2, alpha 6" in stdout and stdout.count("\n") == 1, stdout
    assert "the float base in base/tiny/" in stdout  # a .gguf base: --base is the default
    adapters = detach(jax.device_get(result.state.params["policy"]))[0]
    assert all(np.abs(b).max() > 0 for b in jax.tree.leaves(adapters))  # trained: B moved off zero
    model, base, _ = from_pretrained(base_dir)
    merged_model, merged, tok = from_pretrained(out)
    assert merged_model == model and tok is not None
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 256, size=(2, 9)), jnp.int32)
    mask = jnp.asarray(np.arange(9)[None, :] >= np.array([[0], [3]]))  # the second row left-padded
    want = forward(
        lora.LoRA(model, 2, 6.0, "q_proj|v_proj|up_proj"), lora.merge(base, adapters), tokens, mask
    )
    got = forward(merged_model, merged, tokens, mask)
    real = np.asarray(mask)
    assert (
        np.abs(np.asarray(want.logits) - np.asarray(forward(model, base, tokens, mask).logits))[real].max()
        > 1e-3
    )
    assert np.abs(np.asarray(got.logits) - np.asarray(want.logits))[real].max() < 1e-4
    assert (out / "model.safetensors").read_bytes() == (
        result.dir / "policy" / "model.safetensors"
    ).read_bytes()
    lm, back = load_adapter(out / "adapter", model, base, base_name=str(base_dir))
    assert (lm.rank, lm.alpha) == (2, 6.0)
    assert sorted(lora.check(lm, base)) == ["layers/q_proj", "layers/up_proj", "layers/v_proj"]
    _equal_trees(back, adapters)
    # the float base beside it, named by the adapter (absolute: peft does not resolve a relative path
    # against the adapter's directory), is the .gguf's model and tokenizer
    doc = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (
        doc["base_model_name_or_path"] == str((out / "base" / "tiny").absolute()) and doc["revision"] is None
    )
    base_model, base_back, base_tok = from_pretrained(out / "base" / "tiny")
    assert base_model == model and base_tok.vocab_size == from_pretrained(base_dir)[2].vocab_size
    _equal_trees(base_back, base)
    _peft_parity(out, want, tokens, mask)


def _peft_parity(out: Path, want, tokens, mask) -> None:
    """peft's AutoPeftModelForCausalLM loads OUT/adapter on the base its config names, offline, and
    its logits are klrl's LoRA policy's (``want``) to 1e-4; AutoTokenizer loads the base's tokenizer."""
    from conftest import hf_import

    torch, peft, tf = hf_import("torch"), hf_import("peft"), hf_import("transformers")
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(
        out / "adapter", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    m = np.asarray(mask)
    with torch.no_grad():
        got = pm(
            input_ids=torch.tensor(np.asarray(tokens)),
            attention_mask=torch.tensor(m.astype(np.int64)),
            position_ids=torch.tensor(np.maximum(np.cumsum(m, axis=1) - 1, 0)),
        ).logits.numpy()
    assert np.abs(got - np.asarray(want.logits))[m].max() < 1e-4
    base_dir = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert tf.AutoTokenizer.from_pretrained(base_dir)("ab")["input_ids"]


def test_export_lora_base_reference(lora_run, tiny_gguf_run, tmp_path, capsys):
    """What a LoRA export's adapter names as its base when no base is written: a .gguf with --no-base
    (and a note saying how to get a loadable one), an HF directory by its absolute path, an HF
    directory in the Hugging Face cache by its Hub id and revision; --base on a full fine-tune is
    refused. (The run's config.json is edited: the checkpoint holds only the adapters.)"""
    import shutil

    from klrl.models import from_pretrained, save_pretrained

    result, base_dir = lora_run
    status, stdout, err = _klrl(["export", str(result.dir), str(tmp_path / "g"), "--no-base"], capsys)
    assert status == 0 and "note: adapter/ names the .gguf base, which peft cannot load" in stdout, err
    assert stdout.count("\n") == 1 and not (tmp_path / "g" / "base").exists()
    doc = json.loads((tmp_path / "g" / "adapter" / "adapter_config.json").read_text())
    assert doc["base_model_name_or_path"] == str(Path(base_dir).absolute())
    hf = save_pretrained(*from_pretrained(base_dir), tmp_path / "models--org--tiny-hf" / "snapshots" / "0abc")
    for model_dir, name, revision in (
        (shutil.copytree(hf, tmp_path / "tiny-hf"), str(tmp_path / "tiny-hf"), None),
        (hf, "org/tiny-hf", "0abc"),
    ):
        d = Path(shutil.copytree(result.dir, tmp_path / f"run-{revision}"))
        run_cfg = json.loads((d / "config.json").read_text())
        run_cfg["model"]["path"] = str(model_dir)
        (d / "config.json").write_text(json.dumps(run_cfg))
        out = tmp_path / f"out-{revision}"
        status, stdout, err = _klrl(["export", str(d), str(out)], capsys)
        assert status == 0 and f"names the base {name}" in stdout, err
        doc = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert (doc["base_model_name_or_path"], doc["revision"]) == (name, revision)
        assert not (out / "base").exists()
    status, _, err = _klrl(["export", str(tiny_gguf_run.dir), str(tmp_path / "full"), "--base"], capsys)
    assert status == 2 and "--base: the run is not a LoRA run" in err and err.count("\n") == 1, err


def test_export_lora_run_of_klrls_gpt_is_one_line(gpt_run, tmp_path, capsys):
    """A LoRA run of klrl's GPT (here: the run's config.json says lora.rank=2) is refused in one line:
    its checkpoints hold the adapters, not the task's pretrained base."""
    import json
    import shutil

    d = Path(shutil.copytree(gpt_run.dir, tmp_path / "run"))
    doc = json.loads((d / "config.json").read_text())
    doc["lora"] = {**doc.get("lora", {}), "rank": 2}
    (d / "config.json").write_text(json.dumps(doc))
    status, _, err = _klrl(["export", str(d), str(tmp_path / "out")], capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "a LoRA run of klrl's GPT (lora.rank=2)" in lines[0], err
    assert not (tmp_path / "out").exists()
