"""GGUF files in: weights dequantised to float32 with the ``gguf`` library, the tokenizer rebuilt
from the file's metadata, the model of the family that reads the file's ``general.architecture``
(:func:`klrl.models.registry.gguf_family`; its :class:`~klrl.models.registry.GGUFReading` gives the
config, the tensor names and their conversion: the Llama family's, for ``llama`` and ``qwen2``, is
:mod:`klrl.models.llama_gguf`).

Every check (architecture, fields, tensor names and shapes, quantisation types ``gguf`` can
dequantise, the tokenizer) runs before the weights are dequantised; failures raise
:class:`klrl.models.hf.CheckpointFormatError` naming the file and the field or tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np

from klrl.data.hf_tokenizer import HFTokenizer, byte_level_bpe, make_tokenizer
from klrl.models.gguf_file import read_gguf
from klrl.models.hf import CheckpointFormatError, check_finite
from klrl.models.registry import GGUFReading, gguf_architectures, gguf_family


def _field(fields: dict, key, default=None, *, path=None, required=False):
    if key not in fields:
        if required:
            raise CheckpointFormatError(f"{path}: missing metadata field {key!r}")
        return default
    return fields[key]


def read_tokenizer(fields, path, reading: GGUFReading | None = None) -> HFTokenizer:
    """The tokenizer a GGUF's ``tokenizer.ggml.*`` metadata describes: byte-level BPE (``gpt2``), or
    a SentencePiece vocabulary (``llama``) where the family's ``reading`` builds one."""
    kind = _field(fields, "tokenizer.ggml.model", path=path, required=True)
    spm = reading.spm_tokenizer if reading is not None else None
    if kind != "gpt2" and not (kind == "llama" and spm is not None):
        known = "gpt2 byte-level BPE" + (", llama SentencePiece" if spm is not None else "")
        raise CheckpointFormatError(f"{path}: tokenizer.ggml.model {kind!r} is not supported ({known})")
    tokens = _field(fields, "tokenizer.ggml.tokens", path=path, required=True)
    types = _field(fields, "tokenizer.ggml.token_type", ()) or ()
    if kind == "gpt2":
        merges = _field(fields, "tokenizer.ggml.merges", path=path, required=True)
        tok = byte_level_bpe(tokens, merges, types, _field(fields, "tokenizer.ggml.pre"))
    else:
        unk = _field(fields, "tokenizer.ggml.unknown_token_id")
        unk = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
        tok = spm(tokens, types, unk)
    special = {}
    for name, key in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
    ):
        i = _field(fields, f"tokenizer.ggml.{key}_token_id")
        if i is not None and not 0 <= int(i) < len(tokens):
            raise CheckpointFormatError(
                f"{path}: tokenizer.ggml.{key}_token_id {i} is outside the vocabulary"
            )
        special[name] = tokens[int(i)] if i is not None else None
    # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = bool(_field(fields, "tokenizer.ggml.add_bos_token", kind == "llama"))
    return make_tokenizer(tok, special, _field(fields, "tokenizer.chat_template"), add_bos=add_bos)


def _family(fields, path) -> tuple[str, type, GGUFReading]:
    """The file's architecture, and the class and reading of the family registered for it."""
    arch = _field(fields, "general.architecture", path=path, required=True)
    found = gguf_family(arch)
    if found is None:
        known = ", ".join(gguf_architectures())
        raise CheckpointFormatError(f"{path}: general.architecture {arch!r} is not supported ({known})")
    return arch, *found


def _check_tensors(path, names: dict[str, str], expected: dict, shapes: dict) -> None:
    """The file's tensors against the model's: ``names`` HF -> GGUF name, ``expected`` HF name ->
    shape, ``shapes`` GGUF name -> shape (HF order)."""
    known = set(names.values())
    for g in shapes:
        if g not in known:
            raise CheckpointFormatError(f"{path}: unexpected tensor {g!r}")
    for h, shape in expected.items():
        g = names[h]
        if g not in shapes:
            raise CheckpointFormatError(f"{path}: missing tensor {g!r}")
        if shapes[g] != tuple(shape):
            raise CheckpointFormatError(
                f"{path}: tensor {g!r} has shape {list(shapes[g])}, the metadata implies {list(shape)}"
            )


def gguf_model(path: str | Path, *, dtype=jnp.float32, tokenizer: bool = False):
    """The model a GGUF file describes, from its metadata and tensor shapes alone (no tensor is read;
    its tokens are set by :func:`load_gguf`): its ``vocab_size`` and ``max_len`` before the load.
    ``tokenizer``: ``(model, tokenizer)``, the tokenizer read from the metadata as the load does."""
    path = Path(path)
    try:
        fields, listed = read_gguf(path)
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0]})") from None
    arch, cls, reading = _family(fields, path)
    field = lambda k, default=None, **kw: _field(fields, f"{arch}.{k}", default, path=path, **kw)
    try:
        model = cls(reading.config(arch, field, {t.name: t.shape for t in listed}, path), dtype)
    except ValueError as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{path}: {e}") from None
    return (model, read_tokenizer(fields, path, reading)) if tokenizer else model


def load_gguf(path: str | Path, *, dtype=jnp.float32, put=None):
    """A GGUF file -> ``(model, params, tokenizer)`` with float32 parameter leaves (numpy, or
    what ``put`` makes of each as soon as it is dequantised, e.g. ``jnp.asarray``)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such file")
    try:
        fields, listed = read_gguf(path)
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0]})") from None
    tensors = {t.name: t for t in listed}
    shapes = {n: t.shape for n, t in tensors.items()}
    arch, cls, reading = _family(fields, path)
    field = lambda k, default=None, **kw: _field(fields, f"{arch}.{k}", default, path=path, **kw)
    try:
        cfg = reading.config(arch, field, shapes, path)
        model = cls(cfg, dtype)
    except ValueError as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{path}: {e}") from None
    expected = model.hf_shapes()
    names = {h: reading.tensor_name(h) for h in expected}
    _check_tensors(path, names, expected, shapes)
    _check_quant_types(gguf, listed, path)
    tokenizer = read_tokenizer(fields, path, reading)
    fields.clear()  # the metadata's Python objects (the vocabulary) are done with
    eos = tokenizer.stop_ids[0] if tokenizer.stop_ids else None
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_id}
    cfg = dataclasses.replace(cfg, tokens=tuple((k, v) for k, v in ids.items() if v is not None))
    model = cls(cfg, dtype)

    def get(h: str) -> np.ndarray:
        t = tensors[names[h]]
        a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shapes[t.name])
        check_finite(a, path, t.name)
        return a if reading.convert is None else reading.convert(cfg, h, a)

    return model, model.params_from_hf(get, put), tokenizer


def _check_quant_types(gguf, tensors, path) -> None:
    """Dequantise one row of one tensor of each quantisation type: the ones ``gguf`` cannot
    handle fail here, naming a tensor, before any weight is read."""
    seen = set()
    for t in tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        try:
            gguf.quants.dequantize(t.data[:1], t.tensor_type)
        except (NotImplementedError, ValueError, KeyError, TypeError) as e:
            name = getattr(t.tensor_type, "name", t.tensor_type)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointFormatError(
                f"{path}: tensor {t.name!r} has quantisation type {name}, "
                f"which gguf cannot dequantise ({msg})"
            ) from None
