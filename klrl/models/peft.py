"""LoRA adapters in and out in Hugging Face PEFT's format (``PeftModel.save_pretrained`` /
``PeftModel.from_pretrained``), read and written without torch or peft.

A PEFT LoRA directory holds ``adapter_config.json`` (``peft_type: "LORA"``, ``r``, ``lora_alpha``,
``target_modules``, ``base_model_name_or_path``, ...; PEFT's ``LoraConfig``) and
``adapter_model.safetensors``, one pair of tensors per adapted linear layer of each block::

    base_model.model.<HF module path>.lora_A.weight   [r, in]
    base_model.model.<HF module path>.lora_B.weight   [out, r]

(``torch.nn.Linear`` weights; the same for GPT-2's ``Conv1D`` layers, ``fan_in_fan_out: true``). PEFT's
forward adds ``(lora_alpha / r) * x A^T B^T`` (``LoraLayer``, default scaling), which is
:mod:`klrl.models.lora`'s ``(alpha / r) * (x A) B`` with klrl's ``A = lora_A.weight^T`` ``[in, r]`` and
``B = lora_B.weight^T`` ``[r, out]``, stacked over the layers (``[L, in, r]``, ``[L, r, out]``).

Families: Llama (also Qwen2 and Mistral: the same modules, ``model.layers.{i}.self_attn.q_proj``, ...)
and GPT-2 (``transformer.h.{i}.attn.c_attn``, ...; klrl's ``c_proj`` is HF's ``attn.c_proj`` and
``mlp_c_proj`` is ``mlp.c_proj``). klrl's own GPT has no Hugging Face counterpart and is refused.

Only plain LoRA is read: every PEFT option that changes the function beyond ``(alpha/r) x A B`` on the
block's linear layers (rsLoRA, DoRA, biases, ``modules_to_save``, per-module rank/alpha patterns, a subset
of layers, PiSSA/OLoRA/LoftQ-style initialisations that rewrite the base, ...) is a one-line
:class:`~klrl.models.hf.CheckpointFormatError` naming the file and the field, as is a missing or damaged
file, a missing, unexpected or misshapen tensor, or a target the family has no adapter for.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from klrl.models import lora
from klrl.models.base import PeftLayout as Layout
from klrl.models.hf import CheckpointFormatError, check_finite, save_safetensors
from klrl.models.registry import FAMILIES

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
SCORE = PREFIX + "score.weight"  # a SEQ_CLS adapter's score head (modules_to_save)
_FLOAT = {"F32", "F16", "BF16", "F64"}


# adapter_config.json fields: read (checked below), or without effect on the adapted function
_READ = {
    "peft_type", "task_type", "r", "lora_alpha", "target_modules", "exclude_modules",
    "base_model_name_or_path", "bias", "use_rslora", "use_dora", "modules_to_save", "init_lora_weights",
}  # fmt: skip
_NEUTRAL = {
    "peft_version", "auto_mapping", "revision", "inference_mode", "lora_dropout", "fan_in_fan_out",
    "runtime_config", "megatron_core", "qalora_group_size", "layers_pattern", "ensure_weight_tying",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config",
}  # fmt: skip
# initialisations that leave the base alone (the saved tensors are the whole adapter)
_PLAIN_INIT = (True, False, "gaussian", "orthogonal", "eva")


def layout(model: Any, where: str | Path) -> Layout:
    """The :class:`~klrl.models.base.PeftLayout` ``model``'s family declares (``PEFT``; a
    :class:`~klrl.models.lora.LoRA`: its base's); a family without one (klrl's GPT): a one-line error
    naming ``where``."""
    base = lora.base_of(model)
    found = getattr(base, "PEFT", None)
    if found is None:
        peft = sorted(n for n in FAMILIES if getattr(FAMILIES.get(n), "PEFT", None) is not None)
        raise CheckpointFormatError(
            f"{where}: PEFT adapters name Hugging Face modules; klrl's {type(base).__name__} declares no "
            f"Hugging Face layout (PEFT adapters are read and written for the {', '.join(peft)} families)"
        )
    return found


def _name(base_name: str) -> str:
    """A model's name for :func:`same_base`: the last path component (a Hub id's model part; the
    ``models--org--name`` directory of an HF cache snapshot path), without ``.gguf``, a trailing GGUF
    quantisation tag (``.Q4_1``, ``-Q4_K_M``, ``-f16``, ...) or ``-GGUF``, case-folded, with ``.``, ``_``
    and ``-`` all read as ``-`` (GGUF files spell ``Qwen2-0.5B`` ``qwen2-0_5b``)."""
    parts = [p for p in re.split(r"[/\\]+", base_name.strip()) if p]
    if not parts:
        return ""
    for i, p in enumerate(parts):
        if p.startswith("models--") and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            parts = [p.split("--")[-1]]
            break
    name = re.sub(r"\.gguf$", "", parts[-1], flags=re.I)
    name = re.sub(r"[._-](?:I?Q\d\w*|F16|F32|BF16)$", "", name, flags=re.I)
    return re.sub(r"[._-]+", "-", re.sub(r"-GGUF$", "", name, flags=re.I)).casefold()


def same_base(recorded: str, base_name: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the model ``base_name`` (a name or a path):
    their :func:`_name` forms are equal (``HuggingFaceTB/SmolLM2-135M-Instruct`` ~ ``SmolLM2-135M-Instruct``
    ~ ``SmolLM2-135M-Instruct.Q4_1.gguf`` ~ ``/any/dir/smollm2-135m-instruct/``; not ``SmolLM2-135M``).
    A loose comparison on purpose: it catches an adapter trained on another model, not a renamed copy."""
    return _name(recorded) == _name(base_name)


def _targets_of(lay: Layout, adapted: list[str]) -> list[str]:
    """PEFT ``target_modules`` for klrl's adapted modules (suffix names PEFT matches at a ``.``)."""
    return sorted(lay.targets[m] for m in adapted)


def hub_snapshot(path: str | Path) -> tuple[str, str] | None:
    """``(repo id, revision)`` of a directory inside a Hugging Face cache snapshot
    (``.../models--ORG--NAME/snapshots/REVISION``, what ``huggingface_hub.snapshot_download`` returns),
    else ``None``."""
    parts = Path(os.path.abspath(path)).parts
    for i, p in enumerate(parts[:-2]):
        if p.startswith("models--") and parts[i + 1] == "snapshots" and len(p) > len("models--"):
            return "/".join(p.split("--")[1:]), parts[i + 2]
    return None


def base_reference(model_path: str | Path) -> tuple[str, str | None]:
    """What an adapter's ``base_model_name_or_path`` (and ``revision``) records for the base
    ``model_path`` so that PEFT can load it (``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)``
    passes it to ``AutoModelForCausalLM.from_pretrained`` as it is, resolved against the working
    directory, never the adapter's): the Hub id and revision of an HF directory in the Hugging Face
    cache; else the absolute path (an HF directory loads from it; a ``.gguf`` file does not:
    ``klrl export --base`` writes the float base as an HF directory and records that instead)."""
    p = Path(model_path)
    found = hub_snapshot(p) if p.is_dir() else None
    return found if found is not None else (os.path.abspath(p), None)


def base_dir_name(model_path: str | Path) -> str:
    """The directory name of a base written beside an adapter (``klrl export --base``): the model's
    name, its GGUF extension and quantisation tag dropped (``SmolLM2-135M-Instruct.Q4_1.gguf`` ->
    ``SmolLM2-135M-Instruct``; a Hub snapshot: the repo's name), so :func:`same_base` still takes
    the adapter for one of ``model_path``."""
    found = hub_snapshot(model_path) if Path(model_path).is_dir() else None
    name = found[0].split("/")[-1] if found else Path(os.path.abspath(model_path)).name
    name = re.sub(r"\.gguf$", "", name, flags=re.I)
    name = re.sub(r"[._-](?:I?Q\d\w*|F16|F32|BF16)$", "", name, flags=re.I)
    return re.sub(r"-GGUF$", "", name, flags=re.I) or "model"


def adapter_config(model: lora.LoRA, adapted: list[str], base_name: str, revision: str | None = None) -> dict:
    """The ``adapter_config.json`` of ``model``'s adapters on the modules ``adapted`` (klrl names): PEFT's
    ``LoraConfig`` fields for plain LoRA at their defaults, except the adapter's own."""
    lay = layout(model, "save_adapter")
    alpha = float(model.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "revision": revision,
        "inference_mode": True,
        "r": int(model.rank),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": _targets_of(lay, adapted),
        "exclude_modules": None,
        "lora_dropout": 0.0,
        "fan_in_fan_out": lay.fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layer_replication": None,
        "auto_mapping": None,
    }


def save_adapter(
    out_dir: str | Path,
    model: lora.LoRA,
    adapters: Any,
    base_name: str,
    score: Any = None,
    *,
    revision: str | None = None,
) -> Path:
    """Write ``adapters`` (klrl's layout: ``params/<stack>/<module>/kernel_lora_{a,b}``, ``[L, in, r]`` and
    ``[L, r, out]``; any other leaf, e.g. a value head, is no part of an adapter and is left out) as a PEFT
    directory ``out_dir``: ``adapter_config.json`` (``r = model.rank``, ``lora_alpha = model.alpha``,
    ``base_model_name_or_path = base_name``, ``revision``: :func:`base_reference` gives both for a
    model path) and ``adapter_model.safetensors`` (float32; per layer ``i``:
    ``lora_A.weight = A[i]^T``, ``lora_B.weight = B[i]^T``). ``PeftModel.from_pretrained`` loads it.
    With ``score`` (a reward model's scalar head ``{'kernel': [D, 1], 'bias': [1]}``, bias 0): a
    ``SEQ_CLS`` adapter with the head as ``modules_to_save`` ``score`` (:func:`load_reward_adapter`)."""
    out = Path(out_dir)
    lay = layout(model, out)
    ad = lora.split(adapters)[1]
    stack = ad.get("params", {}).get(lay.stack, {})
    if set(ad) - {"params"} or set(ad.get("params", {})) - {lay.stack} or not stack:
        raise ValueError(
            f"{out}: the adapters are not {type(model.base).__name__} block adapters ({list(ad)})"
        )
    tensors = {}
    for mod, leaves in sorted(stack.items()):
        if mod not in lay.modules or set(leaves) != {"kernel_lora_a", "kernel_lora_b"}:
            raise ValueError(f"{out}: no PEFT name for the adapter of {lay.stack}/{mod} ({sorted(leaves)})")
        a, b = (np.asarray(leaves[k], np.float32) for k in ("kernel_lora_a", "kernel_lora_b"))
        if a.shape[-1] != model.rank or b.shape[-2] != model.rank:
            raise ValueError(f"{out}: {lay.stack}/{mod} has rank {a.shape[-1]}, the model {model.rank}")
        for i in range(a.shape[0]):
            name = f"{PREFIX}{lay.prefix}.{i}.{lay.modules[mod]}"
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    doc = adapter_config(model, sorted(stack), base_name, revision)
    if score is not None:
        if np.any(np.asarray(score["bias"])):
            raise ValueError(
                f"{out}: an HF score head has no bias (this one's is {np.asarray(score['bias'])})"
            )
        tensors[SCORE] = np.ascontiguousarray(np.asarray(score["kernel"], np.float32).T)
        doc.update(task_type="SEQ_CLS", modules_to_save=["score"])
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / WEIGHTS, {"format": "pt"})
    (out / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    return out


# ---- reading ------------------------------------------------------------------------------------


def _read_config(path: Path) -> dict:
    f = path / CONFIG
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: not a PEFT adapter directory")
    if not f.is_file():
        raise CheckpointFormatError(f"{f}: missing (a PEFT adapter directory needs {CONFIG})")
    try:
        doc = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{f}: not a JSON object")
    return doc


def _check_options(doc: dict, f: Path, seq_cls: bool = False) -> tuple[int, float]:
    """``(r, lora_alpha)`` of a plain-LoRA config; any other option: a one-line error naming it."""

    def bad(field: str, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{f}: {field} {doc.get(field)!r}: {why}")

    if doc.get("peft_type") != "LORA":
        raise bad("peft_type", "only LoRA adapters are read (LORA)")
    want = (None, "CAUSAL_LM") if not seq_cls else ("SEQ_CLS",)
    if doc.get("task_type") not in want:
        what = "causal-LM adapters (CAUSAL_LM)" if not seq_cls else "reward-model adapters (SEQ_CLS)"
        raise bad("task_type", f"only {what} are read here")
    r, alpha = doc.get("r", 8), doc.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise bad("r", "the rank must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not np.isfinite(alpha):
        raise bad("lora_alpha", "must be a finite number")
    if doc.get("bias", "none") != "none":
        raise bad("bias", "adapter biases are not supported (none)")
    for field in ("use_rslora", "use_dora"):
        if doc.get(field):
            raise bad(field, "not supported (klrl's LoRA scales by lora_alpha / r, without a magnitude)")
    saved = doc.get("modules_to_save") or []
    if saved and not (seq_cls and set(saved) <= {"score", "classifier"}):
        raise bad(
            "modules_to_save",
            "fully trained modules beside the adapter are not supported (null; a reward model's score head)",
        )
    if doc.get("init_lora_weights", True) not in _PLAIN_INIT:
        raise bad("init_lora_weights", "this initialisation rewrites the base weights; not supported")
    for field, v in sorted(doc.items()):
        if field not in _READ | _NEUTRAL and v not in (None, False, {}, [], ""):
            raise bad(field, "not supported (klrl reads plain LoRA adapters: this option must be unset)")
    return r, float(alpha)


def _module_names(base: Any, lay: Layout) -> list[str]:
    """Every module name PEFT would match against: each weight's module and their parents."""
    leaves = {n.rsplit(".", 1)[0] for n in base.hf_shapes() if n.endswith(".weight")} | {"lm_head"}
    names = set(leaves)
    for n in leaves:
        parts = n.split(".")
        names.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return sorted(names)


def _matches(target: Any, exclude: Any, key: str) -> bool:
    """PEFT's ``check_target_module_exists`` for ``target_modules``/``exclude_modules``: a string is
    full-matched as a regex, a list matches a name equal to an entry or ending in ``.entry``."""

    def hit(spec: Any) -> bool:
        if isinstance(spec, str):
            return re.fullmatch(spec, key) is not None
        return key in spec or any(key.endswith(f".{t}") for t in spec)

    return bool(target) and hit(target) and not (exclude and hit(exclude))


def _adapted(doc: dict, base: Any, lay: Layout, f: Path) -> list[str]:
    """The klrl modules ``target_modules`` (less ``exclude_modules``) selects, the same in every layer."""
    target, exclude = doc.get("target_modules"), doc.get("exclude_modules")
    for field, v in (("target_modules", target), ("exclude_modules", exclude)):
        ok = v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v))
        if not ok or (field == "target_modules" and not v):
            raise CheckpointFormatError(f"{f}: {field} {v!r}: a list of module names or a regular expression")
        if isinstance(v, str) and v.lower() != "all-linear":
            try:
                re.compile(v)
            except re.error as e:
                raise CheckpointFormatError(f"{f}: {field} {v!r}: not a regular expression ({e})") from None
    if isinstance(target, str) and target.lower() == "all-linear":  # PEFT: every linear layer but the head
        target = [lay.modules[m] for m in lay.modules]
    by_layer: dict[int, set] = {}
    own = {v: k for k, v in lay.modules.items()}
    for key in _module_names(base, lay):
        if not _matches(target, exclude, key):
            continue
        m = re.fullmatch(rf"{re.escape(lay.prefix)}\.(\d+)\.(.+)", key)
        if m is None or m.group(2) not in own:
            raise CheckpointFormatError(
                f"{f}: target_modules {target!r} selects {key!r}, a module klrl has no adapter for "
                f"(adaptable: {', '.join(lay.modules.values())} in each of {lay.prefix}.*)"
            )
        by_layer.setdefault(int(m.group(1)), set()).add(own[m.group(2)])
    if not by_layer:
        raise CheckpointFormatError(f"{f}: target_modules {target!r} selects no module of this base")
    n = next(iter(_shapes(base, lay).values()))[0]
    sets = {frozenset(by_layer.get(i, ())) for i in range(n)}
    if len(sets) != 1:
        raise CheckpointFormatError(
            f"{f}: target_modules {target!r} adapts different modules in different layers (not supported)"
        )
    return sorted(next(iter(sets)))


def _shapes(base: Any, lay: Layout) -> dict[str, tuple[int, int, int]]:
    """klrl module -> ``(L, in, out)`` of its kernel, from the base's HF tensor shapes."""
    shapes = base.hf_shapes()
    out = {}
    for mod, hf in lay.modules.items():
        found = [
            shapes[k]
            for k in shapes
            if re.fullmatch(rf"{re.escape(lay.prefix)}\.\d+\.{re.escape(hf)}\.weight", k)
        ]
        (a, b) = found[0]
        out[mod] = (len(found), *((a, b) if lay.fan_in_fan_out else (b, a)))
    return out


def _open_weights(path: Path) -> tuple[Any, Path, dict[str, tuple[tuple[int, ...], str]]]:
    f = path / WEIGHTS
    if not f.is_file():
        also = " (adapter_model.bin, a pickle, is not read: save with safe_serialization=True)"
        raise CheckpointFormatError(f"{f}: missing{also if (path / 'adapter_model.bin').exists() else ''}")
    try:
        h = safe_open(str(f), framework="np")
        info = {}
        for k in h.keys():
            sl = h.get_slice(k)
            info[k] = (tuple(sl.get_shape()), sl.get_dtype())
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointFormatError(f"{f}: not a readable safetensors file ({msg})") from None
    return h, f, info


def _expected(lay: Layout, shapes: dict, adapted: list[str], r: int) -> dict[str, tuple[int, int]]:
    """PEFT tensor name -> torch-layout shape, for the adapted modules of every layer."""
    out = {}
    for mod in adapted:
        n, d_in, d_out = shapes[mod]
        for i in range(n):
            name = f"{PREFIX}{lay.prefix}.{i}.{lay.modules[mod]}"
            out[f"{name}.lora_A.weight"] = (r, d_in)
            out[f"{name}.lora_B.weight"] = (d_out, r)
    return out


def _check_tensors(info: dict, expected: dict, f: Path, lay: Layout) -> None:
    for k in sorted(set(info) - set(expected)):
        m = re.fullmatch(rf"{re.escape(PREFIX)}(.+)\.lora_[AB](?:\.weight)?", k)
        inner = m and re.fullmatch(rf"{re.escape(lay.prefix)}\.\d+\.(.+)", m.group(1))
        why = "not among target_modules' layers"
        if not inner or inner.group(1) not in lay.modules.values():
            why = f"klrl has no adapter for this module (adaptable: {', '.join(lay.modules.values())})"
        raise CheckpointFormatError(f"{f}: unexpected tensor {k!r} ({why})")
    for k, shape in expected.items():
        if k not in info:
            raise CheckpointFormatError(f"{f}: missing tensor {k!r} (target_modules adapts its module)")
        got, dt = info[k]
        if got != shape:
            raise CheckpointFormatError(
                f"{f}: tensor {k!r} has shape {list(got)}, the base and r imply {list(shape)}"
            )
        if dt not in _FLOAT:
            raise CheckpointFormatError(f"{f}: tensor {k!r} has dtype {dt}, not a float")


def _tensor(h: Any, f: Path, name: str) -> np.ndarray:
    """A float32 tensor of the adapter file ``f``; a NaN or an infinity is a one-line error naming them."""
    return check_finite(np.asarray(h.get_tensor(name), np.float32), f, name)


def adapter_options(path: str | Path) -> tuple[int, float]:
    """``(r, lora_alpha)`` of the PEFT directory ``path`` (options checked as by :func:`load_adapter`)."""
    path = Path(path)
    return _check_options(_read_config(path), path / CONFIG)


def adapter_line(path: str | Path) -> str:
    """The log line of a loaded ``model.adapter``: its path, rank, alpha, target modules and tensors."""
    path = Path(path)
    doc = _read_config(path)
    r, alpha = _check_options(doc, path / CONFIG)
    targets = doc.get("target_modules")
    targets = ",".join(sorted(targets)) if isinstance(targets, list) else str(targets or "all linear")
    n = len(_open_weights(path)[2])
    return (
        f"model.adapter: loaded {path} (r={r}, lora_alpha={alpha:g}, target_modules={targets}, {n} tensors)"
    )


def load_reward_adapter(
    path: str | Path, base_model: Any, base_params: Any, *, base_name: str | None = None
) -> tuple[lora.LoRA, Any, Any]:
    """A PEFT sequence-classification LoRA directory (``task_type`` ``SEQ_CLS``, ``modules_to_save``
    ``score``: a reward model as TRL's RewardTrainer with a ``peft_config`` saves it) on ``base_model`` ->
    ``(LoRA model, adapters, score head)``: the head ``{'kernel': score.weight^T [D, 1], 'bias': 0}``
    (transformers' ``*ForSequenceClassification`` score has no bias). Checked as :func:`load_adapter`."""
    return _load(path, base_model, base_params, base_name, seq_cls=True)


def load_adapter(
    path: str | Path, base_model: Any, base_params: Any, *, base_name: str | None = None
) -> tuple[lora.LoRA, Any]:
    """A PEFT LoRA directory on ``base_model`` (a Llama/Qwen2/Mistral or GPT-2 family object, as
    :func:`klrl.models.pretrained.from_pretrained` returns it, with its ``base_params``) ->
    ``(LoRA(base_model, r, lora_alpha, targets), adapters)``: ``targets`` a regex selecting the modules
    ``target_modules`` selects (``''``: all the family's), ``adapters`` float32 device arrays in klrl's
    layout (``A = lora_A.weight^T`` stacked over the layers, ``[L, in, r]``; ``B`` ``[L, r, out]``), so
    that ``LoRA.apply(lora.merge(base_params, adapters), ...)`` is PEFT's model.

    With ``base_name`` (the base's name or path), a ``base_model_name_or_path`` that names another model
    is an error; they are compared by :func:`same_base` (the last path components, without GGUF file and
    quantisation suffixes, case-insensitive); an adapter that records no base is not checked. Every
    failure is a one-line :class:`CheckpointFormatError` naming the file and the field or tensor."""
    return _load(path, base_model, base_params, base_name)[:2]


def _load(
    path: Any, base_model: Any, base_params: Any, base_name: str | None, seq_cls: bool = False
) -> tuple:
    path = Path(path)
    doc = _read_config(path)
    f = path / CONFIG
    lay = layout(base_model, path)
    r, alpha = _check_options(doc, f, seq_cls)
    recorded = doc.get("base_model_name_or_path")
    if (
        base_name is not None
        and isinstance(recorded, str)
        and recorded
        and not same_base(recorded, base_name)
    ):
        raise CheckpointFormatError(
            f"{f}: base_model_name_or_path {recorded!r} is not the base model {base_name!r}"
        )
    adapted = _adapted(doc, base_model, lay, f)
    shapes = _shapes(base_model, lay)
    h, wf, info = _open_weights(path)
    expected = _expected(lay, shapes, adapted, r)
    if seq_cls:
        expected[SCORE] = (1, base_model.hidden_size)
    _check_tensors(info, expected, wf, lay)
    stack = {}
    for mod in adapted:
        name = f"{PREFIX}{lay.prefix}.{{}}.{lay.modules[mod]}.lora_{{}}.weight"
        get = lambda i, ab: _tensor(h, wf, name.format(i, ab)).T  # noqa: B023
        n = shapes[mod][0]
        stack[mod] = {
            "kernel_lora_a": jnp.asarray(np.stack([get(i, "A") for i in range(n)])),
            "kernel_lora_b": jnp.asarray(np.stack([get(i, "B") for i in range(n)])),
        }
    targets = "" if len(adapted) == len(lay.modules) else "/(?:" + "|".join(adapted) + ")$"
    model = lora.LoRA(lora.base_of(base_model), r, alpha, targets)
    found = sorted(p.split("/")[-1] for p in lora.adapted_modules(model, base_params))
    if found != adapted:  # klrl's own targets regex and the family's LORA_TARGETS disagree: a klrl bug
        raise RuntimeError(f"{path}: LoRA targets {targets!r} adapt {found}, the adapter holds {adapted}")
    out = model, {"params": {lay.stack: stack}}
    if not seq_cls:
        return out
    score = _tensor(h, wf, SCORE)
    return (*out, {"kernel": jnp.asarray(score.T), "bias": jnp.zeros((1,), jnp.float32)})
