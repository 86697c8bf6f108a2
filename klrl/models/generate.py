"""Text generation with any :class:`klrl.models.base.CausalLM` and a tokenizer.

Prompts are left-padded to a common length ``P``; one prefill writes them into a KV cache of
``P + max_new_tokens`` slots, then a ``lax.scan`` decodes one token per step (slot ``P + i``),
greedy (``argmax``) when ``temperature == 0`` else sampled from ``softmax(logits / temperature)``.
A row stops at its first stop id (kept in the ids, cut from the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from klrl.models.attention import positions_from_mask


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> ``tokens [B, P]`` int32 and ``mask [B, P]`` bool, left-padded."""
    p = max(len(r) for r in rows)
    tokens = np.full((len(rows), p), pad_id, np.int32)
    mask = np.zeros((len(rows), p), bool)
    for i, r in enumerate(rows):
        if len(r):
            tokens[i, p - len(r) :] = r
            mask[i, p - len(r) :] = True
    return tokens, mask


@partial(jax.jit, static_argnames=("model", "max_new_tokens", "stop_ids"))
def generate_ids(
    model, params, tokens, mask, key, temperature, *, max_new_tokens: int, stop_ids: tuple[int, ...]
):
    """``tokens, mask [B, P]`` -> ``(new [B, N] int32, new_mask [B, N] bool)``: tokens up to and
    including each row's first stop id are marked real."""
    b, p = tokens.shape
    s = p + max_new_tokens
    key_mask = jnp.zeros((b, s), bool).at[:, :p].set(mask)
    slots = jnp.arange(s)
    pos = positions_from_mask(mask)
    att = (slots[None, None, :] <= jnp.arange(p)[None, :, None]) & key_mask[:, None, :]
    att = att | (slots[None, None, :] == jnp.arange(p)[None, :, None])
    out = model.apply(params, tokens, pos, att, model.init_cache(b, s), 0)
    last = out.logits[:, -1]
    nxt_pos = pos[:, -1] + 1
    stops = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)

    def pick(logits, k):
        greedy = jnp.argmax(logits, -1)
        sampled = jax.random.categorical(k, logits / jnp.maximum(temperature, 1e-6), -1)
        return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

    def step(carry, i):
        cache, logits, key_mask, position, alive, k = carry
        k, sub = jax.random.split(k)
        tok = pick(logits, sub)
        slot = p + i
        key_mask = key_mask.at[:, slot].set(True)
        m = (slots[None, None, :] <= slot) & key_mask[:, None, :]
        o = model.apply(params, tok[:, None], position[:, None], m, cache, slot)
        real = alive
        alive = alive & ~jnp.isin(tok, stops)
        return (o.cache, o.logits[:, -1], key_mask, position + 1, alive, k), (tok, real)

    init = (out.cache, last, key_mask, nxt_pos, jnp.ones((b,), bool), key)
    _, (new, real) = jax.lax.scan(step, init, jnp.arange(max_new_tokens))
    return new.T, real.T


def generate_text(
    model,
    params,
    tokenizer,
    prompts: Sequence[str | list[dict[str, str]]],
    max_new_tokens: int,
    temperature: float = 0.0,
    *,
    key: jax.Array | None = None,
) -> list[str]:
    """Completions of ``prompts`` as strings (a prompt given as a list of chat messages is rendered
    with the tokenizer's chat template, generation prompt added)."""
    # a rendered chat template already holds its special tokens (transformers encodes it with
    # add_special_tokens=False); a plain string gets them (BOS) as transformers' tokenizer(text) does
    rows = [
        tokenizer.encode(p, add_special_tokens=True)
        if isinstance(p, str)
        else tokenizer.encode(tokenizer.apply_chat_template(p), add_special_tokens=False)
        for p in prompts
    ]
    tokens, mask = left_pad(rows, tokenizer.pad_id)
    key = jax.random.key(0) if key is None else key
    new, real = generate_ids(
        model,
        params,
        jnp.asarray(tokens),
        jnp.asarray(mask),
        key,
        jnp.float32(temperature),
        max_new_tokens=max_new_tokens,
        stop_ids=tuple(tokenizer.stop_ids),
    )
    new, real = np.asarray(new), np.asarray(real)
    stops = set(tokenizer.stop_ids)
    out = []
    for r, m in zip(new, real, strict=True):
        ids = [int(t) for t, ok in zip(r, m, strict=True) if ok and int(t) not in stops]
        out.append(tokenizer.decode(ids))
    return out
