"""``python tests/fork_runner.py``: ``klrl ARGS`` in a forked child per request, klrl imported once.

Importing jax and klrl costs about 4 CPU s per process, most of a tiny run killed at a kill point
(tests/loop/test_kill_points.py runs twenty of them). This process imports them once, with no JAX backend
started and no thread running (so a fork is safe), then reads one JSON request per line on stdin,
``{"argv": [...], "env": {...}, "log": PATH}``: a forked child sets ``env``, sends its stdout and
stderr to ``log`` and runs ``klrl.cli.main(argv)`` (a process of its own, as ``python -m klrl``:
its own backend, compile cache, signals; a SIGKILL kills only it). The answer is one JSON line,
``{"status": S}`` (``os.waitstatus_to_exitcode``: -9 for SIGKILL).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import klrl  # noqa: E402  (the whole public API: jax, flax, optax, orbax)
import klrl.cli  # noqa: E402
import klrl.cli.launch  # noqa: E402, F401  (what the command imports inside its functions)
import klrl.tasks.text  # noqa: E402, F401
import klrl.tasks.wordclass  # noqa: E402, F401


def _child(req: dict) -> None:
    os.environ.update(req["env"])
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        status = klrl.cli.main(req["argv"])
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 70
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)


def main() -> None:
    assert threading.active_count() == 1, threading.enumerate()  # a fork copies no thread
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
