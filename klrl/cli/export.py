"""``klrl export RUN_DIR OUT_DIR [--step N]``: a run's policy, out of one of its checkpoints.

What is written (the latest complete checkpoint, or ``--step N``; its digests verified first; a newer
step directory that holds no finished save is skipped, and the line printed says so):

* **A run on a pretrained model** (``model.path``, an HF directory or a GGUF file): the policy at
  that checkpoint (a value head on it dropped) as an HF directory, by
  :func:`klrl.models.save_pretrained`: ``config.json``, ``model.safetensors`` (float32),
  ``generation_config.json`` and the tokenizer files, which
  ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and :func:`klrl.models.from_pretrained`
  load. ``model.path`` must still be there (its architecture and tokenizer are read from it).
* **A LoRA run on a pretrained model** (``lora.rank > 0``: the checkpoint's policy is the adapters): the
  merged policy as above (the float base of ``model.path`` with the adapters folded into its kernels,
  ``W + (alpha / r) A B``, :func:`klrl.models.lora.merged_kernels`, PEFT's ``merge_and_unload``; with
  ``model.ref_quant`` the run's base was the quantised one, the export's is the float one, as QLoRA merges
  are), and the adapters alone in PEFT's format in ``OUT_DIR/adapter/``
  (:func:`klrl.models.peft.save_adapter`: ``adapter_config.json``, ``adapter_model.safetensors``), which
  ``peft.PeftModel.from_pretrained`` and :func:`klrl.models.peft.load_adapter` (``model.adapter``) load
  on that base. The rank is the adapters'; alpha is ``lora.alpha`` (``model.adapter``'s ``lora_alpha``
  when the run started from a PEFT adapter: its rank and alpha are the run's). Its
  ``base_model_name_or_path`` is what peft's ``AutoPeftModelForCausalLM.from_pretrained(OUT_DIR/adapter)``
  loads the base from (as given: a relative path would be read against the working directory, not the
  adapter's): with ``--base`` (the default when ``model.path`` is a ``.gguf``, which transformers does
  not load as a model directory) the float base (dequantised) is written as an HF directory in
  ``OUT_DIR/base/NAME/`` (``NAME``: the model's name without its GGUF quantisation tag) and its absolute
  path is recorded; else, for an HF directory ``model.path``, its Hub id and revision when it is a
  snapshot in the Hugging Face cache, or its absolute path (:func:`klrl.models.peft.base_reference`).
  ``--no-base`` on a ``.gguf`` run records the ``.gguf``'s path, and the printed line says so.
* **A run of klrl's own GPT** (the synthetic testbed tasks): not a transformers architecture, so
  ``model.safetensors`` holds the policy's parameters (float32; its value head dropped) under
  their flax paths (``wte/embedding``, ...) and ``config.json`` says what they are: ``{"format": "klrl-gpt",
  "model": the run's model section, "task": the run's task.json, "iteration", "klrl_version",
  "run_config"}``. :func:`load_gpt` reads both back. A LoRA run of the GPT (``lora.rank > 0``) is
  refused: its checkpoints hold the adapters, not the task's pretrained base.
* **A sweep member** (``SWEEP_DIR/MEMBER``): its slice of the sweep's stacked checkpoint, as above.

A bad ``RUN_DIR``, a missing step, a non-empty ``OUT_DIR`` or a damaged checkpoint is an
:class:`ExportError` (the command: one line, exit status 2). ``OUT_DIR`` is written as a temporary
sibling directory and renamed when complete, so it never holds half an export.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file

from klrl.cli.args import check_new_path, check_special, fail
from klrl.cli.flags import BASE, export_parser  # (BASE: a LoRA run's float base in OUT_DIR)
from klrl.config import ConfigError
from klrl.eval.policy import PolicyError as ExportError
from klrl.eval.policy import checkpoint_of as _checkpoint_of
from klrl.eval.policy import lora_of as _lora_of
from klrl.eval.policy import policy_params as _policy_params
from klrl.io import checkpoint as ckpt
from klrl.io.checkpoint import CheckpointError, version
from klrl.io.digest import leaf_name
from klrl.io.readers import RunDirError, read_json, read_run
from klrl.models import lora, peft
from klrl.models.hf import CheckpointFormatError, save_safetensors
from klrl.models.pretrained import from_pretrained, save_pretrained
from klrl.tasks.text import check_model_paths

FORMAT = "klrl-gpt"
SAFETENSORS = "model.safetensors"
ADAPTER = "adapter"  # a LoRA run's adapters in PEFT's format, inside OUT_DIR


def skipped_note(root: Path, step: int) -> str:
    """The step directories after ``step`` that hold no finished save (skipped; export leaves them)."""
    newer = [s for s in ckpt.incomplete_steps(root) if s > step]
    if not newer:
        return ""
    names = ", ".join(f"{ckpt.SUBDIR}/{s}" for s in newer)
    return f" (skipped {names}: no finished checkpoint in it)"


def _write_gpt(cfg, params: Any, step: int, run_dir: Path, root: Path, out: Path) -> str:

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    tensors = {leaf_name(p): np.ascontiguousarray(np.asarray(x), np.float32) for p, x in flat}
    save_safetensors(tensors, out / SAFETENSORS, {"format": FORMAT})  # (mode: the umask's, as config.json)
    task = root / "task.json"
    doc = {
        "format": FORMAT,
        "model": cfg.to_dict()["model"],
        "task": read_json(task) if task.is_file() else None,
        "iteration": step,
        "klrl_version": version(),
        "run_config": cfg.to_dict(),
        "tensors": "the policy's float32 parameters under their flax paths; "
        "klrl.cli.export.load_gpt reads them",
    }
    (out / "config.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return f"klrl GPT policy parameters ({len(tensors)} float32 tensors, safetensors) + config.json"


def _write_hf(cfg, params: Any, out: Path, final: Path, base: bool | None) -> str:
    """The HF export of a pretrained-model run into ``out`` (renamed ``final`` when complete); a LoRA
    run's adapters in ``ADAPTER/`` and, with ``base`` (default: the run's model is a ``.gguf``, which
    PEFT cannot load), the float base in ``BASE/<name>/``, which the adapter records as its base."""
    check_model_paths(cfg)  # the architecture and the tokenizer come from model.path
    model, base_params, tok = from_pretrained(cfg.model.path, tokenizer=True)
    if cfg.lora.rank <= 0:
        if base:
            raise ExportError(
                "--base: the run is not a LoRA run (lora.rank 0): its export is the whole policy already"
            )
        save_pretrained(model, params, tok, out)
        where = f"architecture and tokenizer of {cfg.model.path}"
        return f"HF directory (transformers-loadable) of the policy, {where}"
    lm = _lora_of(cfg, model, params)
    save_pretrained(model, lora.merged_kernels(base_params, params, lm.scale), tok, out)
    gguf = not Path(cfg.model.path).is_dir()
    name, revision = peft.base_reference(cfg.model.path)
    if base or (base is None and gguf):
        rel = Path(BASE) / peft.base_dir_name(cfg.model.path)
        save_pretrained(model, base_params, tok, out / rel)
        name, revision = str(final / rel), None
        names = f"; the float base in {rel}/, which {ADAPTER}/adapter_config.json names"
    elif gguf:
        names = (
            f"; note: {ADAPTER}/ names the .gguf base, which peft cannot load: export with --base to write "
            "the float base beside it"
        )
    else:
        names = f"; {ADAPTER}/adapter_config.json names the base {name}"
    peft.save_adapter(out / ADAPTER, lm, params, base_name=name, revision=revision)
    return (
        f"HF directory (transformers-loadable) of the policy, its LoRA adapters (rank {lm.rank}, alpha "
        f"{lm.alpha:g}) merged into the base {cfg.model.path}, and the adapters alone in PEFT's format in "
        f"{ADAPTER}/{names}"
    )


def export(
    run_dir: str | Path, out_dir: str | Path, step: int | None = None, *, base: bool | None = None
) -> str:
    """Write ``run_dir``'s policy at checkpoint ``step`` (default: the latest) to ``out_dir``
    (module docstring; ``base``: ``--base``/``--no-base``, None: the default); returns a one-line
    statement of what was written."""

    d, out = Path(run_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty directory (nothing is overwritten)")
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        root, member = _checkpoint_of(d)
        cfg, _ = read_run(d)
        if not cfg.model.path and cfg.lora.rank > 0:
            raise ExportError(
                f"{d}: a LoRA run of klrl's GPT (lora.rank={cfg.lora.rank}): its checkpoints hold the "
                "adapters, not the task's pretrained base they sit on (LoRA runs on model.path are exported)"
            )
        params, step = _policy_params(root, member, step)
        tmp.mkdir(parents=True)
        if base and not cfg.model.path:
            raise ExportError("--base: a run of klrl's GPT has no pretrained base to write")
        if cfg.model.path:
            what = _write_hf(cfg, params, tmp, Path(os.path.abspath(out)), base)
        else:
            what = _write_gpt(cfg, params, step, d, root, tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except (RunDirError, CheckpointError, ConfigError, CheckpointFormatError) as e:
        raise ExportError(str(e)) from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return f"{d}: the policy at iteration {step} exported to {out}: {what}{skipped_note(root, step)}"


def load_gpt(out_dir: str | Path) -> tuple[dict, Any]:
    """``(config.json, params)`` of a GPT export: the parameters as the nested dict of NumPy arrays
    the policy was trained with (``GPT(...).apply`` takes them)."""

    out = Path(out_dir)
    doc = json.loads((out / "config.json").read_text())
    if doc.get("format") != FORMAT:
        raise ExportError(f"{out}/config.json: not a {FORMAT} export (format {doc.get('format')!r})")
    params: dict = {}
    for name, x in load_file(str(out / SAFETENSORS)).items():
        *parents, leaf = name.split("/")
        node = params
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return doc, params


def main(argv: list[str]) -> int:
    """``klrl export RUN_DIR OUT_DIR [--step N] [--base | --no-base]``."""

    p = export_parser()
    ns = p.parse_args(argv)
    check_special(ns.run_dir, "RUN_DIR")
    check_special(ns.out_dir, "OUT_DIR")
    check_new_path(ns.out_dir, "OUT_DIR", directory=True)  # too long, a loop, read-only, full: one line
    try:
        print(export(ns.run_dir, ns.out_dir, ns.step, base=ns.base))
    except ExportError as e:
        fail(str(e))
    return 0
