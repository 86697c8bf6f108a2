"""Model families behind one causal-LM interface (:mod:`klrl.models.base`), by name
(:mod:`klrl.models.registry`); klrl's GPT is ``"gpt"``."""

from klrl.models import gpt  # noqa: F401  (registers "gpt")
from klrl.models.base import CausalLM, LMOutput, causal_mask, forward, positions_from_mask, spec_for
from klrl.models.heads import ScalarHead, ValueHead
from klrl.models.registry import family_names, get_family, register_family

__all__ = [
    "CausalLM",
    "LMOutput",
    "ScalarHead",
    "ValueHead",
    "causal_mask",
    "family_names",
    "forward",
    "get_family",
    "positions_from_mask",
    "register_family",
    "spec_for",
]
