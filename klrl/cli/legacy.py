"""``python experiments/run.py [flags]``: ``klrl study`` (no flags) and the other ``klrl`` commands
(:mod:`klrl.cli.commands`) chosen by that script's flags, parsed once.

* ``--report RUN_DIR`` (alone) -> ``klrl report RUN_DIR``;
* ``--sweep AXIS ...`` -> ``klrl sweep --sweep AXIS ...``;
* ``--resume RUN_DIR ...`` -> ``klrl resume RUN_DIR ...``;
* ``--study ...``, or no configuration flag at all -> ``klrl study ...``;
* configuration flags (or ``--config FILE``) alone -> ``klrl train ...``.

The flags are parsed once, as the script's own (its ``--help`` lists them all, a parse error is its
message); the combinations the commands cannot express are refused, one line and exit status 2
(``--report`` with any other flag, ``--sweep``/``--study`` with ``--resume``, ``--study`` with ``--sweep``,
``--sweep-devices`` without ``--sweep``). Then the command's executor runs on those parsed flags
(:func:`klrl.cli.commands.execute`): the same behaviour, messages and exit statuses as the command;
among them, a flag beside ``--study`` or ``--sweep`` that the members would ignore (one the study or an
axis sets per member, a ``ctrl`` knob no member's controller reads) is refused by name
(:func:`klrl.config.sweep.check_overrides`). :func:`legacy_argv` writes the equivalent ``klrl`` command
line.
"""

from __future__ import annotations

import argparse
import sys

from klrl.cli import commands  # (commands.execute looked up at the call: tests replace it)
from klrl.cli.args import build_parser, fail, overrides_of, parse
from klrl.cli.commands import DESCRIPTION, FLAG_DEFAULTS, check_report_alone, distributed_args, sweep_args

__all__ = ["legacy_argv", "legacy_main"]

# the script's mode flags: dropped from the command line passed on (flag -> values it takes)
_MODE_FLAGS = {"--study": 0, "--resume": 1, "--report": 1, "--sweep-devices": 1}


def _legacy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue this run from its latest complete checkpoint")  # fmt: skip
    p.add_argument("--report", metavar="RUN_DIR", default=None,
                   help="write report.md (summary, diagnosis, plots) for this run or sweep directory "
                        "and exit; trains nothing (takes no other flag)")  # fmt: skip
    sweep_args(p)
    p.add_argument(
        "--study",
        action="store_true",
        help="the default beta study (what running with no arguments does): fixed kl.beta "
        "0.01, 0.1, 1 and one proportional controller; other flags apply to every member, "
        "a flag the study sets per member (kl.beta, ctrl.*) or no member reads is an "
        "error",
    )
    distributed_args(p)


def _command(ns: argparse.Namespace) -> str:
    """The command the parsed flags ask for (conflicting mode flags: one line, exit 2)."""
    if ns.resume is not None and ns.sweep:
        fail("--sweep: cannot be combined with --resume")
    if ns.resume is not None and ns.study:
        fail("--study: cannot be combined with --resume")
    if ns.sweep:
        if ns.study:
            fail("--study: cannot be combined with --sweep (the study is a sweep of its own)")
        return "sweep"
    if ns.resume is not None:
        return "resume"
    if ns.study or not (overrides_of(ns) or ns.config):
        return "study"
    return "train"


def _without(argv: list[str], flags: dict[str, int]) -> list[str]:
    """``argv`` less ``flags`` (``--flag VALUE`` or ``--flag=VALUE``; ``flags[name]``: values it takes)."""
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in flags:
            i += 1 if "=" in argv[i] else 1 + flags[name]
            continue
        out.append(argv[i])
        i += 1
    return out


def _parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """The command the script's flags ask for, and the flags parsed (module docstring)."""
    ns = parse(build_parser(DESCRIPTION, extra=_legacy_args), argv)
    if ns.report is not None:
        check_report_alone(ns)
        return "report", ns
    cmd = _command(ns)
    if ns.sweep_devices != 1 and cmd != "sweep":
        fail("--sweep-devices: needs --sweep")
    return cmd, ns


def legacy_argv(argv: list[str]) -> list[str]:
    """The ``klrl`` command line of ``python experiments/run.py`` with ``argv`` (module docstring)."""
    cmd, ns = _parse(argv)
    if cmd == "report":
        return ["report", ns.report]
    drop = {k: v for k, v in _MODE_FLAGS.items() if not (cmd == "sweep" and k == "--sweep-devices")}
    return [cmd, *([ns.resume] if cmd == "resume" else []), *_without(argv, drop)]


def legacy_main(argv: list[str] | None = None) -> int:
    """``python experiments/run.py [flags]``: the command its flags choose, run by
    :func:`klrl.cli.commands.execute` on the flags parsed once (no flags: ``klrl study``)."""
    cmd, ns = _parse(sys.argv[1:] if argv is None else list(argv))
    for flag, default in FLAG_DEFAULTS:  # (every one is a flag of the script: none is missing)
        if not hasattr(ns, flag):
            setattr(ns, flag, default)
    return commands.execute(cmd, ns)
