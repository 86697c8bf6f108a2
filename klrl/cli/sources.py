"""The ``SOURCE`` of ``klrl generate`` and ``klrl eval``: a policy to sample from, read from

* **a run directory** (or a sweep member ``SWEEP/MEMBER``): its latest complete checkpoint, or ``--step
  N`` (digests verified, as ``klrl export`` reads it); the policy on the run's ``model.path`` (a value
  head dropped; LoRA adapters merged into the float base, ``W + (alpha / r) A B``). Its reference is
  ``model.path`` (the base the run started from), its prompt format the run's ``data`` section
  (``chat_template``, ``prompt_len``, ``truncate``, ``field``) and ``sampling.use_eos``;
* **a checkpoint directory** ``RUN/checkpoints/N``: that run at step ``N``;
* **an export** (``klrl export``'s HF directory), **an HF model directory**, **a ``.gguf``** or **a Hub
  name** in the local Hugging Face cache: the model as it is; PPO's defaults for the prompt format;
  the reference is ``--ref`` (an export's ``adapter/adapter_config.json`` names its base: that one by
  default).

klrl's GPT testbed runs and their exports are refused (their tokens are not text). Every problem is
a :class:`SourceError` with one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from klrl.cli.export import ExportError, _checkpoint_of, _lora_of, _policy_params
from klrl.config import ConfigError, DataConfig, RunConfig, SamplingConfig
from klrl.io import checkpoint as ckpt
from klrl.io.checkpoint import CheckpointError
from klrl.io.readers import RunDirError, read_run
from klrl.models import lora
from klrl.models.catalog import resolve_model_path
from klrl.models.hf import CheckpointFormatError
from klrl.models.pretrained import from_pretrained
from klrl.tasks.text import check_model_paths, compute_dtype


class SourceError(ValueError):
    """A SOURCE (or its ``--step``, ``--ref``) that cannot be read; the message is one line."""


@dataclasses.dataclass
class Source:
    """A policy (``model``, ``params``, ``tok``), its prompt format (``data``, ``sampling``), the path of
    its reference (None: none known) and a line saying what was read."""

    model: Any
    params: Any
    tok: Any
    data: DataConfig
    sampling: SamplingConfig
    ref: str | None
    what: str
    ref_params: Any = None  # the reference's parameters when they were read already (a run's base)
    cfg: RunConfig | None = None  # a run's config


def run_dir_of(p: Path) -> tuple[Path, int | None] | None:
    """``(run directory, step or None)`` when ``p`` is a run, a sweep member or a checkpoint directory."""
    if p.parent.name == ckpt.SUBDIR and p.name.isdigit() and (p.parent.parent / "config.json").is_file():
        return p.parent.parent, int(p.name)
    if (p.parent / "sweep.json").is_file() and not (p / "sweep.json").is_file():
        return p, None
    f = p / "config.json"
    if p.is_dir() and f.is_file():
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        if (
            isinstance(doc, dict)
            and isinstance(doc.get("train"), dict)
            and isinstance(doc.get("model"), dict)
        ):
            return p, None
    return None


def _from_run(run_dir: Path, step: int | None) -> Source:
    try:
        cfg: RunConfig = read_run(run_dir)[0]
        if not cfg.model.path:
            raise SourceError(
                f"{run_dir}: a run of klrl's GPT testbed (no model.path): its tokens are not text; "
                "klrl generate and klrl eval read runs on a pretrained model"
            )
        check_model_paths(cfg)
        root, member = _checkpoint_of(run_dir)
        params, step = _policy_params(root, member, step)
        model, base, tok = from_pretrained(cfg.model.path, dtype=compute_dtype(cfg))
        what = "policy"
        if cfg.lora.rank > 0:
            lm = _lora_of(cfg, model, params)
            params = lora.merged_kernels(base, params, lm.scale)
            what = f"policy (LoRA rank {lm.rank} merged into {cfg.model.path})"
    except (RunDirError, CheckpointError, ConfigError, CheckpointFormatError, ExportError) as e:
        raise SourceError(str(e)) from None
    line = f"{run_dir}: the {what} at iteration {step}; reference {cfg.model.path}"
    return Source(model, params, tok, cfg.data, cfg.sampling, cfg.model.path, line, ref_params=base, cfg=cfg)


def _export_base(p: Path) -> str | None:
    """The base an export's PEFT adapter names (``adapter/adapter_config.json``), when it is there."""
    f = p / "adapter" / "adapter_config.json"
    if not f.is_file():
        return None
    try:
        base = json.loads(f.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None
    return base if isinstance(base, str) and base and Path(base).exists() else None


def load_source(source: str, step: int | None = None, ref: str | None = None) -> Source:
    """The policy of ``source`` (module docstring); ``ref`` overrides its reference."""
    try:
        path = Path(resolve_model_path(source, "SOURCE"))
    except ConfigError as e:
        raise SourceError(str(e)) from None
    if not path.exists():
        raise SourceError(f"SOURCE: {source}: no such file or directory")
    run = run_dir_of(path)
    if run is not None:
        if run[1] is not None and step is not None and step != run[1]:
            raise SourceError(f"--step {step}: SOURCE is checkpoint {run[1]} already")
        src = _from_run(run[0], step if step is not None else run[1])
    else:
        if step is not None:
            raise SourceError(f"--step: SOURCE {source} is a model, not a run directory (no checkpoints)")
        cfg = path / "config.json"
        if cfg.is_file() and '"klrl-gpt"' in cfg.read_text():
            raise SourceError(f"{path}: an export of klrl's GPT testbed: its tokens are not text")
        try:
            model, params, tok = from_pretrained(path)
        except (CheckpointFormatError, OSError, ValueError) as e:
            raise SourceError(f"SOURCE: {e}") from None
        if tok is None:
            raise SourceError(f"SOURCE: {path}: no tokenizer (an HF directory needs tokenizer.json)")
        base = _export_base(path)
        line = f"{path}: the model" + (f"; reference {base} (its adapter's base)" if base else "")
        src = Source(model, params, tok, DataConfig(), SamplingConfig(), base, line)
    if ref is not None:
        src.ref, src.ref_params = ref, None
        src.what = src.what.split("; reference")[0] + f"; reference {ref} (--ref)"
    return src


def load_reference(src: Source) -> tuple[Any, Any]:
    """``(model, params)`` of ``src``'s reference (its tokenizer must be the policy's)."""
    if src.ref_params is not None:
        return src.model, src.ref_params
    try:
        path = resolve_model_path(src.ref, "--ref")
        model, params, tok = from_pretrained(path)
    except (ConfigError, CheckpointFormatError, OSError, ValueError) as e:
        raise SourceError(f"--ref: {e}") from None
    if model.vocab_size != src.model.vocab_size:
        raise SourceError(
            f"--ref: {src.ref}: vocabulary of {model.vocab_size} tokens, the policy's has "
            f"{src.model.vocab_size}; the exact KL needs the same tokenizer"
        )
    return model, params
