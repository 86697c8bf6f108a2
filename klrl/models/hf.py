"""Hugging Face model directories in and out: ``config.json`` + ``model.safetensors`` (or a sharded
``model.safetensors.index.json``), read and written with the ``safetensors`` library.

Every check (config fields, the set of tensor names, each tensor's shape and dtype, a file that
``safetensors`` cannot open) runs before any array is read, and any failure raises
:class:`CheckpointFormatError`, whose message is one line naming the file and the field or tensor
(the CLI maps it to exit status 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from klrl.models.registry import hf_family, hf_model_types

_FLOAT = {"F32", "F16", "BF16", "F64"}
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointFormatError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and the field."""


def read_config(path: str | Path) -> dict:
    """``path/config.json`` as a dict."""
    f = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise CheckpointFormatError(f"{path}: not a model directory")
    if not f.is_file():
        raise CheckpointFormatError(f"{f}: missing (a Hugging Face model directory needs config.json)")
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{f}: not valid JSON ({e})") from None


def family_from_config(d: dict, *, dtype=jnp.float32, where: str = "config.json"):
    """The family object a ``config.json`` dict describes: the model of the family registered for
    its ``model_type`` (:func:`klrl.models.registry.hf_family`)."""
    mt = d.get("model_type")
    found = hf_family(mt) if isinstance(mt, str) else None
    if found is None:
        raise CheckpointFormatError(
            f"{where}: model_type {mt!r} is not supported ({', '.join(hf_model_types())})"
        )
    cls, parse = found
    try:
        return cls(parse(d), dtype)
    except KeyError as e:
        raise CheckpointFormatError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointFormatError(f"{where}: {e}") from None


class TensorFiles:
    """The tensors of a directory's safetensors file(s): names, shapes, float32 reads."""

    def __init__(self, path: str | Path):
        path = Path(path)
        idx = path / INDEX
        if idx.is_file():
            try:
                weight_map = json.loads(idx.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointFormatError(f"{idx}: no valid weight_map ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (path / SAFETENSORS).is_file():
            files = [SAFETENSORS]
        else:
            raise CheckpointFormatError(f"{path}: neither {SAFETENSORS} nor {INDEX}")
        self.handles, self.where, self.info = {}, {}, {}
        for name in files:
            f = path / name
            if not f.is_file():
                raise CheckpointFormatError(f"{f}: missing (listed in {INDEX})")
            try:
                h = safe_open(str(f), framework="np")
                keys = list(h.keys())
                for k in keys:
                    sl = h.get_slice(k)
                    self.info[k] = (tuple(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise CheckpointFormatError(f"{f}: not a readable safetensors file ({msg})") from None
            self.handles[name] = h
            for k in keys:
                self.where[k] = name
        self.path = path

    def file_of(self, name: str) -> Path:
        return self.path / self.where[name]

    def get(self, name: str) -> np.ndarray:
        a = np.asarray(self.handles[self.where[name]].get_tensor(name), np.float32)
        return check_finite(a, self.file_of(name), name)


def check_finite(a: np.ndarray, where: str | Path, name: str) -> np.ndarray:
    """``a`` (a tensor read from the file ``where``), or a :class:`CheckpointFormatError` naming the file
    and the tensor when it holds a NaN or an infinity: a non-finite initial weight makes every
    iteration non-finite (each skipped by the guard), so it is refused at load."""
    bad = a.size - int(np.count_nonzero(np.isfinite(a)))
    if bad:
        first = np.unravel_index(int(np.argmin(np.isfinite(a))), a.shape) if a.ndim else ()
        raise CheckpointFormatError(
            f"{where}: tensor {name!r} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf; the "
            f"first at index {list(map(int, first))}): a model cannot start from it"
        )
    return a


def check_tensors(files: TensorFiles, expected: dict[str, tuple[int, ...]], canonical) -> dict[str, str]:
    """Compare the files' tensors with ``expected`` (name -> shape); return canonical -> stored name."""
    names: dict[str, str] = {}
    for stored in files.where:
        c = canonical(stored)
        if c is not None:
            names[c] = stored
    optional = {"lm_head.weight"} - set(expected)  # tied heads: some writers still store the copy
    for c in sorted(set(names) - set(expected) - optional):
        raise CheckpointFormatError(f"{files.file_of(names[c])}: unexpected tensor {names[c]!r}")
    for c in expected:
        if c not in names:
            where = files.path / (INDEX if (files.path / INDEX).is_file() else SAFETENSORS)
            raise CheckpointFormatError(f"{where}: missing tensor {c!r}")
        shape, dt = files.info[names[c]]
        if shape != tuple(expected[c]):
            raise CheckpointFormatError(
                f"{files.file_of(names[c])}: tensor {names[c]!r} has shape {list(shape)}, "
                f"config.json implies {list(expected[c])}"
            )
        if dt not in _FLOAT:
            raise CheckpointFormatError(
                f"{files.file_of(names[c])}: tensor {names[c]!r} has dtype {dt}, not a float"
            )
    return names


def load_hf(path: str | Path, *, dtype=jnp.float32, score: bool = False, put=None):
    """An HF directory -> ``(model, params)`` (float32 leaves: numpy, or what ``put`` makes of
    each, e.g. ``jnp.asarray``, as soon as it is read). With ``score=True`` the
    directory is a ``*ForSequenceClassification`` checkpoint: returns ``(model, params, score)``
    where ``score [num_labels, hidden]`` is its bias-free head and ``model`` the backbone."""
    path = Path(path)
    cfg = read_config(path)
    model = family_from_config(cfg, dtype=dtype, where=str(path / "config.json"))
    files = TensorFiles(path)
    expected = dict(model.hf_shapes())
    if not score and "score.weight" in files.where:
        arch = ", ".join(map(str, cfg.get("architectures") or [])) or "a score head"
        raise CheckpointFormatError(
            f"{files.file_of('score.weight')}: a reward model ({arch}: tensor 'score.weight'), "
            "not a causal LM; "
            f"load it with klrl.load_reward_model({str(path)!r}) (.score(prompts, responses)), or pass it to "
            "PPO as --model.reward_path"
        )
    if score:
        model = type(model)(_tied(model.config), dtype)
        expected = dict(model.hf_shapes())
        labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2
        expected["score.weight"] = (labels, model.hidden_size)
    names = check_tensors(files, expected, model.canonical_name)
    get = lambda c: files.get(names[c])
    params = model.params_from_hf(get, put)
    if score:
        return model, params, get("score.weight")
    return model, params


def _tied(c):
    return dataclasses.replace(c, tie_word_embeddings=True)


def load_score_head(path: str | Path) -> np.ndarray:
    """The ``score`` weight ``[num_labels, hidden]`` of a ``*ForSequenceClassification`` directory."""
    return load_hf(path, score=True)[2]


def umask() -> int:
    """The process's file-creation mask (Linux: read from ``/proc``, which leaves it untouched; else
    set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str]) -> Path:
    """``tensors`` to the safetensors file ``path``, atomically (a temporary file renamed), with the mode
    any new file gets (``0o666`` less the umask, e.g. 0644): the ``safetensors`` library creates its
    files 0600, which would keep a model exported for others from them."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o666 & ~umask())
    tmp.replace(path)
    return path


def save_hf(model, params, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float32) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in model.params_to_hf(params).items()}
    save_safetensors(tensors, out / SAFETENSORS, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.hf_config(), indent=2) + "\n")
    return out
