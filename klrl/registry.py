"""Registries by name: controllers, KL estimators, advantage estimators, tasks, model families,
built-in rewards.

A :class:`Registry` maps a name to an implementation and its metadata. The implementations
register themselves where they are written (``@CONTROLLERS.register("pi")`` in
:mod:`klrl.algo.control`, ``@ESTIMATORS.register("k3")`` in :mod:`klrl.algo.kl`, ...); the registry objects
live here, in a leaf module that imports nothing of klrl, so the config (which validates names),
the plots and the report can read them without importing the implementations (no import cycle).
A registry knows its implementation module (``home``) and imports it on first lookup, so
:meth:`Registry.names` is complete whoever asks first. These registries are the only lists of the
names: the config's help strings and checks, the metric aliases, the plots' labels and the tests
read them (``names(where=...)`` filters by metadata, ``describe()`` lists them for a help string).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    """``name -> (implementation, metadata)``, in registration order."""

    def __init__(self, kind: str, home: str):
        self.kind = kind  # what the entries are, for messages: "controller", "KL estimator", ...
        self.home = home  # the module (or package) whose import registers the built-in entries
        self._items: dict[str, tuple[Any, dict[str, Any]]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[Any], Any]:
        """Decorator: register ``fn`` as ``name`` with ``meta``; returns ``fn`` unchanged."""

        def deco(fn: Any) -> Any:
            if name in self._items and self._items[name][0] is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = (fn, dict(meta))
            return fn

        return deco

    def remove(self, name: str) -> None:
        """Forget ``name`` (tests that register a throw-away entry clean up with this)."""
        self._items.pop(name, None)

    def _load(self) -> None:
        importlib.import_module(self.home)

    def names(self, where: Callable[[dict[str, Any]], bool] | None = None) -> tuple[str, ...]:
        """The names in registration order; with ``where``, those whose metadata it accepts
        (``ADVANTAGES.names(where=lambda m: m["grouped"])``)."""
        self._load()
        return tuple(n for n, (_, m) in self._items.items() if where is None or where(m))

    def describe(self, where: Callable[[dict[str, Any]], bool] | None = None) -> str:
        """``'a, b (its help), c'``: the names with their ``help`` metadata, for help strings."""
        return ", ".join(f"{n} ({h})" if (h := self.meta(n).get("help")) else n for n in self.names(where))

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"

    def get(self, name: str) -> Any:
        return self.entry(name)[0]

    def meta(self, name: str) -> dict[str, Any]:
        return self.entry(name)[1]

    def entry(self, name: str) -> tuple[Any, dict[str, Any]]:
        self._load()
        if name not in self._items:
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of {', '.join(self._items)}")
        return self._items[name]


CONTROLLERS = Registry("controller", "klrl.algo.control")
ESTIMATORS = Registry("KL estimator", "klrl.algo.kl")
ADVANTAGES = Registry("advantage estimator", "klrl.algo.advantages")
TASKS = Registry("task", "klrl.tasks")
FAMILIES = Registry("model family", "klrl.models")
REWARDS = Registry("built-in reward", "klrl.rewards.text")


def is_adaptive(kind: str) -> bool:
    """Whether the controller ``kind`` moves beta (its registration's ``adaptive``, default True): a fixed
    beta has no target to log, report or diagnose against."""
    return bool(CONTROLLERS.meta(kind).get("adaptive", True))
