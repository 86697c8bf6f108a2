"""HF directories: save_pretrained round trip (tensors bit-equal to transformers' own file, and
live through transformers when importable), sharded checkpoints, the score head of a
sequence-classification checkpoint, and bad directories failing with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_hf
from safetensors.numpy import load_file, save_file

from klrl.data.hf_tokenizer import byte_level_bpe, make_tokenizer
from klrl.models.base import forward
from klrl.models.hf import CheckpointFormatError, load_hf, load_score_head
from klrl.models.pretrained import from_pretrained, save_pretrained
from klrl.models.registry import hf_family, hf_model_types
from klrl.registry import FAMILIES

DATA = Path(__file__).parents[1] / "data"
CHECKPOINTS = ["tiny_llama", "tiny_qwen2", "tiny_gpt2"]  # one tiny directory per model type


def logits(model, params, name="tiny_llama"):
    g = np.load(DATA / name / "golden.npz")
    out = jax.jit(lambda p, t, k: forward(model, p, t, k).logits)(
        params, jnp.asarray(g["tokens"], jnp.int32), g["mask"]
    )
    return np.asarray(out)[g["mask"]]


def tiny_tokenizer():
    from klrl.data.hf_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())[:250] + ["ab", "<|im_start|>", "<|im_end|>"]
    tok = byte_level_bpe(chars, ["a b"], [1] * 251 + [3, 3])
    special = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": None,
    }
    return make_tokenizer(tok, special, "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_directory_loads_as_the_family_registered_for_its_model_type(name):
    mt = json.loads((DATA / name / "config.json").read_text())["model_type"]
    cls, parse = hf_family(mt)
    model, _ = load_hf(DATA / name)
    assert type(model) is cls and model.config == parse(json.loads((DATA / name / "config.json").read_text()))
    owners = [n for n in FAMILIES if mt in FAMILIES.meta(n)["hf"]]
    assert len(owners) == 1 and FAMILIES.get(owners[0]) is cls  # one family per model type
    assert mt in hf_model_types() and hf_family("mamba") is None


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_save_pretrained_round_trip(tmp_path, name):
    model, params, _ = from_pretrained(DATA / name)
    tok = tiny_tokenizer()
    out = save_pretrained(model, params, tok, tmp_path / "out")
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    # the exported tensors are bit-equal to the file transformers itself wrote
    mine, theirs = load_file(out / "model.safetensors"), load_file(DATA / name / "model.safetensors")
    assert set(mine) == set(theirs) - {"lm_head.weight"} or set(mine) == set(theirs)
    for k in mine:
        np.testing.assert_array_equal(mine[k], theirs[k], err_msg=k)
    model2, params2, tok2 = from_pretrained(out)
    assert model2 == model
    np.testing.assert_array_equal(logits(model2, params2, name), logits(model, params, name))
    assert tok2.encode("abab<|im_end|>") == tok.encode("abab<|im_end|>") and tok2.stop_ids == tok.stop_ids
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == list(tok.stop_ids)


@needs_hf  # (CI: fails, never skips, without the [hf] extra)
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_export_loads_in_transformers_with_same_logits(tmp_path, name):
    import torch
    import transformers

    model, params, _ = from_pretrained(DATA / name)
    out = save_pretrained(model, params, tiny_tokenizer(), tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    g = np.load(DATA / name / "golden.npz")
    with torch.no_grad():
        want = ref(
            input_ids=torch.tensor(g["tokens"]),
            attention_mask=torch.tensor(g["mask"].astype(np.int64)),
            position_ids=torch.tensor(g["positions"]),
        ).logits.numpy()
    np.testing.assert_allclose(logits(model, params, name), want[g["mask"]], atol=1e-4)


def test_sharded_index_loads_like_the_single_file(tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(DATA / "tiny_llama" / "config.json", d)
    tensors = load_file(DATA / "tiny_llama" / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for f, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(d / f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(ks, f))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    m1, p1 = load_hf(DATA / "tiny_llama")
    m2, p2 = load_hf(d)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)


def test_score_head_of_sequence_classifier_matches_transformers():
    model, params, score = load_hf(DATA / "tiny_llama_cls", score=True)
    assert score.shape == (1, 32) and load_score_head(DATA / "tiny_llama_cls").shape == (1, 32)
    g = np.load(DATA / "tiny_llama_cls" / "golden.npz")
    hidden = jax.jit(lambda p, t, k: forward(model, p, t, k, logits=False).hidden)(
        params, g["tokens"].astype(np.int32), g["mask"]
    )
    got = np.asarray(hidden[:, -1] @ score.T)  # left padding: the last real token is the last slot
    np.testing.assert_allclose(got, g["scores"], atol=1e-5)


# ---- bad directories ---------------------------------------------------------------------------


def copy_tiny(tmp_path, name="tiny_llama"):
    d = tmp_path / name
    shutil.copytree(DATA / name, d)
    return d


def edit_tensors(d, change):
    tensors = load_file(d / "model.safetensors")
    save_file(change(tensors), str(d / "model.safetensors"), metadata={"format": "pt"})


def edit_config(d, **kw):
    c = json.loads((d / "config.json").read_text())
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))


def _bad_cases():
    def no_config(d):
        (d / "config.json").unlink()

    def unknown_type(d):
        edit_config(d, model_type="mamba")

    def missing(d):
        edit_tensors(d, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"})

    def extra(d):
        edit_tensors(d, lambda t: {**t, "model.layers.0.mlp.extra.weight": t["model.norm.weight"]})

    def shape(d):
        edit_config(d, intermediate_size=48)

    def truncated(d):
        b = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(b[: len(b) // 2])

    def bad_field(d):
        c = json.loads((d / "config.json").read_text())
        del c["hidden_size"]
        (d / "config.json").write_text(json.dumps(c))

    def vocab(d):
        from klrl.data.hf_tokenizer import bytes_to_unicode

        chars = list(bytes_to_unicode().values()) + [f"w{i}" for i in range(44)]  # 300 > 256 rows
        make_tokenizer(byte_level_bpe(chars, []), {"eos_token": "w0"}, None).save(d)

    return [
        (no_config, r"config.json: missing"),
        (unknown_type, r"config.json: model_type 'mamba' is not supported"),
        (missing, r"model.safetensors: missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        (extra, r"model.safetensors: unexpected tensor 'model.layers.0.mlp.extra.weight'"),
        (shape, r"model.safetensors: tensor 'model.layers.0.mlp.(down|gate|up)_proj.weight' has shape"),
        (truncated, r"model.safetensors: not a readable safetensors file"),
        (bad_field, r"config.json: missing field 'hidden_size'"),
        (vocab, r"tokenizer.json: the tokenizer's vocabulary has 300 tokens, the embedding only 256 rows"),
    ]


@pytest.mark.parametrize("break_it, match", _bad_cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_bad_directories_fail_with_one_line(tmp_path, break_it, match):
    d = copy_tiny(tmp_path)
    break_it(d)
    with pytest.raises(CheckpointFormatError, match=match) as e:
        from_pretrained(d)
    assert "\n" not in str(e.value) and str(d) in str(e.value)
    assert isinstance(e.value, ValueError)
