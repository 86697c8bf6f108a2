"""The walk from the command line to the jitted step (issue 39): which klrl modules run on the way, how
often each is entered, and how often a call climbs the layering (a lower layer calling into a higher one,
e.g. through a callback it was given).

    python benchmarks/walk.py [--start main|run_one] -- <klrl train flags>

Every klrl module is imported first (the walk is calls, not imports). Then every Python call into a klrl
function is traced (``sys.setprofile``) from the start of ``klrl.cli.commands.main`` (or of
``klrl.cli.launch.run_one``) until ``klrl.step.train.step_fn`` is first called (jit tracing the step).

A call's caller is the nearest klrl frame below it (library frames skipped); a module is *entered* when a
function of it is called from another module; a *climb* is an entry from a lower layer (the layers in
the order of the README's package map). One JSON object on stdout: ``modules_visited`` (and the list, in
the order first entered), ``rooms_passed`` (the modules that call into another one, the rest being leaves
that are only used), ``packages``, ``entries`` per module, ``api_entries``, ``climbs`` (and
``climb_pairs``), ``stack_at_step`` (the klrl frames when the step is traced)."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import pkgutil
import sys
from pathlib import Path
from typing import Any

# the layers bottom first (the README's map, tests/project/test_imports.py's table); klrl/checks.py: api's
ORDER = "registry config data algo models distributed io rewards tasks step analysis loop api cli".split()
ROOT = {"checks": "api"}
STARTS = {"main": ("klrl.cli.commands", "main"), "run_one": ("klrl.cli.launch", "run_one")}
STEP = ("klrl.step.train", "step_fn")


class _Reached(Exception):
    """The step is being traced: the walk is over."""


@functools.cache
def module_of(filename: str, root: Path) -> str | None:
    """The klrl module a code object's file is (None: not klrl's)."""
    try:
        rel = Path(filename).resolve().relative_to(root)
    except ValueError:
        return None
    parts = rel.with_suffix("").parts
    mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return mod if mod.startswith("klrl") else None


def layer(mod: str) -> int:
    """The layer index of ``mod`` (-1: the package root)."""
    parts = mod.split(".")
    name = ROOT.get(parts[1], parts[1]) if len(parts) > 1 else "klrl"
    return ORDER.index(name) if name in ORDER else -1


def _klrl_frames(frame: Any, root: Path) -> list[tuple[str, str]]:
    """(module, function) of the klrl frames from ``frame`` down the stack."""
    out = []
    while frame is not None:
        mod = module_of(frame.f_code.co_filename, root)
        if mod is not None:
            out.append((mod, frame.f_code.co_name))
        frame = frame.f_back
    return out


def trace(argv: list[str], start: str) -> tuple[list[tuple[str | None, str]], list[str]]:
    """Run ``klrl train argv`` traced: the (caller module, callee module) of every klrl call from
    ``start``'s entry to the step's tracing, and the klrl stack at that moment."""
    import klrl

    root = Path(klrl.__file__).resolve().parent.parent
    for info in pkgutil.walk_packages(klrl.__path__, "klrl."):
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional dependency (e.g. matplotlib): not on the walk either
            pass
    from klrl.cli import commands

    calls: list[tuple[str | None, str]] = []
    on, stack = [False], []

    def prof(frame: Any, event: str, arg: Any) -> None:
        mod = module_of(frame.f_code.co_filename, root) if event == "call" else None
        if mod is None or frame.f_code.co_name == "<module>":
            return
        on[0] = on[0] or (mod, frame.f_code.co_name) == STARTS[start]
        if not on[0]:
            return
        below = _klrl_frames(frame.f_back, root)
        calls.append((below[0][0] if below else None, mod))
        if (mod, frame.f_code.co_name) == STEP:
            sys.setprofile(None)
            stack[:] = [f"{m}:{f}" for m, f in _klrl_frames(frame, root)[::-1]]
            raise _Reached

    sys.setprofile(prof)
    try:
        commands.main(["train", *argv])
    except _Reached:
        pass
    finally:
        sys.setprofile(None)
    return calls, stack


def summary(calls: list[tuple[str | None, str]], stack: list[str], start: str) -> dict[str, Any]:
    """The walk's numbers (see the module docstring)."""
    visited = list(dict.fromkeys(m for _, m in calls))
    # the rooms passed through: modules that call into another module (the rest are leaves, only used)
    rooms = list(dict.fromkeys(c for c, m in calls if c is not None and c != m))
    entries: dict[str, int] = {}
    climbs: dict[str, int] = {}
    for caller, mod in calls:
        if caller == mod:
            continue
        entries[mod] = entries.get(mod, 0) + 1
        if caller is not None and layer(caller) >= 0 and layer(mod) > layer(caller):
            climbs[f"{caller} -> {mod}"] = climbs.get(f"{caller} -> {mod}", 0) + 1
    return {
        "start": start,
        "modules_visited": len(visited),
        "rooms_passed": len(rooms),
        "rooms": rooms,
        "packages": sorted({m.split(".")[1] if "." in m else "klrl" for m in visited}),
        "calls": len(calls),
        "api_entries": entries.get("klrl.api", 0),
        "climbs": sum(climbs.values()),
        "climb_pairs": climbs,
        "stack_at_step": stack,
        "modules": visited,
        "entries": dict(sorted(entries.items(), key=lambda kv: -kv[1])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", default="run_one", choices=sorted(STARTS))
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="klrl train's flags (after --)")
    a = ap.parse_args()
    calls, stack = trace([x for x in a.rest if x != "--"], a.start)
    if not stack:
        sys.exit("walk: the step was never traced (did the run start?)")
    print(json.dumps(summary(calls, stack, a.start)))


if __name__ == "__main__":
    main()
