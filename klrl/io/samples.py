"""``samples.jsonl``: sampled responses you can read, one JSON object per sample.

Each line: ``{"iteration", "prompt", "completion", "reward", "kl_seq_sum", "ref_logprob", ...}``
(``kl_seq_sum``: the sample's summed per-token KL estimate, nats per sequence; ``ref_logprob``:
the reference model's summed log-probability of the response, nats; extra per-sample fields
pass through). Non-finite numbers are written as the strings ``"nan"``/``"inf"`` (JSON has no
NaN), as in ``metrics.jsonl``. The file is appended to and flushed line by line, so a crash
loses at most a torn last line, which :func:`read_samples` skips.

Read back: :func:`samples` (``klrl.samples``: a run's or a sweep's samples as a pandas DataFrame,
a list of dicts without pandas) and :func:`report_lines` (the report's samples section: the first
and the last iteration side by side). The step's side (the rows it returns) is :mod:`klrl.step.samples`,
their decoding and the writing :mod:`klrl.loop.samples`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from klrl.io.readers import read_sweep_members


def _clean(v: Any) -> Any:
    if isinstance(v, np.generic | np.ndarray):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


class SamplesWriter:
    """Appends samples to ``<run_dir>/samples.jsonl``; at most ``max_per_iteration`` per call (0: all)."""

    def __init__(self, run_dir: str | os.PathLike, max_per_iteration: int = 0, name: str = "samples.jsonl"):
        self.path = Path(run_dir) / name
        self.max_per_iteration = max_per_iteration
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")

    def write(
        self,
        iteration: int,
        prompts: Sequence[Any],
        completions: Sequence[str],
        rewards: Sequence[float],
        kl_seq_sum: Sequence[float] | None = None,
        ref_logprob: Sequence[float] | None = None,
        **extra: Sequence[Any],
    ) -> int:
        """Append one line per sample; returns how many were written. Sequences must be equally long."""
        n = len(completions)
        cols = {
            "prompt": prompts,
            "completion": completions,
            "reward": rewards,
            "kl_seq_sum": kl_seq_sum,
            "ref_logprob": ref_logprob,
            **extra,
        }
        cols = {
            k: np.asarray(v).tolist() if isinstance(v, np.ndarray) else v
            for k, v in cols.items()
            if v is not None
        }
        for k, v in cols.items():
            if len(v) != n:
                raise ValueError(f"samples: {k} has {len(v)} values for {n} completions")
        k = n if self.max_per_iteration <= 0 else min(n, self.max_per_iteration)
        for i in range(k):
            row = {"iteration": int(iteration), **{c: _clean(v[i]) for c, v in cols.items()}}
            self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return k

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SamplesWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_samples(path: str | os.PathLike, iteration: int | None = None) -> list[dict[str, Any]]:
    """The lines of a ``samples.jsonl`` (of one ``iteration`` if given); a torn last line is skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if iteration is None or row.get("iteration") == iteration:
                rows.append(row)
    return rows


def trim_samples(path: str | os.PathLike, before: int, moved_to: str | os.PathLike | None = None) -> int:
    """Cut ``samples.jsonl`` back to its rows of iterations ``< before`` (the quality rollback's
    restored step), in place: rows are appended in iteration order, so the kept rows are a prefix and
    the file is truncated to it (a :class:`SamplesWriter` still open on it, in append mode, goes on
    writing at the new end). The dropped complete lines are appended to ``moved_to`` (if given) first,
    so nothing written is lost; a torn last line is dropped. Returns the number of rows moved."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = [x + b"\n" for x in path.read_bytes().split(b"\n")[:-1]]
    keep = 0
    for line in lines:
        try:
            it = int(json.loads(line).get("iteration", 0))
        except (ValueError, AttributeError):
            break
        if it >= before:
            break
        keep += 1
    dropped = lines[keep:]
    if moved_to is not None and dropped:
        with open(moved_to, "ab") as f:
            f.write(b"".join(dropped))
            f.flush()
            os.fsync(f.fileno())
    os.truncate(path, sum(map(len, lines[:keep])))
    return len(dropped)


# ---- reading back: the report's section and klrl.samples ----------------------------------------


def table_cell(s: str, width: int = 200) -> str:
    """``s`` on one line, ``|`` escaped, cut to ``width`` characters: a markdown table cell."""
    s = " ".join(str(s).split()).replace("|", "\\|")
    return s if len(s) <= width else s[: width - 1] + "…"


def side_by_side(rows: list[dict[str, Any]], n: int = 4) -> list[str]:
    """Markdown lines: the first and the last iteration's samples of one run, side by side (sample
    ``i`` of each; the prompts differ: each iteration draws its own). [] without samples."""
    if not rows:
        return []
    its = sorted({int(r["iteration"]) for r in rows})
    first = [r for r in rows if r["iteration"] == its[0]][:n]
    last = [r for r in rows if r["iteration"] == its[-1]][:n]

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return ""
        return (
            f"**{table_cell(r['prompt'], 120)}** → {table_cell(r['completion'], 160)} "
            f"(reward {float(r['reward']):.3g}, KL {float(r['kl_seq_sum']):.3g})"
        )

    head = f"| # | iteration {its[0]} | iteration {its[-1]} |"
    out = [head, "|---|---|---|"]
    for i in range(max(len(first), len(last))):
        out.append(
            f"| {i} | {cell(first[i] if i < len(first) else None)} | "
            f"{cell(last[i] if i < len(last) else None)} |"
        )
    out += [
        "",
        "Each cell: **prompt** → completion (task reward; KL = the sample's summed k1 estimate, "
        "nats/sequence, the per-sample term of `kl/k1_seq_sum`).",
    ]
    return out


def report_lines(run_dir: Path | None, title: str = "## Samples") -> list[str]:
    """The report's samples section for one run directory ([] without samples.jsonl)."""
    if run_dir is None or not (Path(run_dir) / "samples.jsonl").is_file():
        return []
    body = side_by_side(read_samples(Path(run_dir) / "samples.jsonl"))
    return [title, "", *body, ""] if body else []


def _run_dirs(source: Any) -> list[tuple[str, Path]]:
    """(member name, directory) of a run directory, a sweep directory, a RunResult or a list of them."""
    if isinstance(source, list | tuple):
        out = []
        for r in source:
            out += _run_dirs(r)
        return out
    d = getattr(source, "dir", source)
    if d is None:
        raise ValueError("samples: this result has no run directory (write=False)")
    d = Path(d)
    if (d / "sweep.json").is_file():
        return [(n, d / n) for n in read_sweep_members(d)]
    return [(d.name, d)]


def samples(source: Any, iteration: int | None = None, *, frame: bool = True) -> Any:
    """The samples of a run or sweep (a directory, a :class:`~klrl.analysis.results.RunResult` or a sweep's
    results): a pandas DataFrame with one row per sample (columns ``member``, ``iteration``,
    ``prompt``, ``completion``, ``reward``, ``kl_seq_sum``, ...) or, with ``frame=False``, a list of
    dicts; without pandas (``pip install 'klrl[viz]'``) the list, with a warning that says so.
    ``iteration``: only that iteration's."""
    rows = []
    for name, d in _run_dirs(source):
        path = d / "samples.jsonl"
        if path.is_file():
            rows += [{"member": name, **r} for r in read_samples(path, iteration)]
    if not frame:
        return rows
    try:
        import pandas as pd
    except ImportError:
        warnings.warn(
            "klrl.samples: pandas is not installed (pip install 'klrl[viz]'), so this is a list "
            "of dicts, not a DataFrame (frame=False asks for the list)",
            stacklevel=2,
        )
        return rows
    return pd.DataFrame(rows)
