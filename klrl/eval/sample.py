"""Completions of a policy to a prompt pool, as PPO samples them (``klrl generate``, ``klrl eval``, a study).

``sample`` answers each prompt of a :class:`klrl.data.prompts.PromptPool` ``n`` times with PPO's sampler
(:func:`klrl.models.rollout.generate`: a stop id ends a response, at most ``max_new`` tokens), row ``m``
(prompt-major) drawn with key ``fold_in(key(seed), m)``, so the same seed gives the same completions
whatever the batch size; temperature 0 is greedy. ``decode`` turns the token rows into texts as
:func:`klrl.models.generate.generate_text` does (the stop token dropped).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.config import SamplingConfig
from klrl.data.prompts import PromptPool
from klrl.models.rollout import generate


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
def _sample(model, params, prompt, pmask, keys, cfg, stops, pad):
    ro = generate(model, params, prompt, pmask, keys, cfg, stops, pad)
    return ro.response, ro.mask


def chunks(n: int, size: int) -> Iterator[tuple[np.ndarray, int]]:
    """``(rows, k)``: row indices in fixed-size chunks (the last filled up with row 0, so every chunk has
    one shape and one compiled program serves them all), ``k`` real rows."""
    size = max(1, min(size, n))
    for i in range(0, n, size):
        rows = np.arange(i, i + size)
        k = int(min(size, n - i))
        yield np.where(rows < n, rows, 0), k


def sample(
    model: Any,
    params: Any,
    tok: Any,
    pool: PromptPool,
    n: int,
    max_new: int,
    temperature: float,
    seed: int,
    batch: int,
    use_eos: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(idx [M], response [M, R], mask [M, R])``, ``M = n len(pool)``: ``n`` completions of each prompt
    (prompt-major, ``idx[m]`` the prompt's row), row ``m`` drawn with key ``fold_in(key(seed), m)``;
    temperature 0: greedy (top-1 at temperature 1)."""
    cfg = SamplingConfig(
        response_len=max_new, temperature=temperature or 1.0, top_k=0 if temperature else 1, use_eos=use_eos
    )
    idx = np.repeat(np.arange(len(pool)), n)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(len(idx)))
    stops = tuple(int(s) for s in tok.stop_ids)
    resp, mask = np.zeros((len(idx), max_new), np.int32), np.zeros((len(idx), max_new), np.float32)
    for rows, k in chunks(len(idx), batch):
        p = idx[rows]
        r, m = _sample(model, params, jnp.asarray(pool.tokens[p]), jnp.asarray(pool.mask[p]), keys[rows], cfg,
                       stops, int(tok.pad_id))  # fmt: skip
        resp[rows[:k]], mask[rows[:k]] = np.asarray(r)[:k], np.asarray(m)[:k]
    return idx, resp, mask


def decode(tok: Any, response: np.ndarray, mask: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``(texts, tokens [M], stopped [M])``: the completions without their stop token (as
    :func:`klrl.models.generate.generate_text` decodes them), their token counts (the stop token
    included) and whether a stop token ended each."""
    stops = set(int(s) for s in tok.stop_ids)
    texts, stopped = [], []
    for r, m in zip(response, mask, strict=True):
        ids = [int(t) for t, ok in zip(r, m, strict=True) if ok > 0]
        stopped.append(bool(ids) and ids[-1] in stops)
        texts.append(tok.decode([i for i in ids if i not in stops]))
    return texts, mask.sum(axis=1).astype(int), np.asarray(stopped)


def token_ids(response: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """Each completion's token ids (its stop token included), for parity work (``klrl generate --ids``)."""
    return [
        [int(t) for t, ok in zip(r, m, strict=True) if ok > 0] for r, m in zip(response, mask, strict=True)
    ]
