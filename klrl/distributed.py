"""Multi-host (multi-process) runs: one Python process per host (or per accelerator), one program.

JAX's multi-controller model: every process runs the same script, calls
:func:`initialize` before anything touches a device, and from then on
``jax.devices()`` lists the devices of *all* processes, so
:func:`klrl.step.parallel.make_mesh` builds its ``(sweep, data, fsdp, tensor)`` mesh over the whole
slice and the one jitted step runs across processes (gradients and statistics
are averaged by the same named-axis collectives as on one host).

What changes with more than one process:

* Arrays passed into the step must be *global* arrays. Everything klrl feeds the
  step (prompt pool, reward tables, the initial train state) is generated from
  seeds, so every process holds the same values; :func:`replicate` turns such a
  host-local tree into replicated global arrays without any communication.
* The step's outputs (state, metrics) are global arrays, replicated (a run) or split
  over the ``sweep`` axis (a sweep); :func:`to_host` gives every process their full value.
* Only process 0 writes files (run directory, ``metrics.jsonl``, TensorBoard, summaries);
  :func:`is_main` is the guard, and the run directory's name is agreed from process 0
  (:func:`agree_path`). Checkpoints are saved by all processes together (orbax
  coordinates them and writes the replicated state once), so the run directory must be on
  a filesystem every process sees.

Launch: see ``docs/launch.md``. On Cloud TPU, Slurm, Kubernetes and other
clusters JAX detects the coordinator, process count and id itself; elsewhere pass
them as arguments or as ``KLRL_COORDINATOR`` (``host:port``), ``KLRL_NUM_PROCESSES``
and ``KLRL_PROCESS_ID``. Joining waits at most ``timeout_s`` (``KLRL_DISTRIBUTED_TIMEOUT``, default
:data:`DEFAULT_TIMEOUT_S`) for the coordinator and the other processes; then the process ends with
one line naming the coordinator and the timeout, and exit status 2 (JAX's own deadline would abort
the process from C++ with a stack trace, after 300 s).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ENV_COORDINATOR = "KLRL_COORDINATOR"
ENV_NUM_PROCESSES = "KLRL_NUM_PROCESSES"
ENV_PROCESS_ID = "KLRL_PROCESS_ID"
ENV_TIMEOUT = "KLRL_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0  # processes a launcher starts together join in seconds; a slow cluster sets more
_JAX_MARGIN_S = 30  # JAX's own deadline comes this much later: the watchdog's line is the one printed


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from e


def timeout_from_env() -> float:
    """``KLRL_DISTRIBUTED_TIMEOUT`` in seconds, else :data:`DEFAULT_TIMEOUT_S` (``ValueError`` if not > 0)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV_TIMEOUT}: expected a number of seconds > 0, got {raw!r}")
    return value


def _exit_with(message: str) -> None:
    """The default of :func:`initialize`'s ``on_timeout``: one line on stderr, exit status 2, now
    (from the watchdog thread, while the main thread is blocked inside JAX's C++ ``Connect``)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def timeout_message(coordinator_address: str | None, num_processes: Any, process_id: Any, s: float) -> str:
    """The line of a join that timed out: the coordinator, this process, the timeout and its knob."""
    where = coordinator_address or "the auto-detected coordinator"
    who = f"process {process_id} of {num_processes}" if process_id is not None else "this process"
    if process_id == 0:  # the coordinator itself: the others did not come
        why = "did every other process start, with this address?"
    else:
        why = "is process 0 running there, the port open, and every process started?"
    return (
        f"--distributed: {who} could not join the run at {where} within {s:g} s ({why} "
        f"--distributed-timeout or ${ENV_TIMEOUT} sets the wait)"
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: float | None = None,
    on_timeout: Callable[[str], Any] = _exit_with,
    **kwargs: Any,
) -> None:
    """Join the multi-process run: ``jax.distributed.initialize`` with arguments from here or the env.

    Each argument left ``None`` is read from ``KLRL_COORDINATOR`` / ``KLRL_NUM_PROCESSES`` /
    ``KLRL_PROCESS_ID``; whatever is still ``None`` is left to JAX's cluster auto-detection
    (Cloud TPU, Slurm, Open MPI, Kubernetes, ...). Call it once per process, before anything
    touches a device. ``kwargs`` go to ``jax.distributed.initialize`` (e.g. ``local_device_ids``).
    On CPU the cross-process collectives are gloo (JAX's default since 0.5.1).

    ``timeout_s`` (None: :func:`timeout_from_env`): the longest wait for the coordinator and the
    other processes. A join that takes longer cannot be interrupted from Python (JAX's client blocks
    in C++ and aborts the process at its own deadline), so a watchdog thread calls
    ``on_timeout(message)`` at ``timeout_s``: by default one line on stderr and ``os._exit(2)``.
    """
    if coordinator_address is None:
        coordinator_address = os.environ.get(ENV_COORDINATOR, "").strip() or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    if timeout_s is None:
        timeout_s = timeout_from_env()
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout: expected a number of seconds > 0, got {timeout_s}")
    message = timeout_message(coordinator_address, num_processes, process_id, timeout_s)
    joined = threading.Event()
    watchdog = threading.Timer(timeout_s, lambda: joined.is_set() or on_timeout(message))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=int(timeout_s) + 1 + _JAX_MARGIN_S,
            **kwargs,
        )
    finally:
        joined.set()
        watchdog.cancel()


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_main() -> bool:
    """True on the process that writes (process 0; the only process of a single-host run)."""
    return jax.process_index() == 0


def put(tree: Any, sharding: Any) -> Any:
    """``tree`` laid out with ``sharding`` (one sharding for every leaf, or a pytree of shardings
    like ``tree``, e.g. :attr:`klrl.step.train.Train.state_shardings`), from host-local values.

    With one process this is ``jax.device_put``. With several, every process holds the
    same full value of each leaf (klrl derives everything from seeds) and supplies the
    shards of its own devices (``jax.make_array_from_callback``): no communication and no
    check that the processes agree. Leaves that already carry their sharding are kept.
    """
    if not is_multiprocess():
        return jax.device_put(tree, sharding)

    def leaf(x: Any, sh: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding == sh:
            return x
        host = to_host(x)
        return jax.make_array_from_callback(host.shape, sh, lambda index: host[index])

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: leaf(x, sharding), tree)
    return jax.tree.map(leaf, tree, sharding)


def replicate(tree: Any, mesh: Any) -> Any:
    """``tree`` replicated over every device of ``mesh`` (``NamedSharding(mesh, P())``); see :func:`put`.

    Use it for what a multi-process step takes that is not already a global array
    (the task's ``env``, a restored state).
    """
    return put(tree, NamedSharding(mesh, P()))


def to_host(tree: Any) -> Any:
    """NumPy copies of a tree of arrays, the same full value on every process.

    A replicated global array is read from this process's own copy; one sharded across
    processes (e.g. a sweep's members over the ``sweep`` axis) is all-gathered.
    """

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(leaf, tree)


def broadcast_str(value: str) -> str:
    """Process 0's ``value`` on every process (e.g. a run directory named by a timestamp)."""
    if not is_multiprocess():
        return value
    data = np.zeros(4096, np.uint8)
    raw = value.encode()[:4096]
    data[: len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(data))
    return bytes(out[out != 0].tolist()).decode()


def agree_path(path: Any) -> Any:
    """Process 0's ``path`` (a :class:`pathlib.Path` or ``None``) on every process."""
    if not is_multiprocess():
        return path
    value = broadcast_str(str(path) if path is not None and is_main() else "")
    return Path(value) if value else None


def sync(name: str) -> None:
    """A barrier across processes (no-op with one)."""
    if is_multiprocess():
        multihost_utils.sync_global_devices(name)
