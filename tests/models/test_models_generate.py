"""generate_text / generate_ids: batched, left-padded KV-cache generation against a reference that
recomputes the whole sequence with teacher forcing at every step (no cache)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from klrl.data.hf_tokenizer import byte_level_bpe, bytes_to_unicode, make_tokenizer
from klrl.models.base import forward
from klrl.models.generate import generate_ids, generate_text, left_pad
from klrl.models.hf import load_hf

DATA = Path(__file__).parents[1] / "data"


@functools.lru_cache
def _teacher_forced(model):
    return jax.jit(lambda p, t: forward(model, p, t, jnp.ones_like(t, bool)).logits)


def greedy_reference(model, params, prompt: list[int], n: int, size: int = 16) -> list[int]:
    """Greedy decoding by full teacher-forced passes over the unpadded sequence (kept in a fixed
    buffer: the slots after it are in the causal future, so they change nothing)."""
    assert len(prompt) + n <= size
    f = _teacher_forced(model)
    seq = np.zeros((1, size), np.int32)
    seq[0, : len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n):
        seq[0, i] = int(jnp.argmax(f(params, jnp.asarray(seq))[0, i - 1]))
    return seq[0, len(prompt) : len(prompt) + n].tolist()


def test_left_pad():
    t, m = left_pad([[5, 6], [7]], 0)
    assert t.tolist() == [[5, 6], [0, 7]] and m.tolist() == [[True, True], [False, True]]


def test_batched_greedy_equals_unbatched_recompute():
    for name in ("tiny_llama", "tiny_gpt2"):
        model, params = load_hf(DATA / name)
        prompts = [[5, 9, 200, 31, 77], [12, 40], [100, 3, 9]]
        tokens, mask = left_pad(prompts, 0)
        new, real = generate_ids(
            model,
            params,
            jnp.asarray(tokens),
            jnp.asarray(mask),
            jax.random.key(0),
            jnp.float32(0.0),
            max_new_tokens=6,
            stop_ids=(),
        )
        assert np.asarray(real).all()
        for row, p in zip(np.asarray(new), prompts, strict=True):
            assert row.tolist() == greedy_reference(model, params, p, 6), name


def test_generate_text_stops_at_a_stop_id_and_samples_with_temperature():
    model, params = load_hf(DATA / "tiny_llama")
    chars = list(bytes_to_unicode().values())
    tok = make_tokenizer(
        byte_level_bpe(chars, []),
        {"eos_token": chars[0], "pad_token": chars[0]},
        "{{ messages[0]['content'] }}",
    )
    prompt = "hello"
    ids = tok.encode(prompt)
    ref = greedy_reference(model, params, ids, 8)
    stop = ref[3]
    tok2 = make_tokenizer(tok.tok, {"eos_token": tok.tok.id_to_token(stop), "pad_token": chars[0]}, None)
    cut = ref[: ref.index(stop)]
    assert generate_text(model, params, tok2, [prompt], 8) == [tok.decode(cut)]
    assert generate_text(model, params, tok, [[{"role": "user", "content": prompt}]], 8) == [tok.decode(ref)]
    a = generate_text(model, params, tok, [prompt] * 4, 8, temperature=1.0, key=jax.random.key(1))
    assert len(set(a)) > 1  # sampling: different rows differ
