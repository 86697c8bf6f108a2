"""Regenerate tests/data/dpo_golden.json with TRL's own ``DPOTrainer._compute_loss`` (never needed by klrl
or its tests; ``tests/algo/test_dpo_losses.py`` reads what this writes).

    python3 -m venv /tmp/trlenv && /tmp/trlenv/bin/pip install -q torch==2.13.0 'trl==1.12.*'
    /tmp/trlenv/bin/python tests/data/make_dpo_goldens.py

A fixed batch (seeded NumPy): ``B = 4`` pairs of sequences of ``T = 7`` tokens over a vocabulary of
``V = 11``, the chosen rows first (TRL's ``[chosen; rejected]`` layout), each with a prompt of 1-3
tokens, a completion of 2-6 tokens (``completion_mask``) and right padding; the policy's ``logits
[2B, T, V]``, and the reference's sequence log-probabilities ``ref_chosen_logps`` / ``ref_rejected_logps``
(TRL's ``precompute_ref_logps`` inputs). The trainer is built with ``object.__new__`` and only the
attributes ``_compute_loss`` reads (an accelerator stub whose gathers return their input); the model is
a stub returning the fixed logits, so the numbers are TRL's code from the logits on: the shifted
completion log-probabilities, the log-ratios, the loss of each ``loss_type`` and the reward metrics.

Cases: ``sigmoid`` at beta 0.1 and 0.5; ``sigmoid`` with ``label_smoothing`` 0.2 (TRL 1.12 ignores it
for sigmoid: the golden records the plain DPO loss; klrl's cDPO differs by design, the test checks it
against NumPy); ``ipo`` at beta 0.1 and 1.0; ``robust`` with ``label_smoothing`` 0.1 and 0.3;
``hinge`` at beta 0.5.
"""

from __future__ import annotations

import json
import sys
import types
from collections import defaultdict
from pathlib import Path

# this folder holds a peft/ goldens folder that would shadow the peft package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402

OUT = Path(__file__).resolve().parent / "dpo_golden.json"
B, T, V, SEED = 4, 7, 11, 0
CASES = [
    {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0},
    {"loss_type": "sigmoid", "beta": 0.5, "label_smoothing": 0.0},
    {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.2},
    {"loss_type": "ipo", "beta": 0.1, "label_smoothing": 0.0},
    {"loss_type": "ipo", "beta": 1.0, "label_smoothing": 0.0},
    {"loss_type": "robust", "beta": 0.1, "label_smoothing": 0.1},
    {"loss_type": "robust", "beta": 0.3, "label_smoothing": 0.3},
    {"loss_type": "hinge", "beta": 0.5, "label_smoothing": 0.0},
]


def batch():
    rng = np.random.default_rng(SEED)
    ids = rng.integers(1, V, size=(2 * B, T)).astype(np.int64)
    attn = np.zeros((2 * B, T), np.int64)
    comp = np.zeros((2 * B, T), np.int64)
    for i in range(2 * B):
        p = int(rng.integers(1, 4))
        c = int(rng.integers(2, T - p + 1))
        attn[i, : p + c] = 1
        comp[i, p : p + c] = 1
        ids[i, p + c :] = 0
    logits = rng.normal(0.0, 2.0, size=(2 * B, T, V)).astype(np.float32)
    ref = rng.normal(-12.0, 3.0, size=(2 * B,)).astype(np.float32)
    return ids, attn, comp, logits, ref


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def unwrap_model(self, m):
        return m


def trainer(case: dict, logits: torch.Tensor) -> DPOTrainer:
    t = object.__new__(DPOTrainer)
    model = types.SimpleNamespace(training=True)
    t.__dict__.update(
        model=model, ref_model=None, accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[case["loss_type"]],
        loss_weights=[1.0], beta=case["beta"], label_smoothing=case["label_smoothing"], use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
    )  # fmt: skip
    return t


def main() -> None:
    ids, attn, comp, logits, ref = batch()
    lt = torch.tensor(logits)
    fwd = lambda **kw: types.SimpleNamespace(logits=lt.clone())
    out = {
        "trl": trl.__version__,
        "torch": torch.__version__,
        "input_ids": ids.tolist(),
        "attention_mask": attn.tolist(),
        "completion_mask": comp.tolist(),
        "logits": logits.tolist(),
        "ref_chosen_logps": ref[:B].tolist(),
        "ref_rejected_logps": ref[B:].tolist(),
        "cases": [],
    }
    for case in CASES:
        t = trainer(case, lt)
        inputs = {
            "input_ids": torch.tensor(ids), "attention_mask": torch.tensor(attn),
            "completion_mask": torch.tensor(comp), "ref_chosen_logps": torch.tensor(ref[:B]),
            "ref_rejected_logps": torch.tensor(ref[B:]),
        }  # fmt: skip
        loss = t._compute_loss(fwd, inputs, return_outputs=False)
        m = t._metrics["train"]
        out["cases"].append({
            **case,
            "loss": float(loss),
            "rewards_chosen": m["rewards/chosen"][-1], "rewards_rejected": m["rewards/rejected"][-1],
            "reward_margin": m["rewards/margins"][-1], "reward_accuracy": m["rewards/accuracies"][-1],
            "logps_chosen": m["logps/chosen"][-1], "logps_rejected": m["logps/rejected"][-1],
        })  # fmt: skip
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT} (trl {trl.__version__}, {len(CASES)} cases)")


if __name__ == "__main__":
    main()
