"""Time to the first iteration: JAX's persistent compilation cache, the phase lines before the first
iteration, and XLA's compile banners kept out of the terminal.

* **The persistent compilation cache** (:func:`enable_cache`): on by default, in
  ``<klrl cache>/xla/<machine key>`` (the klrl cache: ``task.cache_dir``, else ``$KLRL_CACHE``, else
  ``~/.cache/klrl``), created private to the user (mode 0700). JAX's own cache key covers the program,
  the compile options, the jax/jaxlib versions and the devices; XLA:CPU code is also compiled for the
  host's instruction set, which that key does not name, so the directory is keyed by
  :func:`machine_key` (the CPU model and feature flags, the machine, the jax/jaxlib versions, the
  device kinds): an executable compiled on a host with other CPU features is never read back. A
  second run of the same shapes reads the executables instead of compiling them (JAX's
  ``jax_persistent_cache_min_compile_time_secs``: programs that took :data:`MIN_COMPILE_S` or more to
  compile are written). ``KLRL_COMPILE_CACHE=0`` turns it off; a cache directory the user set for JAX
  (``JAX_COMPILATION_CACHE_DIR`` / ``jax_compilation_cache_dir``) is left as it is.
* **Phase lines** (:func:`phase_log`): before the first iteration klrl says what it does (the task's
  model load, the reference's pretraining or cache hit, the compile, each with its seconds) on stderr
  when stderr is a terminal (a captured or redirected stderr keeps the run's one-line errors the only
  line), or always with ``KLRL_PROGRESS=1`` (never with ``KLRL_PROGRESS=0`` or ``train.quiet``).
* **XLA's banners** (:func:`xla_banners`): XLA writes its C++ log lines (``E1207 12:00:00.123 ...
  slow_operation_alarm.cc] Constant folding an instruction is taking > 1s``, ``Very slow compile?``)
  straight to the process's stderr (file descriptor 2) while it compiles. Around the compile of the
  train step that descriptor is pointed at a file; afterwards the C++ log lines are appended to the
  run's ``xla.log`` (the terminal gets one line naming it) and anything else written meanwhile goes
  to stderr as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental.compilation_cache import compilation_cache as cc

__all__ = [
    "CACHE_ENV",
    "PROGRESS_ENV",
    "CacheStats",
    "enable_cache",
    "machine_key",
    "phase_log",
    "xla_banners",
]

CACHE_ENV = "KLRL_COMPILE_CACHE"  # 0/false/off: no persistent compilation cache
PROGRESS_ENV = "KLRL_PROGRESS"  # 1: phase lines whatever stderr is; 0: none
MIN_COMPILE_S = 0.2  # programs that took this long to compile are written to the cache
XLA_LOG = "xla.log"  # in the run directory: XLA's C++ log lines written while the train step compiled
_OFF = ("0", "false", "off", "no")
# an absl/glog log line: severity, date, time, thread, file:line]  (I1207 12:00:00.123456  4242 x.cc:65] ...)
_ABSL = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+\S+:\d+\]")


def machine_key(cpuinfo: str | None = None) -> str:
    """16 hex digits of this host's CPU model and feature flags (``cpuinfo``, default
    ``/proc/cpuinfo``; without one ``platform.processor()``), ``platform.machine()``, the OS, the jax
    and jaxlib versions and the device kinds: executables compiled where any of these differ are not
    read back."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k in ("model name", "flags", "Features", "CPU part", "vendor_id") and k not in fields:
            fields[k] = " ".join(sorted(v.split())) if k in ("flags", "Features") else v.strip()
    cpu = repr(sorted(fields.items())) if fields else platform.processor()
    kinds = sorted({d.device_kind for d in jax.devices()})
    parts = [platform.machine(), platform.system(), cpu, jax.__version__, jaxlib.__version__, *kinds]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def enable_cache(root: str | os.PathLike) -> Path | None:
    """Turn JAX's persistent compilation cache on in ``root/xla/<machine_key()>`` (module docstring);
    returns the directory, or None when it is off (``KLRL_COMPILE_CACHE=0``) or the user set JAX's own
    (left as it is). Idempotent: a second call with the same directory changes nothing."""
    if os.environ.get(CACHE_ENV, "").strip().lower() in _OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    base = Path(root).expanduser() / "xla"
    if current and not str(current).startswith(str(base)):
        return None  # the user's own cache directory
    path = base / machine_key()
    if current == str(path):
        return path
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        for p in (base, path):  # private to the user: a cached executable is code this process runs
            os.chmod(p, 0o700)
    except OSError:
        return None  # an unwritable cache: compile as before
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # (the user's own: kept)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    cc.reset_cache()  # (a compile before this call initialised the cache without a directory)
    return path


class CacheStats:
    """Counts of persistent-cache hits and misses and the backend compile seconds, from JAX's monitoring
    events (listeners registered once per process); :meth:`since` gives the change since a snapshot."""

    _counts: dict[str, float] = {"hits": 0, "misses": 0, "trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0}
    _durations = {
        "/jax/core/compile/jaxpr_trace_duration": "trace_s",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
        "/jax/core/compile/backend_compile_duration": "compile_s",
    }
    _registered = False

    @classmethod
    def register(cls) -> None:
        if cls._registered:
            return
        names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}

        def on_event(event: str, **kw: Any) -> None:
            if event in names:
                cls._counts[names[event]] += 1

        def on_duration(event: str, duration: float, **kw: Any) -> None:
            if event in cls._durations:
                cls._counts[cls._durations[event]] += duration

        jax.monitoring.register_event_listener(on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        cls._registered = True

    @classmethod
    def snapshot(cls) -> dict[str, float]:
        cls.register()
        return dict(cls._counts)

    @classmethod
    def since(cls, snap: dict[str, float]) -> dict[str, float]:
        return {k: cls._counts[k] - snap.get(k, 0) for k in cls._counts}


def phase_log(quiet: bool) -> Callable[[str], None] | None:
    """The phase lines' printer (stderr, ``klrl: `` in front), or None when they are off (module
    docstring: ``train.quiet``, ``KLRL_PROGRESS``, a stderr that is not a terminal)."""
    env = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if quiet or env in _OFF:
        return None
    if env not in ("1", "true", "on", "yes"):
        try:
            if not sys.stderr.isatty():
                return None
        except (AttributeError, ValueError):
            return None
    return lambda line: print(f"klrl: {line}", file=sys.stderr, flush=True)


def compile_line(seconds: float, stats: dict[str, float], callbacks: bool = False) -> str:
    """``compiled the train step in 41.2 s (tracing 6.1 s, lowering 2.0 s, XLA 33.0 s; persistent cache:
    1 read, 0 written)`` (XLA: its compile, or the read from the cache); ``callbacks``: the step calls
    host functions (``reward.fn``), and JAX writes no program with host callbacks to its persistent
    cache, which the line says when nothing was read or written."""
    hits, misses = int(stats["hits"]), int(stats["misses"])
    if hits or misses:
        cache = f"persistent cache: {hits} read, {misses} written"
    elif not jax.config.jax_compilation_cache_dir:
        cache = "persistent cache off"
    elif callbacks:
        cache = "not cached: JAX's persistent cache skips programs with host callbacks, here reward.fn's"
    else:
        cache = "persistent cache: nothing read or written"
    parts = (
        f"tracing {stats['trace_s']:.1f} s, lowering {stats['lower_s']:.1f} s, XLA {stats['compile_s']:.1f} s"
    )
    return f"compiled the train step in {seconds:.1f} s ({parts}; {cache})"


@contextlib.contextmanager
def xla_banners(
    run_dir: str | os.PathLike | None, log: Callable[[str], None] | None = None
) -> Iterator[None]:
    """File descriptor 2 pointed at a temporary file for the block; then XLA's C++ log lines (and the
    lines that continue them) go to ``run_dir/xla.log`` (``log`` gets one line naming it) and the rest
    to stderr as written. Without ``run_dir`` (or where descriptor 2 cannot be redirected) nothing
    changes."""
    if run_dir is None:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    tmp = tempfile.TemporaryFile()
    os.dup2(tmp.fileno(), 2)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", "replace")
        tmp.close()
        xla, rest = split_banners(text)
        if rest:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(rest)
                sys.stderr.flush()
        if xla:
            path = Path(run_dir) / XLA_LOG
            with contextlib.suppress(OSError):
                with path.open("a") as f:
                    f.write(xla)
                n = sum(1 for ln in xla.splitlines() if _ABSL.match(ln))
                if log is not None:
                    log(f"XLA's compile messages ({n}) are in {path}")


def split_banners(text: str) -> tuple[str, str]:
    """``(xla, rest)``: the absl-format log lines of ``text`` with the lines that continue them (up to the
    next line that is not indented, empty, starred or one of XLA's own continuation lines, i.e. its
    multi-line messages), and everything else, each in its order."""
    xla, rest, inside = [], [], False
    for line in text.splitlines(keepends=True):
        if _ABSL.match(line):
            inside = True
            xla.append(line)
        elif inside and (not line.strip() or line[0] in " \t*" or _continues(line)):
            xla.append(line)
        else:
            inside = False
            rest.append(line)
    return "".join(xla), "".join(rest)


def _continues(line: str) -> bool:
    """A line of XLA's slow-compile and constant-folding messages after their first."""
    return line.startswith(("Constant folding", "This isn't necessarily a bug", "If you'd like to file a bug",
                            "%", "ROOT ", "[Compiling module"))  # fmt: skip


def elapsed(t0: float) -> str:
    return f"{time.time() - t0:.1f} s"
