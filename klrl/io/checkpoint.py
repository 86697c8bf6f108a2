"""Checkpoints with orbax: the whole train state plus a JSON record of the run.

Layout: ``<run_dir>/checkpoints/<step>/{state,meta}``, ``<step>`` = the number of
iterations done (``state.iteration``). orbax writes each step to a temporary
directory (``<step>.orbax-checkpoint-tmp-*``) and renames it when complete, so a
half-written checkpoint is never listed: :func:`latest_step` only sees finalized
steps. A directory named after a step that holds no finished save (empty, foreign files, a copy
cut short: :func:`is_finished`) is not a checkpoint either: it is skipped, and moved aside to
``<step>.incomplete`` (:func:`set_aside`) before a resumed run writes that step. Saves are
asynchronous (the state is copied to host memory first, so the donated device buffers can be reused
at once); the last ``keep`` steps are kept.

``meta`` holds the run config, the klrl version, the iteration, the number of
``metrics.jsonl`` lines written up to that state, the rollback count and, for every array of the
state, its dtype, shape and a 128-bit digest of its values (``arrays``: ``{leaf path: [dtype,
shape, hex]}``, :func:`klrl.io.digest.digests`), verified after every restore: bit rot in a data
file is refused, not trained on. (Checkpoints of earlier versions hold a SHA-256 per array
instead, ``checksum``, still verified.)

Sharded state: :func:`save` hands orbax the arrays as they are, so every process writes the shards
it holds (no gather; orbax copies them to host memory before it returns, so the next step may
donate the buffers), and :func:`restore` reads a checkpoint onto any target sharding (a pytree of
``jax.ShapeDtypeStruct`` with ``.sharding``, or ``shardings=``), e.g. a state saved from 8
devices restored onto 4 or onto 1: each process reads only the parts of its own shards.

Why the digest is not a SHA-256 per array: :mod:`klrl.io.digest`.

Damaged checkpoints end in :class:`CheckpointError` and nothing else: orbax runs its reads in a
fresh asyncio loop and, when one read fails, closes that loop while the others are still in
flight, whose completions then print ``RuntimeError: Event loop is closed`` tracebacks; the
loop is drained before it is closed (:func:`_drain_on_error`), and orbax's own ERROR log lines,
which repeat an error the caller gets as an exception, are dropped (:class:`_OrbaxErrors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from klrl import distributed
from klrl.io.digest import DIGEST, digests, leaf_name

SUBDIR = "checkpoints"


@functools.cache
def version() -> str:
    """The running klrl's version, recorded in every checkpoint: the installed distribution's (what
    ``pyproject.toml`` declares, as ``klrl.__version__``), read from its metadata so that this layer
    does not import the package root; ``0+unknown`` for a source tree that was never installed."""
    try:
        return importlib.metadata.version("klrl")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, corrupt or incompatible."""


class DiskFull(CheckpointError):
    """A write to the run directory failed: no space left on its device (ENOSPC)."""


# ---- orbax's error path, quiet ------------------------------------------------------------------


def _drain_on_error(coro):
    """orbax's ``_run_sync_via_new_loop``, but on an error the loop's remaining tasks are awaited
    (30 s at most) before it is closed, so no tensorstore completion lands on a closed loop."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    except BaseException:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if pending:
            with contextlib.suppress(BaseException):
                loop.run_until_complete(asyncio.wait(pending, timeout=30))
        raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _install_drain() -> None:
    try:
        from orbax.checkpoint._src import asyncio_utils
    except ImportError:  # another orbax layout: nothing to patch
        return
    if hasattr(asyncio_utils, "_run_sync_via_new_loop"):
        asyncio_utils._run_sync_via_new_loop = _drain_on_error


class _OrbaxErrors(logging.Filter):
    """Drops orbax's ERROR records (absl logger): each repeats an exception the caller receives."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


class _UnretrievedWriteErrors(logging.Filter):
    """Drops asyncio's ``Task exception was never retrieved`` records of a failed save's writes: orbax
    writes each array in a task of its own; when the disk fills, every pending write fails and those
    whose error no one awaited are logged by asyncio's default handler at garbage collection, one
    traceback each (241 lines in issue 52). The save's first error reaches the caller (a
    :class:`DiskFull`, one line), so these repeat it: dropped when the error is a full disk or
    tensorstore's ``RESOURCE_EXHAUSTED``, or the task ran orbax's code."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(
            ("Task exception was never retrieved", "Future exception was never retrieved")
        ):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        if is_disk_full(exc) or "RESOURCE_EXHAUSTED" in str(exc):
            return False
        tb = exc.__traceback__
        while tb is not None:
            if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


def _install_quiet_errors() -> None:
    log = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxErrors) for f in log.filters):
        log.addFilter(_OrbaxErrors())
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _UnretrievedWriteErrors) for f in log.filters):
        log.addFilter(_UnretrievedWriteErrors())


_install_drain()
_install_quiet_errors()


# ---- disk full ----------------------------------------------------------------------------------


def is_disk_full(e: BaseException | None) -> bool:
    """``e`` or an exception in its chain is ENOSPC (an ``OSError``, or tensorstore's message)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == 28:  # errno.ENOSPC
            return True
        msg = str(e)
        if "No space left on device" in msg or "os_error_code='28'" in msg:
            return True
        e = e.__cause__ or e.__context__
    return False


def failed_file(e: BaseException | None) -> str | None:
    """The file named by the first ``OSError`` with a ``filename`` in ``e``'s chain, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
        e = e.__cause__ or e.__context__
    return None


# ---- which step directories are checkpoints -----------------------------------------------------

INCOMPLETE = ".incomplete"  # the suffix a step directory that is no checkpoint is moved aside to


def is_finished(step_dir: str | Path) -> bool:
    """``step_dir`` holds a save that orbax completed: its commit record (``commit_success.txt``, or
    ``_CHECKPOINT_METADATA`` with a ``commit_timestamp_nsecs``, both written before the temporary
    directory is renamed to the step's name) and the ``state`` and ``meta`` items. An empty step
    directory, one holding something else, or a half-copied save has none of them; a finished save
    whose files were damaged later is finished, and refused when read (never skipped)."""
    p = Path(step_dir)
    if not ((p / "state").is_dir() and (p / "meta").is_dir()):
        return False
    if (p / "commit_success.txt").is_file():
        return True
    try:
        record = json.loads((p / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("commit_timestamp_nsecs") is not None


def _step_dirs(path: Path) -> list[Path]:
    """The entries of ``path`` named after a step (a file of that name too: it would block the step)."""
    if not path.is_dir():
        return []
    return sorted((p for p in path.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def complete_steps(run_dir: str | Path) -> list[int]:
    """The finished checkpoint steps on disk (:func:`is_finished`), oldest first."""
    return [int(p.name) for p in _step_dirs(directory(run_dir)) if is_finished(p)]


def incomplete_steps(run_dir: str | Path) -> list[int]:
    """The step directories (named after a step) that hold no finished save (:func:`is_finished`),
    e.g. one a user or a tool created, or a copy cut short: never restored, they are moved aside
    (:func:`set_aside`) before a run writes that step again."""
    return [int(p.name) for p in _step_dirs(directory(run_dir)) if not is_finished(p)]


def set_aside(run_dir: str | Path, steps: list[int]) -> list[str]:
    """Rename the step directories ``steps`` to ``<step>.incomplete`` (``-2``, ``-3``, ... when taken),
    a name orbax does not list as a step, so the run can write those steps again; nothing is deleted.
    Returns the new names (relative to the run directory)."""
    out = []
    for s in steps:
        src = directory(run_dir) / str(int(s))
        dst, n = src.with_name(f"{s}{INCOMPLETE}"), 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{s}{INCOMPLETE}-{n}")
        src.rename(dst)
        out.append(f"{SUBDIR}/{dst.name}")
    return out


def remove_partial(run_dir: str | Path) -> list[str]:
    """Remove the temporary directories of saves that never finished (``<step>.orbax-checkpoint-tmp*``:
    a save cut short by a full disk; never listed as a checkpoint) from ``run_dir``'s checkpoints, freeing
    their space; returns their names. Called once no save is pending (the run is ending)."""
    removed = []
    for p in sorted(directory(run_dir).glob("*.orbax-checkpoint-tmp*")):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed


def disk_full_error(run_dir: str | Path, cause: BaseException | None = None) -> DiskFull:
    """The one-line :class:`DiskFull` for ``run_dir``, naming the file that could not be written (when
    ``cause``'s chain names it) and the last complete checkpoint."""
    d = Path(run_dir).absolute()
    remove_partial(d)
    done = complete_steps(d)
    last = (
        f"the last complete checkpoint, {done[-1]}, is intact: free space or copy {d} to another disk "
        "and continue it with --resume"
        if done
        else "no checkpoint was completed: free space or give another --train.out_dir"
    )
    file = failed_file(cause)
    where = f" writing {file}" if file else ""
    return DiskFull(f"{d}: disk full (no space left on device){where}; {last}")


def state_bytes(abstract: Any) -> dict[str, int]:
    """The bytes of ``abstract``'s arrays (shapes and dtypes: arrays or ``ShapeDtypeStruct``) by the
    state's top-level field (``params``, ``ref_params``, ``opt_state``, ...), largest first."""
    out: dict[str, int] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        if x is None or not hasattr(x, "shape"):
            continue
        key = path[0] if path else None
        name = str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", "state"))))
        out[name] = out.get(name, 0) + int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def plan_line(abstract: Any, keep: int, every: int, run_dir: str | Path) -> str:
    """The line a writing run logs at its start: where its checkpoints go, when, how many are kept and
    about how big each is (the whole train state, :func:`state_bytes`: an upper bound, orbax's files
    compress a little, e.g. 1.84 GB on disk for SmolLM2-135M's 2.15 GB), the largest parts named."""
    sizes = state_bytes(abstract)
    total = sum(sizes.values())
    parts = ", ".join(f"{k} {_gb(v)}" for k, v in list(sizes.items())[:4] if v >= 0.05 * total)
    when = f"every {every} iterations and at the end" if every > 0 else "at the end (and at a stop)"
    return (
        f"checkpoints: {when}, the newest {keep} kept (train.keep_checkpoints), each {_gb(total)} of "
        f"arrays ({parts}; up to {_gb(keep * total)} on disk) in {directory(run_dir)}"
    )


def finish(mgr: ocp.CheckpointManager) -> None:
    """Wait for the pending save and close ``mgr``; on an exception's way out (``finally``), an error
    here is dropped, so the first error is the one reported."""
    unwinding = sys.exc_info()[1] is not None
    try:
        mgr.wait_until_finished()
    except Exception:
        if not unwinding:
            raise
    finally:
        with contextlib.suppress(Exception):
            mgr.close()


def directory(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / SUBDIR


def manager(
    run_dir: str | Path, keep: int = 3, async_save: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
    """The run's checkpoint manager. ``read_only`` touches nothing on disk (and needs the directory)."""
    path = directory(run_dir)
    if read_only and not path.is_dir():
        raise CheckpointError(f"no checkpoint directory {path}")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        enable_async_checkpointing=async_save,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,  # leftovers of a killed save
    )
    if not read_only:
        return ocp.CheckpointManager(path, options=options)
    with _quiet_absl():  # orbax warns that a read-only manager is read-only
        return ocp.CheckpointManager(path, options=options)


@contextlib.contextmanager
def _quiet_absl():
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


def host_copy(state: Any) -> Any:
    """NumPy copies of every leaf (the full value on every process): safe from buffer donation."""
    return jax.tree.map(lambda x: np.array(x, copy=True), distributed.to_host(state))


def check_arrays(state: Any, expected: dict[str, list], where: str) -> None:
    """Raise :class:`CheckpointError` naming the first leaf whose digest is not ``expected``."""
    got = digests(state)
    if set(got) != set(expected):
        raise CheckpointError(f"{where} does not match its digest record (other leaves)")
    bad = [k for k in got if got[k] != [expected[k][0], list(expected[k][1]), expected[k][2]]]
    if bad:
        raise CheckpointError(
            f"{where} is damaged: the digest of {len(bad)} array(s) ({bad[0]}"
            f"{', ...' if len(bad) > 1 else ''}) differs from the one recorded at save"
        )


def checksums(state: Any) -> dict[str, str]:
    """``{leaf path: sha256 hex}`` of every array of ``state`` (host values), over the dtype, the
    shape and the C-order bytes: the record of checkpoints before :func:`digests` (still verified)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        x = np.ascontiguousarray(np.asarray(leaf))
        h = hashlib.sha256(f"{x.dtype.str}{x.shape}".encode())
        h.update(memoryview(x).cast("B") if x.size else b"")
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


def verify(state: Any, expected: dict[str, str], where: str) -> None:
    """Raise :class:`CheckpointError` naming the first leaf whose SHA-256 is not ``expected``."""
    got = checksums(state)
    if set(got) != set(expected):
        raise CheckpointError(f"{where} does not match its checksum record (other leaves)")
    bad = [k for k in got if got[k] != expected[k]]
    if bad:
        raise CheckpointError(
            f"{where} is damaged: the SHA-256 of {len(bad)} array(s) ({bad[0]}"
            f"{', ...' if len(bad) > 1 else ''}) differs from the one recorded at save"
        )


def save(mgr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Start saving ``state`` and ``meta`` as ``step`` (returns before the write ends if async; the
    arrays are already copied to host memory then). Sharded arrays are written shard by shard, each
    process its own; ``meta['arrays']`` gets every array's dtype, shape and digest (:func:`digests`).
    Every process must call it."""
    state = jax.tree.map(lambda x: x if isinstance(x, jax.Array | np.ndarray) else np.asarray(x), state)
    meta = {**meta, "digest": DIGEST, "arrays": digests(state)}
    args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta))
    mgr.save(int(step), args=args, force=True)


def latest_step(mgr: ocp.CheckpointManager) -> int | None:
    """The newest *complete* step (:func:`steps`)."""
    done = steps(mgr)
    return done[-1] if done else None


def steps(mgr: ocp.CheckpointManager) -> list[int]:
    """The complete steps, oldest first: those orbax lists (it leaves out the temporary directories of
    saves in progress or killed) whose directory holds a finished save (:func:`is_finished`)."""
    path = Path(mgr.directory)
    return sorted(int(s) for s in mgr.all_steps() if is_finished(path / str(int(s))))


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON record of ``step`` alone (cheap; no arrays are read)."""
    try:
        out = mgr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = out["meta"]
    except Exception as e:  # orbax raises many types for a damaged directory
        why = _why(e, Path(mgr.directory) / str(int(step)) / "meta")
        raise CheckpointError(f"checkpoint {step} in {mgr.directory} is unreadable: {why}") from e
    if not isinstance(meta, dict) or not {"config", "version", "iteration", "metrics_lines"} <= set(meta):
        raise CheckpointError(f"checkpoint {step} in {mgr.directory} has no valid meta record")
    return meta


def target(abstract: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` leaves for :func:`restore`: the shapes and dtypes of ``abstract``
    (arrays or structs) with ``shardings`` (one ``Sharding`` for every leaf, or a pytree of them
    like ``abstract``, ``None`` leaves allowed); ``shardings=None`` drops every sharding (restore
    as host NumPy arrays)."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), abstract)
    return jax.tree.map(
        lambda x, s: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract,
        shardings,
        is_leaf=lambda s: s is None,
    )


def saved_structure(mgr: ocp.CheckpointManager, step: int) -> Any:
    """The state of ``step`` as saved, without reading it: a pytree (NamedTuples as dicts) of host
    ``jax.ShapeDtypeStruct`` (e.g. a target for :func:`restore` where the model is not built)."""
    try:
        with _quiet_absl():  # (a warning that the step's own metadata file is not the state's)
            tree = ocp.PyTreeCheckpointer().metadata(Path(mgr.directory) / str(int(step)) / "state")
        tree = tree.item_metadata
        tree = getattr(tree, "tree", tree)
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)), tree)
    except Exception as e:
        why = _why(e, Path(mgr.directory) / str(int(step)) / "state")
        raise CheckpointError(f"checkpoint {step} in {mgr.directory} is unreadable: {why}") from e


def _leaf_sharding(x: Any) -> Any:
    s = getattr(x, "sharding", None)
    return s if isinstance(s, jax.sharding.Sharding) else None


def restore(
    mgr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None, *, shardings: Any = None
) -> tuple[Any, dict]:
    """Restore ``step`` (default: the latest complete one) onto ``abstract_state``'s structure.

    A leaf with a ``.sharding`` (a ``jax.ShapeDtypeStruct(..., sharding=...)``, an array), or the
    matching leaf of ``shardings`` (see :func:`target`), is restored as a ``jax.Array`` with that
    sharding, whatever mesh it was saved from (each process reads its own shards); any other leaf
    as a host NumPy array. Every leaf must match the shape and dtype recorded at save and its
    digest (:func:`check_arrays`; SHA-256 for older checkpoints), else :class:`CheckpointError`.
    All processes must call it (the digests are computed where the shards are).
    """
    step = latest_step(mgr) if step is None else step
    if step is None:
        raise CheckpointError(f"no complete checkpoint in {mgr.directory}")
    where = f"checkpoint {step} in {mgr.directory}"
    want = target(abstract_state, shardings) if shardings is not None else abstract_state
    want = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_leaf_sharding(x)), want)
    meta = read_meta(mgr, step)
    arrays = meta.get("arrays")
    if isinstance(arrays, dict):  # shapes and dtypes checked before anything is read
        flat = jax.tree_util.tree_flatten_with_path(want)[0]
        mine = {leaf_name(p): [np.dtype(x.dtype).name, [int(n) for n in x.shape]] for p, x in flat}
        if set(mine) != set(arrays) or any(mine[k] != list(arrays[k][:2]) for k in mine):
            raise CheckpointError(f"{where} does not match this model's state")

    def args_of(x):
        s = _leaf_sharding(x)
        if s is None:
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
        return ocp.ArrayRestoreArgs(sharding=s, global_shape=x.shape, dtype=x.dtype)

    try:
        out = mgr.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=want, restore_args=jax.tree.map(args_of, want)),
            ),
        )
    except Exception as e:
        raise CheckpointError(
            f"{where} is unreadable: {_why(e, Path(mgr.directory) / str(step) / 'state')}"
        ) from e
    state = out["state"]
    got_leaves = jax.tree.leaves(state)
    want_leaves = jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves) or any(
        tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype
        for g, w in zip(got_leaves, want_leaves, strict=False)
    ):
        raise CheckpointError(f"{where} does not match this model's state")
    if isinstance(arrays, dict):
        check_arrays(state, arrays, where)
    elif meta.get("checksum") is not None:
        verify(state, meta["checksum"], where)
    return state, meta


_ARRAY_READ = re.compile(r'Error reading "([^"]+?)(?:/[0-9.]+)?"')  # TensorStore's words for an array
_INTERNALS = ("<", "pybind", "TensorStore", "tensorstore", "Traceback", "OCDBT", "zarr", "{")


def _why(e: BaseException, files: Path) -> str:
    """Why a checkpoint could not be read, naming the array or the file (under ``files``, the step's
    item directory) and never the library's own text (TensorStore specs, bound methods)."""
    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        m = _ARRAY_READ.search(str(x))
        if m:
            text = str(x)
            how = ("a file is truncated" if "OUT_OF_RANGE" in text or "byte range" in text
                   else "a file is damaged: its data does not decode" if "corrupt" in text.lower()
                   else "a file is truncated or damaged")  # fmt: skip
            return f"array {m.group(1)} cannot be read from {files} ({how})"
    for x in chain:
        if isinstance(x, OSError) and x.filename:
            return f"{x.filename}: {x.strerror or type(x).__name__}"
    msg = " ".join(str(e).split())
    if msg and len(msg) <= 200 and not any(s in msg for s in _INTERNALS):
        return f"{files}: {msg}"
    return f"{files} is damaged or incomplete (a file is missing, truncated or not orbax's)"
