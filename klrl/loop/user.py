"""The user's own hooks and metric functions, in the manner of Levanter's ``Trainer.add_hook(fn, every=N)``
and tunix's ``metric_fns``.

* :func:`hook` (``klrl.hook(fn, every=N)``) and :func:`every` (``klrl.every(N)``, also a decorator): a
  plain function ``fn(loop, row)`` called on the recorded rows whose iteration is a multiple of ``N``
  (``row.it`` = 0, N, 2N, ...), as a :class:`~klrl.loop.hooks.Hook`; it may return a request
  (:class:`~klrl.loop.hooks.Stop`, :class:`~klrl.loop.hooks.Note`, :class:`~klrl.loop.hooks.Restore`)
  as the built-in hooks do;
* :func:`as_hook`: any object given as a hook: a :class:`~klrl.loop.hooks.Hook` as it is, an object with
  ``on_row`` or (the older name) ``on_step`` and ``on_stop`` adapted;
* :class:`MetricFns`: functions ``fn(row_metrics, samples) -> {name: float}`` whose results are merged
  into each member's row as ``user/<name>`` before it is written (``metrics.jsonl``, TensorBoard, the
  run's result); ``samples`` is the member's decoded samples (a list of ``{prompt, completion, reward,
  ...}`` rows) on the iterations they are written (``train.samples_every``), else None;
* :func:`load` and :func:`from_config`: ``module:function`` specs (``train.hooks``, ``train.metric_fns``,
  e.g. from the command line), a bad one a :class:`~klrl.config.ConfigError` naming the field.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from klrl.config import ConfigError, RunConfig
from klrl.loop.hooks import Hook, Loop, Row

__all__ = ["MetricFns", "as_hook", "every", "from_config", "hook", "load"]

PREFIX = "user/"


class Every(Hook):
    """``fn(loop, row)`` on the rows whose iteration is a multiple of ``n`` (its return value: a request,
    or None); ``on_stop(loop)`` too if ``fn`` has one."""

    def __init__(self, n: int, fn: Callable[[Loop, Row], Any]):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"every: n must be an int >= 1, got {n!r}")
        if not callable(fn):
            raise TypeError(f"hook: fn must be a function fn(loop, row), got {type(fn).__name__}")
        self.every, self.fn = n, fn

    def on_row(self, loop: Loop, row: Row) -> Any:
        return self.fn(loop, row)

    def on_stop(self, loop: Loop) -> None:
        stop = getattr(self.fn, "on_stop", None)
        if callable(stop):
            stop(loop)


def every(n: int, fn: Callable[[Loop, Row], Any] | None = None) -> Any:
    """A hook calling ``fn(loop, row)`` every ``n`` iterations (``row.it`` = 0, n, 2n, ...); without
    ``fn``, a decorator: ``@klrl.every(10)``."""
    if fn is None:
        return lambda f: Every(n, f)
    return Every(n, fn)


def hook(fn: Callable[[Loop, Row], Any], every: int = 1) -> Hook:  # noqa: A002 - Levanter's name
    """``klrl.hook(fn, every=N)``: ``fn(loop, row)`` on every ``N``-th row (:func:`every`)."""
    return Every(every, fn)


class _Adapted(Hook):
    """An object with ``on_row(loop, row)`` (or ``on_step``, the older name) and maybe ``on_stop(loop)``
    and ``every``, not a :class:`~klrl.loop.hooks.Hook` subclass."""

    def __init__(self, obj: Any, method: str):
        self.obj, self.method, self.every = obj, method, int(getattr(obj, "every", 1))

    def on_row(self, loop: Loop, row: Row) -> Any:
        return getattr(self.obj, self.method)(loop, row)

    def on_stop(self, loop: Loop) -> None:
        stop = getattr(self.obj, "on_stop", None)
        if callable(stop):
            stop(loop)


def as_hook(obj: Any) -> Hook:
    """``obj`` as a :class:`~klrl.loop.hooks.Hook`: a Hook as it is, an object with ``on_row`` (or
    ``on_step``, the older name) adapted, a plain function ``fn(loop, row)`` called after every row."""
    if isinstance(obj, Hook):
        return obj
    for method in ("on_row", "on_step"):
        if callable(getattr(obj, method, None)):
            return _Adapted(obj, method)
    if callable(obj):
        return Every(1, obj)
    raise TypeError(f"hooks: {type(obj).__name__} is not a hook (on_row(loop, row), on_stop(loop))")


class MetricFns(Hook):
    """The user's metric functions (``{name: fn}``), merged into each member's row as ``user/<name>``
    (told before the metrics sink, so the row is written with them)."""

    def __init__(self, fns: Sequence[Callable] | dict[str, Callable], samples: Any = None):
        items = fns.items() if isinstance(fns, dict) else ((getattr(f, "__name__", "fn"), f) for f in fns)
        self.fns = list(items)
        self.samples = samples  # the samples hook (klrl.loop.samples.Samples) whose decoded rows fns get

    def on_row(self, loop: Loop, row: Row) -> None:
        decoded = _samples(getattr(self.samples, "log", None), row)
        for j, mj in enumerate(row.members):
            out: dict[str, float] = {}
            for name, fn in self.fns:
                got = fn(dict(mj), decoded[j] if decoded is not None else None)
                if not isinstance(got, dict):
                    raise TypeError(f"metric function {name}: returned {type(got).__name__}, not a dict")
                out.update({f"{PREFIX}{k}": float(v) for k, v in got.items()})
            mj.update(out)
            loop.rows[j][-1].update(out)


def _samples(log: Any, row: Row) -> list[list[dict[str, Any]]] | None:
    """Each member's decoded samples of ``row`` (as rows), if the sample log wrote them; else None."""
    last = getattr(log, "last", None)
    if not last or last[0] != row.it:
        return None
    out = []
    for dec in last[1]:
        n = len(dec["completion"])
        out.append(
            [{k: v[i] for k, v in dec.items() if hasattr(v, "__len__") and len(v) == n} for i in range(n)]
        )
    return out


def load(spec: str, field: str) -> Callable:
    """The function ``module:function`` names; a bad spec is a :class:`ConfigError` naming ``field``."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ConfigError(f"{field}: expected module:function, got {spec!r}")
    try:
        module = importlib.import_module(where)
    except Exception as e:
        raise ConfigError(
            f"{field}: {spec!r}: module {where} does not import ({type(e).__name__}: {e})"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field}: {spec!r}: {where} has no function {attr!r}")
    return fn


def _specs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def from_config(cfg: RunConfig) -> tuple[list[Hook], list[Callable]]:
    """The hooks (``train.hooks``, each called after every row) and metric functions
    (``train.metric_fns``) ``cfg`` names."""
    tc = cfg.train
    hooks = [Every(1, load(s, "train.hooks")) for s in _specs(tc.hooks)]
    return hooks, [load(s, "train.metric_fns") for s in _specs(tc.metric_fns)]
