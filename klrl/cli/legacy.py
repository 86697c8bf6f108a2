"""``python experiments/run.py [flags]``: the ``klrl`` command (:func:`klrl.cli.commands.main`) with the
flags of that script translated into a command.

* ``--report RUN_DIR`` (alone) -> ``klrl report RUN_DIR``;
* ``--sweep AXIS ...`` -> ``klrl sweep --sweep AXIS ...``;
* ``--resume RUN_DIR ...`` -> ``klrl resume RUN_DIR ...``;
* ``--study ...``, or no configuration flag at all -> ``klrl study ...``;
* configuration flags (or ``--config FILE``) alone -> ``klrl train ...``.

The flags are parsed first as the script's own (its ``--help`` lists them all, a parse error is its
message), and the combinations the commands cannot express are refused here, one line and exit status 2
(``--report`` with any other flag, ``--sweep``/``--study`` with ``--resume``, ``--study`` with ``--sweep``,
``--sweep-devices`` without ``--sweep``). Then the command runs: the same behaviour, messages and exit
statuses; among them, a flag beside ``--study`` or ``--sweep`` that the members would ignore (one the
study or an axis sets per member, a ``ctrl`` knob no member's controller reads) is refused by name
(:func:`klrl.config.sweep.check_overrides`).
"""

from __future__ import annotations

import argparse
import sys

from klrl.cli.args import build_parser, fail, overrides_of, parse
from klrl.cli.commands import DESCRIPTION, check_report_alone, distributed_args, main, sweep_args

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
    p.add_argument("--study", action="store_true",
                   help="the default beta study (what running with no arguments does): fixed kl.beta "
                        "0.01, 0.1, 1 and one proportional controller; other flags apply to every member, "
                        "a flag the study sets per member (kl.beta, ctrl.*) or no member reads is an "
                        "error")  # fmt: skip
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


def legacy_argv(argv: list[str]) -> list[str]:
    """The ``klrl`` command line of ``python experiments/run.py`` with ``argv`` (module docstring)."""
    ns = parse(build_parser(DESCRIPTION, extra=_legacy_args), argv)
    if ns.report is not None:
        check_report_alone(ns)
        return ["report", ns.report]
    cmd = _command(ns)
    if ns.sweep_devices != 1 and cmd != "sweep":
        fail("--sweep-devices: needs --sweep")
    drop = {k: v for k, v in _MODE_FLAGS.items() if not (cmd == "sweep" and k == "--sweep-devices")}
    return [cmd, *([ns.resume] if cmd == "resume" else []), *_without(argv, drop)]


def legacy_main(argv: list[str] | None = None) -> int:
    """``python experiments/run.py [flags]``: :func:`klrl.cli.commands.main` of :func:`legacy_argv`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return main(legacy_argv(argv))
