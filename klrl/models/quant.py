"""A weight-only quantised copy of a causal LM (int8 or int4), for the frozen KL reference.

The reference of PPO-with-KL is read-only: it only scores the policy's samples, so its weights
may be stored in fewer bits. :func:`quantize` turns a family's ``(model, params)`` into
``(qmodel, qparams)``: ``qmodel`` implements :class:`klrl.models.base.CausalLM` over ``qparams``,
in which the kernels of the transformer blocks' linear layers are qwix ``QArray`` s (integer
values plus float32 scales, post-training quantisation, ``qwix.PtqProvider``) and every other leaf
(norms, biases, embeddings, LM head) is the float array it was.

The scheme is symmetric absmax quantisation of the kernel ``W [in, out]`` (qwix's
``weight_calibration_method="absmax"``)::

    s = max|W_blk| / (q_max + 1/2),   Q = clip(round(W / s), -q_max - 1, q_max),   W ~= Q * s

(qwix's ``numerics.get_symmetric_bound``: the top bucket is a whole one; ``round`` half to even)
with ``q_max = 127`` (int8) or ``7`` (int4) and the block ``W_blk``: a whole output column
(per-channel) for int8; for int4 32 consecutive inputs of one output column (``tile_size=32``,
the block size of llama.cpp's Q4_0/Q4_1, and a divisor of every width of the supported families'
checkpoints). The activations stay float: the layer computes ``x @ Q`` in the compute dtype and
rescales (qwix's ``dot_general``), so this saves memory, not FLOPs.

The embedding and the LM head stay float: the (tied) embedding is read by a gather, which qwix's
``dot_general`` interception never sees, and the head's product *is* the reference log-probs the KL
is made of (``log softmax(h E^T)``): an error there is an error of the KL itself, and for a small
model the vocabulary rows are a large share of the weights that buy least.

The layers run inside ``nn.scan`` (Llama, GPT-2: stacked ``[L, ...]`` kernels), which qwix's
:func:`qwix.quantize_params` does not handle (it would take the layer axis as a channel axis):
:func:`quantize_params_for` quantises each stacked kernel layer by layer (``vmap`` over the leading
axes until the scales have the shape the wrapped module's own init gives).

Memory (:func:`nbytes`): int8 values take one byte; ``jnp.int4`` values take what the backend's
buffers take, which on XLA:CPU is one byte per value (unpacked; ``nbytes(..., packed=True)`` counts
the 4 bits a packed store holds, as XLA's GPU/TPU backends do).

Source: qwix (``qwix._src.providers.ptq``, ``qwix._src.core.qarray``); Dettmers et al., "LLM.int8()"
(2022) for per-channel absmax int8; Frantar et al., "GPTQ" / llama.cpp for 32-wide int4 blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax.sharding import PartitionSpec
from qwix._src.core import qarray
from qwix._src.providers import ptq

from klrl.models.base import LMOutput, PartitionRules

Array = jax.Array
KINDS = ("none", "int8", "int4")
INT4_TILE = 32  # inputs per int4 scale (llama.cpp's Q4 block)


def _linears(model: Any) -> str | None:
    """The qwix ``module_path`` (full-matched against the flax module path) of ``model``'s linear layers
    inside the transformer blocks: its family's ``LORA_TARGETS`` (the layers adapters may sit on);
    embeddings and LM heads are left out on purpose. None: the family declares none."""
    t = getattr(type(model), "LORA_TARGETS", None)
    return None if t is None else f"^(?:{t})$"


def check(model: Any, kind: str) -> None:
    """One-line :class:`ValueError` naming ``model.ref_quant`` for an unknown ``kind`` or a family
    that cannot be quantised (one whose linear layers are not listed here). klrl's own ``gpt``
    family is supported: its blocks are plain ``nn.Dense`` in a Python loop, the same interception."""
    if kind not in KINDS:
        raise ValueError(f"model.ref_quant: must be one of {', '.join(KINDS)} (got {kind!r})")
    if kind != "none" and _linears(model) is None:
        raise ValueError(
            f"model.ref_quant: {kind} supports the llama, gemma3, gpt2 and gpt families, "
            f"not {type(model).__name__}"
        )


def module_path(model: Any) -> str:
    """The qwix ``module_path`` regex of ``model``'s quantised linear layers (for a
    ``qwix.LoraRule(module_path=module_path(model), **rule_args(kind), ...)``)."""
    check(model, "int8")
    return _linears(model)


def rule_args(kind: str) -> dict:
    """The qwix rule keyword arguments of weight-only quantisation of ``kind``: int8 per output
    channel; int4 in blocks of :data:`INT4_TILE` inputs; absmax (symmetric) calibration; activations
    float (no ``act_qtype``). ``{}`` for ``"none"``."""
    if kind not in KINDS:
        raise ValueError(f"model.ref_quant: must be one of {', '.join(KINDS)} (got {kind!r})")
    if kind == "int8":
        return {"weight_qtype": jnp.int8, "weight_calibration_method": "absmax"}
    if kind == "int4":
        return {"weight_qtype": jnp.int4, "tile_size": INT4_TILE, "weight_calibration_method": "absmax"}
    return {}


def _sample_inputs(model: Any) -> tuple[Array, Array, Array]:
    t = jnp.zeros((1, 2), jnp.int32)
    return t, t, jnp.ones((1, 2, 2), bool)


def _is_aux(_path: Any, v: Any) -> bool:
    return isinstance(v, ptq.WithAux)


def _quantize_leaf(x: Array, abstract: ptq.WithAux) -> ptq.WithAux:
    """``x`` quantised as ``abstract.how`` says, ``vmap`` ped over as many leading (stacked layer)
    axes as make its values and scales the shapes of ``abstract`` (0 for an unstacked kernel)."""
    want = jax.tree.map(lambda s: s.shape, abstract.array)
    f = lambda v: qarray.quantize(v, abstract.how)
    for _ in range(x.ndim):
        try:
            got = jax.tree.map(lambda s: s.shape, jax.eval_shape(f, x))
        except ValueError:  # the per-layer tiling does not fit the stacked shape
            got = None
        if got == want:
            return abstract.replace(array=f(x))
        f = jax.vmap(f)
    raise ValueError(f"cannot quantise a {x.shape} leaf into {want}")


def quantize_params_for(
    qwix_module: nn.Module, params: Any, sample_inputs: tuple, *, key: Array | None = None
) -> Any:
    """``params`` (float, ``{"params": ...}``) -> the tree ``qwix_module`` (a linen module wrapped
    by ``qwix.quantize_model`` / ``qwix.apply_lora_to_model``, any provider) applies: each leaf
    that the wrapped module's init (``jax.eval_shape``, on ``sample_inputs``) turns into a qwix
    ``WithAux`` is quantised (layer by layer for ``nn.scan``-stacked kernels); the others are
    returned as they are. Parameters the wrapper creates itself (LoRA's ``kernel_lora_a`` /
    ``kernel_lora_b``) are not in ``params``: with ``key`` they are initialised by
    ``qwix_module.init(key, *sample_inputs)`` (jitted, only those leaves kept), else left out."""
    abstract = jax.eval_shape(qwix_module.init, jax.random.key(0), *sample_inputs)
    abs_flat = flax.traverse_util.flatten_dict(nn.unbox(abstract), is_leaf=_is_aux)
    out = {}
    for path, x in flax.traverse_util.flatten_dict(params).items():
        a = abs_flat.get(path)
        out[path] = _quantize_leaf(x, a) if isinstance(a, ptq.WithAux) else x
    missing = [p for p in abs_flat if p not in out]
    if key is not None and missing:

        def init_missing(k):
            full = flax.traverse_util.flatten_dict(
                nn.unbox(qwix_module.init(k, *sample_inputs)), is_leaf=_is_aux
            )
            return [full[p] for p in missing]

        out.update(zip(missing, jax.jit(init_missing)(key), strict=True))
    return flax.traverse_util.unflatten_dict(out)


@dataclasses.dataclass(frozen=True)
class QuantLM:
    """``base`` (a float :class:`~klrl.models.base.CausalLM`) over weight-quantised parameters;
    made by :func:`quantize`. The LM head, the cache and the sizes are ``base`` 's."""

    base: Any
    kind: str
    module: nn.Module = dataclasses.field(repr=False, compare=False)
    wrapped: bool = False  # base's params carry no top-level "params" key (klrl's gpt)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    @property
    def max_len(self) -> int:
        return self.base.max_len

    @property
    def dtype(self) -> Any:
        return getattr(self.base, "dtype", None)

    def init(self, key: Array) -> Any:
        """Fresh random parameters of ``base``, quantised."""
        return quantize(self.base, self.base.init(key), self.kind)[1]

    def apply(self, params, tokens, positions, mask, cache=None, index=None, *, logits=True) -> LMOutput:
        p = {"params": params} if self.wrapped else params
        return self.module.apply(p, tokens, positions, mask, cache, index, logits)

    def head(self, params, hidden: Array) -> Array:
        """``base`` 's LM head (float: its leaves are not quantised)."""
        return self.base.head(params, hidden)

    def init_cache(self, batch: int, length: int) -> Any:
        return self.base.init_cache(batch, length)

    def partition_rules(self) -> PartitionRules:
        """``base`` 's rules, the integer values of a kernel placed like the kernel; scales
        replicated (small, and a per-channel scale has size-1 axes that cannot be split)."""
        out: list[tuple[str, PartitionSpec]] = [(r"/array/scale$", PartitionSpec())]
        for rx, spec in self.base.partition_rules():
            if rx.endswith("kernel$"):
                out.append((rx[: -len("$")] + "/array/qvalue$", spec))
            out.append((rx, spec))
        return tuple(out)


def quantize(model: Any, params: Any, kind: str) -> tuple[Any, Any]:
    """``(model, params)`` -> ``(qmodel, qparams)`` with the blocks' linear kernels quantised to
    ``kind`` (``rule_args``); ``"none"`` returns its inputs. ``qmodel`` is a :class:`QuantLM`."""
    check(model, kind)
    if kind == "none":
        return model, params
    rule = qwix.QuantizationRule(module_path=_linears(model), **rule_args(kind))
    qmodule = qwix.quantize_model(model.module, qwix.PtqProvider([rule]))
    wrapped = "params" not in params
    p = {"params": params} if wrapped else params
    qp = quantize_params_for(qmodule, p, _sample_inputs(model))
    return QuantLM(model, kind, qmodule, wrapped), (qp["params"] if wrapped else qp)


def nbytes(tree: Any, *, packed: bool = False) -> int:
    """Bytes of a pytree's leaves: what each concrete array's device buffer occupies
    (``on_device_size_in_bytes``: ``jnp.int4`` is one byte per value on XLA:CPU); with ``packed``
    (or for abstract / NumPy leaves) ``size * bits / 8``, int4 at 4 bits."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not packed and hasattr(x, "on_device_size_in_bytes"):
            total += int(x.on_device_size_in_bytes())
            continue
        dt = np.dtype(x.dtype)
        bits = jnp.iinfo(dt).bits if jnp.issubdtype(dt, jnp.integer) else dt.itemsize * 8
        total += -(-int(np.prod(x.shape)) * bits // 8)
    return total
