"""Model families behind one causal-LM interface (:mod:`klrl.models.base`)."""

from klrl.models.base import CausalLM, LMOutput, causal_mask, forward, positions_from_mask, spec_for

__all__ = ["CausalLM", "LMOutput", "causal_mask", "forward", "positions_from_mask", "spec_for"]
