"""Model families by name: one registration each, its constructor and how checkpoints reach it.

``@register_family(name, hf=..., hf_config=..., gguf=...)`` over the family's constructor puts it
in :data:`klrl.registry.FAMILIES`; :mod:`klrl.models.hf` and :mod:`klrl.models.gguf` find a
checkpoint's family there (by ``config.json``'s ``model_type``, by GGUF's
``general.architecture``), so a new family is its module plus this one registration (and the import
of its module in :mod:`klrl.models`, the registry's home).

The constructor is what :func:`get_family` returns: a builder ``(model_config, vocab_size, max_len,
*, lm_head=True) -> CausalLM`` for a family built fresh from ``model.*`` (klrl's ``"gpt"``), the
:class:`klrl.models.base.CausalLM` class ``(family_config, dtype)`` for a family read from
checkpoints (``"gpt2"``, ``"llama"``). Metadata:

* ``hf``: the HF ``model_type`` values the family reads, with ``hf_config`` (``config.json`` dict ->
  family config);
* ``gguf``: a :class:`GGUFReading` (the GGUF architectures, the config from the metadata, the
  tensor names and their conversion).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from klrl.registry import FAMILIES, Registry

__all__ = [
    "FAMILIES",
    "GGUFReading",
    "family_names",
    "get_family",
    "gguf_family",
    "gguf_architectures",
    "hf_family",
    "hf_model_types",
    "register_family",
]


class GGUFReading(NamedTuple):
    """How a family reads a GGUF file; :func:`klrl.models.gguf.load_gguf` does the rest (the file,
    the checks, dequantising, the tokenizer). The family config must have a ``tokens`` field (the
    tokenizer's special ids are put there)."""

    architectures: tuple[str, ...]  # the general.architecture values it reads
    # (arch, field, shapes, path) -> family config; field(key, default=None, required=False) reads
    # the metadata "<arch>.<key>"; shapes: GGUF tensor name -> shape (row-major, as HF's)
    config: Callable[..., Any]
    tensor_name: Callable[[str], str]  # HF tensor name -> GGUF tensor name
    convert: Callable[[Any, str, Any], Any] | None = None  # (config, HF name, float32 array) -> array
    # (tokens, token types, unk token) -> tokenizers.Tokenizer of a SentencePiece vocabulary
    # (tokenizer.ggml.model "llama"); None: the family reads byte-level BPE ("gpt2") files only
    spm_tokenizer: Callable[..., Any] | None = None


def register_family(
    name: str,
    *,
    hf: tuple[str, ...] = (),
    hf_config: Callable[[dict], Any] | None = None,
    gguf: GGUFReading | None = None,
    **meta: Any,
) -> Callable[[Any], Any]:
    """Decorator: register a model family's constructor under ``name`` (module docstring)."""
    if bool(hf) != (hf_config is not None):
        raise ValueError(f"model family {name!r}: hf and hf_config go together")
    return FAMILIES.register(name, hf=tuple(hf), hf_config=hf_config, gguf=gguf, **meta)


def get_family(name: str):
    """The constructor registered as ``name`` (``ValueError`` listing the families otherwise)."""
    return FAMILIES.get(name)


def family_names() -> tuple[str, ...]:
    return FAMILIES.names()


def hf_model_types() -> tuple[str, ...]:
    """Every HF ``model_type`` some family reads, sorted."""
    return tuple(sorted(t for n in FAMILIES for t in FAMILIES.meta(n).get("hf", ())))


def hf_family(model_type: str) -> tuple[Any, Callable[[dict], Any]] | None:
    """``(family class, config.json dict -> family config)`` of the family that reads HF
    ``model_type``, or None."""
    for n in FAMILIES.names(where=lambda m: model_type in m.get("hf", ())):
        return FAMILIES.get(n), FAMILIES.meta(n)["hf_config"]
    return None


def gguf_architectures() -> tuple[str, ...]:
    """Every GGUF ``general.architecture`` some family reads, sorted."""
    return tuple(sorted(a for n in FAMILIES if (g := FAMILIES.meta(n).get("gguf")) for a in g.architectures))


def gguf_family(arch: str) -> tuple[Any, GGUFReading] | None:
    """``(family class, its GGUFReading)`` of the family that reads GGUF architecture ``arch``, or None."""
    for n in FAMILIES.names(where=lambda m: m.get("gguf") is not None and arch in m["gguf"].architectures):
        return FAMILIES.get(n), FAMILIES.meta(n)["gguf"]
    return None


_ = Registry  # re-exported type
