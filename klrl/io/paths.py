"""The paths a run (or a command) opens and writes, checked before anything is built: no named pipe,
socket or device where a file is read, directories that can be written (tried, not inferred), outputs
that do not overwrite anything. Every failure is one :class:`~klrl.config.ConfigError` naming the field
or flag, the path and the cause; :func:`klrl.checks.preflight` runs them for the API and the command line
alike (:mod:`klrl.cli.args` turns them into one line and exit 2 for the commands that are not runs).
Standard library only: the command line imports this module without jax."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import NoReturn

from klrl.config import ConfigError, RunConfig
from klrl.io.readers import special_kind


def _fail(message: str) -> NoReturn:
    raise ConfigError(message)


# ---- paths: no FIFO, socket or device ----------------------------------------------------------------
# the config fields that name a file or directory klrl opens (reward.fn: FILE.py:FUNCTION)
PATH_FIELDS = ("model.path", "model.value_path", "model.reward_path", "model.eval_path", "model.adapter",
               "data.path", "data.eval_path", "reward.fn", "task.cache_dir", "train.out_dir")  # fmt: skip


def check_special(path: str | os.PathLike | None, what: str) -> None:
    """``path`` (a path argument) is not a named pipe, socket or device (checked before anything opens
    it: a FIFO with no writer would wait forever, a device may never end)."""
    if not path:
        return
    kind = special_kind(path)
    if kind is not None:
        _fail(f"{what}: {path}: not a regular file or directory ({kind})")


def check_special_fields(cfgs: list[RunConfig]) -> None:
    """:func:`check_special` for every :data:`PATH_FIELDS` value of ``cfgs``."""
    for cfg in cfgs:
        for name in PATH_FIELDS:
            section, field = name.split(".")
            for value in str(getattr(getattr(cfg, section), field)).split(","):  # reward.fn: a list
                value = value.strip()
                if name == "reward.fn" and ":" in value:
                    value = value.rsplit(":", 1)[0]
                check_special(value, name)


# ---- paths a run will write ----------------------------------------------------------------------
def _existing_ancestor(p: Path, what: str) -> Path:
    """The nearest ancestor of ``p`` (``p`` itself included) that exists; a component that cannot be
    looked up (a name too long, a symbolic link loop or one to nothing, no permission) is one line."""
    p = p.absolute()
    while True:
        try:
            os.stat(p)
            return p
        except (FileNotFoundError, NotADirectoryError):
            if os.path.islink(p):  # (a loop is ELOOP below; here a link to a path that does not exist)
                _fail(f"{what}: {p} is a symbolic link to {os.readlink(p)}, which does not exist")
            if p == p.parent:
                return p
            p = p.parent
        except OSError as e:  # ENAMETOOLONG, ELOOP, EACCES
            _fail(f"{what}: {p}: {e.strerror or type(e).__name__}")


def _probe(top: Path) -> None:
    """Create a directory in ``top`` and a 4 KiB file in it, fsync'ed, then remove both (a full disk
    refuses the file's block where an empty directory may still fit); raises what the disk raised."""
    probe = tempfile.mkdtemp(prefix=".klrl-write-test-", dir=top)
    try:
        fd = os.open(os.path.join(probe, "probe"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(probe, "probe"))
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def check_writable_dir(path: str | os.PathLike, what: str) -> None:
    """``path`` is (or can be created as) a directory this process can write into.

    Tried, not inferred from permission bits (``os.access`` says yes to root in ``/proc``, or on a
    read-only mount): a directory (``path``'s first missing component) is created in the nearest
    existing ancestor with a 4 KiB file in it (a full disk), and removed at once; nothing is left
    behind. Every failure (a name too long, a symbolic link loop, a file in the way, read-only, no
    permission, no space) names ``what``, the path and the cause."""
    p = Path(path)
    top = _existing_ancestor(p, what)
    if top == p.absolute() and not top.is_dir():
        _fail(f"{what}: {p} exists and is not a directory")
    if not top.is_dir():
        _fail(f"{what}: {p} cannot be created: {top} is not a directory")
    try:
        _probe(top)
    except OSError as e:
        where = "" if top == p.absolute() else f" cannot be created: {top}"
        _fail(f"{what}: {p}{where} is not writable ({e.strerror or type(e).__name__})")


def check_new_path(path: str | os.PathLike, what: str, *, directory: bool) -> None:
    """An output a command creates (``klrl export``'s ``OUT_DIR``, ``reward-model``'s ``--out`` with
    ``directory``; ``generate --out FILE``): nothing there yet (an empty directory is allowed for a
    directory) and its parent writable (:func:`check_writable_dir`)."""
    p = Path(path)
    top = _existing_ancestor(p, what)
    if top == p.absolute():
        if not directory or not p.is_dir() or any(p.iterdir()):
            kind = "exists and is not an empty directory" if directory else "exists"
            _fail(f"{what}: {p}: {kind} (nothing is overwritten)")
        check_writable_dir(p, what)
        return
    check_writable_dir(p.parent if not directory else p, what)


def check_run_dir_writable(run_dir: str | os.PathLike, what: str) -> None:
    """A run directory (and its files) that a resume or a report writes into."""
    d = Path(run_dir)
    if not os.access(d, os.W_OK | os.X_OK):
        _fail(f"{what}: {d} is not writable (read-only or no permission)")
    try:  # a full disk (os.access does not see it): a file of one block, written and removed
        _probe(d)
    except OSError as e:
        _fail(f"{what}: {d} is not writable ({e.strerror or type(e).__name__})")
    for name in ("metrics.jsonl", "config.json", "checkpoints", "events.jsonl", "report.md"):
        f = d / name
        if f.exists() and not os.access(f, os.W_OK):
            _fail(f"{what}: {f} is not writable (read-only or no permission)")


# ---- a DPO run (klrl.dpo and ``klrl dpo``) -------------------------------------------------------------
def dpo_config_file(run_dir: str | os.PathLike) -> Path:
    """The ``config.json`` of the DPO run directory ``run_dir`` that a resume continues."""
    f = Path(run_dir) / "config.json"
    if not f.is_file():
        _fail(f"resume: {run_dir}: no config.json (not a DPO run directory)")
    return f


def check_dpo_paths(pairs: object, run_dir: str | os.PathLike | None, resume: bool) -> None:
    """The paths of a DPO run: ``pairs`` (when a path) is no named pipe, socket or device; ``run_dir``
    (None: in memory) is new (nothing there, or an empty directory) and writable, or with ``resume`` a
    DPO run directory (:func:`dpo_config_file`) that can be written."""
    if isinstance(pairs, str | os.PathLike):
        check_special(pairs, "pairs")
    check_special(run_dir, "run_dir")
    if resume and run_dir is None:
        _fail("resume: needs run_dir (the run directory to continue)")
    if resume:
        dpo_config_file(run_dir)
        check_run_dir_writable(run_dir, "run_dir")
    elif run_dir is not None:
        check_new_path(run_dir, "run_dir", directory=True)
