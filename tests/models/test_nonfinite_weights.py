"""Initial weights with a NaN or an infinity are refused at load (issue 41, item 3), in one line naming
the file and the tensor: a PEFT adapter (model.adapter), an HF directory (model.path, reward_path,
value_path, eval_path all read through klrl.models.hf), a GGUF file. Before: an adapter with a NaN in
lora_A ran to exit 0 with every iteration skipped by the non-finite guard."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from klrl.config import ConfigError, RunConfig
from klrl.models.hf import CheckpointFormatError

DATA = Path(__file__).parents[1] / "data"
A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _poison(f: Path, name: str, value: float) -> None:
    t = load_file(str(f))
    t[name] = t[name].copy()
    t[name].reshape(-1)[5] = value
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_an_adapter_with_a_non_finite_value_is_one_line(value, tmp_path):
    from klrl.models.peft import load_adapter
    from klrl.models.pretrained import from_pretrained
    from klrl.step.train import initial_adapters

    d = Path(shutil.copytree(DATA / "peft" / "tiny_llama", tmp_path / "adapter"))
    _poison(d / "adapter_model.safetensors", A0, value)
    model, params = from_pretrained(DATA / "tiny_llama", tokenizer=False)[:2]
    with pytest.raises(CheckpointFormatError) as e:
        load_adapter(d, model, params)
    msg = str(e.value)
    want = f"{d / 'adapter_model.safetensors'}: tensor '{A0}' holds 1 non-finite value (NaN or inf"
    assert "\n" not in msg and msg.startswith(want), msg
    cfg = RunConfig().replace(model={"path": str(DATA / "tiny_llama"), "adapter": str(d)}, lora={"rank": 4},
                              task={"name": "text"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^model.adapter: .*holds 1 non-finite value"):
        initial_adapters(cfg, model, params)  # what make_train calls: one line and exit 2 on the CLI


def test_an_hf_checkpoint_with_a_nan_is_one_line(tmp_path):
    from klrl.models.pretrained import from_pretrained

    d = Path(shutil.copytree(DATA / "tiny_llama", tmp_path / "m"))
    name = "model.layers.1.mlp.down_proj.weight"
    _poison(d / "model.safetensors", name, np.nan)
    with pytest.raises(CheckpointFormatError) as e:
        from_pretrained(d, tokenizer=False)
    msg = str(e.value)
    want = f"{d / 'model.safetensors'}: tensor '{name}' holds 1 non-finite"
    assert "\n" not in msg and msg.startswith(want), msg


def test_a_gguf_file_with_an_inf_is_one_line(tmp_path):
    import gguf

    from klrl.models.gguf import load_gguf

    f = Path(shutil.copy(DATA / "tiny_gguf" / "tiny.gguf", tmp_path / "t.gguf"))
    t = next(t for t in gguf.GGUFReader(str(f)).tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type.name == "F32"
    with open(f, "r+b") as fh:  # the tensor's third float32 -> +inf
        fh.seek(int(t.data_offset) + 8)
        fh.write(np.array([np.inf], np.float32).tobytes())
    with pytest.raises(CheckpointFormatError) as e:
        load_gguf(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f}: tensor 'blk.0.attn_q.weight' holds 1 non-finite"), msg
