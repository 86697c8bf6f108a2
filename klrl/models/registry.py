"""Model families by name: ``@register_family("llama")`` over a builder, :func:`get_family`.

A builder takes ``(model_config, vocab_size, max_len, *, lm_head=True, **kw)`` and returns a
:class:`klrl.models.base.CausalLM`; families that load pretrained weights take their own keywords.
klrl's GPT is ``"gpt"`` (:mod:`klrl.models.gpt`).
"""

from __future__ import annotations

from klrl.registry import FAMILIES, Registry

__all__ = ["FAMILIES", "register_family", "get_family", "family_names"]


def register_family(name: str, **meta):
    """Decorator: register a model-family builder under ``name``."""
    return FAMILIES.register(name, **meta)


def get_family(name: str):
    """The builder registered as ``name`` (``ValueError`` listing the families otherwise)."""
    return FAMILIES.get(name)


def family_names() -> tuple[str, ...]:
    return FAMILIES.names()


_ = Registry  # re-exported type
