"""The run directory side of :func:`klrl.loop.driver.drive`: what it creates, cuts back and writes at the end.

A single run keeps everything in its run directory; a sweep keeps ``sweep.json``, ``task.json`` and
``checkpoints/`` in the sweep directory and one directory (config, metrics, events, summary) per
member. Only process 0 writes (klrl.distributed); every process reads the same lines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

from klrl.config import RunConfig
from klrl.io import checkpoint as ckpt
from klrl.io import readers
from klrl.io.results import RunResult, columns, member_names, sweep_axes
from klrl.io.resume import Resume, complete_lines, replace_file

ROLLED_BACK = "metrics.rolled_back.jsonl"
SAMPLES_ROLLED_BACK = "samples.rolled_back.jsonl"


def member_dirs(root: Path, cfgs: list[RunConfig], stacked: bool, existing: bool = False) -> list[Path]:
    """A run's directory, or a sweep's member directories: after the swept values
    (:func:`klrl.io.results.member_names`) for a new sweep, those ``sweep.json`` lists for an
    ``existing`` one (older sweeps: ``member-XX``)."""
    if not stacked:
        return [root]
    names = readers.read_sweep_members(root) if existing else member_names(cfgs)
    if len(names) != len(cfgs):
        raise ckpt.CheckpointError(f"{root}/sweep.json lists {len(names)} members, the sweep has {len(cfgs)}")
    return [root / n for n in names]


def create_dirs(root: Path, cfgs: list[RunConfig], stacked: bool, task_info: dict[str, Any]) -> None:
    """A new run's (or sweep's) files: ``task.json``, ``config.json`` per member, ``sweep.json`` (a
    sweep; process 0 only; the metrics files are the sink's, :class:`klrl.loop.hooks.MetricsSink`).
    Each JSON file is written atomically and the directory's marker (``config.json`` of a run,
    ``sweep.json`` of a sweep) after the others, so a directory a resume recognises holds them all
    whole, whenever the process was killed (a missing ``metrics.jsonl`` is an empty one)."""
    dirs = member_dirs(root, cfgs, stacked)
    for d in dirs:
        d.mkdir(exist_ok=True)
    replace_file(root / "task.json", json.dumps(task_info, indent=1, default=str).encode())
    for j, d in enumerate(dirs):
        replace_file(d / "config.json", json.dumps(cfgs[j].to_dict(), indent=1).encode())
    if stacked:
        index = {"members": [d.name for d in dirs], "axes": sweep_axes(cfgs)}
        replace_file(root / "sweep.json", json.dumps(index, indent=1, default=str).encode())


def cut_to_checkpoint(
    resume: Resume,
    n_lines: int,
    cfgs: list[RunConfig],
    dirs: list[Path],
    alias_names: set[str],
    main: bool,
) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """A valid resume's files cut back to its checkpoint (``n_lines`` metrics rows), atomically:
    metrics and samples of the iterations after it dropped, ``config.json`` rewritten (process 0);
    returns every member's rows (aliases left out) and each member's resume message (process 0; none
    on the others: the sink writes them to the event files, the first is the log's)."""
    rows: list[list[dict[str, Any]]] = []
    msgs: list[str] = []
    for j, d in enumerate(dirs):
        lines = complete_lines(d / "metrics.jsonl")
        kept_rows = [json.loads(line) for line in lines[:n_lines]]
        rows.append([{k: v for k, v in r.items() if k not in alias_names} for r in kept_rows])
        if main:
            path = d / "metrics.jsonl"  # (a directory killed before its first row may have none)
            if len(lines) != n_lines or not path.is_file() or path.stat().st_size != sum(map(len, lines)):
                replace_file(d / "metrics.jsonl", b"".join(lines[:n_lines]))
            replace_file(d / "config.json", json.dumps(cfgs[j].to_dict(), indent=1).encode())
            if (d / "samples.jsonl").is_file():  # samples of iterations after the checkpoint: rewritten
                kept = [
                    x
                    for x in complete_lines(d / "samples.jsonl")
                    if json.loads(x).get("iteration", 0) < n_lines
                ]
                replace_file(d / "samples.jsonl", b"".join(kept))
            dropped = len(lines) - n_lines
            m = f"resumed from checkpoint {resume.step} ({dropped} metrics lines after it dropped)"
            if resume.fresh and dropped:  # killed before its first checkpoint was committed
                m = (
                    f"resumed from checkpoint 0, the initial state (no complete checkpoint; {dropped} "
                    "metrics lines dropped, recomputed)"
                )
            m += resume.note()  # step directories skipped (no finished save in them)
            msgs.append(m)
    return rows, msgs


def rollback_bases(meta: dict[str, Any], metric: str, traces: list[list[float]]) -> list[float | None]:
    """Each member's rollback reference (the metric at iteration 0) as a resumed checkpoint saved it
    (``rollback_base``: ``metric`` with its ``value`` or per-member ``values``, the other guarded
    metrics' per-member values in ``others``), or its first row's value (a checkpoint that did not guard
    ``metric``, or of an older version)."""
    saved = meta.get("rollback_base") or {}
    if saved.get("metric") == metric:
        values = saved.get("values", [saved.get("value")])
    else:
        values = (saved.get("others") or {}).get(metric)
    bases: list[float | None] = []
    for j, trace in enumerate(traces):
        ok = values is not None and j < len(values)
        bases.append(values[j] if ok else (trace[0] if trace else None))
    return bases


def move_rolled_back(dirs: list[Path | None], target: int, main: bool) -> None:
    """A rollback to ``target``: the metrics rows after it move to ``metrics.rolled_back.jsonl``
    (appended, never lost; the samples of those iterations are :class:`klrl.loop.samples.Samples`')."""
    if not main:
        return
    for d in dirs:
        if d is None:
            continue
        path = d / "metrics.jsonl"
        lines = complete_lines(path)
        with open(d / ROLLED_BACK, "ab") as f:
            f.write(b"".join(lines[target:]))
            f.flush()
            os.fsync(f.fileno())
        os.truncate(path, sum(map(len, lines[:target])))  # the writer appends (O_APPEND) from here


def results(
    cfgs: list[RunConfig],
    dirs: list[Path | None],
    rows: list[list[dict[str, Any]]],
    state: Any,
    stacked: bool,
    info: dict[str, Any],
    write: bool,
) -> list[RunResult]:
    """One :class:`RunResult` per member (its slice of a stacked state); with ``write`` (process 0 of a
    run that writes) each member's ``summary.json``."""
    out = []
    for j, c in enumerate(cfgs):
        member_state = jax.tree.map(lambda x, j=j: x[j], state) if stacked else state
        r = RunResult(c, dirs[j], columns(rows[j]), member_state, dict(info))
        if write:
            (dirs[j] / "summary.json").write_text(json.dumps(r.summary(), indent=1))
        out.append(r)
    return out
