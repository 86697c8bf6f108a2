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
``climb_pairs``), ``stack_at_step`` (the klrl frames when the step is traced), ``stack_at_make`` (when
the step is made: the first call of ``klrl.step.parallel.shard_step``), ``spine`` (the modules of those
two stacks: the hallway from the start to the step, as opposed to the work done on the way) and
``reentered`` (per module, the calls at which it was on the klrl stack twice with another module between:
a room entered a second time before the walk left it, e.g. a callback into a caller). The listeners JAX
calls on every compile (``jax.monitoring``: klrl.loop.compile counts cache hits and compile seconds) are
left out: JAX calls them from wherever a compile happens, no klrl module calls them."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import pkgutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

# the layers bottom first (the README's map, tests/project/test_imports.py's table); klrl/checks.py: api's
ORDER = "registry config data algo models distributed io rewards tasks step analysis loop api cli".split()
ROOT = {"checks": "api"}
STARTS = {"main": ("klrl.cli.commands", "main"), "run_one": ("klrl.cli.launch", "run_one")}
STEP = ("klrl.step.train", "step_fn")
MAKE = ("klrl.step.parallel", "shard_step")
MONITORING = "jax/_src/monitoring.py"  # JAX's listener registry (klrl.loop.compile's compile statistics)


class Walk(NamedTuple):
    """What :func:`trace` saw: the (caller module, callee module) of every klrl call, the klrl stack when
    the step was made and when it was traced (``module:function``, outermost first), and per module the
    calls at which it was on the stack twice with another module between."""

    calls: list[tuple[str | None, str]]
    stack: list[str]
    make_stack: list[str]
    reentered: dict[str, int]


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


def trace(argv: list[str], start: str) -> Walk:
    """Run ``klrl train argv`` traced from ``start``'s entry to the step's tracing (:class:`Walk`)."""
    import klrl

    root = Path(klrl.__file__).resolve().parent.parent
    for info in pkgutil.walk_packages(klrl.__path__, "klrl."):
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional dependency (e.g. matplotlib): not on the walk either
            pass
    from klrl.cli import commands

    w = Walk([], [], [], {})
    on = [False]

    def prof(frame: Any, event: str, arg: Any) -> None:
        mod = module_of(frame.f_code.co_filename, root) if event == "call" else None
        if mod is None or frame.f_code.co_name == "<module>":
            return
        if frame.f_back is not None and frame.f_back.f_code.co_filename.endswith(MONITORING):
            return  # a JAX monitoring listener: JAX calls it whenever anything compiles, no klrl module does
        on[0] = on[0] or (mod, frame.f_code.co_name) == STARTS[start]
        if not on[0]:
            return
        frames = _from_start(_klrl_frames(frame, root), start)
        w.calls.append((frames[1][0] if len(frames) > 1 else None, mod))
        if len(frames) > 1 and frames[1][0] != mod:  # an entry: is a room on the stack twice?
            for m in _twice([m for m, _ in frames]):
                w.reentered[m] = w.reentered.get(m, 0) + 1
        here = [f"{m}:{f}" for m, f in frames[::-1]]
        if (mod, frame.f_code.co_name) == MAKE and not w.make_stack:
            w.make_stack[:] = here
        if (mod, frame.f_code.co_name) == STEP:
            sys.setprofile(None)
            w.stack[:] = here
            raise _Reached

    sys.setprofile(prof)
    try:
        commands.main(["train", *argv])
    except _Reached:
        pass
    finally:
        sys.setprofile(None)
    return w


def _from_start(frames: list[tuple[str, str]], start: str) -> list[tuple[str, str]]:
    """The klrl frames (innermost first) down to ``start``'s frame (the ones below it are not the walk's)."""
    for i in range(len(frames) - 1, -1, -1):
        if frames[i] == STARTS[start]:
            return frames[: i + 1]
    return frames


def _twice(mods: list[str]) -> list[str]:
    """The modules that appear in two separate runs of ``mods`` (A, B, A: A entered again from B)."""
    runs = [m for i, m in enumerate(mods) if i == 0 or mods[i - 1] != m]
    return sorted({m for m in runs if runs.count(m) > 1})


def summary(w: Walk, start: str) -> dict[str, Any]:
    """The walk's numbers (see the module docstring)."""
    calls = w.calls
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
        "stack_at_step": w.stack,
        "stack_at_make": w.make_stack,
        "spine": list(dict.fromkeys(f.split(":")[0] for f in [*w.make_stack, *w.stack])),
        "reentered": dict(sorted(w.reentered.items(), key=lambda kv: -kv[1])),
        "modules": visited,
        "entries": dict(sorted(entries.items(), key=lambda kv: -kv[1])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", default="run_one", choices=sorted(STARTS))
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="klrl train's flags (after --)")
    a = ap.parse_args()
    w = trace([x for x in a.rest if x != "--"], a.start)
    if not w.stack:
        sys.exit("walk: the step was never traced (did the run start?)")
    print(json.dumps(summary(w, a.start)))


if __name__ == "__main__":
    main()
