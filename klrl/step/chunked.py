"""Logit-derived quantities from final hidden states, a chunk of positions at a time.

For a vocabulary of ``V`` tokens the logits of ``B`` sequences x ``T`` positions are a ``[B, T, V]``
float32 buffer: 100 MB for SmolLM2 (``V = 49152``) at 16 x 32, and several such buffers in the
update's backward (logits, ``log_softmax``, its ``exp``, their cotangents). Everything PPO-KL reads
of them is one number per position, so this module never forms them at once: the positions are
flattened to ``N = B T`` rows and cut into chunks of ``chunk`` rows (the last one zero-padded); for
each chunk (``lax.map``) the LM head (the family's ``head(params, hidden) -> [..., V]`` logits, the
same product its ``apply`` computes) gives ``[chunk, V]`` logits, and only per-position values
leave the chunk:

* ``policy_logp``, ``ref_logp``: ``log softmax(z / tau)[y_t]`` of the sampled token ``y_t``
  (:func:`klrl.algo.logprobs.token_logprobs`);
* ``policy_entropy``: ``-sum_v p_v log p_v`` of the tempered policy (:func:`klrl.algo.logprobs.entropy`);
* ``kl``: the exact full-vocabulary ``KL(pi || pi_ref)`` per position, :func:`klrl.algo.kl.full_kl` of the
  two tempered logits chunks (one output per clamp asked for).

A KL estimator of the full logits (``inputs="logits"`` in :data:`klrl.registry.ESTIMATORS`) runs here
only as the term its registration names (``chunked="kl"`` for ``full``; :func:`estimator_term`);
:func:`check_estimators` refuses one without a chunked form by name, before anything compiles. The
estimators of the sampled tokens' log-probs need none: they read ``policy_logp`` and ``ref_logp``.

With ``checkpoint=True`` each chunk is one ``jax.checkpoint``: its backward recomputes that chunk's
logits, so the gradient of the PPO loss holds one chunk's ``[chunk, V]`` buffers at a time, not
``[B, T, V]`` (peak memory ``O(chunk V)`` instead of ``O(B T V)``; cost: the head's forward twice).
Values agree with the full-logits path to float32 rounding (the matmuls have other shapes), which
``tests/step/test_chunked.py`` checks for the values and the gradients.

``model.logits`` (:class:`klrl.config.run.ModelConfig`) chooses the path: ``full`` (today's
``[B, T, V]`` logits), ``chunked``, or ``auto`` (chunked from :data:`CHUNK_MIN_VOCAB` tokens on; the
small testbed vocabularies keep the full path and its numbers bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from klrl.algo import kl as kl_lib
from klrl.algo.logprobs import entropy, token_logprobs
from klrl.config import ConfigError, RunConfig
from klrl.registry import ESTIMATORS

Array = jax.Array
CHUNK_MIN_VOCAB = 32768
TERMS = ("policy_logp", "policy_entropy", "ref_logp", "kl")


def use_chunks(mode: str, vocab_size: int) -> bool:
    """``model.logits`` -> whether the chunked path is taken for a vocabulary of ``vocab_size``."""
    if mode not in ("auto", "full", "chunked"):
        raise ValueError(f"model.logits: must be auto, full or chunked (got {mode!r})")
    return mode == "chunked" or (mode == "auto" and vocab_size >= CHUNK_MIN_VOCAB)


def _refuse(field: str, est: str, why: str) -> None:
    meta = ESTIMATORS.meta(est)
    if meta["inputs"] == "logits" and meta.get("chunked") not in TERMS:
        raise ConfigError(
            f"{field}: the KL estimator {est!r} reads the full [B, T, V] logits and declares no chunked "
            f"form, which {why} (use model.logits=full, or register it with chunked=<a term of "
            "klrl.step.chunked.TERMS>)"
        )


def check_estimators(cfg: RunConfig, vocab_size: int) -> None:
    """On the chunked path, every KL estimator the run uses that reads the full logits must declare
    its chunked form (a term of :data:`TERMS`); otherwise a :class:`ConfigError` names it (rather
    than a silent substitution, or a missing ``[B, T, V]`` buffer at trace time)."""
    if not use_chunks(cfg.model.logits, vocab_size):
        return
    used = {"kl.estimator": cfg.kl.estimator, "ctrl.estimator": cfg.ctrl.estimator}
    if cfg.kl.placement in ("loss", "reward+loss"):
        used["kl.loss_estimator"] = cfg.kl.loss_estimator
    why = f"model.logits={cfg.model.logits} needs for a vocabulary of {vocab_size}"
    for field, est in used.items():
        _refuse(field, est, why)


def estimator_term(name: str, terms: dict[str, Any]) -> Any:
    """The value of KL estimator ``name`` (one of the full logits) on the chunked path: the term of
    ``terms`` (:func:`head_terms`'s outputs, e.g. ``{"kl": full KL under kl.clamp}``) its
    registration declares as its chunked form (a :class:`ConfigError` naming it without one)."""
    _refuse("KL estimator", name, "the chunked path (model.logits) needs")
    return terms[ESTIMATORS.meta(name)["chunked"]]


def lm_head(model: Any, params: Any, hidden: Array) -> Array:
    """``model``'s LM head on final hidden states ``[..., D]`` -> float32 logits ``[..., V]``."""
    head = getattr(model, "head", None)
    if head is None:
        raise TypeError(f"{type(model).__name__} has no head(params, hidden): model.logits=chunked needs one")
    return head(params, hidden)


def _logits(model: Any, params: Any, hidden: Array, temperature: float) -> Array:
    """Tempered float32 logits of one chunk. The head's output passes through a float32-to-float32
    ``reduce_precision`` (the identity on its values and derivatives) so that XLA's CPU backend does
    not fuse the reductions that read the logits (``log_softmax``'s max) into the head's matmul: such
    a fused matmul-and-reduce ran 2.5x slower than the matmul alone (106 against 41 ms for a ``[128,
    576] x [576, 49152]`` head on an AMD EPYC; 280 ms a chunk in the SmolLM2 update), and an
    ``optimization_barrier`` does not survive to XLA's fusion passes."""
    z = jax.lax.reduce_precision(lm_head(model, params, hidden), exponent_bits=8, mantissa_bits=23)
    return z / temperature


def map_positions(fn: Callable, inputs: tuple, chunk: int, *, checkpoint: bool = False) -> Any:
    """``fn`` over chunks of positions: every array of ``inputs`` is ``[B, T, ...]`` (``None`` is
    passed through); ``fn`` maps ``[c, ...]`` rows to a pytree of ``[c, ...]`` arrays, and the result
    is that pytree at ``[B, T, ...]``. The ``B T`` rows are cut into ``ceil(B T / c)`` chunks of
    ``c = min(chunk, B T)`` rows (the last zero-padded) and mapped with ``lax.map``; with
    ``checkpoint`` each chunk is a ``jax.checkpoint`` (its backward recomputes it)."""
    present = [x for x in inputs if x is not None]
    b, t = present[0].shape[:2]
    n = b * t
    c = max(min(chunk, n), 1)
    k = -(-n // c)

    def split(x):
        if x is None:
            return None
        x = x.reshape(n, *x.shape[2:])
        x = jnp.pad(x, [(0, k * c - n)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(k, c, *x.shape[1:])

    body = jax.checkpoint(fn) if checkpoint else fn
    out = jax.lax.map(lambda xs: body(*xs), tuple(split(x) for x in inputs))
    return jax.tree.map(lambda y: y.reshape(k * c, *y.shape[2:])[:n].reshape(b, t, *y.shape[2:]), out)


def head_terms(
    model: Any,
    tokens: Array,
    mask: Array,
    *,
    temperature: float,
    chunk: int,
    want: tuple[str, ...],
    policy: tuple[Any, Array] | None = None,
    ref: tuple[Any, Array] | None = None,
    clamps: tuple[Any, ...] = (0.0,),
    checkpoint: bool = False,
) -> dict[str, Any]:
    """Per-position terms ``[B, T]`` float32 from hidden states, chunk by chunk (module docstring).

    ``policy`` and ``ref`` are ``(params, hidden [B, T, D])`` of the policy and the reference (the
    same family ``model``; the hidden states at the positions that predict ``tokens [B, T]``);
    ``want`` names the terms of :data:`TERMS` to return. ``kl`` is a tuple: ``full_kl`` under each
    of ``clamps``. ``mask [B, T]`` is the response mask ``full_kl`` reads (its masked positions are
    0); the log-probs and the entropy are returned unmasked, as from full logits.
    """
    for w in want:
        if w not in TERMS:
            raise ValueError(f"head_terms: unknown term {w!r} ({', '.join(TERMS)})")
    if policy is None and any(w.startswith("policy") or w == "kl" for w in want):
        raise ValueError("head_terms: the policy's terms need policy=(params, hidden)")
    if ref is None and any(w in ("ref_logp", "kl") for w in want):
        raise ValueError("head_terms: the reference's terms need ref=(params, hidden)")
    pol_params, pol_h = policy if policy is not None else (None, None)
    ref_params, ref_h = ref if ref is not None else (None, None)
    if "kl" not in want:
        ref_h = ref_h if "ref_logp" in want else None
    if not any(w.startswith("policy") or w == "kl" for w in want):
        pol_h = None

    def one(tok, m, hp, hq):
        out: dict[str, Any] = {}
        zp = None if hp is None else _logits(model, pol_params, hp, temperature)
        zq = None if hq is None else _logits(model, ref_params, hq, temperature)
        if "policy_logp" in want:
            out["policy_logp"] = token_logprobs(zp, tok)
        if "policy_entropy" in want:
            out["policy_entropy"] = entropy(zp)
        if "ref_logp" in want:
            out["ref_logp"] = token_logprobs(zq, tok)
        if "kl" in want:
            out["kl"] = tuple(kl_lib.full_kl(zp, zq, m, c) for c in clamps)
        return out

    return map_positions(one, (tokens, mask, pol_h, ref_h), chunk, checkpoint=checkpoint)
