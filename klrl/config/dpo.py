"""The ``dpo`` section: direct preference optimisation from preference pairs (``klrl dpo``, ``klrl.dpo``).

Defaults are TRL 1.12's ``DPOConfig`` where it has the field (``beta`` 0.1, ``loss_type`` sigmoid,
``label_smoothing`` 0, ``learning_rate`` 1e-6, ``per_device_train_batch_size`` 8, ``max_grad_norm``
1.0, AdamW without weight decay); ``iterations`` counts klrl iterations (one batch of ``batch_size``
pairs each, ``minibatches`` optimiser steps on it), not epochs. The model, LoRA, prompt and response
lengths are PPO's sections (``model.path``, ``lora``, ``data``, ``sampling``).
"""

from __future__ import annotations

from klrl.config.fields import _check, _f
from klrl.config.schema import section

LOSSES = ("sigmoid", "ipo", "robust", "hinge")


@section("dpo")
class DPOConfig:
    """Direct preference optimisation (klrl.algo.dpo: the losses; klrl.step.dpo: the step)."""

    loss: str = _f(
        "sigmoid", "sigmoid (DPO; cDPO with label_smoothing), ipo, robust or hinge (TRL's loss_type)"
    )
    beta: float = _f(0.1, "the KL coefficient: implicit reward beta * log pi/pi_ref (IPO's tau)")
    label_smoothing: float = _f(0.0, "probability a label is flipped: cDPO for sigmoid, robust's epsilon")
    lr: float = _f(1e-6, "AdamW learning rate (TRL's default; LoRA usually wants 1e-5..1e-4)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm (0 = off)")
    batch_size: int = _f(8, "pairs per iteration (its reference log-probs are computed once)")
    minibatches: int = _f(1, "optimiser steps per iteration, each on batch_size / minibatches pairs")
    iterations: int = _f(100, "iterations (batches) to train")
    seed: int = _f(0, "seed: the adapters' initialisation and the order of the pairs")
    eval_fraction: float = _f(0.1, "fraction of the pairs held out (their prompts measure the exact KL)")
    eval_every: int = _f(
        10, "held-out metrics every N iterations, and after the last (0 = after the last only)"
    )
    eval_prompts: int = _f(
        64, "held-out pairs scored and prompts answered for the exact KL (at most; 0 = none)"
    )
    checkpoint_every: int = _f(
        50, "checkpoint every N iterations, and after the last (0 = after the last only)"
    )

    def __post_init__(self) -> None:
        _check(self.loss in LOSSES, "dpo.loss", f"must be one of {', '.join(LOSSES)} (got {self.loss!r})")
        _check(self.beta > 0, "dpo.beta", "must be > 0")
        hi = 0.5 if self.loss == "robust" else 1.0
        _check(0 <= self.label_smoothing < hi, "dpo.label_smoothing", f"must be in [0, {hi})")
        if self.label_smoothing and self.loss in ("ipo", "hinge"):
            _check(
                False,
                "dpo.label_smoothing",
                f"has no meaning for dpo.loss {self.loss} (use sigmoid or robust)",
            )
        _check(self.lr > 0, "dpo.lr", "must be > 0")
        _check(self.weight_decay >= 0, "dpo.weight_decay", "must be >= 0")
        _check(self.max_grad_norm >= 0, "dpo.max_grad_norm", "must be >= 0")
        _check(self.batch_size >= 1, "dpo.batch_size", "must be >= 1")
        _check(self.minibatches >= 1, "dpo.minibatches", "must be >= 1")
        _check(self.batch_size % self.minibatches == 0, "dpo.minibatches", "must divide dpo.batch_size")
        _check(self.iterations >= 1, "dpo.iterations", "must be >= 1")
        _check(0 < self.eval_fraction < 1, "dpo.eval_fraction", "must be in (0, 1)")
        _check(self.eval_every >= 0, "dpo.eval_every", "must be >= 0")
        _check(self.eval_prompts >= 0, "dpo.eval_prompts", "must be >= 0")
        _check(self.checkpoint_every >= 0, "dpo.checkpoint_every", "must be >= 0")
