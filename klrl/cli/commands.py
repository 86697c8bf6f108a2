"""The ``klrl`` command: ``klrl train | sweep | study | resume | report | export``, over one executor.

* ``klrl train [--config FILE] [--section.field V ...]``: one training run.
* ``klrl sweep kl.beta=0.01,0.1 [train.seed=0,1 ...] [--sweep-devices K] [flags]``: the Cartesian
  grid of the axes as one compiled program (``--sweep AXIS`` works too).
* ``klrl study [flags]``: the default beta study (fixed beta in {0.01, 0.1, 1} and a proportional
  controller), with the flags applied to every member.
* ``klrl resume RUN_DIR [--train.iterations N ...]``: continue a run from its latest checkpoint.
* ``klrl report RUN_DIR``: write ``report.md`` for a run or sweep directory.
* ``klrl export RUN_DIR OUT_DIR [--step N]``: a checkpoint's policy as a model directory
  (:mod:`klrl.cli.export`).
* ``klrl generate SOURCE --prompts FILE``, ``klrl eval SOURCE --prompts FILE``: completions of a run,
  a checkpoint, an export or a model; rewards, exact KL and a judge's perplexity (:mod:`klrl.cli.generate`).
* ``klrl models``: the pretrained models klrl can see on this machine, with the path to pass as
  ``--model.path`` (:func:`klrl.models.catalog.find_models`).

A Hub name in a ``model.*`` path (``--model.path HuggingFaceTB/SmolLM2-135M-Instruct``) is read from
the local Hugging Face cache, fetched into it first when it is not there
(:func:`klrl.models.catalog.resolve_model_paths`); the run's ``config.json`` records the snapshot's path.

``python experiments/run.py [flags]`` is this command, chosen by its flags (:mod:`klrl.cli.legacy`).
Every check that needs no compiled code (the flags, the ``--distributed`` arguments, a damaged run
directory, then :func:`klrl.checks.preflight`, the same checks ``klrl.run`` and ``klrl.sweep`` make: the
paths a run opens and writes, the config, the model paths and fields, the task's vocabulary and lengths,
the reward functions, the device count) runs before anything is built, once (the API is told:
``checked=True``); a failure is one line on stderr and exit status 2. ``--check`` (every command that
trains) runs those checks alone, and those the run makes once its task is built (the text task's prompts,
reward functions and adapters, without reading a weight: :func:`klrl.checks.check_text_task`): ``check: ok (N
members)`` and exit 0, or the run's error line and exit 2; nothing is built or written.
Exit status: 0 done (or stopped by SIGTERM after a checkpoint), 130
stopped by SIGINT, 1 the run stopped itself (non-finite guard, rollback limit).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from klrl.analysis.results import load_sweep
from klrl.cli.args import (
    SWEEP_SYNTAX,
    build_parser,
    check_coordinator,
    check_run_dir_writable,
    check_special,
    config_from_args,
    fail,
    overrides_of,
    parse,
)
from klrl.cli.flags import PARSERS
from klrl.config import ConfigError, RunConfig, config_warnings
from klrl.config.schema import closest
from klrl.io.readers import RunDirError, read_run

__all__ = ["COMMANDS", "DESCRIPTION", "execute", "main"]

# the subcommands, one row each: name, one-line help, an example (from which the usage text is made)
TABLE = (
    ("train", "one training run:", "klrl train --kl.beta 0.1 --train.iterations 50"),
    ("sweep", "a grid as one program:", "klrl sweep kl.beta=0.01,0.1,1 train.seed=0,1"),
    ("study", "the default beta study:", "klrl study --train.iterations 50"),
    ("resume", "continue from a checkpoint:", "klrl resume runs/NAME --train.iterations 200"),
    ("report", "write report.md for a run:", "klrl report runs/NAME"),
    ("export", "a checkpoint's policy:", "klrl export runs/NAME OUT_DIR [--step N]"),
    ("generate", "completions of a run or model:", "klrl generate runs/NAME --prompt 'Hi' [--n 4]"),
    ("eval", "rewards, exact KL, judge NLL:", "klrl eval runs/NAME --prompts P.jsonl [--judge M]"),
    ("models", "pretrained models it can see:", "klrl models   (their paths, for --model.path)"),
    ("reward-model", "a Bradley-Terry reward model:",
     "klrl reward-model --model.path M --pairs P.jsonl --out DIR (--model.reward_path DIR)"),
    ("dpo", "DPO/IPO from preference pairs:",
     "klrl dpo --model.path M --pairs P.jsonl --out DIR [--dpo.betas 0.01,0.1,1] [--lora.rank 8]"),
)  # fmt: skip
COMMANDS = tuple(name for name, _, _ in TABLE)
DESCRIPTION = "PPO with a KL penalty; beta lives in the train state."
# klrl.distributed.DEFAULT_TIMEOUT_S, for --distributed-timeout's help (klrl.distributed imports jax;
# tests/cli/test_cli.py holds the two equal)
DISTRIBUTED_TIMEOUT_S = 120.0
# OSErrors that are the environment's fault (a full or read-only disk, permissions), not a bug
_USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                errno.EISDIR, errno.ENOENT, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP}  # fmt: skip
# the flags besides the config fields, and their defaults (a namespace lacking one gets it)
FLAG_DEFAULTS = (("config", None), ("resume", None), ("report", None), ("sweep", []), ("sweep_devices", 1),
                 ("study", False), ("quiet", False), ("check", False), ("distributed", False),
                 ("coordinator", None), ("num_processes", None), ("process_id", None),
                 ("distributed_timeout", None))  # fmt: skip


# ---- flags -----------------------------------------------------------------------------------------
def distributed_args(p: argparse.ArgumentParser) -> None:
    """``--quiet``, ``--check`` and the ``--distributed`` flags (every command that trains)."""
    p.add_argument("--quiet", action="store_true", help="print only the summary (= --train.quiet true)")
    p.add_argument(
        "--check",
        action="store_true",
        help="run every check the run makes before it compiles (klrl.checks.preflight and "
        "check_text_task: no weight is read), print one line and exit: 0 if they pass, 2 "
        "and the run's error otherwise; nothing is built or written",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run (jax.distributed) before anything else; "
        "auto-detected on Cloud TPU, Slurm, ...",
    )
    p.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="--distributed: process 0's address ($KLRL_COORDINATOR)")  # fmt: skip
    p.add_argument("--num-processes", metavar="N", type=int, default=None,
                   help="--distributed: process count ($KLRL_NUM_PROCESSES)")  # fmt: skip
    p.add_argument("--process-id", metavar="I", type=int, default=None,
                   help="--distributed: this process's index ($KLRL_PROCESS_ID)")  # fmt: skip
    p.add_argument("--distributed-timeout", metavar="SECONDS", type=float, default=None,
                   help="--distributed: the longest wait for the coordinator and the other "
                        "processes, then one line and exit 2 "
                        f"($KLRL_DISTRIBUTED_TIMEOUT; default {DISTRIBUTED_TIMEOUT_S:g})")  # fmt: skip


def sweep_args(p: argparse.ArgumentParser) -> None:
    """``--sweep AXIS`` and ``--sweep-devices K``."""
    p.add_argument("--sweep", metavar="SECTION.FIELD=V1,V2,...", action="append", default=[],
                   help="a sweep axis (repeatable: the grid is their Cartesian product), run as one "
                        "compiled program")  # fmt: skip
    p.add_argument("--sweep-devices", metavar="K", type=int, default=1,
                   help="device groups the sweep members are split over (the rest of the devices "
                        "split each member's batch)")  # fmt: skip


def given_flags(ns: argparse.Namespace) -> list[str]:
    """The flags given besides ``--report`` (for the conflicts of a report)."""
    out = ["--" + d for d in overrides_of(ns)]
    for flag, default in FLAG_DEFAULTS:
        if flag != "report" and hasattr(ns, flag) and getattr(ns, flag) != default:
            out.append("--" + flag.replace("_", "-"))
    return out


def check_report_alone(ns: argparse.Namespace) -> None:
    """A report trains nothing: no other flag."""
    others = given_flags(ns)
    if others:
        fail(
            f"--report: cannot be combined with {others[0]} (a report trains nothing and reads the "
            "run's own config)"
        )


# ---- the configs of a command ----------------------------------------------------------------------
def _study_members(cfg: RunConfig, overridden: bool) -> list[RunConfig]:
    if not overridden:  # the built-in default: short enough for a laptop CPU in a few minutes
        cfg = cfg.replace(train={"iterations": 100, "name": cfg.train.name or "beta-study"})
    try:
        members = [cfg.replace(kl={"beta": b}, ctrl={"kind": "fixed"}) for b in (0.01, 0.1, 1.0)]
        adaptive = {"kind": "proportional", "target": 3.0, "unit": "seq_sum", "horizon": 1000.0}
        members.append(cfg.replace(kl={"beta": 0.1}, ctrl=adaptive))
    except ConfigError as e:
        fail(f"--study: {e}")
    return members


def _sweep_members(cfg: RunConfig, specs: list[str]) -> tuple[list[RunConfig], dict[str, Any]]:
    from klrl.config.sweep import check_members, grid, parse_axis

    for spec in specs:
        if "=" not in spec:
            fail(f"--sweep {spec}: {SWEEP_SYNTAX}")
    try:
        axes = dict(parse_axis(spec, cfg) for spec in specs)
        if len(axes) != len(specs):
            fail("--sweep: the same field is given twice")
        members = grid(cfg, axes)
        check_members(members)
    except ConfigError as e:
        fail(str(e))
    return members, axes


def _is_sweep_dir(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, "sweep.json"))


def _read_sweep_dir(sweep_dir: str) -> list[RunConfig]:

    try:
        return [r.config for r in load_sweep(sweep_dir)]  # damaged files fail here, read-only
    except (RunDirError, FileNotFoundError) as e:
        fail(f"--resume: {e}")


def _read_resume_dir(run_dir: str) -> RunConfig:

    try:
        cfg, _ = read_run(run_dir)  # a damaged config.json or metrics.jsonl fails here, read-only
    except RunDirError as e:
        fail(f"--resume: {e}")
    return cfg


def _configs(mode: str, ns: argparse.Namespace) -> tuple[RunConfig, list[RunConfig] | None, Any]:
    """``(config, sweep members or None, sweep axes)`` of ``mode`` from the flags (and, for a resume,
    the run's saved config: the flags override it)."""
    base = members = axes = None
    if mode == "resume":
        if ns.config:
            fail("--config: cannot be combined with --resume (the run's config.json is the base)")
        if _is_sweep_dir(ns.resume):  # every member's config, with the overrides applied to each
            members = [config_from_args(ns, base=m) for m in _read_sweep_dir(ns.resume)]
            if ns.quiet:
                members = [m.replace(train={"quiet": True}) for m in members]
            return members[0], members, {}
        base = _read_resume_dir(ns.resume)
    cfg = config_from_args(ns, base=base)
    if ns.quiet:
        cfg = cfg.replace(train={"quiet": True})
    if mode == "study":
        members = _study_members(cfg, bool(overrides_of(ns) or ns.config))
        axes = {"kl.beta": None, "ctrl.kind": None}
    elif mode == "sweep":
        if not ns.sweep:
            fail(f"sweep: no axis given; {SWEEP_SYNTAX}")
        members, axes = _sweep_members(cfg, ns.sweep)
    from klrl.config.relevance import check_relevance

    if members is not None:  # a flag the study or the sweep sets per member, or no member reads: refused
        _check_overrides(ns, cfg, members, "the study" if mode == "study" else "--sweep")
    if mode == "resume":  # a field without effect among the flags given (its config.json is the run's own;
        try:  # a new run's fields are klrl.checks.preflight's)
            check_relevance(members or [cfg], only=overrides_of(ns))
        except ConfigError as e:
            fail(str(e))
    return cfg, members, axes


def _check_overrides(ns: argparse.Namespace, cfg: RunConfig, members: list[RunConfig], by: str) -> None:
    """The flags (and ``--config`` fields) beside a study or sweep are used by its members
    (:func:`klrl.config.sweep.check_overrides`)."""
    from klrl.config.sweep import check_overrides

    default = RunConfig().to_dict()
    changed = [f"{s}.{k}" for s, fs in cfg.to_dict().items() for k, v in fs.items() if v != default[s][k]]
    try:
        check_overrides(list(dict.fromkeys([*overrides_of(ns), *changed])), cfg, members, by)
    except ConfigError as e:
        fail(f"--{e}" if str(e).split(":")[0] in overrides_of(ns) else str(e))


# ---- the checks before anything is built -------------------------------------------------------------
def _check_distributed(ns: argparse.Namespace) -> bool:
    want = ns.distributed or ns.coordinator or ns.num_processes is not None or ns.process_id is not None
    check_coordinator(ns.coordinator)
    t = ns.distributed_timeout
    if t is not None and not 0 < t < float("inf"):
        fail(f"--distributed-timeout: must be a number of seconds > 0 (got {t})")
    if t is not None and not want:
        fail("--distributed-timeout: needs --distributed")
    if ns.num_processes is not None and ns.num_processes < 1:
        fail(f"--num-processes: must be >= 1 (got {ns.num_processes})")
    if ns.process_id is not None:
        n = ns.num_processes
        if ns.process_id < 0 or (n is not None and ns.process_id >= n):
            fail(f"--process-id: must be in [0, --num-processes) (got {ns.process_id})")
    return bool(want)


def _check_inputs(
    mode: str, ns: argparse.Namespace, cfg: RunConfig, members: list[RunConfig] | None, distributed: bool
) -> list[RunConfig]:
    """:func:`klrl.checks.preflight`, the one check of every door (the paths a run writes, the model paths
    and fields, the built-in task's vocabulary and lengths, the reward functions, a single run's device
    count unless ``--distributed``, which checks it once joined: :func:`_join`; a Hub name resolved is one
    line on stdout); then the config's warnings. Returns the members resolved."""
    from klrl.checks import preflight

    try:
        members = preflight(members or [cfg], "run" if members is None else "sweep",
                            sweep_devices=ns.sweep_devices, resume=ns.resume if mode == "resume" else None,
                            devices=not distributed, log=print)  # fmt: skip
    except ConfigError as e:
        fail(str(e))
    for w in config_warnings(cfg):  # after every check: an error is the only line on stderr
        print(f"warning: {w}", file=sys.stderr)
    return members


def _join(ns: argparse.Namespace, run_alone: bool, cfg: RunConfig) -> None:
    """``--distributed``: join the other processes (before anything touches a device), then a run's
    ``train.devices`` against all their devices (:func:`klrl.checks.check_device_count`: the one check
    :func:`klrl.checks.preflight` leaves to a distributed run, which cannot count them before)."""
    from klrl.checks import check_device_count
    from klrl.distributed import ENV_COORDINATOR, initialize, timeout_from_env

    try:
        timeout = ns.distributed_timeout or timeout_from_env()
    except ValueError as e:
        fail(f"--distributed-timeout: {e}")
    where = ns.coordinator or os.environ.get(ENV_COORDINATOR) or "the auto-detected coordinator"
    print(f"joining the distributed run at {where} (waiting up to {timeout:g} s)", flush=True)
    try:
        initialize(ns.coordinator, ns.num_processes, ns.process_id, timeout_s=timeout)
    except ValueError as e:
        if "coordinator_address" in str(e):  # JAX's words when nothing was given or detected
            e = ValueError(
                "no coordinator given and no cluster detected (Cloud TPU, Slurm, Open MPI, "
                "Kubernetes): pass --coordinator HOST:PORT --num-processes N --process-id I "
                "(or $KLRL_COORDINATOR, $KLRL_NUM_PROCESSES, $KLRL_PROCESS_ID)"
            )
        fail(f"--distributed: {e}")
    if run_alone:
        try:
            check_device_count(cfg)
        except ConfigError as e:
            fail(str(e))


# ---- the executor ----------------------------------------------------------------------------------
def _report(run_dir: str, ns: argparse.Namespace) -> int:
    from klrl.analysis.report import ReportError, write_report

    check_report_alone(ns)

    if Path(run_dir).is_dir():
        check_run_dir_writable(run_dir, "--report")
    try:
        print(write_report(run_dir, log=print))
    except (ReportError, RunDirError) as e:
        fail(f"--report: {e}")
    except OSError as e:  # a write that failed (report.md is replaced atomically: the old one is whole)
        if e.errno not in _USER_ERRNOS:
            raise
        fail(f"--report: {e.filename or run_dir}: {e.strerror} (report.md unchanged)")
    return 0


def execute(mode: str, ns: argparse.Namespace) -> int:
    """Run ``mode`` (one of :data:`COMMANDS`) with the parsed flags ``ns`` (``--check``: the checks alone)."""
    # (``--config`` is checked where it is read: klrl.io.readers, a shell's ``<(...)`` allowed)
    check_special(ns.report if mode == "report" else ns.resume, "RUN_DIR")  # before anything opens it
    if mode == "report":
        return _report(ns.report, ns)
    cfg, members, axes = _configs(mode, ns)
    if ns.sweep_devices != 1 and mode != "sweep":
        fail("--sweep-devices: needs --sweep")
    if ns.sweep_devices < 1:
        fail(f"--sweep-devices: must be >= 1 (got {ns.sweep_devices})")
    distributed = _check_distributed(ns)
    checked = _check_inputs(mode, ns, cfg, members, distributed)
    cfg, members = checked[0], None if members is None else checked
    if ns.check:  # nothing joined, built, compiled or written
        _check_as_the_run(checked)
        print(f"check: ok ({len(checked)} member{'s' if len(checked) != 1 else ''})")
        return 0
    if distributed:
        _join(ns, members is None, cfg)
    return _launch(mode, ns, cfg, members, axes)


def _check_as_the_run(members: list[RunConfig]) -> None:
    """``--check``: the checks the run makes once its task is built, without building it (the text
    task's prompts, reward functions and adapters: :func:`klrl.checks.check_text_task`), failing with the
    line the run would print. A sweep's task is its first member's, as the run builds it."""
    from klrl.checks import check_text_task
    from klrl.cli.launch import guarded

    guarded(lambda: check_text_task(members[0]))


def _launch(
    mode: str, ns: argparse.Namespace, cfg: RunConfig, members: list[RunConfig] | None, axes: Any
) -> int:
    """The run or sweep of checked configs (:mod:`klrl.cli.launch`), with a report at its end."""
    from klrl.analysis.report import maybe_write_report

    resume = ns.resume if mode == "resume" else None
    try:
        if members is not None:
            return run_sweep(members, axes, ns.sweep_devices, resume, maybe_write_report)
        return run_one(cfg, resume, maybe_write_report)
    except OSError as e:
        if e.errno in _USER_ERRNOS:
            fail(f"{e.filename or ''}: {e.strerror}".lstrip(": "))
        raise


def run_one(cfg: RunConfig, resume: str | None, report: Any = None) -> int:
    """:func:`klrl.cli.launch.run_one` (imported when a run starts: jax and the training stack)."""
    from klrl.cli import launch

    return launch.run_one(cfg, resume, report)


def run_sweep(
    members: list[RunConfig], axes: Any, sweep_devices: int, resume: str | None, report: Any = None
) -> int:
    """:func:`klrl.cli.launch.run_sweep` (imported when a sweep starts)."""
    from klrl.cli import launch

    return launch.run_sweep(members, axes, sweep_devices, resume, report)


# ---- the entry point -------------------------------------------------------------------------------
def _command_parser(cmd: str) -> argparse.ArgumentParser:
    def extra(p: argparse.ArgumentParser) -> None:
        if cmd in ("resume", "report"):
            p.add_argument("run_dir", metavar="RUN_DIR", help=f"the run directory to {cmd}")
        if cmd == "sweep":
            sweep_args(p)
        if cmd != "report":
            distributed_args(p)

    if cmd == "report":  # reads the run's own config: no field is a flag of it (check_report_alone)
        return build_parser("klrl report: write report.md and its plots for a run or sweep directory",
                            extra=extra, prog=f"klrl {cmd}", shown=lambda name: False)  # fmt: skip
    if cmd == "resume":  # only what a resume may change (klrl.io.resume.check_resumable)
        from klrl.io.readers import RESUME_MUTABLE

        shown = lambda name: name in RESUME_MUTABLE or name.startswith(("diag.", "log."))
        return build_parser(f"klrl resume: continue a run or sweep from its newest checkpoint, bit for bit. "
                            f"{DESCRIPTION}", extra=extra, prog=f"klrl {cmd}", shown=shown,
                            epilog="Only the flags listed may change; every other config field is the run's "
                            "own (its config.json).")  # fmt: skip
    return build_parser(f"klrl {cmd}: {DESCRIPTION}", extra=extra, prog=f"klrl {cmd}")


def _usage() -> str:
    """The top-level usage text, made from :data:`TABLE`."""
    lines = [f"usage: klrl {{{','.join(COMMANDS)}}} [flags]  (klrl COMMAND --help lists the flags)", ""]
    for name, text, example in TABLE:
        if len(name) > 8:  # a long name: the example on its own line
            lines += [f"  {name}  {text}", f"{'':11}{example}"]
        else:
            lines.append(f"  {name:<8} {text:<29} {example}")
    return "\n".join(lines) + "\n"


def models_main(argv: list[str]) -> int:
    """``klrl models``: the pretrained models klrl can see (:func:`klrl.models.catalog.find_models`),
    one entry each (name, family, parameters, where it was found; its path on the next line), and
    where it looked. Reads file headers only, offline."""
    p = build_parser(
        "klrl models: the pretrained models klrl can see on this machine (offline)",
        prog="klrl models",
        fields=False,
    )
    if argv and argv[0] not in ("-h", "--help"):
        fail(f"{argv[0]}: klrl models takes no flags or arguments")
    p.parse_args(argv)  # --help
    from klrl.models.catalog import find_models
    from klrl.tasks.pretrain import cache_root

    found, looked = find_models(klrl_cache=cache_root())
    print(f"{len(found)} pretrained model{'s' if len(found) != 1 else ''} (pass the path as --model.path):")
    for f in found:
        print(f.line())
    print("looked in: " + "; ".join(f"{what} {', '.join(map(str, dirs))}" for what, dirs in looked.items()))
    print(
        "a Hub name (--model.path Org/Name) is read from the Hugging Face cache, and fetched into it with "
        "huggingface_hub when it is not there (never with HF_HUB_OFFLINE=1)"
    )
    return 0


# the commands with a parser of their own: name -> "module:function" (imported only when it runs)
STANDALONE = {"export": "klrl.cli.export:main", "models": "klrl.cli.commands:models_main",
              "generate": "klrl.cli.generate:generate_main", "eval": "klrl.cli.generate:eval_main",
              "reward-model": "klrl.cli.reward_model:main", "dpo": "klrl.cli.dpo:main"}  # fmt: skip


def _standalone(cmd: str) -> Any:
    module, _, name = STANDALONE[cmd].partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    """``klrl COMMAND [flags]`` (:data:`COMMANDS`). A filesystem error no check caught first (a name too
    long, a symbolic link loop, read-only, no permission, no space, a file in a directory's place) is
    one line naming the path and the cause, exit 2, whichever command met it."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except OSError as e:
        if e.errno not in _USER_ERRNOS:
            raise
        fail(f"{e.filename or ''}: {e.strerror}".lstrip(": "))
    except RuntimeError as e:  # pathlib's resolve() on a loop (Python < 3.13)
        if not str(e).startswith("Symlink loop from "):
            raise
        fail(f"{str(e)[len('Symlink loop from ') :].strip(chr(39))}: a symbolic link loop")


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), end="")
        if not argv:
            fail(f"expected a command: {', '.join(COMMANDS)}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in STANDALONE:  # commands with their own parser (imported when run); the rest share build_parser's
        if cmd in PARSERS and ("-h" in rest or "--help" in rest):  # the help without the command's module
            PARSERS[cmd]().parse_known_args(rest)
        return _standalone(cmd)(rest)
    if cmd not in COMMANDS:
        near = closest(cmd.lstrip("-"), COMMANDS)
        hint = f"; did you mean klrl {near}?" if near else ""
        fail(f"{cmd!r}: not a klrl command{hint} (commands: {', '.join(COMMANDS)})")
    ns = parse(_command_parser(cmd), rest, positional_axes=cmd == "sweep")
    for flag, default in FLAG_DEFAULTS:
        if not hasattr(ns, flag):
            setattr(ns, flag, default)
    if cmd == "resume":
        ns.resume = ns.run_dir
    if cmd == "report":
        ns.report = ns.run_dir
    return execute(cmd, ns)
