"""Registries by name: controllers, KL estimators, advantage estimators, tasks, model families,
built-in rewards.

A :class:`Registry` maps a name to an implementation and its metadata. The implementations
register themselves where they are written (``@CONTROLLERS.register("pi")`` in
:mod:`klrl.algo.control`, ``@ESTIMATORS.register("k3")`` in :mod:`klrl.algo.kl`, ...); the registry objects
live here, in a leaf module that imports nothing of klrl, so the config (which validates names),
the plots and the report can read them without importing the implementations (no import cycle).
A registry knows its implementation module (``home``) and imports it on first lookup, so
:meth:`Registry.names` is complete whoever asks first. klrl's own entries are *declared* here, with
their metadata (:data:`BUILTIN`): their names and metadata are read without importing the
implementations (which import jax), so ``klrl train --help`` and a config's checks stay fast; the
implementation registers under the declared name without metadata (``@CONTROLLERS.register("pi")``),
and only an implementation (:meth:`Registry.get`) imports the home module. An entry registered outside
klrl (a user's) brings its metadata to ``register`` as before. These registries are the only lists of the
names: the config's help strings and checks, the metric aliases, the plots' labels and the tests
read them (``names(where=...)`` filters by metadata, ``describe()`` lists them for a help string).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    """``name -> (implementation, metadata)``, in registration order."""

    def __init__(self, kind: str, home: str, declared: tuple[tuple[str, dict[str, Any]], ...] = ()):
        self.kind = kind  # what the entries are, for messages: "controller", "KL estimator", ...
        self.home = home  # the module (or package) whose import registers the built-in entries
        self._items: dict[str, tuple[Any, dict[str, Any]]] = {}
        # the built-in entries' names and metadata, known before ``home`` is imported (in its order)
        self._declared: dict[str, dict[str, Any]] = {name: dict(meta) for name, meta in declared}

    def register(self, name: str, **meta: Any) -> Callable[[Any], Any]:
        """Decorator: register ``fn`` as ``name`` with ``meta``; returns ``fn`` unchanged."""

        def deco(fn: Any) -> Any:
            if name in self._items and self._items[name][0] is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if name in self._declared and meta:
                raise ValueError(f"{self.kind} {name!r}: its metadata is declared in klrl.registry (BUILTIN)")
            self._items[name] = (fn, self._declared.get(name, dict(meta)))
            return fn

        return deco

    def remove(self, name: str) -> None:
        """Forget ``name`` (tests that register a throw-away entry clean up with this)."""
        self._items.pop(name, None)

    def _load(self) -> None:
        importlib.import_module(self.home)

    def _metas(self) -> dict[str, dict[str, Any]]:
        """``name -> metadata`` of every entry, the declared ones first (the home imported only when
        nothing is declared: then only the implementations know the names)."""
        if not self._declared:
            self._load()
        return {**self._declared, **{n: m for n, (_, m) in self._items.items()}}

    def names(self, where: Callable[[dict[str, Any]], bool] | None = None) -> tuple[str, ...]:
        """The names in registration order; with ``where``, those whose metadata it accepts
        (``ADVANTAGES.names(where=lambda m: m["grouped"])``)."""
        return tuple(n for n, m in self._metas().items() if where is None or where(m))

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
        if name in self._declared and name not in self._items:  # (a registered entry's: its own)
            return self._declared[name]
        return self.entry(name)[1]

    def entry(self, name: str) -> tuple[Any, dict[str, Any]]:
        self._load()
        if name in self._declared and name not in self._items:  # (the home lost its implementation)
            raise ValueError(
                f"{self.kind} {name!r}: declared in klrl.registry, not registered by {self.home}"
            )
        if name not in self._items:
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of {', '.join(self._items)}")
        return self._items[name]


# klrl's own entries: registry -> ((name, metadata), ...), in registration order. The implementations
# register these names bare.
BUILTIN: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    # label: the gains the plots print; help: for --ctrl.kind; adaptive=False: never moves beta; knobs: the
    # ctrl fields it reads beside those every kind reads (klrl.config.sweep.ctrl_knobs; none given: all)
    "controller": (
        ("fixed", {"adaptive": False, "knobs": ()}),
        (
            "proportional",
            {
                "label": lambda c: f"horizon={c.horizon:g}",
                "help": "Ziegler 2019",
                "knobs": ("target", "horizon", "clip"),
            },
        ),
        (
            "band",
            {
                "label": lambda c: f"band={c.band:g} x{c.factor:g}",
                "help": "PPO paper",
                "knobs": ("target", "band", "factor"),
            },
        ),
        (
            "pi",
            {
                "label": lambda c: f"kp={c.kp:g} ki={c.ki:g}",
                "knobs": ("target", "kp", "ki", "integral_max", "step_clip"),
            },
        ),
        ("dual", {"label": lambda c: f"lr={c.lr:g}", "help": "Lagrangian", "knobs": ("target", "lr")}),
    ),
    # inputs: what the estimator reads (logp or logits); chunked: its term on the chunked logits path
    "KL estimator": (
        *((n, {"inputs": "logp"}) for n in ("k1", "k2", "k3", "abs")),
        ("full", {"inputs": "logits", "chunked": "kl"}),
    ),
    # critic: trains a value model; grouped: compares the responses to one prompt (ppo.group_size >= 2)
    "advantage estimator": (
        ("gae", {"critic": True, "grouped": False, "help": "value function"}),
        ("grpo", {"critic": False, "grouped": True, "help": "group-normalised"}),
        ("rloo", {"critic": False, "grouped": True, "help": "leave-one-out"}),
    ),
    "task": (
        ("peer", {"help": "a PPO-shaped benchmark without language"}),
        ("wordclass", {"help": "fraction of positive words"}),
        ("testbed", {"help": "proxy reward model, exact gold"}),
        ("text", {"help": "a pretrained model.path on the data section's prompts"}),
    ),
    # factory: a function of its parameters that returns the reward function
    "built-in reward": (("positivity", {}), ("length", {"factory": True}), ("arithmetic", {})),
}

CONTROLLERS = Registry("controller", "klrl.algo.control", BUILTIN["controller"])
ESTIMATORS = Registry("KL estimator", "klrl.algo.kl", BUILTIN["KL estimator"])
ADVANTAGES = Registry("advantage estimator", "klrl.algo.advantages", BUILTIN["advantage estimator"])
TASKS = Registry("task", "klrl.tasks", BUILTIN["task"])
FAMILIES = Registry("model family", "klrl.models")  # (read once a model is: its metadata are loaders)
REWARDS = Registry("built-in reward", "klrl.rewards.text", BUILTIN["built-in reward"])


def is_adaptive(kind: str) -> bool:
    """Whether the controller ``kind`` moves beta (its registration's ``adaptive``, default True): a fixed
    beta has no target to log, report or diagnose against."""
    return bool(CONTROLLERS.meta(kind).get("adaptive", True))
