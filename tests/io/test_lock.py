"""The run directory's lock (issue 12): one writer at a time, taken over from a dead holder, released
on every way out; the ``O_EXCL`` fallback for filesystems without ``flock``."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from klrl.io import lock as lk
from klrl.io.checkpoint import CheckpointError

HOLDER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": os.getpid(), "host": sys.argv[2], "since": 0}).encode())
print("held", flush=True)
time.sleep(120)
"""


def _holder_process(path, host=None):
    """A bare process (no klrl) that holds ``path`` the way RunLock does, until killed."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), host or socket.gethostname()], stdout=subprocess.PIPE
    )
    assert p.stdout.readline() == b"held\n"
    return p


def test_second_writer_is_refused_with_one_line_naming_the_holder(tmp_path):
    with lk.run_lock(tmp_path) as held:
        assert held.held and (tmp_path / lk.NAME).is_file()
        record = json.loads((tmp_path / lk.NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        # a second open file description conflicts with flock even in the same process
        with pytest.raises(lk.RunDirLocked) as e:
            lk.RunLock(tmp_path).acquire()
        msg = str(e.value)
        assert isinstance(e.value, CheckpointError) and "\n" not in msg
        assert str(tmp_path) in msg and f"pid {os.getpid()} on {socket.gethostname()}" in msg
    assert not (tmp_path / lk.NAME).exists()  # released: the file is gone, the next writer may come
    lk.RunLock(tmp_path).acquire().release()


def test_released_on_an_exception(tmp_path):
    with pytest.raises(ZeroDivisionError), lk.run_lock(tmp_path):
        raise ZeroDivisionError
    with lk.run_lock(tmp_path):
        pass


def test_live_process_holds_and_dead_one_is_taken_over(tmp_path):
    p = _holder_process(tmp_path / lk.NAME)
    try:
        with pytest.raises(lk.RunDirLocked, match=f"pid {p.pid} "):
            lk.RunLock(tmp_path).acquire()
    finally:
        p.kill()
        p.wait()
    assert (tmp_path / lk.NAME).exists()  # kill -9 leaves the file; the kernel dropped the flock
    with lk.run_lock(tmp_path):
        assert json.loads((tmp_path / lk.NAME).read_text())["pid"] == os.getpid()


def test_exclusive_fallback_without_flock(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = tmp_path / lk.NAME
    with lk.run_lock(tmp_path):
        with pytest.raises(lk.RunDirLocked, match=f"pid {os.getpid()} "):
            lk.RunLock(tmp_path).acquire()
    assert not path.exists()
    # a file left by a dead process of this host is stale: taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": time.time()}))
    with lk.run_lock(tmp_path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    # a live process's (here: our parent's) is not; nor one of another host (its PID means nothing here)
    for pid, host in ((os.getppid(), socket.gethostname()), (dead.pid, "elsewhere")):
        path.write_text(json.dumps({"pid": pid, "host": host, "since": time.time()}))
        with pytest.raises(lk.RunDirLocked, match=f"pid {pid} on {host}"):
            lk.RunLock(tmp_path).acquire()
