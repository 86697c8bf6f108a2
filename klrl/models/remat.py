"""Rematerialisation (``jax.checkpoint``) of transformer blocks, one policy for every family.

``model.remat`` (:class:`klrl.config.run.ModelConfig`) chooses what the backward of the PPO update keeps
of each block's forward (names as MaxText's ``remat_policy``):

* ``none``: everything the backward reads is kept (fastest, most memory: per block the norms,
  projections, attention probabilities ``[B, H, T, T]`` and MLP activations ``[B, T, F]``);
* ``block``: each block is one ``jax.checkpoint`` that keeps its matmul outputs without batch
  dimensions (q/k/v/o, gate/up/down: ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``,
  MaxText's ``minimal``) and recomputes the rest (norms, RoPE, attention scores and softmax,
  activations) in the backward;
* ``dots``: each block is one ``jax.checkpoint`` that keeps every matmul output, the attention's
  batched ones included (scores ``[B, H, T, T]`` and the mixed values:
  ``jax.checkpoint_policies.dots_saveable``, MaxText's ``save_dot_except_mlp`` family), and recomputes
  only the elementwise work (norms, RoPE, masking and softmax, SwiGLU);
* ``full``: each block is one ``jax.checkpoint`` that keeps nothing but its input (the residual
  stream ``[B, T, D]``) and reruns the whole block in the backward (MaxText's ``full``; the
  "remat" of ``docs/scaling.md``): about one more forward of the trunk per update step.

The checkpoint only matters under differentiation: forwards that are not differentiated (rollout,
scoring) compute the same values either way, and klrl applies the policy only to the models the
update differentiates (:func:`with_remat`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

REMAT_MODES = ("none", "block", "dots", "full")


def check_mode(mode: Any) -> str:
    """``mode`` as one of :data:`REMAT_MODES` (``False``/``True`` mean ``none``/``full``)."""
    if mode is False or mode is None:
        return "none"
    if mode is True:
        return "full"
    if mode not in REMAT_MODES:
        raise ValueError(f"remat: must be one of {', '.join(REMAT_MODES)} (got {mode!r})")
    return mode


def remat_block(block: type[nn.Module], mode: Any, *, prevent_cse: bool = False) -> type[nn.Module]:
    """The flax block class ``block`` wrapped for ``mode`` (``none``: ``block`` itself).

    ``prevent_cse=False`` suits blocks inside ``nn.scan``: in a loop XLA cannot merge the
    recomputation with the forward, so the optimisation barriers would only cost (jax's advice for
    checkpoints in scans); an unrolled Python loop over layers (klrl's GPT) needs ``True``.
    """
    mode = check_mode(mode)
    if mode == "none":
        return block
    policy = {
        "block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        "dots": jax.checkpoint_policies.dots_saveable,
    }.get(mode)
    return nn.remat(block, policy=policy, prevent_cse=prevent_cse)


def with_remat(model: Any, mode: Any) -> Any:
    """A copy of the causal LM ``model`` whose blocks follow ``mode`` (``model`` itself for
    ``none`` or a family without a ``remat`` field)."""
    mode = check_mode(mode)
    if mode == "none" or not hasattr(model, "remat"):
        return model
    return dataclasses.replace(model, remat=mode)
