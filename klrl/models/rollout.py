"""Prompts -> responses: KV-cache sampling inside ``lax.scan``.

Prompts are left-padded to a fixed length P with a prompt mask, so every
response starts at slot P of a cache of length S = P + R. Each step samples a
token from ``softmax(logits / temperature)`` (optionally restricted to the top
k), records its log-probability under the *full* tempered policy (the
distribution PPO's ratio and the KL use; top-k only changes which token is
drawn), and, for a value head on the trunk, the value V(s_t) of the state that
produced it. A stop token (any of the tokenizer's ``stop_ids``) ends a response: it is kept
(mask 1) and every later position is PAD with mask 0. The model is any
:class:`klrl.models.base.CausalLM`. Randomness is per example: ``keys[b]`` and the step
index alone decide example b's draw, so results do not depend on how the batch
is split over devices.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from klrl.config import SamplingConfig
from klrl.models.attention import causal_mask, positions_from_mask
from klrl.models.base import CausalLM
from klrl.models.heads import ValueHead, detach

Array = jax.Array


class Rollout(NamedTuple):
    prompt: Array  # [B, P] int32, left-padded
    prompt_mask: Array  # [B, P] float32
    response: Array  # [B, R] int32, PAD after EOS
    mask: Array  # [B, R] float32 response mask (EOS included)
    logp: Array  # [B, R] behaviour log-probs under the tempered full policy
    value: Array | None  # [B, R] V(s_t) from a trunk value head, else None
    logits: Array | None  # [B, R, V] tempered policy logits (for exact KL), else None
    prompt_idx: Array | None = None  # [B] int32 rows of the prompt pool sampled (set by the train step)
    hidden: Array | None = None  # [B, R, D] final hidden states that gave each token's logits, else None


def sequence(prompt: Array, prompt_mask: Array, response: Array, mask: Array) -> tuple[Array, Array]:
    """Concatenate prompt and response into ``[B, P + R]`` tokens and key mask.

    The response part of the key mask is all ones: positions after EOS only
    follow the real tokens, so they never influence them.
    """
    tokens = jnp.concatenate([prompt, response], axis=1)
    key_mask = jnp.concatenate([prompt_mask, jnp.ones_like(mask)], axis=1)
    return tokens, key_mask


def response_slice(x: Array, prompt_len: int, response_len: int) -> Array:
    """The positions whose outputs predict response tokens: ``x[:, P-1 : P+R-1]``."""
    return x[:, prompt_len - 1 : prompt_len + response_len - 1]


def gumbel_argmax(keys: Array, logits: Array) -> Array:
    """``[B]`` int32 draws from ``softmax(logits [B, V])``, one key per row.

    The same draws as ``vmap(jax.random.categorical)(keys, logits)`` (Gumbel-max with
    ``jax.random.gumbel``; ties go to the lowest index), with the argmax written as a max and a
    min over matching indices: two plain reductions that XLA vectorises on CPU, where the
    index-carrying argmax reduction was half of the sampling time (``benchmarks/NOTES.md``).
    A row with NaN logits draws token ``V - 1`` (``categorical``: the first NaN's index); either
    way a token id stays in range, and the step's non-finite guard skips such an iteration.
    """
    v = logits.shape[-1]
    g = jax.vmap(lambda k: jax.random.gumbel(k, (v,), logits.dtype))(keys) + logits
    best = jnp.max(g, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(g == best, jnp.arange(v, dtype=jnp.int32), v), axis=-1), v - 1)


def _sample(logits: Array, keys: Array, temperature: float, top_k: int) -> tuple[Array, Array, Array]:
    scaled = logits / temperature
    draw_from = scaled
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        draw_from = jnp.where(scaled >= kth, scaled, -jnp.inf)
    tok = gumbel_argmax(keys, draw_from)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0], scaled


def stop_set(stop_ids: int | tuple[int, ...]) -> tuple[int, ...]:
    """A stop id or a set of them, as a non-empty tuple of ints."""
    ids = (stop_ids,) if isinstance(stop_ids, int) else tuple(int(i) for i in stop_ids)
    if not ids:
        raise ValueError("stop_ids: at least one stop token is needed")
    return ids


def is_stop(tok: Array, stop_ids: tuple[int, ...]) -> Array:
    """``tok`` is one of ``stop_ids`` (elementwise bool)."""
    hit = tok == stop_ids[0]
    for i in stop_ids[1:]:
        hit = hit | (tok == i)
    return hit


def _values(value_head: ValueHead | None, head_params: Any, out: Any) -> Array | None:
    """The value head's ``V`` of ``out.hidden`` (None without a head)."""
    return None if value_head is None else value_head.apply(head_params, out.hidden)


def _prefill(
    model: CausalLM, params: Any, prompt: Array, prompt_mask: Array, r: int, keep_hidden: bool, values
) -> tuple[Array, Array, tuple]:
    """The prompt's forward into a fresh cache of ``S = P + r`` slots: ``(full_mask [B, S, S],
    positions [B, S], carry)``, the decode scan's first carry ``(cache, logits, hid, value, done)``
    read at the last prompt slot (``value`` 0 without a head)."""
    b, p = prompt.shape
    s = p + r
    key_mask = jnp.concatenate([prompt_mask, jnp.ones((b, r), prompt_mask.dtype)], axis=1)
    full_mask = causal_mask(key_mask)  # [B, S, S]
    positions = positions_from_mask(key_mask)  # [B, S]
    cache = model.init_cache(b, s)

    # the LM head on the last prompt slot only (the others' logits are never read: P - 1 rows of
    # [D] x [D, V] saved, 11% of the SmolLM2 workload's rollout FLOPs); a model without ``head`` (the
    # CausalLM protocol does not require one) computes them all
    head = getattr(model, "head", None)
    out = model.apply(params, prompt, positions[:, :p], full_mask[:, :p], cache, 0, logits=head is None)
    cache = out.cache
    logits = out.logits[:, -1] if head is None else head(params, out.hidden[:, -1])
    hid = out.hidden[:, -1] if keep_hidden else None
    v0 = values(out)
    value = v0[:, -1] if v0 is not None else jnp.zeros((b,), jnp.float32)
    done = jnp.zeros((b,), bool)
    return full_mask, positions, (cache, logits, hid, value, done)


def _sample_step(
    logits: Array,
    hid: Array | None,
    value: Array,
    done: Array,
    t: Array | int,
    *,
    keys: Array,
    cfg: SamplingConfig,
    stops: tuple[int, ...],
    pad_id: int,
    keep_logits: bool,
) -> tuple[Array, Array, tuple]:
    """Step ``t``'s draw from ``logits``: ``(done, token, ys)``; ``ys`` is what the step records
    (token, mask, log-prob, value, tempered logits or None, hidden or None). A finished row draws PAD."""
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, t)
    tok, logp, scaled = _sample(logits, step_keys, cfg.temperature, cfg.top_k)
    valid = ~done
    tok = jnp.where(valid, tok, pad_id)
    new_done = done | (valid & is_stop(tok, stops)) if cfg.use_eos else done
    ys = (tok, valid.astype(jnp.float32), logp, value, scaled if keep_logits else None, hid)
    return new_done, tok, ys


def _decode(
    model: CausalLM,
    params: Any,
    carry: tuple,
    full_mask: Array,
    positions: Array,
    r: int,
    step,
    values,
    keep_hidden: bool,
    unroll: int,
) -> tuple:
    """The ``lax.scan`` over steps ``0 .. r-2`` (each samples a token, then feeds it through the model
    at slot ``P + t``) and the last step's draw: the recorded ``ys`` stacked to ``[B, r, ...]``."""
    p = full_mask.shape[-1] - r

    def body(carry, t):
        cache, logits, hid, value, done = carry
        done, tok, ys = step(logits, hid, value, done, t)
        slot = p + t
        mask_t = jax.lax.dynamic_slice_in_dim(full_mask, slot, 1, axis=1)  # [B, 1, S]
        pos_t = jax.lax.dynamic_slice_in_dim(positions, slot, 1, axis=1)
        o = model.apply(params, tok[:, None], pos_t, mask_t, cache, slot)
        vo = values(o)
        v = vo[:, 0] if vo is not None else value
        return (o.cache, o.logits[:, 0], o.hidden[:, 0] if keep_hidden else None, v, done), ys

    (cache, logits, hid, value, done), ys = jax.lax.scan(body, carry, jnp.arange(r - 1), unroll=unroll)
    _, _, last = step(logits, hid, value, done, r - 1)
    return jax.tree.map(lambda a, x: jnp.concatenate([jnp.moveaxis(a, 0, 1), x[:, None]], axis=1), ys, last)


def generate(
    model: CausalLM,
    params: Any,
    prompt: Array,
    prompt_mask: Array,
    keys: Array,
    cfg: SamplingConfig,
    stop_ids: int | tuple[int, ...],
    pad_id: int = 0,
    keep_logits: bool = False,
    unroll: int = 1,
    *,
    value_head: ValueHead | None = None,
    keep_hidden: bool = False,
) -> Rollout:
    """Sample ``cfg.response_len`` tokens for each prompt with a KV cache.

    ``keep_logits``: return the tempered logits ``[B, R, V]``; ``keep_hidden``: the final hidden
    states ``[B, R, D]`` they came from instead (what :mod:`klrl.step.chunked` reads for a large
    vocabulary: the logits are a function of them through the LM head).

    ``stop_ids``: one id or a tuple; any of them ends a response. ``value_head``: a head on the
    policy trunk (``params`` then carries its parameters, :func:`klrl.models.heads.attach`), whose
    values are recorded. ``keys [B]`` are per-example PRNG keys; step t uses
    ``fold_in(keys[b], t)``. ``unroll`` is the decode scan's unroll factor (1 measured fastest on
    CPU, ``benchmarks/NOTES.md``).
    """
    stops = stop_set(stop_ids)
    head_params = None
    if value_head is not None:
        params, head_params = detach(params)
    values = functools.partial(_values, value_head, head_params)
    r = cfg.response_len
    full_mask, positions, carry = _prefill(model, params, prompt, prompt_mask, r, keep_hidden, values)
    step = functools.partial(
        _sample_step, keys=keys, cfg=cfg, stops=stops, pad_id=pad_id, keep_logits=keep_logits
    )
    stacked = _decode(model, params, carry, full_mask, positions, r, step, values, keep_hidden, unroll)
    tok, valid, logp, val, lg, hs = stacked
    return Rollout(
        prompt=prompt,
        prompt_mask=prompt_mask.astype(jnp.float32),
        response=tok,
        mask=valid,
        logp=logp * valid,
        value=val * valid if value_head is not None else None,
        logits=lg,
        hidden=hs,
    )
