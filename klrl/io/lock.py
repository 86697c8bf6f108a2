"""One writer per run directory: an exclusive lock held for the whole life of a writing run.

``<run_dir>/.klrl.lock`` is locked with ``fcntl.flock`` (exclusive, non-blocking) and holds the
holder's ``{"pid", "host", "since"}`` as JSON. The kernel drops a ``flock`` when its process
dies (``kill -9`` included), so a lock file left behind by a dead process is simply taken
over: no stale-lock guessing. Where the filesystem has no ``flock`` (some network
filesystems), the file is created with ``O_EXCL`` instead and one left by a dead process of
this host (its PID is gone) is removed as stale. The holder removes the file on release.

A second writer gets :class:`RunDirLocked` (a :class:`~klrl.io.checkpoint.CheckpointError`:
exit status 2 from the command line) naming the holder. In a multi-process run only process 0
takes the lock (the others write nothing but orbax's shards, coordinated by orbax).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from klrl.io.checkpoint import CheckpointError

NAME = ".klrl.lock"


class RunDirLocked(CheckpointError):
    """Another live process writes this run directory."""


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        h = {}
    if not h:
        return "another klrl process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
    return f"pid {h.get('pid')} on {h.get('host')}, since {since}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The lock of ``run_dir`` (which must exist); :meth:`acquire` / :meth:`release`."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.path = self.dir / NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _refuse(self) -> RunDirLocked:
        return RunDirLocked(
            f"{self.dir} is in use by {_holder(self.path)}: one process at a time may write a run "
            "directory; wait for it to end or stop it"
        )

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        while True:
            existed = self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refuse() from None
            except OSError as e:  # no flock on this filesystem
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    raise
                if not existed:  # the empty file just created here is no one's lock
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
                return self._acquire_exclusive(record)
            # a releasing holder may have removed the file between our open and flock: then the
            # locked inode is no longer the lock file; try again on the current one
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._write(fd, record)
        return self

    def _write(self, fd: int, record: str) -> None:
        """The holder's record into the locked ``fd``, which is then held; a failed write (a full
        disk) closes it, removes the file and raises an ``OSError`` naming it."""
        try:
            os.ftruncate(fd, 0)
            os.write(fd, record.encode())
        except OSError as e:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        self._fd = fd

    def _acquire_exclusive(self, record: str) -> RunLock:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    h = json.loads(self.path.read_text() or "{}")
                except (OSError, ValueError):
                    h = {}
                stale = h.get("host") == socket.gethostname() and not _pid_alive(int(h.get("pid", 0)))
                if not stale:
                    raise self._refuse() from None
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            self._write(fd, record)
            return self
        raise self._refuse()

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # before unlocking: a waiting process then retries on a fresh file
        os.close(self._fd)
        self._fd = None


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[RunLock]:
    """``with run_lock(d):`` the body runs holding ``d``'s lock (:class:`RunDirLocked` if taken);
    it is released on every way out."""
    lock = RunLock(run_dir).acquire()
    try:
        yield lock
    finally:
        lock.release()
