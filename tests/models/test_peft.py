"""klrl.models.peft: PEFT LoRA adapters in and out, against goldens made by PEFT itself
(``tests/data/make_peft_goldens.py``: torch + transformers + peft; not needed here).

Tolerance: klrl's logits (float32, CPU) match PEFT's within ``ATOL = 1e-4`` on every real token
(measured: about 1e-6, the base models' own klrl-vs-transformers difference); the adapters change
the logits by about 2, so a dropped, transposed or mis-scaled adapter cannot pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_import
from safetensors.numpy import load_file, save_file

from klrl.models import lora
from klrl.models.base import forward
from klrl.models.hf import CheckpointFormatError
from klrl.models.peft import load_adapter, same_base, save_adapter
from klrl.models.pretrained import from_pretrained

DATA = Path(__file__).parents[1] / "data"
NAMES = ("tiny_llama", "tiny_gpt2")
ATOL = 1e-4
_BASES: dict = {}


def base(name: str):
    if name not in _BASES:
        _BASES[name] = from_pretrained(DATA / name, tokenizer=False)[:2]
    return _BASES[name]


def golden(name: str) -> dict:
    return dict(np.load(DATA / "peft" / name / "golden.npz"))


def logits(model, params, g: dict) -> np.ndarray:
    out = forward(model, params, jnp.asarray(g["tokens"], jnp.int32), jnp.asarray(g["mask"])).logits
    return np.asarray(out)


def max_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    return float(np.abs(a - b)[mask.astype(bool)].max())


@pytest.mark.parametrize("name", NAMES)
def test_peft_adapter_logits_match_peft(name):
    model, params = base(name)
    lm, adapters = load_adapter(DATA / "peft" / name, model, params, base_name=name)
    g = golden(name)
    assert lm.rank == 4 and lm.alpha == 8.0 and lm.targets == "" and lm.base is model
    assert max_diff(g["logits"], g["base_logits"], g["mask"]) > 1.0  # the adapter matters
    assert max_diff(logits(lm, lora.merge(params, adapters), g), g["logits"], g["mask"]) < ATOL
    merged = lora.merged_kernels(params, adapters, lm.scale)  # PEFT's merge_and_unload
    assert max_diff(logits(model, merged, g), g["merged_logits"], g["mask"]) < ATOL


@pytest.mark.parametrize("name", NAMES)
def test_loaded_adapters_are_the_files_tensors_in_klrls_layout(name):
    model, params = base(name)
    lm, adapters = load_adapter(DATA / "peft" / name, model, params)
    fresh = jax.eval_shape(lambda p: lm.init_adapters(p, jax.random.PRNGKey(0)), params)
    assert jax.tree.map(lambda x: x.shape, adapters) == jax.tree.map(lambda x: x.shape, fresh)
    raw = load_file(str(DATA / "peft" / name / "adapter_model.safetensors"))
    hf = {  # klrl module -> HF module path of layer 1 (written out by hand)
        "tiny_llama": ("layers", "model.layers.1.self_attn.k_proj", "k_proj"),
        "tiny_gpt2": ("h", "transformer.h.1.mlp.c_proj", "mlp_c_proj"),
    }[name]
    stack, path, mod = hf
    a = np.asarray(adapters["params"][stack][mod]["kernel_lora_a"][1])
    b = np.asarray(adapters["params"][stack][mod]["kernel_lora_b"][1])
    np.testing.assert_array_equal(a, raw[f"base_model.model.{path}.lora_A.weight"].T)
    np.testing.assert_array_equal(b, raw[f"base_model.model.{path}.lora_B.weight"].T)


@pytest.mark.parametrize("name", NAMES)
def test_save_adapter_writes_pefts_tensors_and_config(name, tmp_path):
    model, params = base(name)
    src = DATA / "peft" / name
    lm, adapters = load_adapter(src, model, params)
    with_head = {**adapters, "v_head": {"kernel": jnp.ones((3, 1))}}  # not part of an adapter: left out
    out = save_adapter(tmp_path / "a", lm, with_head, base_name=name)
    ours, theirs = (
        load_file(str(out / "adapter_model.safetensors")),
        load_file(str(src / "adapter_model.safetensors")),
    )
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].dtype == np.float32 and ours[k].tobytes() == theirs[k].tobytes(), k
    doc, ref = (json.loads((d / "adapter_config.json").read_text()) for d in (out, src))
    for field in (
        "peft_type",
        "task_type",
        "r",
        "lora_alpha",
        "fan_in_fan_out",
        "bias",
        "use_rslora",
        "use_dora",
    ):
        assert doc[field] == ref[field], field
    assert doc["base_model_name_or_path"] == name
    again, ad2 = load_adapter(out, model, params, base_name=name)
    assert again == lm and jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), ad2, adapters))


@pytest.mark.parametrize("name", NAMES)
def test_peft_loads_klrls_adapter(name, tmp_path):
    torch = hf_import("torch")
    peft = hf_import("peft")
    tf = hf_import("transformers")
    model, params = base(name)
    lm, adapters = load_adapter(DATA / "peft" / name, model, params)
    out = save_adapter(tmp_path / "a", lm, adapters, base_name=name)
    hf = tf.AutoModelForCausalLM.from_pretrained(
        DATA / name, attn_implementation="eager", dtype=torch.float32
    )
    pm = peft.PeftModel.from_pretrained(hf, out).eval()
    g = golden(name)
    with torch.no_grad():
        got = pm(
            input_ids=torch.tensor(g["tokens"]),
            attention_mask=torch.tensor(g["mask"].astype(np.int64)),
            position_ids=torch.tensor(g["positions"]),
        ).logits.numpy()
    assert max_diff(got, g["logits"], g["mask"]) < ATOL


def test_a_subset_of_targets_round_trips(tmp_path):
    """A klrl LoRA on some modules only (GPT-2's attention c_proj, not the MLP's): written with
    target_modules PEFT matches only there, read back to the same model and function."""
    model, params = base("tiny_gpt2")
    lm = lora.LoRA(model, 2, 3.0, "/c_proj$")
    assert lora.check(lm, params) == ["h/c_proj"]
    ad = lm.init_adapters(params, jax.random.PRNGKey(1))
    b = ad["params"]["h"]["c_proj"]["kernel_lora_b"]  # qwix's B = 0: a random one (a constant is LayerNorm's)
    ad["params"]["h"]["c_proj"]["kernel_lora_b"] = 0.1 * jax.random.normal(jax.random.PRNGKey(2), b.shape)
    out = save_adapter(tmp_path / "a", lm, ad, "gpt2")
    doc = json.loads((out / "adapter_config.json").read_text())
    assert doc["target_modules"] == ["attn.c_proj"] and doc["r"] == 2 and doc["lora_alpha"] == 3
    assert doc["fan_in_fan_out"] is True
    lm2, ad2 = load_adapter(out, model, params, base_name="openai-community/gpt2")
    assert lora.check(lm2, params) == ["h/c_proj"] and lm2.scale == 1.5
    g = golden("tiny_gpt2")
    want = logits(lm, lora.merge(params, ad), g)
    assert max_diff(want, g["base_logits"], g["mask"]) > 1e-3
    assert max_diff(logits(lm2, lora.merge(params, ad2), g), want, g["mask"]) == 0.0


def test_same_base_names():
    assert same_base("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert same_base("/home/u/models/smollm2-135m-instruct/", "SmolLM2-135M-Instruct")
    assert same_base("Qwen/Qwen2-0.5B", "/c/hub/models--Qwen--Qwen2-0.5B/snapshots/0a1b2c")
    assert same_base("TheBloke/Mistral-7B-v0.1-GGUF", "mistral-7b-v0.1.Q4_K_M.gguf")
    assert same_base("Qwen/Qwen2-0.5B-Instruct", "qwen2-0_5b-instruct-q4_k_m.gguf")
    assert not same_base("HuggingFaceTB/SmolLM2-135M", "SmolLM2-135M-Instruct")
    assert not same_base("tiny_llama", "tiny_qwen2")


# ---- bad input: one line naming the file and the field or tensor ---------------------------------


def _copy(tmp_path: Path, name: str = "tiny_llama") -> Path:
    return Path(shutil.copytree(DATA / "peft" / name, tmp_path / "adapter"))


def _edit_config(d: Path, **fields) -> None:
    f = d / "adapter_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **fields}))


def _edit_tensors(d: Path, edit) -> None:
    f = d / "adapter_model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f), metadata={"format": "pt"})


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
CONFIG_CASES = {
    "rslora": ({"use_rslora": True}, "use_rslora"),
    "dora": ({"use_dora": True}, "use_dora"),
    "bias": ({"bias": "lora_only"}, "bias"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    "layers": ({"layers_to_transform": [0]}, "layers_to_transform"),
    "pissa": ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    "ia3": ({"peft_type": "IA3"}, "peft_type"),
    "seq_cls": ({"task_type": "SEQ_CLS"}, "task_type"),
    "rank": ({"r": 0}, "r 0"),
    "head": ({"target_modules": ["q_proj", "lm_head"]}, "'lm_head', a module klrl has no adapter for"),
    "mlp": ({"target_modules": ["mlp"]}, "'model.layers.0.mlp', a module klrl has no adapter for"),
    "gpt2_targets": ({"target_modules": ["c_attn"]}, "selects no module"),
    "one_layer": ({"target_modules": r"model\.layers\.0\..*_proj"}, "different layers"),
    "bad_regex": ({"target_modules": "q_proj("}, "not a regular expression"),
    "other_base": (
        {"base_model_name_or_path": "meta-llama/Llama-3.2-1B"},
        "is not the base model 'tiny_llama'",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_is_one_line(case, tmp_path):
    fields, words = CONFIG_CASES[case]
    d = _copy(tmp_path)
    _edit_config(d, **fields)
    model, params = base("tiny_llama")
    with pytest.raises(CheckpointFormatError) as e:
        load_adapter(d, model, params, base_name="tiny_llama")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(d / "adapter_config.json")), msg
    assert words in msg and list(fields)[0] in msg, msg


FILE_CASES = {
    "no_dir": (lambda d: shutil.rmtree(d), "not a PEFT adapter directory", ""),
    "no_config": (lambda d: (d / "adapter_config.json").unlink(), "missing", "adapter_config.json"),
    "bad_json": (
        lambda d: (d / "adapter_config.json").write_text("{r: 4"),
        "not valid JSON",
        "adapter_config.json",
    ),
    "no_weights": (
        lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
        "adapter_model.bin, a pickle, is not read",
        "adapter_model.safetensors",
    ),
    "corrupt": (
        lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage"),
        "not a readable safetensors file",
        "adapter_model.safetensors",
    ),
    "shape": (
        lambda d: _edit_tensors(d, lambda t: t.__setitem__(A0, np.zeros((4, 16), np.float32))),
        f"tensor '{A0}' has shape [4, 16], the base and r imply [4, 32]",
        "adapter_model.safetensors",
    ),
    "missing_tensor": (
        lambda d: _edit_tensors(d, lambda t: t.pop(A0)),
        f"missing tensor '{A0}'",
        "adapter_model.safetensors",
    ),
    "head_tensor": (
        lambda d: _edit_tensors(
            d,
            lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", np.zeros((4, 32), np.float32)),
        ),
        "unexpected tensor 'base_model.model.lm_head.lora_A.weight' (klrl has no adapter for this module",
        "adapter_model.safetensors",
    ),
    "int_tensor": (
        lambda d: _edit_tensors(d, lambda t: t.__setitem__(A0, np.zeros((4, 32), np.int32))),
        "not a float",
        "adapter_model.safetensors",
    ),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_bad_files_are_one_line(case, tmp_path):
    edit, words, file = FILE_CASES[case]
    d = _copy(tmp_path)
    edit(d)
    model, params = base("tiny_llama")
    with pytest.raises(CheckpointFormatError) as e:
        load_adapter(d, model, params)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(d / file)) and words in msg, msg


def test_klrls_own_gpt_is_refused_in_one_line(tmp_path):
    from klrl.config import ModelConfig
    from klrl.models.gpt import GPT

    gpt = GPT(ModelConfig(n_layers=1, d_model=16, n_heads=2), 32, 8)
    d = _copy(tmp_path)
    for call in (
        lambda: load_adapter(d, gpt, None),
        lambda: save_adapter(tmp_path / "out", lora.LoRA(gpt, 2, 2.0), {}, "gpt"),
    ):
        with pytest.raises(CheckpointFormatError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "GPT declares no Hugging Face layout" in msg and "gpt2, llama" in msg, msg
    assert not (tmp_path / "out").exists()


def test_an_adapter_for_another_base_is_one_line():
    """tiny_llama's adapter on tiny_qwen2 (same family, one KV head instead of two): its name, then the
    k/v projections' shapes, do not fit."""
    model, params = from_pretrained(DATA / "tiny_qwen2", tokenizer=False)[:2]
    d = DATA / "peft" / "tiny_llama"
    with pytest.raises(CheckpointFormatError, match="base_model_name_or_path 'tiny_llama' is not the base"):
        load_adapter(d, model, params, base_name=str(DATA / "tiny_qwen2"))
    with pytest.raises(CheckpointFormatError) as e:
        load_adapter(d, model, params)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(d / "adapter_model.safetensors")), msg
    assert "k_proj.lora_B.weight' has shape [16, 4], the base and r imply [8, 4]" in msg, msg


@pytest.mark.parametrize("name", NAMES)
def test_a_reward_adapter_round_trips_and_scores_as_transformers(name, tmp_path):
    """A SEQ_CLS adapter (the base + a reward model's own adapters + its score head): written, read back
    tensor for tensor, and, where torch and peft are installed, ``PeftModel`` on transformers'
    ``*ForSequenceClassification`` scores the last real token as klrl's ScalarHead does."""
    from klrl.models.heads import ScalarHead
    from klrl.models.peft import load_reward_adapter

    model, params = base(name)
    lm, adapters = load_adapter(DATA / "peft" / name, model, params)
    head = {"kernel": jax.random.normal(jax.random.PRNGKey(3), (model.hidden_size, 1)), "bias": jnp.zeros(1)}
    out = save_adapter(tmp_path / "rm", lm, adapters, base_name=name, score=head)
    doc = json.loads((out / "adapter_config.json").read_text())
    assert doc["task_type"] == "SEQ_CLS" and doc["modules_to_save"] == ["score"]
    lm2, ad2, head2 = load_reward_adapter(out, model, params, base_name=name)
    for a, b in zip(jax.tree.leaves((adapters, head)), jax.tree.leaves((ad2, head2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(CheckpointFormatError, match="task_type 'SEQ_CLS': only causal-LM adapters"):
        load_adapter(out, model, params)
    g = golden(name)
    tokens, mask = jnp.asarray(g["tokens"], jnp.int32), jnp.asarray(g["mask"])
    hidden = forward(lm2, lora.merge(params, ad2), tokens, mask, logits=False).hidden
    mine = np.asarray(ScalarHead(model.hidden_size).apply(head2, hidden))[
        :, -1
    ]  # left-padded: the last token
    torch = hf_import("torch")
    peft = hf_import("peft")
    tf = hf_import("transformers")
    hf = tf.AutoModelForSequenceClassification.from_pretrained(
        DATA / name, num_labels=1, attn_implementation="eager", dtype=torch.float32
    )
    hf.config.pad_token_id = 0
    pm = peft.PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        hs = pm(
            input_ids=torch.tensor(g["tokens"]),
            attention_mask=torch.tensor(g["mask"].astype(np.int64)),
            position_ids=torch.tensor(g["positions"]),
            output_hidden_states=True,
        ).hidden_states[-1]
    theirs = (hs[:, -1] @ pm.base_model.model.score.modules_to_save["default"].weight.T)[:, 0].numpy()
    np.testing.assert_allclose(mine, theirs, atol=ATOL, rtol=1e-4)


def test_adapter_line_says_what_was_loaded():
    """The log line of ``model.adapter`` (klrl.loop.build.make_program prints it): path, r, lora_alpha, the
    target modules and the number of tensors (the golden: 2 layers x 7 modules x A and B = 28)."""
    from klrl.models.peft import adapter_line

    d = DATA / "peft" / "tiny_llama"
    line = adapter_line(d)
    assert line.startswith(f"model.adapter: loaded {d} (r=4, lora_alpha=8, target_modules=")
    assert "=down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj," in line
    assert line.endswith(", 28 tensors)")
