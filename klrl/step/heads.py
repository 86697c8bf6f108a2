"""What the stages of :mod:`klrl.step.train` read of the models: the policy's tempered response logits
and values (the update, under ``model.remat``), the separate value model's values, and on the chunked
path (:mod:`klrl.step.chunked`, ``model.logits``) the same per-position terms from hidden states without
``[B, R, V]`` logits (the update's policy terms, the scoring's reference log-probs and exact KL).
"""

from __future__ import annotations

from typing import Any

import jax

from klrl.models.base import forward
from klrl.models.heads import detach
from klrl.models.rollout import Rollout, response_slice
from klrl.step import chunked
from klrl.step.context import Context, full_params
from klrl.step.stages import Batch, TrainState

Array = jax.Array


def policy_out(ctx: Context, pol_params: Any, tokens: Array, key_mask: Array) -> tuple[Array, Array | None]:
    """Tempered response logits ``[B, R, V]`` and (with a head on the trunk) values ``[B, R]``, as the
    update differentiates them (``model.remat``)."""
    trunk, head = detach(pol_params) if ctx.head else (pol_params, None)
    out = forward(ctx.update_policy, trunk, tokens, key_mask)
    logits = response_slice(out.logits, ctx.p_len, ctx.r_len) / ctx.cfg.sampling.temperature
    value = None
    if ctx.head:
        value = response_slice(ctx.models.value_head.apply(head, out.hidden), ctx.p_len, ctx.r_len)
    return logits, value


def value_out(ctx: Context, value_params: Any, tokens: Array, key_mask: Array, model: Any = None) -> Array:
    """Values ``[B, R]`` of the separate value model (``model``: the value trunk to run, default
    ``ctx.models.value``)."""
    trunk, head = detach(value_params)
    model = ctx.models.value if model is None else model
    hidden = forward(model, trunk, tokens, key_mask, logits=False).hidden
    return response_slice(ctx.models.value_head.apply(head, hidden), ctx.p_len, ctx.r_len)


def policy_terms(ctx: Context, pol_params: Any, mb: Batch, ref_params: Any) -> tuple:
    """The update's policy terms on the chunked path (:mod:`klrl.step.chunked`, no ``[mb, R, V]``
    logits): ``(logp, entropy, values or None, full KL or None)``, each ``[mb, R]``; the full KL (a
    ``full`` loss estimator, under ``kl.clamp``) reads the reference's head ``ref_params``."""
    trunk, head = detach(pol_params) if ctx.head else (pol_params, None)
    out = forward(ctx.update_policy, trunk, mb.tokens, mb.key_mask, logits=False)
    hidden = response_slice(out.hidden, ctx.p_len, ctx.r_len)
    want = ("policy_logp", "policy_entropy") + (("kl",) if ctx.full_in_loss else ())
    t = chunked.head_terms(
        ctx.models.policy, mb.response, mb.mask, temperature=ctx.cfg.sampling.temperature,
        chunk=ctx.cfg.model.logits_chunk, want=want, policy=(trunk, hidden),
        ref=(ref_params, mb.ref_hidden) if ctx.full_in_loss else None, clamps=(ctx.cfg.kl.clamp,),
        checkpoint=True,
    )  # fmt: skip
    ent = t["policy_entropy"]
    ent = jax.lax.stop_gradient(ent) if ctx.cfg.ppo.ent_coef == 0 else ent  # a statistic only
    value = None
    if ctx.head:
        value = response_slice(ctx.models.value_head.apply(head, out.hidden), ctx.p_len, ctx.r_len)
    return t["policy_logp"], ent, value, t["kl"][0] if ctx.full_in_loss else None


def score_terms(ctx: Context, state: TrainState, ro: Rollout, ref_hidden: Array) -> tuple:
    """Scoring on the chunked path: ``(ref_logp, exact KL or None, full KL under kl.clamp or None)``,
    each ``[B, R]``, from the reference's and the rollout's hidden states (:mod:`klrl.step.chunked`)."""
    clamp = ctx.cfg.kl.clamp
    pol = full_params(ctx, state.params, state.ref_params)["policy"]
    pol = detach(pol)[0] if ctx.head else pol
    t = chunked.head_terms(
        ctx.models.policy, ro.response, ro.mask, temperature=ctx.cfg.sampling.temperature,
        chunk=ctx.cfg.model.logits_chunk, want=("ref_logp",) + (("kl",) if ctx.exact_kl else ()),
        policy=(pol, ro.hidden) if ctx.exact_kl else None, ref=(state.ref_params, ref_hidden),
        clamps=(0.0,) if clamp == 0 else (0.0, clamp),
    )  # fmt: skip
    kl = t.get("kl")
    return t["ref_logp"] * ro.mask, kl[0] if kl else None, kl[-1] if kl else None
