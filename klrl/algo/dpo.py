"""Direct preference optimisation: the losses of DPO and its kin, pure maths on ``[B]`` arrays.

A pair is a prompt ``x`` with a chosen response ``y_w`` and a rejected one ``y_l``. With
``log pi(y|x)`` the sum of the response's token log-probabilities (:func:`completion_logps`), each
response's **log-ratio** to the reference is ``h(y) = log pi_theta(y|x) - log pi_ref(y|x)`` (nats per
sequence) and its **implicit reward** ``r(y) = beta * h(y)`` (Rafailov et al. 2023, "Direct Preference
Optimization", eq. 5: the reward of the KL-regularised objective ``E[r] - beta KL(pi || pi_ref)`` whose
optimum is ``pi_theta``). With ``delta = h(y_w) - h(y_l)`` the per-pair losses are:

* ``sigmoid`` (DPO, Rafailov et al. 2023, eq. 7), with label smoothing ``eps`` the conservative DPO of
  Mitchell 2023 ("A note on DPO with noisy preferences", cDPO: the label is flipped with probability
  ``eps``)::

      L = -(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)

  TRL 1.12's ``DPOTrainer`` (``loss_type='sigmoid'``) ignores ``label_smoothing``; its 0.x versions
  computed the line above. With ``eps = 0`` both are the same (the goldens check it).
* ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", eq. 17, ``tau = beta``)::

      L = (delta_avg - 1 / (2 beta))^2,   delta_avg = h(y_w) / n_w - h(y_l) / n_l

  where ``n`` is the response's number of tokens (at least 1). The paper writes ``delta`` with
  sequence log-probabilities; TRL divides each log-ratio by its response's token count (the mean
  log-ratio per token; "confirmed with the IPO authors", its source says), and klrl does as TRL.
* ``robust`` (Chowdhury et al. 2024, "Provably Robust DPO", eq. 9: an unbiased loss under labels
  flipped with probability ``eps < 1/2``)::

      L = ((1 - eps)(-log sigmoid(beta delta)) - eps (-log sigmoid(-beta delta))) / (1 - 2 eps)

* ``hinge`` (SLiC, Zhao et al. 2023): ``L = relu(1 - beta delta)``.

The batch loss is the mean over pairs (TRL's ``per_sequence_loss.mean()``). Everything is float32;
``beta`` may be a traced array (a sweep's members differ in it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from klrl.algo.logprobs import token_logprobs

Array = jax.Array

LOSS_TYPES = ("sigmoid", "ipo", "robust", "hinge")


def completion_logps(logits: Array, tokens: Array, completion: Array) -> Array:
    """``sum_t c_t log softmax(logits_{t-1})[tokens_t]`` ``[B]`` float32: the log-probability of the
    response tokens of ``tokens [B, T]`` (``completion [B, T]`` 1 on them) given what precedes them,
    from the model's ``logits [B, T, V]`` (position ``t-1`` predicts token ``t``; a response token at
    position 0 has no prediction and counts 0, as TRL's shifted ``completion_mask``)."""
    lp = token_logprobs(logits[:, :-1], tokens[:, 1:])
    return jnp.sum(jnp.where(completion[:, 1:] > 0, lp, 0.0), axis=-1)


def sigmoid_loss(delta: Array, beta: Array, label_smoothing: float = 0.0) -> Array:
    """DPO (cDPO with ``label_smoothing``) per pair ``[B]`` (module docstring)."""
    z = beta * delta
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def robust_loss(delta: Array, beta: Array, label_smoothing: float = 0.0) -> Array:
    """Robust DPO per pair ``[B]`` (module docstring); ``label_smoothing`` in ``[0, 1/2)``."""
    z = beta * delta
    clean = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z)
    flipped = -label_smoothing * jax.nn.log_sigmoid(-z)
    return (clean - flipped) / (1.0 - 2.0 * label_smoothing)


def hinge_loss(delta: Array, beta: Array) -> Array:
    """SLiC's hinge per pair ``[B]``: ``relu(1 - beta delta)``."""
    return jax.nn.relu(1.0 - beta * delta)


def ipo_loss(
    chosen_logratio: Array, rejected_logratio: Array, chosen_len: Array, rejected_len: Array, beta: Array
) -> Array:
    """IPO per pair ``[B]``: ``(h_w / n_w - h_l / n_l - 1 / (2 beta))^2``, ``n`` the token counts
    (clamped to >= 1; module docstring)."""
    d = chosen_logratio / jnp.maximum(chosen_len, 1.0) - rejected_logratio / jnp.maximum(rejected_len, 1.0)
    return (d - 1.0 / (2.0 * beta)) ** 2


def pair_losses(
    loss_type: str,
    chosen_logratio: Array,
    rejected_logratio: Array,
    beta: Array,
    *,
    label_smoothing: float = 0.0,
    chosen_len: Array | None = None,
    rejected_len: Array | None = None,
) -> Array:
    """The per-pair loss ``[B]`` of ``loss_type`` (one of :data:`LOSS_TYPES`) from the log-ratios
    ``h = log pi_theta - log pi_ref`` of the chosen and rejected responses; ``ipo`` also needs their
    token counts."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    hc, hr, beta = f32(chosen_logratio), f32(rejected_logratio), f32(beta)
    delta = hc - hr
    if loss_type == "sigmoid":
        return sigmoid_loss(delta, beta, label_smoothing)
    if loss_type == "robust":
        return robust_loss(delta, beta, label_smoothing)
    if loss_type == "hinge":
        return hinge_loss(delta, beta)
    if loss_type == "ipo":
        if chosen_len is None or rejected_len is None:
            raise ValueError("ipo: the loss needs the responses' token counts (chosen_len, rejected_len)")
        return ipo_loss(hc, hr, f32(chosen_len), f32(rejected_len), beta)
    raise ValueError(f"dpo.loss: unknown loss type {loss_type!r} (one of {', '.join(LOSS_TYPES)})")


def pair_metrics(chosen_logratio: Array, rejected_logratio: Array, beta: Array) -> dict[str, Array]:
    """TRL's reward metrics of a batch, means over pairs: ``dpo/rewards_chosen`` and
    ``dpo/rewards_rejected`` (``beta h``, nats scaled by beta), ``dpo/reward_margin`` (their difference)
    and ``dpo/reward_accuracy`` (the fraction with ``r_w > r_l``; a tie is wrong)."""
    rc = beta * chosen_logratio.astype(jnp.float32)
    rr = beta * rejected_logratio.astype(jnp.float32)
    return {
        "dpo/rewards_chosen": jnp.mean(rc),
        "dpo/rewards_rejected": jnp.mean(rr),
        "dpo/reward_margin": jnp.mean(rc - rr),
        "dpo/reward_accuracy": jnp.mean((rc > rr).astype(jnp.float32)),
    }
