"""A policy to sample from and score (the ``SOURCE`` of ``klrl generate`` and ``klrl eval``, a study's
run at a step), read from

* **a run directory** (or a sweep member ``SWEEP/MEMBER``): its latest complete checkpoint, or ``--step
  N`` (digests verified, as ``klrl export`` reads it); the policy on the run's ``model.path`` (a value
  head dropped; LoRA adapters merged into the float base, ``W + (alpha / r) A B``). Its reference is
  ``model.path`` (the base the run started from), its prompt format the run's ``data`` section
  (``chat_template``, ``prompt_len``, ``truncate``, ``field``) and ``sampling.use_eos``;
* **a checkpoint directory** ``RUN/checkpoints/N``: that run at step ``N``;
* **a DPO run** (:mod:`klrl.loop.dpo`; or a member ``SWEEP/dpo.beta=B,dpo.seed=S`` of a DPO sweep) at a
  step, through :func:`policy_at` and :func:`checkpoint_steps`: its adapters (the state's ``params``)
  merged into ``model.path`` as above; its prompt format its ``config.json``'s ``data`` and ``sampling``;
* **an export** (``klrl export``'s HF directory), **an HF model directory**, **a ``.gguf``** or **a Hub
  name** in the local Hugging Face cache: the model as it is; PPO's defaults for the prompt format;
  the reference is ``--ref`` (an export's ``adapter/adapter_config.json`` names its base: that one by
  default).

klrl's GPT testbed runs and their exports are refused (their tokens are not text). Every problem is
a :class:`SourceError` with one line. :func:`policy_at` is the same read for a run at a step, and
:func:`checkpoint_steps` lists a run's complete checkpoints (a study evaluates each).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from klrl.config import ConfigError, DataConfig, RunConfig, SamplingConfig
from klrl.io import checkpoint as ckpt
from klrl.io.checkpoint import CheckpointError
from klrl.io.readers import RunDirError, read_json, read_run, read_sweep_members
from klrl.models import lora, peft
from klrl.models.catalog import resolve_model_path
from klrl.models.heads import detach
from klrl.models.hf import CheckpointFormatError
from klrl.models.pretrained import from_pretrained, text_model
from klrl.tasks.text import check_model_paths, compute_dtype


class PolicyError(ValueError):
    """A run directory, step or checkpoint that holds no readable policy (``klrl export`` calls it
    ``ExportError``)."""


def checkpoint_of(run_dir: Path) -> tuple[Path, int | None]:
    """Where ``run_dir``'s checkpoints are, and its member index (a sweep member) or None."""
    if (run_dir / "sweep.json").is_file():
        raise PolicyError(
            f"{run_dir}: a sweep directory; export one member: klrl export {run_dir}/MEMBER OUT_DIR"
        )
    parent = run_dir.parent
    if not (run_dir / "checkpoints").is_dir() and (parent / "sweep.json").is_file():
        names = read_sweep_members(parent)
        if run_dir.name in names:
            return parent, names.index(run_dir.name)
    return run_dir, None


def policy_params(root: Path, member: int | None, step: int | None, dpo: bool = False) -> tuple[Any, int]:
    """The policy's parameters (host arrays) at ``step`` (default: the latest complete one: a step
    directory holding no finished save is skipped, :func:`klrl.io.checkpoint.is_finished`), and that step.
    ``dpo``: a DPO run's state (:class:`klrl.step.dpo.DPOState`: ``params`` the policy's own, always
    stacked by member) rather than PPO's (``params/policy``)."""

    mgr = ckpt.manager(root, read_only=True)
    try:
        done = ckpt.steps(mgr)
        if not done:
            raise PolicyError(f"{root}: no complete checkpoint to export")
        if step is None:
            step = done[-1]
        elif step not in done:
            raise PolicyError(
                f"--step: no checkpoint {step} in {root} (complete: {', '.join(map(str, done))})"
            )
        try:
            state, _ = ckpt.restore(mgr, ckpt.saved_structure(mgr, step), step)  # digests verified
        except CheckpointError as e:  # the older checkpoints to export instead
            older = [s for s in done if s < step]
            hint = f" (older checkpoints: {', '.join(map(str, older))}; export one with --step {older[-1]})"
            raise CheckpointError(f"{e}{hint if older else ''}") from e
    finally:
        mgr.close()
    try:
        policy = state["params"] if dpo else state["params"]["policy"]
    except (KeyError, TypeError):
        raise PolicyError(f"checkpoint {step} in {root} holds no policy parameters (params/policy)") from None
    if member is not None:
        policy = jax.tree.map(lambda x: np.asarray(x[member]), policy)

    return detach(policy)[0], step


def lora_of(cfg, model: Any, adapters: Any) -> lora.LoRA:
    """The run's LoRA model: the adapters' rank; ``lora.alpha``, or ``model.adapter``'s ``lora_alpha``."""
    flat = jax.tree_util.tree_flatten_with_path(adapters)[0]
    ranks = {int(np.shape(x)[-1]) for p, x in flat if str(getattr(p[-1], "key", "")).endswith("_lora_a")}
    if len(ranks) != 1:
        raise PolicyError(
            f"lora.rank: the checkpoint's policy is not LoRA adapters of one rank (ranks {sorted(ranks)})"
        )
    alpha = cfg.lora.alpha
    doc = Path(cfg.model.adapter) / peft.CONFIG if cfg.model.adapter else None
    if doc is not None and doc.is_file():  # the run's rank and alpha were the adapter's
        alpha = float(read_json(doc).get("lora_alpha", alpha))
    return lora.LoRA(model, ranks.pop(), alpha, cfg.lora.targets)


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


@functools.lru_cache(maxsize=2)
def _base(path: str, dtype: Any) -> tuple[Any, Any, Any]:
    """``(model, params, tokenizer)`` of a run's ``model.path``, read once per process (a study reads
    every checkpoint of every member on the same base)."""
    return from_pretrained(path, dtype=dtype)


def dpo_run_of(run_dir: Path) -> tuple[Path, int, dict] | None:
    """``(root, member index, config.json)`` when ``run_dir`` is a DPO run (member 0) or a member of a
    DPO sweep (:mod:`klrl.loop.dpo`: ``config.json`` with a ``dpo`` section at the root), else None."""
    root, j = run_dir, 0
    if not (run_dir / "config.json").is_file() and (run_dir.parent / "sweep.json").is_file():
        try:
            names = read_sweep_members(run_dir.parent)
        except RunDirError:
            return None
        if run_dir.name not in names:
            return None
        root, j = run_dir.parent, names.index(run_dir.name)
    try:
        doc = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (root, j, doc) if isinstance(doc, dict) and isinstance(doc.get("dpo"), dict) else None


def _merged(cfg: RunConfig, params: Any, what: str) -> tuple[Any, Any, Any, Any, str]:
    """``(model, params, base, tokenizer, what)``: the saved ``params`` on ``cfg``'s base, LoRA adapters
    merged into it (``what`` says so)."""
    model, base, tok = _base(str(cfg.model.path), compute_dtype(cfg))
    if cfg.lora.rank > 0:
        lm = lora_of(cfg, model, params)
        params = lora.merged_kernels(base, params, lm.scale)
        what = f"{what} (LoRA rank {lm.rank} merged into {cfg.model.path})"
    return model, params, base, tok, what


def _from_dpo_run(root: Path, member: int, doc: dict, step: int | None, run_dir: Path) -> Source:
    """A DPO run's policy at ``step``: its adapters merged into ``model.path`` (the reference)."""
    try:
        sections = {k: doc.get(k, {}) for k in ("model", "lora", "data", "sampling")}
        cfg = RunConfig.from_dict({"task": {"name": "text"}, **sections})
        check_model_paths(cfg)
        params, step = policy_params(root, member, step, dpo=True)
        model, params, base, tok, what = _merged(cfg, params, "DPO policy")
    except (CheckpointError, ConfigError, CheckpointFormatError, PolicyError) as e:
        raise SourceError(str(e)) from None
    line = f"{run_dir}: the {what} at iteration {step}; reference {cfg.model.path}"
    return Source(model, params, tok, cfg.data, cfg.sampling, cfg.model.path, line, ref_params=base)


def _from_run(run_dir: Path, step: int | None) -> Source:
    if (dpo := dpo_run_of(run_dir)) is not None:
        return _from_dpo_run(*dpo, step, run_dir)
    try:
        cfg: RunConfig = read_run(run_dir)[0]
        if not cfg.model.path:
            raise SourceError(
                f"{run_dir}: a run of klrl's GPT testbed (no model.path): its tokens are not text; "
                "klrl generate and klrl eval read runs on a pretrained model"
            )
        check_model_paths(cfg)
        root, member = checkpoint_of(run_dir)
        params, step = policy_params(root, member, step)
        model, params, base, tok, what = _merged(cfg, params, "policy")
    except (RunDirError, CheckpointError, ConfigError, CheckpointFormatError, PolicyError) as e:
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
            model, params, tok = text_model(path)
        except ValueError as e:
            raise SourceError(f"SOURCE: {e}") from None
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


def policy_at(run_dir: str | Path, step: int | None = None) -> Source:
    """The policy of a run (or a sweep member ``SWEEP/MEMBER``; a PPO or a DPO run) at checkpoint ``step``
    (None: the latest complete one), LoRA adapters merged into the base; the base is read once per process."""
    return _from_run(Path(run_dir), step)


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The complete checkpoints of a run, a sweep or a sweep member, in order (digests not yet checked:
    :func:`policy_at` checks the one it reads)."""
    dpo = dpo_run_of(Path(run_dir)) if not (Path(run_dir) / "sweep.json").is_file() else None
    if dpo is not None:
        root = dpo[0]
    elif (Path(run_dir) / "sweep.json").is_file():
        root = Path(run_dir)
    else:
        root = checkpoint_of(Path(run_dir))[0]
    mgr = ckpt.manager(Path(root), read_only=True)
    try:
        return list(ckpt.steps(mgr))
    finally:
        mgr.close()
