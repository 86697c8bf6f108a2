"""``klrl.run(config)`` and ``klrl.sweep(members)``: training from Python; the command line is a thin
layer over them.

A run is a sweep of one member. Both are checked at their entry (:mod:`klrl.checks`: the
configuration, then the task and the models against the policy, then the devices), built by one
:func:`klrl.loop.build.make_program` (one :func:`klrl.step.train.make_train` per program) and driven
by the one loop (:func:`klrl.loop.driver.drive`: logging, checkpoints, signals, guard, rollback,
resume); results are :mod:`klrl.analysis.results`.

A sweep is one compiled program: ``vmap`` over stacked train states. Its members may differ only in
what lives in the train state (:data:`klrl.config.sweep.SWEEPABLE`: ``kl.beta``, the controller,
``train.seed``, ``optim.lr``); on a ``(sweep, data)`` mesh the members are split over the ``sweep``
axis and each member's batch over the ``data`` devices of its group. The mesh may span several
processes (:mod:`klrl.distributed`); then only process 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from klrl import distributed
from klrl.analysis.results import SUMMARY_KEYS, RunResult, Sweep, columns, load_run, load_sweep
from klrl.checks import check_program, preflight, preflight_dpo
from klrl.config import ConfigError, DataConfig, LoRAConfig, RunConfig, SamplingConfig
from klrl.config.dpo import DPOConfig
from klrl.io.resume import prepare as prepare_resume
from klrl.loop import reliability, user
from klrl.loop.build import adopt_adapter, build_task, make_program, member_state
from klrl.loop.dpo import DPOResult, member_name
from klrl.loop.dpo import drive as drive_dpo
from klrl.loop.driver import ROLLED_BACK, drive
from klrl.models import lora as lora_lib
from klrl.models.pretrained import text_model
from klrl.rewards.pairs import Pairs, check_pairs, encode_as_ppo, heldout_prompts, read_pairs, split
from klrl.step.dpo import DPOProgram, Heldout, PairData
from klrl.tasks.base import Task
from klrl.tasks.text import save_policy

__all__ = [
    "ROLLED_BACK",
    "DPOResult",
    "dpo",
    "SUMMARY_KEYS",
    "RunResult",
    "build_task",
    "columns",
    "load_run",
    "load_sweep",
    "make_program",
    "member_state",
    "run",
    "sweep",
]


def run(
    cfg: RunConfig,
    *,
    task: Task | None = None,
    run_dir: str | Path | None = None,
    write: bool = True,
    log: Any = None,
    resume: str | Path | None = None,
    report: Callable[[RunResult], Any] | None = None,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
    hooks: Sequence[Any] = (),
    checked: bool = False,
    metrics: Sequence[Callable[..., dict[str, float]]] = (),
    **models: Any,
) -> RunResult:
    """Train ``cfg`` to the end and return its metrics, final state and run directory.

    ``write=False`` keeps everything in memory (no run directory, no checkpoints).
    ``resume=RUN_DIR`` continues that run from its latest complete checkpoint up to
    ``cfg.train.iterations`` (see :func:`klrl.io.resume.check_resumable` for what ``cfg`` may change);
    ``metrics.jsonl`` is cut back to the checkpoint, so the result is the same, bit for bit,
    as a run that was never interrupted. ``report(result)`` is called at the end of a written run
    (e.g. :func:`klrl.analysis.report.maybe_write_report`); ``models`` go to
    :func:`klrl.step.train.make_train` (``policy=``, ``policy_params=``, ...).
    ``on_step(iteration, metrics)`` is called with each iteration's metrics as they are recorded
    (e.g. for a live plot; see :func:`klrl.loop.driver.drive`). ``hooks``: ``klrl.hook(fn, every=N)``
    or objects with ``on_row(loop, row)`` and ``on_stop(loop)`` (:class:`klrl.loop.hooks.Hook`:
    ``row.it``, ``row.members[0]`` the row as ``metrics.jsonl`` has it; ``loop.rows``, ``loop.dirs``; a
    request returned: :mod:`klrl.loop.hooks`), told after the built-in hooks (metrics, checkpoints,
    samples, progress, trackers). ``checked``: ``cfg`` already
    passed :func:`klrl.checks.preflight` (mode ``"run"``, the same ``write`` and ``resume``) and is not
    checked again. ``metrics``: functions ``fn(row_metrics, samples) -> {name: float}`` whose values are
    written with each row as ``user/<name>`` (:mod:`klrl.loop.user`; ``train.metric_fns`` names them
    as ``module:function``, ``train.hooks`` names hooks).

    SIGTERM/SIGINT finish the current iteration, checkpoint and return
    (``result.info['stopped']`` names the signal). :class:`klrl.loop.reliability.RunStopped` is raised
    when the non-finite guard skipped ``train.max_consecutive_skips`` iterations in a row
    (the state is checkpointed) or the quality rollback hit ``train.max_rollbacks``.
    Bad input raises :class:`ConfigError` or :class:`klrl.io.checkpoint.CheckpointError`.
    """
    return _go(
        [cfg], False, task, run_dir, write, log, resume, report, on_step, hooks, checked, metrics, 1, models
    )


def sweep(
    members: list[RunConfig],
    *,
    task: Task | None = None,
    out_dir: str | Path | None = None,
    write: bool = True,
    sweep_devices: int = 1,
    log: Any = None,
    resume: str | Path | None = None,
    report: Callable[[list[RunResult]], Any] | None = None,
    on_step: Callable[[int, dict[str, Any]], Any] | None = None,
    hooks: Sequence[Any] = (),
    checked: bool = False,
    metrics: Sequence[Callable[..., dict[str, Any]]] = (),
) -> Sweep:
    """Run all ``members`` in one compiled program; one :class:`RunResult` each.

    The loop is a single run's (:mod:`klrl.loop.driver`): with ``write``, ``out_dir`` (default: a new run
    directory) gets one sub-directory per member, named after its swept values
    (:func:`klrl.analysis.results.member_names`: ``kl.beta=0.1,train.seed=1``, else ``member-XX``), each with
    its own config, ``metrics.jsonl`` and event file (with an HParams session), a ``sweep.json`` index
    (``members`` and ``axes``), and ``checkpoints/`` of the stacked state every
    ``train.checkpoint_every`` iterations. SIGTERM/SIGINT checkpoint and return (``info['stopped']``);
    ``resume=SWEEP_DIR`` continues the sweep exactly (bit for bit against an uninterrupted one).
    The non-finite guard and the quality rollback apply per member (a rollback restores the whole
    sweep to a checkpoint good for the members that crossed; the others replay exactly).
    A member on a pretrained ``model.path`` ends with its ``policy/`` as a run does.
    ``report(results)`` is called at the end of a written sweep. With several processes only
    process 0 writes. ``on_step(iteration, metrics)`` gets each iteration's ``{name: array over
    members}`` as it is recorded (e.g. for a live plot). The result is a list with
    ``.to_frame()`` (:func:`klrl.analysis.results.to_frame`). ``sweep_devices``: the device groups
    the members are split over (the rest of the devices split each member's batch). ``hooks``: as
    :func:`run`'s (``row.members[j]``: member ``j``'s row); ``checked``: as :func:`run`'s (mode ``"sweep"``);
    ``metrics``: as :func:`run`'s.
    """
    return _go(list(members), True, task, out_dir, write, log, resume, report, on_step, hooks, checked,
               metrics, sweep_devices, {})  # fmt: skip


def _go(members, stacked, task, out_dir, write, log, resume, report, on_step, hooks, checked, metrics,
        sweep_devices, models):  # fmt: skip
    """:func:`run` (one member, not ``stacked``: its one result) and :func:`sweep` (a :class:`Sweep`): check,
    build, drive, then each member's final ``policy/`` (a pretrained ``model.path``) and ``report``. The whole
    of it inside :class:`~klrl.loop.reliability.RunGuard`: signals from the start (a SIGTERM during the task
    build or the compile stops at the first iteration boundary), the run directory's lock, a full disk as
    one line. The checks before anything is built are :func:`klrl.checks.preflight` (a Hub name in a
    ``model.*`` path is read from the local Hugging Face cache there), unless ``checked``: the caller ran it
    on these members (the command line does, before it joins a distributed run)."""
    with reliability.RunGuard(log) as guard:
        given = task is not None
        members, plan = _checked(
            members, stacked, given, write, resume, out_dir, guard, sweep_devices, checked
        )
        spec_hooks, spec_metrics = user.from_config(members[0])  # train.hooks, train.metric_fns
        prog, task = make_program(members, task, stacked=stacked, write=write, resume=plan, log=log,
                                  check=check_program, sweep_devices=sweep_devices, **models)  # fmt: skip
        results, stop_error = drive(prog, write=write, out_dir=out_dir, resume=plan, log=log, guard=guard,
                                    on_step=on_step, hooks=[*hooks, *spec_hooks],
                                    metrics=[*metrics, *spec_metrics])  # fmt: skip
        out = Sweep(results) if stacked else results[0]
        if results[0].dir is not None and distributed.is_main():
            for r in results:  # a pretrained start ends as an HF directory
                if r.config.model.path and r.state is not None:
                    save_policy(task, r.state, r.dir / "policy", adopt_adapter(r.config))
            if report is not None:
                report(out)
        if stop_error is not None:
            raise reliability.RunStopped(f"stopped: {stop_error}", out)
        return out


def _checked(members, stacked, task_given, write, resume, out_dir, guard, sweep_devices, checked):
    """``members`` through :func:`klrl.checks.preflight` (unless ``checked``: the command line ran it) and
    the resume plan (None: a fresh start)."""
    if not checked:
        members = preflight(members, "sweep" if stacked else "run", write=write, resume=resume,
                            run_dir=out_dir, sweep_devices=sweep_devices, task_given=task_given)  # fmt: skip
    if resume is None:
        return members, None
    if distributed.is_main() and Path(resume).is_dir():
        guard.hold(resume)  # before reading it: a second writer is refused, not interleaved
    return members, prepare_resume(members if stacked else members[0], resume)


# ---- DPO ---------------------------------------------------------------------------------------------
def dpo(
    pairs: str | Path | list[dict] | Pairs,
    *,
    model_path: str | Path | None = None,
    model: tuple[Any, Any, Any] | None = None,
    cfg: DPOConfig | None = None,
    betas: Sequence[float] | None = None,
    seeds: Sequence[int] | None = None,
    lora: LoRAConfig | None = None,
    data: DataConfig | None = None,
    sampling: SamplingConfig | None = None,
    heldout: Pairs | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    log: Callable[[str], Any] | None = None,
    on_step: Callable[[int, dict], Any] | None = None,
) -> DPOResult:
    """Train DPO (or IPO, robust, hinge: ``cfg.loss``) from preference pairs; every ``(beta, seed)`` of
    ``betas x seeds`` (default ``cfg.beta``, ``cfg.seed``) is a member of one compiled program.

    ``pairs``: a JSONL/Parquet file or records with TRL's ``prompt``/``chosen``/``rejected`` columns
    (tokenised in PPO's text format, :func:`klrl.rewards.pairs.encode_as_ppo`, with ``data`` and
    ``sampling``: PPO's sections and defaults), or already tokenised :class:`Pairs` (with prompt
    lengths). ``dpo.eval_fraction`` of them are held out (the split keyed by ``cfg.seed``), unless
    ``heldout`` gives the held-out pairs. The model: ``model_path`` (an HF directory, a ``.gguf``, a
    ``klrl models`` name or a Hub name in the local cache) or ``model=(family, params, tokenizer)``;
    ``lora.rank > 0`` trains adapters on the frozen base (the reference: the base), else the whole model.

    ``run_dir``: the run directory (:mod:`klrl.loop.dpo`: metrics, checkpoints, ``policy/``; None: in
    memory); ``resume=True`` continues it bit for bit. Returns a :class:`DPOResult` (``members[j]``:
    beta, seed, rows, state; ``policy(j)``: the member's model and merged parameters). Bad input
    raises :class:`ConfigError` or :class:`klrl.rewards.pairs.PairsError` (one line each).
    """
    cfg, lora = cfg or DPOConfig(), lora or LoRAConfig()
    data, sampling = data or DataConfig(), sampling or SamplingConfig()
    betas = [float(b) for b in (betas if betas is not None else [cfg.beta])]
    seeds = [int(s) for s in (seeds if seeds is not None else [cfg.seed])]
    model_path = preflight_dpo(pairs, cfg=cfg, betas=betas, seeds=seeds, model_path=model_path,
                               model_given=model is not None, run_dir=run_dir, resume=resume)  # fmt: skip
    family, base, tok = model if model is not None else _dpo_model(model_path)
    train_pairs, held_pairs = _dpo_pairs(pairs, heldout, tok, data, sampling, cfg)
    if cfg.batch_size > len(train_pairs):
        raise ConfigError(f"dpo.batch_size: {cfg.batch_size} exceeds the {len(train_pairs)} training pairs")
    adapters = _dpo_adapters(family, base, lora)
    held = _dpo_heldout(held_pairs, cfg, tok)
    members = [(b, s) for b in betas for s in seeds]
    sections = {"dpo": cfg, "lora": lora, "data": data, "sampling": sampling}
    doc = {k: dataclasses.asdict(v) for k, v in sections.items()}
    doc |= {
        "model": {"path": str(model_path or "")},
        "members": [list(m) for m in members],
        "pairs": {"train": len(train_pairs), "heldout": len(held_pairs)},
    }
    if log is not None:
        how = f"LoRA rank {lora.rank}" if adapters else "full fine-tuning"
        n_prompts = 0 if held.prompts is None else len(held.prompts)
        log(
            f"{cfg.loss} on {len(train_pairs)} pairs ({len(held_pairs)} held out, {n_prompts} "
            f"held-out prompts for the exact KL); {how}; {len(members)} member(s): "
            + ", ".join(member_name(b, s) for b, s in members)
        )
    program = DPOProgram(family, adapters, cfg)
    return drive_dpo(program, base, tok, PairData.of(train_pairs), held, members, sampling, run_dir=run_dir,
                     resume=resume, config_doc=json.loads(json.dumps(doc, default=str)),
                     model_path=model_path, log=log, on_step=on_step)  # fmt: skip


def _dpo_model(model_path: str) -> tuple[Any, Any, Any]:
    """``(family, params, tokenizer)`` read from ``model_path`` (checked there by the preflight)."""
    try:
        return text_model(model_path)
    except ValueError as e:
        raise ConfigError(f"model.path: {e}") from None


def _dpo_adapters(family, base, lora: LoRAConfig):
    """The LoRA adapters ``lora`` asks for on ``base`` (None: ``lora.rank`` 0, the whole model trains)."""
    if lora.rank <= 0:
        return None
    try:
        adapters = lora_lib.LoRA(family, lora.rank, lora.alpha, lora_lib.parse_targets(lora.targets))
        lora_lib.check(adapters, base, "lora.rank")
    except ValueError as e:
        raise ConfigError(str(e).replace("model.lora.", "lora.")) from None
    return adapters


def _dpo_heldout(held_pairs: Pairs, cfg: DPOConfig, tok) -> Heldout:
    """The held-out pairs scored at each evaluation and the prompts of the exact KL
    (``cfg.eval_prompts`` of each)."""
    prompts, pmask = heldout_prompts(held_pairs, cfg.eval_prompts, tok.pad_id)
    as_jnp = lambda x: None if x is None else jnp.asarray(x)
    scored = held_pairs.take(np.arange(min(len(held_pairs), cfg.eval_prompts)))
    return Heldout(PairData.of(scored) if len(scored) else None, as_jnp(prompts), as_jnp(pmask))


def _dpo_pairs(pairs, heldout, tok, data, sampling, cfg) -> tuple[Pairs, Pairs]:
    """``(training, held-out)`` :class:`Pairs` from a file, records or tokenised pairs."""
    source = ""
    if isinstance(pairs, str | Path):
        source, pairs = str(pairs), read_pairs(pairs)
    if not isinstance(pairs, Pairs):
        check_pairs(list(pairs), [f"row {i}" for i in range(len(pairs))])
        pairs = encode_as_ppo(list(pairs), tok, data, sampling, source=source)
    if pairs.chosen_prompt_len is None:
        raise ConfigError("pairs: tokenised pairs need chosen_prompt_len and rejected_prompt_len")
    if heldout is not None:
        return pairs, heldout
    tr, ev = split(len(pairs), cfg.eval_fraction, cfg.seed)
    return pairs.take(tr), pairs.take(ev)
