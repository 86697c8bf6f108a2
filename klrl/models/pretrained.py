"""Pretrained checkpoints in and out: :func:`from_pretrained` (an HF directory or a GGUF file) and
:func:`save_pretrained` (an HF directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads).

Every failure is a :class:`klrl.models.hf.CheckpointFormatError` with a one-line message naming
the file and the field or tensor, raised before any array reaches a device.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from klrl.data.hf_tokenizer import HFTokenizer, TokenizerFormatError, load_tokenizer_dir
from klrl.models.gguf import gguf_model, load_gguf
from klrl.models.hf import CheckpointFormatError, family_from_config, load_hf, read_config, save_hf


def check_vocab(model, tokenizer, where: str) -> None:
    """The tokenizer's ids must index the embedding's rows."""
    if tokenizer is not None and tokenizer.vocab_size > model.vocab_size:
        raise CheckpointFormatError(
            f"{where}: the tokenizer's vocabulary has {tokenizer.vocab_size} tokens, "
            f"the embedding only {model.vocab_size} rows (vocab_size)"
        )


def pretrained_shape(path: str | Path) -> tuple[int, int] | None:
    """``(vocab_size, max_len)`` of the model at ``path`` (an HF directory or a ``.gguf`` file) from its
    ``config.json`` or GGUF metadata alone, no weight read: the lengths checked before anything is
    built (``klrl ... --check`` as the run). None where the config cannot be read: the load says why."""
    path = Path(path)
    try:
        if path.suffix == ".gguf" or path.is_file():
            model = gguf_model(path)
        else:
            model = family_from_config(read_config(path), where=str(path / "config.json"))
        return int(model.vocab_size), int(model.max_len)
    except (CheckpointFormatError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def pretrained_header(path: str | Path, *, dtype=jnp.float32):
    """``(model, tokenizer or None)`` of an HF directory or a ``.gguf`` file without reading a weight:
    what :func:`from_pretrained` checks before it reads the weights (the config or metadata, the
    tokenizer, the vocabulary), the same :class:`CheckpointFormatError` where they fail."""
    path = Path(path)
    if path.suffix == ".gguf" or path.is_file():
        model, tok = gguf_model(path, dtype=dtype, tokenizer=True)
        check_vocab(model, tok, str(path))
        return model, tok
    model = family_from_config(read_config(path), dtype=dtype, where=str(path / "config.json"))
    tok = None
    if (path / "tokenizer.json").is_file():
        try:
            tok = load_tokenizer_dir(path)
        except TokenizerFormatError as e:
            raise CheckpointFormatError(str(e)) from None
        check_vocab(model, tok, str(path / "tokenizer.json"))
    return model, tok


def from_pretrained(path: str | Path, *, dtype=jnp.float32, tokenizer: bool = True):
    """``path`` (an HF model directory or a ``.gguf`` file) -> ``(model, params, tokenizer)``.

    ``model`` implements :class:`klrl.models.base.CausalLM` with compute ``dtype``; ``params`` are
    float32 device arrays; ``tokenizer`` is a :class:`klrl.data.hf_tokenizer.HFTokenizer` (``None``
    for a directory without ``tokenizer.json``, or when ``tokenizer=False``).
    """
    path = Path(path)
    if path.suffix == ".gguf" or path.is_file():
        model, params, tok = load_gguf(path, dtype=dtype, put=jnp.asarray)
        check_vocab(model, tok, str(path))
    else:
        model, params = load_hf(path, dtype=dtype, put=jnp.asarray)
        tok = None
        if tokenizer and (path / "tokenizer.json").is_file():
            try:
                tok = load_tokenizer_dir(path)
            except TokenizerFormatError as e:
                raise CheckpointFormatError(str(e)) from None
            check_vocab(model, tok, str(path / "tokenizer.json"))
    return model, params, (tok if tokenizer else None)


def text_model(path: str | Path):
    """:func:`from_pretrained` for a command that reads and writes text: ``(model, params, tokenizer)``;
    a checkpoint that cannot be read, or one without a tokenizer, is a :class:`ValueError` whose message
    names the path and the cause (the caller prefixes its field)."""
    try:
        model, params, tok = from_pretrained(path)
    except (CheckpointFormatError, OSError, ValueError) as e:
        raise ValueError(str(e)) from None
    if tok is None:
        raise ValueError(f"{path}: no tokenizer (an HF directory needs tokenizer.json)")
    return model, params, tok


def save_pretrained(model, params, tokenizer: HFTokenizer | None, out_dir: str | Path) -> Path:
    """Write an HF directory: ``config.json``, ``model.safetensors`` (float32),
    ``generation_config.json`` (the stop ids as ``eos_token_id``) and the tokenizer files."""
    out = save_hf(model, params, out_dir)
    if tokenizer is not None:
        tokenizer.save(out)
        gen = {
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": list(tokenizer.stop_ids),
            "pad_token_id": tokenizer.pad_id,
        }
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
