"""``samples.jsonl``: sampled responses you can read, one JSON object per sample.

Each line: ``{"iteration", "prompt", "completion", "reward", "kl_seq_sum", "ref_logprob", ...}``
(``kl_seq_sum``: the sample's summed per-token KL estimate, nats per sequence; ``ref_logprob``:
the reference model's summed log-probability of the response, nats; extra per-sample fields
pass through). Non-finite numbers are written as the strings ``"nan"``/``"inf"`` (JSON has no
NaN), as in ``metrics.jsonl``. The file is appended to and flushed line by line, so a crash
loses at most a torn last line, which :func:`read_samples` skips.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


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
