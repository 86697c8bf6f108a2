"""LoRA adapters on any model family, through qwix (Google's JAX LoRA and quantisation library).

A target linear layer ``y = x W (+ b)`` becomes (Hu et al. 2021, "LoRA", eq. 3; PEFT's ``LoraLayer``)::

    y = x W (+ b) + (alpha / r) * (x A) B,     A [in, r], B [r, out]

with ``A`` drawn from qwix's default (``he_uniform``) and ``B = 0``, so the adapted model equals the base
exactly at initialisation. :class:`LoRA` wraps a family's :class:`~klrl.models.base.CausalLM`; qwix
intercepts the family's own ``nn.Dense`` matmuls (``qwix.apply_lora_to_model``), so no family defines
adapters itself, only which of its modules may carry one (``LORA_TARGETS``, a regex full-matched against
the flax module path, e.g. ``layers/q_proj``).

Parameters are split in two pytrees of the family's own layout:

* the **base** (the loaded checkpoint), frozen: the reference is the base with the adapters off;
* the **adapters**: only the ``<kernel>_lora_a`` ``[(L,) in, r]`` and ``<kernel>_lora_b`` ``[(L,) r, out]``
  leaves, at the path of the kernel they adapt (a leading layer axis ``L`` for scanned layers).

:func:`merge` puts them together for :meth:`LoRA.apply` (a dict union: no copy under ``jit``);
:func:`split` takes them apart; :func:`merged_kernels` folds the adapters into the base (an HF export).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from klrl.models import quant
from klrl.models.attention import causal_mask, positions_from_mask
from klrl.models.base import LMOutput

Array = jax.Array
SUFFIXES = ("_lora_a", "_lora_b")


def base_of(model: Any) -> Any:
    """The model under ``model``'s adapters (a :class:`LoRA`'s base); any other model itself."""
    return model.base if isinstance(model, LoRA) else model


def family_targets(model: Any) -> str:
    """The regex of the module paths of ``model``'s family that may carry an adapter (``LORA_TARGETS``)."""
    t = getattr(type(model), "LORA_TARGETS", None)
    if t is None:
        raise ValueError(f"lora.rank: the {type(model).__name__} family declares no LoRA targets")
    return t


def module_regex(model: Any, targets: str = "") -> str:
    """qwix's ``module_path`` (full-matched): the family's adaptable modules, narrowed by ``targets`` (a
    regex searched in the module path, as PEFT's ``target_modules``; ``''``: all of them)."""
    fam = family_targets(model)
    return f"(?=(?:{fam})$)" + (f"(?=.*(?:{targets}))" if targets else "") + ".*"


def is_adapter(path: tuple) -> bool:
    """Whether the leaf at ``path`` (a ``jax.tree_util`` key path) is a LoRA factor."""
    last = path[-1]
    return str(getattr(last, "key", last)).endswith(SUFFIXES)


def split(params: Any) -> tuple[Any, Any]:
    """``(base, adapters)``: the nested dict ``params`` without and with only its LoRA factors."""

    def part(tree: Any, want: bool, path: tuple = ()) -> Any:
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                sub = part(v, want, (*path, k))
                if sub or not want:
                    out[k] = sub
            elif k.endswith(SUFFIXES) == want:
                out[k] = v
        return out

    return part(params, False), part(params, True)


def merge(base: Any, adapters: Any) -> Any:
    """The union of two nested dicts (``adapters``' leaves added beside ``base``'s; a dict, not a copy)."""
    if not adapters:
        return base
    out = dict(base)
    for k, v in adapters.items():
        out[k] = merge(base[k], v) if isinstance(v, dict) and k in base else v
    return out


def count(adapters: Any) -> int:
    """Number of adapter parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(adapters))


@dataclasses.dataclass(frozen=True)
class LoRA:
    """``base`` (any :class:`~klrl.models.base.CausalLM` family) with rank-``rank`` adapters on the modules
    :func:`module_regex` selects; ``quant`` (``none``/``int8``/``int4``, :mod:`klrl.models.quant`) keeps the
    frozen base weight-only quantised (QLoRA). ``apply`` takes :func:`merge` ``(base, adapters)``; the rest
    of the interface (``head``, ``init_cache``, ``partition_rules``, sizes) is the base's."""

    base: Any
    rank: int
    alpha: float
    targets: str = ""
    quant: str = "none"
    remat: str | None = None  # None: the base's (klrl.models.remat.with_remat replaces it)

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"lora.rank: must be > 0 for adapters (got {self.rank})")
        base = self.base
        if self.remat is None:
            object.__setattr__(self, "remat", getattr(base, "remat", "none"))
        elif getattr(base, "remat", self.remat) != self.remat:
            object.__setattr__(self, "base", dataclasses.replace(base, remat=self.remat))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def rules(self) -> list:
        """qwix's rules: adapters on the targets; with ``quant``, every linear layer of the blocks weight-only
        quantised (the targets through their LoRA rule, the others through a plain quantisation rule: the
        first rule matching a module applies), as :func:`klrl.models.quant.quantize` quantises the base."""
        extra = {}
        if self.quant != "none":
            extra = quant.rule_args(self.quant)
        path = module_regex(self.base, self.targets)
        rules = [qwix.LoraRule(module_path=path, rank=self.rank, alpha=float(self.alpha), **extra)]
        if extra:
            rules.append(qwix.QuantizationRule(module_path=module_regex(self.base), **extra))
        return rules

    @property
    def module(self) -> Any:
        return qwix.apply_lora_to_model(self.base.module, qwix.LoraProvider(self.rules))

    @property
    def wrapped(self) -> bool:
        """The family's ``module.apply`` takes ``{"params": tree}`` (klrl's GPT), not the tree."""
        return not hasattr(type(self.base), "params_from_hf")

    def apply(self, params, tokens, positions, mask, cache=None, index=None, *, logits=True) -> LMOutput:
        variables = {"params": params} if self.wrapped else params
        return self.module.apply(variables, tokens, positions, mask, cache, index, logits)

    def init_adapters(self, base_params: Any, key: Array) -> Any:
        """Fresh adapters for ``base_params`` (qwix's initialisers: ``A`` he-uniform, ``B`` zero), made by
        one forward of two tokens that creates the missing LoRA parameters."""
        t = jnp.zeros((1, 2), jnp.int32)
        m = jnp.ones((1, 2), bool)
        variables = {"params": base_params} if self.wrapped else base_params
        _, new = self.module.apply(
            variables, t, positions_from_mask(m), causal_mask(m), rngs={"params": key}, mutable=["params"]
        )
        return split(new if not self.wrapped else new["params"])[1]

    def __getattr__(self, name: str) -> Any:  # the rest of the CausalLM interface: the base's
        if name.startswith("__") or name in {f.name for f in dataclasses.fields(LoRA)}:
            raise AttributeError(name)
        return getattr(self.base, name)


def _adapter_shapes(model: LoRA, base_params: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    shapes = jax.eval_shape(lambda p: model.init_adapters(p, jax.random.PRNGKey(0)), base_params)
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    names = lambda path: tuple(k for k in (str(getattr(k, "key", k)) for k in path) if k != "params")
    return {names(path): leaf.shape for path, leaf in flat}


def adapted_widths(model: LoRA, base_params: Any) -> dict[str, tuple[int, int]]:
    """``{module path: (in, out)}`` of every adapted kernel, '/'-joined paths, from the shapes alone
    (``jax.eval_shape``: nothing is computed or allocated, whatever the rank). ``A`` is
    ``[(L,) in..., r]`` and ``B`` ``[(L,) r, out...]``; the rank's axis in ``B`` is the one that changes
    with the rank (compared with rank + 1), so a layer count equal to the rank is not mistaken for it."""
    now = _adapter_shapes(model, base_params)
    more = _adapter_shapes(dataclasses.replace(model, rank=model.rank + 1), base_params)
    out = {}
    for keys, a in now.items():
        if not keys[-1].endswith("_lora_a"):
            continue
        kb = (*keys[:-1], keys[-1][: -len("_lora_a")] + "_lora_b")
        b, b1 = now[kb], more[kb]
        lead = next(i for i in range(len(b)) if b[i] != b1[i])  # the layer axes come before the rank's
        out["/".join(keys[:-1])] = (math.prod(a[lead:-1]), math.prod(b[lead + 1 :]))
    return out


def adapted_modules(model: LoRA, base_params: Any) -> list[str]:
    """The '/'-joined module paths that carry an adapter (from the shapes alone: nothing is computed)."""
    return list(adapted_widths(model, base_params))


def check(model: LoRA, base_params: Any, field: str = "lora.rank") -> list[str]:
    """The adapted module paths; a ``ValueError`` naming ``lora.targets`` when none matches, or
    ``field`` (the rank's) when the rank exceeds an adapted layer's width ``min(in, out)`` (a larger
    rank adds parameters and memory, never expressiveness: ``A B`` has rank ``<= min(in, out)``)."""
    widths = adapted_widths(model, base_params)
    if not widths:
        fam = family_targets(model.base)
        raise ValueError(
            f"lora.targets: {model.targets!r} matches no linear layer of the "
            f"{type(model.base).__name__} family (its adaptable modules: {fam})"
        )
    name, (n_in, n_out) = min(widths.items(), key=lambda kv: min(kv[1]))
    if model.rank > min(n_in, n_out):
        raise ValueError(
            f"{field}: {model.rank} exceeds the width of the adapted layer {name} (min(in, out) = "
            f"min({n_in}, {n_out}) = {min(n_in, n_out)}); a rank must be <= {min(n_in, n_out)} on these "
            "layers (narrow them with lora.targets)"
        )
    return list(widths)


def merged_kernels(base_params: Any, adapters: Any, scale: float) -> Any:
    """``W + scale * A @ B`` for every adapted kernel, in float32 (the adapters folded into the base: what an
    exported merged model holds; PEFT's ``merge_and_unload``)."""
    out = jax.tree.map(lambda x: x, base_params)

    def walk(b: dict, a: dict) -> None:
        for k, v in a.items():
            if isinstance(v, dict):
                walk(b[k], v)
            elif k.endswith("_lora_a"):
                name = k[: -len("_lora_a")]
                lo_b = a[name + "_lora_b"]
                delta = jnp.einsum("...ir,...ro->...io", v.astype(jnp.float32), lo_b.astype(jnp.float32))
                b[name] = (b[name].astype(jnp.float32) + scale * delta.reshape(b[name].shape)).astype(
                    b[name].dtype
                )

    walk(out, adapters)
    return out


def parse_targets(targets: str) -> str:
    """``targets`` checked as a regex (a ``ValueError`` naming ``lora.targets`` otherwise)."""
    try:
        re.compile(targets)
    except re.error as e:
        raise ValueError(f"lora.targets: {targets!r} is not a regular expression ({e})") from None
    return targets
