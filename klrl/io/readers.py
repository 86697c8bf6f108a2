"""Readers of a run directory's files that fail in one way: :class:`RunDirError` naming the file.

A run directory may be damaged by a user or a disk: a ``config.json`` that is not an object, nested
past Python's recursion limit, or not UTF-8; a ``metrics.jsonl`` with a garbage or binary line, or a
directory in its place. Every such case raises :class:`RunDirError` (a ``ValueError``) with a one-line
message naming the path, and nothing is written. A torn last line of a ``.jsonl`` file (a crash
mid-write: no final newline) is the one damage that is tolerated: it is left out.

:func:`config_diff`: the fields two configs read back differ in (the resume check, the report's
sweep tables).
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import zlib
from pathlib import Path
from typing import Any

from klrl.config import ConfigError, RunConfig
from klrl.config.schema import short

_NONFINITE = ("nan", "inf", "-inf")  # what klrl.io.logging writes for non-finite metrics
MAX_JSON_BYTES = 64 << 20  # a config or index file larger than this is not one klrl wrote


class RunDirError(ValueError):
    """A run directory's file is missing, unreadable or damaged. The message names the file."""


class NotARunDirError(RunDirError, FileNotFoundError):
    """The path is not a klrl run or sweep directory at all (also a ``FileNotFoundError``)."""


def _is_anonymous_pipe(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a shell's anonymous pipe (``<(...)``: ``/dev/fd/N`` -> ``pipe:[...]``), whose
    writer is running; a named pipe (``mkfifo``) may have none, and opening it would wait forever."""
    return os.path.basename(os.path.realpath(path)).startswith("pipe:[")


def special_kind(path: str | os.PathLike, pipes: bool = False) -> str | None:
    """What ``path`` is when it is neither a regular file nor a directory (nor, with ``pipes``, a
    shell's anonymous pipe): ``'a named pipe (FIFO)'``, ``'a socket'``, ``'a device'``; None otherwise
    (also when it does not exist). Checked with ``stat``, before anything opens it (opening a FIFO
    with no writer waits forever, reading ``/dev/zero`` never ends)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return None if pipes and _is_anonymous_pipe(path) else "a named pipe (FIFO)"
    return "a socket" if stat.S_ISSOCK(mode) else "a device"


def _read_bytes(path: Path, limit: int | None = None) -> bytes:
    """The bytes of ``path``: a regular file, or a shell's anonymous pipe (``--config <(...)``) when
    there is a ``limit``; a device (``/dev/zero``), named pipe, socket or directory is refused before
    it is opened. At most ``limit + 1`` bytes are read: ``stat``'s size is not trusted (a device or a
    pipe has none, a file may grow)."""
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            kind = special_kind(path, pipes=limit is not None)
            if kind is not None:
                raise RunDirError(f"{path}: not a regular file ({kind})")
        with path.open("rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise RunDirError(f"{path}: more than {limit} bytes, too large for a klrl file")
        return data
    except IsADirectoryError:
        raise RunDirError(f"{path}: is a directory, expected a file") from None
    except FileNotFoundError:
        raise RunDirError(f"{path}: no such file") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None


class _Pairs(dict):
    """A JSON object that had a key twice: ``dups`` names them (:func:`_loads` refuses it)."""

    dups: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook``: a dict, marked when a key appears twice (``json`` keeps the
    later value without a word)."""
    d = _Pairs(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        d.dups = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return d


def duplicate_key(value: Any, path: str = "") -> str | None:
    """The dotted path of the first key given twice in a JSON value read by :func:`_loads`
    (``kl.beta``), None when there is none."""
    if isinstance(value, dict):
        if getattr(value, "dups", ()):
            return f"{path}.{value.dups[0]}".lstrip(".")
        items = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for k, v in items:
        if isinstance(v, dict | list) and (found := duplicate_key(v, f"{path}.{k}" if path else str(k))):
            return found
    return None


def _loads(text: str, where: str) -> Any:
    """The JSON value of ``text``; a key given twice in one object is refused (a silent last-wins
    would drop the earlier value), naming its dotted path."""
    try:
        value = json.loads(text, object_pairs_hook=_object)
        dup = duplicate_key(value)
        if dup is not None:
            raise RunDirError(
                f"{where}: duplicate key {dup!r} (a key may appear once; the later value "
                "would silently replace the earlier)"
            )
        return value
    except json.JSONDecodeError as e:
        raise RunDirError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise RunDirError(f"{where}: JSON nested too deeply") from None


def _text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunDirError(f"{where}: not UTF-8 text (byte {e.start})") from None


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of a small file (a config)."""
    p = Path(path)
    return _text(_read_bytes(p, MAX_JSON_BYTES), str(p))


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in ``path``."""
    p = Path(path)
    return _loads(_text(_read_bytes(p, MAX_JSON_BYTES), str(p)), str(p))


def read_task_info(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """A run (or sweep) directory's ``task.json`` (None: none, a directory older than it); a damaged
    one raises :class:`RunDirError` naming the file."""
    p = Path(run_dir) / "task.json"
    if not (p.exists() or p.is_symlink()):
        return None
    info = read_json(p)
    if not isinstance(info, dict):
        raise RunDirError(f"{p}: not a JSON object (a klrl task.json is one)")
    return info


def read_config(path: str | os.PathLike) -> RunConfig:
    """The :class:`RunConfig` in a ``config.json``."""
    p = Path(path)
    d = read_json(p)
    try:
        return RunConfig.from_dict(d)
    except ConfigError as e:
        raise RunDirError(f"{p}: not a valid klrl config: {e}") from None
    except RecursionError:
        raise RunDirError(f"{p}: not a valid klrl config: nested too deeply") from None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The objects of a ``.jsonl`` file, one per line; a torn last line (no final newline) that does
    not parse is left out, any other line that is not a JSON object raises :class:`RunDirError`."""
    p = Path(path)
    data = _read_bytes(p)
    if p.suffix == ".gz":  # stored results are gzipped (experiments/results/*/member-*/metrics.jsonl.gz)
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise RunDirError(f"{p}: not a valid gzip file ({e})") from None
    lines = data.split(b"\n")
    rows = []
    for n, line in enumerate(lines, 1):
        torn = n == len(lines)  # after the last newline: empty, or a line cut mid-write
        if torn and not line:
            break
        where = f"{p} line {n}"
        try:
            row = _loads(_text(line, where), where)
        except RunDirError:
            if torn:
                break
            raise
        if not isinstance(row, dict):
            if torn:
                break
            raise RunDirError(f"{where}: expected a JSON object, got {short(row)}")
        rows.append(row)
    return rows


def _number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return True
    return isinstance(v, str) and v in _NONFINITE


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``: :func:`read_jsonl`, each row ``{"iteration": int, name:
    number or "nan"/"inf"/"-inf"}``."""
    rows = read_jsonl(path)
    for n, row in enumerate(rows, 1):
        it = row.get("iteration")
        if isinstance(it, bool) or not isinstance(it, int):
            raise RunDirError(f"{path} line {n}: no integer 'iteration' (got {short(it)})")
        for k, v in row.items():
            if not _number(v):
                raise RunDirError(f"{path} line {n}: metric {short(k)} is not a number (got {short(v)})")
    return rows


def is_dir(path: str | os.PathLike) -> bool:
    """``Path.is_dir`` that is False where the path cannot be looked up at all (a name too long)."""
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def what_is(path: Path) -> str:
    """What ``path`` is, for a message where a directory was expected: ``a file``, ``a broken
    symbolic link``, ``a named pipe (FIFO)``, the lookup's error (``Too many levels of symbolic links``,
    ``File name too long``), ..., ``no such directory``."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else "no such directory"
    except OSError as e:
        return e.strerror or type(e).__name__
    if path.is_file():
        return "a file, not a directory; pass the run directory that holds config.json"
    return special_kind(path) or "not a directory"


def read_run(run_dir: str | os.PathLike) -> tuple[RunConfig, list[dict[str, Any]]]:
    """A run directory's config and metrics rows (no metrics file: no rows)."""
    d = Path(run_dir)
    if not is_dir(d):
        raise NotARunDirError(f"{d}: not a klrl run directory ({what_is(d)})")
    if not ((d / "config.json").exists() or (d / "config.json").is_symlink()):
        raise NotARunDirError(f"{d}: not a klrl run directory (no config.json)")
    cfg = read_config(d / "config.json")
    m = d / "metrics.jsonl"
    if not (m.exists() or m.is_symlink()) and (d / "metrics.jsonl.gz").exists():
        m = d / "metrics.jsonl.gz"
    rows = read_metrics(m) if (m.exists() or m.is_symlink()) else []
    return cfg, rows


def read_sweep_members(sweep_dir: str | os.PathLike) -> list[str]:
    """The member directory names of a sweep: ``sweep.json``'s ``members``, else ``member-XX/``."""
    d = Path(sweep_dir)
    index = d / "sweep.json"
    if index.exists():
        doc = read_json(index)
        members = doc.get("members") if isinstance(doc, dict) else None
        ok = isinstance(members, list) and all(isinstance(m, str) for m in members)
        if not ok or any(m in ("", ".", "..") or "/" in m or "\\" in m for m in members):
            raise RunDirError(f"{index}: expected {{'members': [directory names]}}, got {short(doc)}")
        return list(members)
    names = sorted(p.name for p in d.glob("member-*") if (p / "config.json").is_file())
    if not names:
        raise NotARunDirError(f"{d}: not a klrl sweep directory (no sweep.json or member-XX/config.json)")
    return names


# fields a resume may change: none of them changes the model, the batch or the maths of an iteration
RESUME_MUTABLE = frozenset(
    {
        "train.iterations",
        "train.quiet",
        "train.log_every",
        "train.samples_every",
        "train.samples_n",
        "train.out_dir",
        "train.name",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.max_consecutive_skips",
        "train.rollback_metric",
        "train.rollback_threshold",
        "train.rollback_guards",
        "train.rollback_factor",
        "train.max_rollbacks",
        "reward.timeout",  # how long a hung reward call is waited for, not what a call computes
    }
)


def config_diff(a: RunConfig | dict[str, Any], b: RunConfig | dict[str, Any]) -> list[str]:
    """Dotted names of the fields that differ between two configs (or their ``to_dict()``)."""
    da = a.to_dict() if isinstance(a, RunConfig) else a
    db = b.to_dict() if isinstance(b, RunConfig) else b
    out = []
    for sec in sorted(set(da) | set(db)):
        fa, fb = da.get(sec) or {}, db.get(sec) or {}
        out += [f"{sec}.{k}" for k in sorted(set(fa) | set(fb)) if fa.get(k, ...) != fb.get(k, ...)]
    return out
