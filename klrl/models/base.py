"""The causal-LM interface: what rollout, scoring and the update use of a model, and nothing else.

A model *family* (klrl's own GPT, GPT-2, Llama, Qwen2, ...) is one object implementing
:class:`CausalLM`. Its parameters are a plain pytree (float32 leaves; the family's ``dtype`` is
the *compute* dtype), so they checkpoint, ``vmap`` and shard like any other state.

Shapes and conventions, shared by every family:

* ``tokens [B, T]`` int32, left-padded.
* ``positions [B, T]`` int32: the first real token of a row is position 0
  (:func:`~klrl.models.attention.positions_from_mask`).
* ``mask [B, T, S]`` bool: query ``t`` may attend key ``s``; causality and padding are folded in
  (:func:`~klrl.models.attention.causal_mask`). Without a cache ``S = T``; with one, ``S`` is the
  cache length and the ``T`` new tokens are written at slot ``index``. Without a cache, ``apply``
  also takes a padding mask ``[B, T]`` (1 = real token, Hugging Face's ``attention_mask``) and makes
  it causal itself; any other shape is a ``ValueError`` naming the expected ones
  (:func:`~klrl.models.attention.attention_mask`).
* The KV cache is a pytree the family defines (:meth:`CausalLM.init_cache`), threaded by the
  caller, so decoding is a plain ``lax.scan``.
* Outputs: ``logits [B, T, V]`` float32 (``V = vocab_size``, the embedding's rows) and the final
  hidden states ``hidden [B, T, D]`` (after the final norm), from which value and reward heads
  (:mod:`klrl.models.heads`) read.

Partitioning: :meth:`CausalLM.partition_rules` is the hook through which a family declares how its
parameters are placed on a device mesh with the named axes ``fsdp`` and ``tensor`` (see
:func:`spec_for`).

The families read from checkpoints (GPT-2, Llama, Gemma 3) share one wrapper of their flax module,
:class:`FlaxLM`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from klrl.models.attention import (  # noqa: F401 (re-exported)
    attention_mask,
    causal_mask,
    empty_cache,
    positions_from_mask,
)
from klrl.models.remat import check_mode

Array = jax.Array
Params = Any
Cache = Any
# (regex matched against the '/'-joined parameter path, PartitionSpec over mesh axes 'fsdp'/'tensor')
PartitionRules = Sequence[tuple[str, PartitionSpec]]


class LMOutput(NamedTuple):
    logits: Array | None  # [B, T, V] float32; None when called with ``logits=False``
    hidden: Array  # [B, T, D] final hidden states (after the final norm), compute dtype
    cache: Cache | None  # the updated cache when one was passed, else None


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as klrl uses it."""

    vocab_size: int  # rows of the embedding / columns of the logits
    hidden_size: int  # D, the width heads read
    max_len: int  # the longest sequence (positions) the model supports

    def init(self, key: Array) -> Params:
        """Fresh random float32 parameters."""
        ...

    def apply(
        self,
        params: Params,
        tokens: Array,
        positions: Array,
        mask: Array,
        cache: Cache | None = None,
        index: Array | int | None = None,
        *,
        logits: bool = True,
    ) -> LMOutput:
        """Forward over ``tokens [B, T]``; with ``cache``, one decode step writing slot ``index``."""
        ...

    def init_cache(self, batch: int, length: int) -> Cache:
        """An empty KV cache of ``length`` slots for ``batch`` rows."""
        ...

    def partition_rules(self) -> PartitionRules:
        """How the parameters are placed on a ``(data, fsdp, tensor)`` mesh; unmatched leaves are
        replicated."""
        ...


# ---- helpers shared by every family ------------------------------------------------------------


def forward(
    model: CausalLM, params: Params, tokens: Array, key_mask: Array, *, logits: bool = True
) -> LMOutput:
    """Teacher-forced forward of whole left-padded sequences ``tokens [B, S]`` with ``key_mask [B, S]``."""
    return model.apply(params, tokens, positions_from_mask(key_mask), causal_mask(key_mask), logits=logits)


def lm_head(params: Params, hidden: Array, embedding: str, tied: bool, dtype: Any) -> Array:
    """The LM head alone: final hidden states ``[..., D]`` (after the final norm) -> float32 logits
    ``[..., V]`` in the compute ``dtype``: ``x @ E^T`` with ``E = params['params'][embedding]['embedding']``
    (``tied``), else ``x @ params['params']['lm_head']['kernel']`` (the product flax's
    ``Embed.attend`` / ``Dense`` compute in the families' ``apply``)."""
    p, h = params["params"], hidden.astype(dtype)
    if tied:  # contract with E's width directly: under autodiff `E.T` became a transposed copy of E
        return jnp.einsum("...d,vd->...v", h, p[embedding]["embedding"].astype(dtype)).astype(jnp.float32)
    return jnp.dot(h, p["lm_head"]["kernel"].astype(dtype)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class PeftLayout:
    """Where a family's adaptable layers sit, for Hugging Face PEFT adapters (:mod:`klrl.models.peft`):
    klrl's scanned stack and the HF module paths."""

    stack: str  # the key of the scanned layers in klrl's params: params[stack][module]
    prefix: str  # the HF path of layer i: f"{prefix}.{i}"
    modules: dict  # klrl module -> HF module path inside a layer
    targets: dict  # klrl module -> its name in a written target_modules (PEFT: a name's last components)
    fan_in_fan_out: bool  # HF stores the base weight [in, out] (GPT-2's Conv1D)


@dataclasses.dataclass(frozen=True)
class FlaxLM:
    """A flax module family as a :class:`CausalLM`: the wrapper GPT-2, Llama and Gemma 3 share.

    A family subclasses it as a frozen dataclass with its own ``config`` type and declares, as class
    attributes: ``MODULE`` (the flax module class, built ``MODULE(config, dtype, remat)``, whose
    ``__call__`` takes ``(tokens, positions, mask, cache, index, logits)``), ``EMBEDDING`` (the
    embedding's parameter name, which the tied head reads), ``LORA_TARGETS`` (:mod:`klrl.models.lora`),
    ``PARTITION_RULES`` (:meth:`partition_rules`) and, for Hugging Face PEFT adapters, ``PEFT`` (a
    :class:`PeftLayout`; None: the family has none). It adds ``hf_config`` and the HF tensor
    conversion. ``hidden_size``, ``max_len`` and ``init_cache`` read the HF names of a decoder's
    config (``hidden_size``, ``max_position_embeddings``, ``num_hidden_layers``,
    ``num_key_value_heads``, ``head_dim``); a config with other names overrides them. ``dtype`` is
    the compute dtype (float32 or bfloat16); parameters stay float32. The config must have
    ``vocab_size`` and ``tie_word_embeddings``.
    """

    MODULE: ClassVar[Any]
    EMBEDDING: ClassVar[str]
    LORA_TARGETS: ClassVar[str]
    PARTITION_RULES: ClassVar[PartitionRules]
    PEFT: ClassVar[PeftLayout | None] = None

    config: Any
    dtype: Any = jnp.float32
    remat: str = "none"  # what the backward keeps of each block (klrl.models.remat)

    def __post_init__(self):
        object.__setattr__(self, "remat", check_mode(self.remat))

    @property
    def module(self) -> Any:
        return self.MODULE(self.config, self.dtype, self.remat)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_len(self) -> int:
        return self.config.max_position_embeddings

    def init_cache(self, batch: int, length: int):
        c = self.config
        return empty_cache(c.num_hidden_layers, batch, c.num_key_value_heads, length, c.head_dim, self.dtype)

    def partition_rules(self) -> PartitionRules:
        """The family's ``PARTITION_RULES``."""
        return self.PARTITION_RULES

    def init(self, key: Array):
        t = jnp.zeros((1, 2), jnp.int32)
        return self.module.init(key, t, t, jnp.ones((1, 2, 2), bool))

    def apply(self, params, tokens, positions, mask, cache=None, index=None, *, logits=True) -> LMOutput:
        return self.module.apply(params, tokens, positions, mask, cache, index, logits)

    def head(self, params, hidden: Array) -> Array:
        """The LM head alone: final hidden states ``[..., D]`` (after the final norm) -> float32
        logits ``[..., V]``, the same product as :meth:`apply` (``x @ E^T`` tied, else
        ``x @ lm_head``, in the compute dtype; :func:`lm_head`)."""
        return lm_head(params, hidden, self.EMBEDDING, self.config.tie_word_embeddings, self.dtype)


def param_path(path: tuple) -> str:
    """A ``jax.tree_util`` key path as ``'a/b/c'``."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(name))
    return "/".join(parts)


def spec_for(rules: PartitionRules, params: Params) -> Any:
    """A pytree of :class:`PartitionSpec` like ``params``: the first rule whose regex
    ``re.search``-matches a leaf's path gives its spec; no match: replicated (``PartitionSpec()``)."""
    compiled = [(re.compile(r), s) for r, s in rules]

    def one(path, _leaf):
        p = param_path(path)
        for rx, spec in compiled:
            if rx.search(p):
                return spec
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(one, params)
