"""The DPO driver: iterations of the compiled sweep step (:mod:`klrl.step.dpo`), held-out metrics,
``metrics.jsonl``, orbax checkpoints, an exact resume and the final export. A separate, short driver
rather than :func:`klrl.loop.driver.drive` (whose hooks read PPO's rollouts, samples and rollback);
it reuses the run directory's pieces: :mod:`klrl.io.checkpoint` (save, restore, digests),
:class:`klrl.io.logging.MetricsWriter`, :func:`klrl.io.resume.complete_lines` / ``replace_file``.

The run directory (one member: everything at its root; a sweep: a sub-directory per member, named
``dpo.beta=B,dpo.seed=S``, and ``sweep.json`` listing them)::

    config.json        the settings (``dpo``, ``lora``, ``data``, ``sampling``, ``model``) and members
    metrics.jsonl      row ``i``: the training metrics of iteration ``i`` (its batch, before each of its
                       updates) and, every ``dpo.eval_every`` iterations, the held-out metrics of the
                       state after ``i`` updates; a last row ``dpo.iterations`` with the held-out ones
    checkpoints/       the stacked train state every ``dpo.checkpoint_every`` iterations and at the end
    policy/            (each member) the final policy as an HF directory; with LoRA the adapters merged,
                       and alone in PEFT's format in ``policy/adapter`` (its base: the model's HF
                       directory, or for a ``.gguf`` the float base written once to ``base/NAME``)

Resume (``resume=True`` on an existing directory): the latest complete checkpoint is restored (its
digests verified), every ``metrics.jsonl`` cut back to it, and the run continues to ``dpo.iterations``
(the only setting that may change): the rows are bit for bit those of a run never interrupted, since
an iteration depends only on the state (the batch is keyed by the member's key and the iteration).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from klrl.config import ConfigError
from klrl.io import checkpoint as ckpt
from klrl.io.logging import MetricsWriter
from klrl.io.resume import complete_lines, replace_file
from klrl.models import lora as lora_lib
from klrl.models import peft
from klrl.models.pretrained import save_pretrained
from klrl.step import dpo as dpo_step

CONFIG = "config.json"


@dataclasses.dataclass
class DPOMember:
    """One trained member: its beta and seed, directory, metrics rows and final (host) state."""

    beta: float
    seed: int
    dir: Path | None
    rows: list[dict[str, Any]]
    state: dpo_step.DPOState


@dataclasses.dataclass
class DPOResult:
    """The members of a DPO run or sweep, with what :meth:`policy` needs."""

    members: list[DPOMember]
    dir: Path | None
    program: dpo_step.DPOProgram
    base: Any
    tokenizer: Any

    def policy(self, j: int = 0) -> tuple[Any, Any]:
        """``(model, params)`` of member ``j``'s policy as a plain model of the family (adapters merged
        into the base in float32), for :func:`klrl.models.base.forward` or generation."""
        params = jax.device_get(self.members[j].state.params)
        lora = self.program.lora
        if lora is None:
            return self.program.model, params
        return self.program.model, lora_lib.merged_kernels(jax.device_get(self.base), params, lora.scale)

    def metric(self, name: str, j: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(iterations, values)`` of ``name`` in member ``j``'s rows (where it was recorded)."""
        pts = [(r["iteration"], r[name]) for r in self.members[j].rows if name in r]
        return np.array([p[0] for p in pts]), np.array([p[1] for p in pts], np.float64)

    def __len__(self) -> int:
        return len(self.members)


def member_name(beta: float, seed: int) -> str:
    return f"dpo.beta={beta:g},dpo.seed={seed}"


def member_dirs(root: Path, members: list[tuple[float, int]]) -> list[Path]:
    """The root for one member; a named sub-directory each for several."""
    if len(members) == 1:
        return [root]
    return [root / member_name(b, s) for b, s in members]


def _check_resume(root: Path, doc: dict) -> None:
    f = root / CONFIG
    if not f.is_file():
        raise ConfigError(f"resume: {root}: no {CONFIG} (not a DPO run directory)")
    saved = json.loads(f.read_text())
    strip = lambda d: {**d, "dpo": {k: v for k, v in d.get("dpo", {}).items() if k != "iterations"}}
    a, b = strip(saved), strip(doc)
    if a != b:
        diff = sorted(
            f"{s}.{k}"
            for s in set(a) | set(b)
            if isinstance(a.get(s), dict)
            for k in set(a.get(s, {})) | set(b.get(s, {}))
            if a.get(s, {}).get(k) != b.get(s, {}).get(k)
        )
        raise ConfigError(
            f"resume: {', '.join(diff) or 'members'}: differ from the run's {CONFIG} (only "
            "dpo.iterations may change on resume)"
        )


def _start(
    root: Path | None, dirs: list[Path], doc: dict, resume: bool, states: Any
) -> tuple[Any, int, list]:
    """``(states, first iteration, rows per member)``: fresh, or restored from ``root``'s latest
    checkpoint with every ``metrics.jsonl`` cut back to it."""
    rows: list[list[dict]] = [[] for _ in dirs]
    if root is None:
        return states, 0, rows
    if not resume:
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise ConfigError(
                f"run_dir: {root}: exists and is not empty (resume it, or pick a new directory)"
            )
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        (root / CONFIG).write_text(json.dumps(doc, indent=1) + "\n")
        if len(dirs) > 1:
            (root / "sweep.json").write_text(
                json.dumps({"members": [d.name for d in dirs], "axes": ["dpo.beta", "dpo.seed"]}, indent=1)
                + "\n"
            )
        return states, 0, rows
    _check_resume(root, doc)
    mgr = ckpt.manager(root, read_only=True)
    step = ckpt.latest_step(mgr)
    lines = 0
    if step is not None:
        states, meta = ckpt.restore(mgr, states, step)
        lines = int(meta["metrics_lines"])
    mgr.close()
    for j, d in enumerate(dirs):
        kept = complete_lines(d / "metrics.jsonl")[:lines]
        replace_file(d / "metrics.jsonl", b"".join(kept))
        rows[j] = [json.loads(x) for x in kept]
    (root / CONFIG).write_text(json.dumps(doc, indent=1) + "\n")
    return states, (0 if step is None else step), rows


def _due(it: int, every: int, last: int) -> bool:
    return it == last or (every > 0 and it % every == 0)


def drive(
    prog: dpo_step.DPOProgram,
    base: Any,
    tokenizer: Any,
    train: dpo_step.PairData,
    held: dpo_step.Heldout,
    members: list[tuple[float, int]],
    sampling: Any,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    config_doc: dict | None = None,
    model_path: str | Path | None = None,
    log: Callable[[str], Any] | None = None,
    on_step: Callable[[int, dict], Any] | None = None,
) -> DPOResult:
    """Train ``members`` (``(beta, seed)`` each) as one compiled program (module docstring)."""
    cfg = prog.cfg
    root = None if run_dir is None else Path(run_dir).absolute()
    dirs = member_dirs(root, members) if root is not None else []
    states = dpo_step.stack([dpo_step.init_state(prog, base, s, b) for b, s in members])
    states, first, rows = _start(root, dirs, config_doc or {}, resume, states)
    if not dirs:
        rows = [[] for _ in members]
    step = dpo_step.make_sweep_step(prog)
    evaluate = dpo_step.make_sweep_eval(prog, sampling, tuple(tokenizer.stop_ids), tokenizer.pad_id)
    writers = [MetricsWriter(d) for d in dirs]
    mgr = ckpt.manager(root, async_save=False) if root is not None else None
    try:
        for it in range(first, cfg.iterations + 1):
            host: dict[str, np.ndarray] = {}
            if _due(it, cfg.eval_every, cfg.iterations) and (
                held.pairs is not None or held.prompts is not None
            ):
                host.update(dpo_step.to_host(evaluate(states, base, held)))
            if it < cfg.iterations:
                states, m = step(states, base, train)
                host.update(dpo_step.to_host(m))
            for j in range(len(members)):
                row = {"iteration": it, **{k: float(v[j]) for k, v in sorted(host.items())}}
                rows[j].append(row)
                if writers:
                    writers[j].write(it, row)
            if on_step is not None:
                on_step(it, host)
            if log is not None and (it == cfg.iterations or _due(it, cfg.eval_every, cfg.iterations)):
                log(_line(it, cfg.iterations, host))
            done = it + 1
            if (
                mgr is not None
                and it < cfg.iterations
                and (done == cfg.iterations or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0))
            ):
                meta = {
                    "config": config_doc or {},
                    "version": ckpt.version(),
                    "iteration": done,
                    "metrics_lines": done,
                    "kind": "dpo",
                }
                ckpt.save(mgr, done, states, meta)
    finally:
        for w in writers:
            w.close()
        if mgr is not None:
            ckpt.finish(mgr)
    host_states = jax.device_get(states)
    out = [
        DPOMember(b, s, dirs[j] if dirs else None, rows[j], dpo_step.member(host_states, j))
        for j, (b, s) in enumerate(members)
    ]
    result = DPOResult(out, root, prog, base, tokenizer)
    if root is not None and model_path is not None:
        for j in range(len(out)):
            export_policy(result, j, out[j].dir / "policy", model_path, root)
    return result


def _line(it: int, total: int, m: dict[str, np.ndarray]) -> str:
    parts = [f"iteration {it}/{total}"]
    for k, label in (
        ("dpo/loss", "loss"),
        ("dpo/reward_accuracy", "accuracy"),
        ("eval/dpo/reward_accuracy", "held-out accuracy"),
        ("kl/exact_seq_sum", "KL nats/seq"),
    ):
        if k in m:
            parts.append(f"{label} " + " ".join(f"{v:.4g}" for v in np.atleast_1d(m[k])))
    return "; ".join(parts)


def export_policy(result: DPOResult, j: int, out: Path, model_path: str | Path, root: Path) -> Path:
    """Member ``j``'s final policy as an HF directory ``out`` (the adapters merged); with LoRA also the
    adapters alone in ``out/adapter`` (PEFT's format), their base an HF directory peft loads: the
    model's own, or for a ``.gguf`` the float base written once to ``root/base/NAME``."""
    model, params = result.policy(j)
    save_pretrained(model, params, result.tokenizer, out)
    lora = result.program.lora
    if lora is None:
        return out
    if Path(model_path).suffix.lower() == ".gguf":
        base_dir = root / "base" / peft.base_dir_name(model_path)
        if not (base_dir / "config.json").is_file():
            save_pretrained(model, jax.device_get(result.base), result.tokenizer, base_dir)
        name, revision = str(base_dir), None
    else:
        name, revision = peft.base_reference(model_path)
    peft.save_adapter(
        out / "adapter", lora, result.members[j].state.params, base_name=name, revision=revision
    )
    return out
