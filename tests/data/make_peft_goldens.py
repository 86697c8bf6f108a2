"""Regenerate the PEFT LoRA goldens under tests/data/peft/ with torch + transformers + peft (never
needed by klrl or its tests; ``tests/models/test_peft.py`` reads what this writes).

    pip install torch==2.13.0 && pip install transformers peft   # in the venv, once
    python tests/data/make_peft_goldens.py

For each tiny base (``tests/data/tiny_llama``, ``tests/data/tiny_gpt2``: HF directories that
transformers loads), a PEFT LoRA (``r=4``, ``lora_alpha=8``, PEFT's default scaling ``lora_alpha/r``)
on every linear layer of its blocks (Llama: ``q,k,v,o,gate,up,down_proj``; GPT-2: ``c_attn``,
``c_proj`` (both the attention's and the MLP's: PEFT matches a name's last components) and ``c_fc``),
every ``lora_A`` and ``lora_B`` set to seeded normal values (``B`` nonzero, so the adapter changes the
function), saved with PEFT's own ``save_pretrained`` to ``tests/data/peft/<name>/``
(``adapter_config.json``, ``adapter_model.safetensors``; PEFT's README.md template removed), and
``golden.npz`` beside it:

* ``tokens``, ``mask``, ``positions``: a left-padded batch (rows of 10, 7 and 4 real tokens; the
  first real token is position 0, as ``klrl.models.base.forward`` numbers them);
* ``logits``: the PEFT model's (``PeftModel`` over the base, eager attention, explicit
  ``attention_mask`` and ``position_ids``);
* ``merged_logits``: the model ``merge_and_unload()`` returns, on the same batch;
* ``base_logits``: the base alone (how much the adapter changes the function);
* ``reload_logits``: ``PeftModel.from_pretrained(base, dir)`` of the saved directory (PEFT reads back
  what it wrote).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import peft
import torch
import transformers as tf

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # base_model_name_or_path is a bare name, not a Hub id
HERE = Path(__file__).resolve().parent
OUT = HERE / "peft"
SEED = 0
R, ALPHA, STD = 4, 8, 0.1
TARGETS = {
    "tiny_llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "tiny_gpt2": ["c_attn", "c_proj", "c_fc"],
}


def batch(vocab: int, lengths=(10, 7, 4), seed=SEED):
    rng = np.random.default_rng(seed + 1)
    t = max(lengths)
    tokens = rng.integers(3, vocab, size=(len(lengths), t)).astype(np.int64)
    mask = np.zeros((len(lengths), t), bool)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = True
        tokens[i, : t - n] = 0
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    return tokens, mask, positions


def logits_of(model, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def base_of(name: str):
    return tf.AutoModelForCausalLM.from_pretrained(
        HERE / name, attn_implementation="eager", dtype=torch.float32
    ).eval()


def one(name: str) -> None:
    torch.manual_seed(SEED)
    base = base_of(name)
    tokens, mask, positions = batch(base.config.vocab_size)
    base_logits = logits_of(base, tokens, mask, positions)
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS[name], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, cfg).eval()
    model.peft_config["default"].base_model_name_or_path = name  # not this machine's path
    gen = torch.Generator().manual_seed(SEED)
    n = 0
    with torch.no_grad():
        for mod_name, p in sorted(model.named_parameters()):
            if ".lora_A." in mod_name or ".lora_B." in mod_name:
                p.copy_(torch.randn(p.shape, generator=gen) * STD)
                n += 1
    logits = logits_of(model, tokens, mask, positions)
    out = OUT / name
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model-card template: no part of the adapter
    reload = peft.PeftModel.from_pretrained(base_of(name), out).eval()
    reload_logits = logits_of(reload, tokens, mask, positions)
    merged = copy.deepcopy(model).merge_and_unload().eval()
    merged_logits = logits_of(merged, tokens, mask, positions)
    np.savez_compressed(
        out / "golden.npz",
        tokens=tokens,
        mask=mask,
        positions=positions,
        logits=logits,
        merged_logits=merged_logits,
        base_logits=base_logits,
        reload_logits=reload_logits,
    )
    m = mask.astype(bool)
    print(
        f"{name}: {n} LoRA tensors; max |peft - base| {np.abs(logits - base_logits)[m].max():.3g}, "
        f"|peft - merged| {np.abs(logits - merged_logits)[m].max():.3g}, "
        f"|peft - reloaded| {np.abs(logits - reload_logits)[m].max():.3g}"
    )


if __name__ == "__main__":
    print("torch", torch.__version__, "transformers", tf.__version__, "peft", peft.__version__)
    for name in TARGETS:
        one(name)
