"""The DPO program: pure ``init`` and one jitted iteration, vmapped over the members of a sweep.

An iteration of one member (:func:`dpo_iteration`):

  draw ``batch_size`` pairs (a permutation keyed by the member's key and the iteration) ->
  the reference's log-probabilities of their responses, once (one forward of the frozen base, no
  gradient) -> ``minibatches`` AdamW steps on the DPO loss in a ``lax.scan`` -> the metrics (means
  over the minibatches, each computed before its step, as TRL logs them).

The reference is the loaded base: with LoRA the policy is the base plus adapters (``params`` holds
only them) and the reference the base with them off; in full fine-tuning ``params`` starts as a copy
of the base, which stays the reference. Either way the base is an argument of the compiled program,
shared by every member, never part of the state.

beta lives in ``state.beta`` (float32) and is only used as an array, so members that differ in beta
and seed are one program: :func:`make_sweep_step` is ``jit(vmap(dpo_iteration))`` over stacked states
(:func:`stack`). A run is a sweep of one.

:func:`heldout_metrics` measures a member on held-out data: the DPO loss, reward margin and accuracy on
the held-out pairs, and the exact KL of the policy to the reference on held-out prompts: responses
sampled from the policy at temperature 1 (fixed keys, the same for every member and evaluation), and
``kl/exact_seq_sum = mean_x sum_t KL(pi(.|x, y<t) || pi_ref(.|x, y<t))`` (nats per sequence, the sum
over the full vocabulary at every response position: no estimator variance at a position, an unbiased
estimate of the sequence KL ``KL(pi(.|x) || pi_ref(.|x))`` over the sampled responses), as PPO's
``kl/exact_seq_sum``; ``kl/exact_token_mean`` divides each sequence's sum by its length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from klrl.algo import kl as kl_lib
from klrl.algo.dpo import completion_logps, pair_losses, pair_metrics
from klrl.config import SamplingConfig
from klrl.config.dpo import DPOConfig
from klrl.models import lora as lora_lib
from klrl.models.base import forward
from klrl.models.rollout import generate, response_slice, sequence

Array = jax.Array


class DPOState(NamedTuple):
    """One member's train state (a sweep stacks them on a leading axis)."""

    params: Any  # the adapters (LoRA) or the whole trunk (full fine-tuning)
    opt_state: Any
    beta: Array  # float32 []
    key: Array  # uint32 [2]: the member's key (the adapters' init and the order of the pairs)
    iteration: Array  # int32 []: updates done


class PairData(NamedTuple):
    """Pairs on the device: right-padded tokens ``[N, T]`` int32, their masks and response
    (completion) masks ``[N, T]`` float32."""

    chosen: Array
    chosen_mask: Array
    chosen_comp: Array
    rejected: Array
    rejected_mask: Array
    rejected_comp: Array

    @staticmethod
    def of(pairs: Any) -> PairData:
        """From :class:`klrl.rewards.pairs.Pairs` (with prompt lengths)."""
        return PairData(
            jnp.asarray(pairs.chosen),
            jnp.asarray(pairs.chosen_mask),
            jnp.asarray(pairs.completion("chosen")),
            jnp.asarray(pairs.rejected),
            jnp.asarray(pairs.rejected_mask),
            jnp.asarray(pairs.completion("rejected")),
        )

    def take(self, idx: Array) -> PairData:
        return PairData(*(x[idx] for x in self))


@dataclasses.dataclass(frozen=True)
class DPOProgram:
    """What the compiled functions close over: the model family, the adapters (None: full
    fine-tuning), the settings and the optimiser."""

    model: Any
    lora: lora_lib.LoRA | None
    cfg: DPOConfig

    @property
    def optimizer(self) -> optax.GradientTransformation:
        """AdamW (optax's defaults b1 0.9, b2 0.999, eps 1e-8, as torch's), after global-norm clipping."""
        adam = optax.adamw(self.cfg.lr, weight_decay=self.cfg.weight_decay)
        if self.cfg.max_grad_norm > 0:
            return optax.chain(optax.clip_by_global_norm(self.cfg.max_grad_norm), adam)
        return adam

    def apply_model(self) -> Any:
        return self.model if self.lora is None else self.lora

    def policy_params(self, params: Any, base: Any) -> Any:
        """The parameters the policy's forward takes (the adapters beside the frozen ``base``)."""
        return params if self.lora is None else lora_lib.merge(base, params)


def init_state(prog: DPOProgram, base: Any, seed: int, beta: float) -> DPOState:
    """A member's initial state: fresh adapters (qwix's: ``B = 0``, so the policy is the reference) or a
    copy of the base; AdamW's zero moments; ``beta`` as float32."""
    key = jax.random.PRNGKey(seed)
    k_init, k_data = jax.random.split(key)
    if prog.lora is None:
        params = jax.tree.map(jnp.array, base)
    else:
        params = jax.jit(prog.lora.init_adapters)(base, k_init)
    return DPOState(params, prog.optimizer.init(params), jnp.float32(beta), k_data, jnp.int32(0))


def stack(states: list[DPOState]) -> DPOState:
    """Members' states on a leading axis (a sweep's state)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def member(states: DPOState, j: int) -> DPOState:
    """Member ``j`` of a stacked state."""
    return jax.tree.map(lambda x: x[j], states)


def pair_logps(model: Any, params: Any, batch: PairData) -> tuple[Array, Array]:
    """``(log pi(y_w|x), log pi(y_l|x))`` ``[B]``: one forward of the chosen and rejected rows together
    (TRL's concatenated forward)."""
    b = batch.chosen.shape[0]
    tokens = jnp.concatenate([batch.chosen, batch.rejected])
    mask = jnp.concatenate([batch.chosen_mask, batch.rejected_mask])
    comp = jnp.concatenate([batch.chosen_comp, batch.rejected_comp])
    logps = completion_logps(forward(model, params, tokens, mask).logits, tokens, comp)
    return logps[:b], logps[b:]


def dpo_loss(
    prog: DPOProgram, params: Any, base: Any, batch: PairData, ref: tuple[Array, Array], beta: Array
) -> tuple[Array, dict[str, Array]]:
    """The mean DPO loss of a minibatch and its metrics (:func:`klrl.algo.dpo.pair_metrics`, plus
    ``dpo/loss`` and the policy's ``dpo/logps_chosen``/``dpo/logps_rejected``, nats per sequence)."""
    lc, lr = pair_logps(prog.apply_model(), prog.policy_params(params, base), batch)
    hc, hr = lc - ref[0], lr - ref[1]
    n = lambda c: jnp.sum(c, axis=-1)  # TRL's IPO counts: completion_mask summed, unshifted
    per = pair_losses(
        prog.cfg.loss,
        hc,
        hr,
        beta,
        label_smoothing=prog.cfg.label_smoothing,
        chosen_len=n(batch.chosen_comp),
        rejected_len=n(batch.rejected_comp),
    )
    loss = jnp.mean(per)
    metrics = {
        "dpo/loss": loss,
        **pair_metrics(hc, hr, beta),
        "dpo/logps_chosen": jnp.mean(lc),
        "dpo/logps_rejected": jnp.mean(lr),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def reference_logps(prog: DPOProgram, base: Any, batch: PairData) -> tuple[Array, Array]:
    """The reference's log-probabilities of a batch (the base alone), without gradient."""
    return jax.lax.stop_gradient(pair_logps(prog.model, base, batch))


def batch_indices(state: DPOState, n: int, size: int) -> Array:
    """``size`` distinct rows of ``n``: a permutation keyed by ``fold_in(state.key, iteration)``."""
    return jax.random.permutation(jax.random.fold_in(state.key, state.iteration), n)[:size]


def dpo_iteration(prog: DPOProgram, state: DPOState, base: Any, data: PairData) -> tuple[DPOState, dict]:
    """One iteration of one member (module docstring): ``(new state, metrics)``."""
    cfg, opt = prog.cfg, prog.optimizer
    idx = batch_indices(state, data.chosen.shape[0], cfg.batch_size)
    batch = data.take(idx)
    ref = reference_logps(prog, base, batch)
    m = cfg.minibatches
    split = lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:])
    mbs = (jax.tree.map(split, batch), jax.tree.map(split, ref))

    def update(carry, mb):
        params, opt_state = carry
        b, r = mb
        grads, metrics = jax.grad(dpo_loss, argnums=1, has_aux=True)(prog, params, base, b, r, state.beta)
        metrics["dpo/grad_norm"] = optax.tree.norm(grads)
        upd, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, upd), opt_state), metrics

    (params, opt_state), metrics = jax.lax.scan(update, (state.params, state.opt_state), mbs)
    metrics = {k: jnp.mean(v) for k, v in metrics.items()}
    metrics["dpo/beta"] = state.beta
    new = state._replace(params=params, opt_state=opt_state, iteration=state.iteration + 1)
    return new, metrics


def make_sweep_step(prog: DPOProgram) -> Any:
    """``step(states, base, data) -> (states, {name: [members]})``: one compiled program for all the
    stacked members (``jit(vmap(dpo_iteration))``; the base and the pairs are shared, not mapped)."""

    def dpo_sweep_step(states, base, data):  # (the name the compile logs show)
        return jax.vmap(lambda s: dpo_iteration(prog, s, base, data))(states)

    return jax.jit(dpo_sweep_step, donate_argnums=0)


# ---- held-out metrics --------------------------------------------------------------------------------
class Heldout(NamedTuple):
    """Held-out data: pairs (their DPO metrics) and left-padded prompts ``[N, P]`` (the exact KL), or
    None for either."""

    pairs: PairData | None
    prompts: Array | None
    prompt_mask: Array | None


def heldout_metrics(
    prog: DPOProgram,
    sampling: SamplingConfig,
    stop_ids: tuple[int, ...],
    pad_id: int,
    state: DPOState,
    base: Any,
    held: Heldout,
) -> dict[str, Array]:
    """One member's held-out metrics (module docstring): ``eval/dpo/loss``, ``eval/dpo/reward_margin``,
    ``eval/dpo/reward_accuracy`` on the held-out pairs; ``kl/exact_seq_sum``, ``kl/exact_token_mean``,
    ``kl/k1_seq_sum`` and ``eval/response_len`` on the held-out prompts."""
    out: dict[str, Array] = {}
    policy = prog.policy_params(state.params, base)
    if held.pairs is not None:
        ref = reference_logps(prog, base, held.pairs)
        loss, m = dpo_loss(prog, state.params, base, held.pairs, ref, state.beta)
        for k in ("loss", "reward_margin", "reward_accuracy"):
            out[f"eval/dpo/{k}"] = m[f"dpo/{k}"]
    if held.prompts is not None:
        n, p = held.prompts.shape
        temp1 = dataclasses.replace(sampling, temperature=1.0, top_k=0)
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(n))
        ro = generate(
            prog.apply_model(),
            policy,
            held.prompts,
            held.prompt_mask,
            keys,
            temp1,
            stop_ids,
            pad_id,
            keep_logits=True,
        )
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        ref_logits = response_slice(
            forward(prog.model, base, tokens, key_mask).logits, p, sampling.response_len
        )
        exact = kl_lib.full_kl(ro.logits, ref_logits, ro.mask)
        ref_lp = jnp.take_along_axis(
            jax.nn.log_softmax(ref_logits.astype(jnp.float32)), ro.response[..., None], axis=-1
        )[..., 0]
        length = jnp.sum(ro.mask, axis=-1)
        out["kl/exact_seq_sum"] = jnp.mean(jnp.sum(exact, axis=-1))
        out["kl/exact_token_mean"] = jnp.mean(jnp.sum(exact, axis=-1) / jnp.maximum(length, 1.0))
        out["kl/k1_seq_sum"] = jnp.mean(jnp.sum((ro.logp - ref_lp) * ro.mask, axis=-1))
        out["eval/response_len"] = jnp.mean(length)
    return out


def make_sweep_eval(
    prog: DPOProgram, sampling: SamplingConfig, stop_ids: tuple[int, ...], pad_id: int
) -> Any:
    """``evaluate(states, base, held) -> {name: [members]}``, jitted; the members one after the other
    (``lax.map``: the memory of one member's logits at a time, not the sweep's)."""

    def dpo_sweep_eval(states, base, held):
        one = lambda s: heldout_metrics(prog, sampling, tuple(stop_ids), pad_id, s, base, held)
        return jax.lax.map(one, states)

    return jax.jit(dpo_sweep_eval)


def to_host(metrics: dict[str, Array]) -> dict[str, np.ndarray]:
    """``{name: [members]}`` as float64 NumPy (one device transfer)."""
    return {k: np.asarray(v, np.float64) for k, v in jax.device_get(metrics).items()}
