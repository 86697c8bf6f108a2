"""The machinery under :mod:`klrl.config.run`: config errors, the section decorator that checks every
field's type (and that every float is finite), and the "did you mean" messages for unknown names.

A section is a frozen keyword-only dataclass whose fields carry ``help`` metadata. ``@section("kl")``
makes one and wraps its ``__init__`` so that an unknown keyword (``KLConfig(betta=1)``) raises
:class:`UnknownFieldError` naming the field and the valid names, and runs the generic checks before
the class's own ``__post_init__`` rules:

* ``int`` fields take an ``int`` (not a ``bool``) in ``[-2**31, 2**31 - 1]`` (int32: the train state's
  counters and seeds are int32 or smaller on the device);
* ``float`` fields take an ``int`` or ``float`` (an ``int`` is stored as a ``float``), finite unless the
  field's metadata says ``nonfinite=True``;
* ``bool`` fields take a ``bool``; ``str`` fields a ``str`` without NUL characters.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import reprlib
from collections.abc import Iterable
from typing import Any

INT_MIN, INT_MAX = -(2**31), 2**31 - 1


class ConfigError(ValueError):
    """A configuration value breaks a rule. The message names the field."""


class UnknownFieldError(ConfigError, TypeError):
    """A field or section name that does not exist (also a ``TypeError``, what a dataclass raises)."""


# names other libraries use for klrl's fields (TRL's PPOConfig / PPOTrainer, verl's algorithm.kl_ctrl)
ALIASES = {
    "kl_coef": ("kl.beta", "TRL/verl"),
    "init_kl_coef": ("kl.beta", "TRL"),
    "beta": ("kl.beta", "TRL GRPO/DPO"),
    "target_kl": ("ctrl.target", "verl; its unit is ctrl.unit"),
    "target": ("ctrl.target", "TRL; its unit is ctrl.unit"),
    "kl_target": ("ctrl.target", ""),
    "horizon": ("ctrl.horizon", "TRL/verl"),
    "adap_kl_ctrl": ("ctrl.kind", "TRL: --ctrl.kind proportional is its adaptive controller"),
    "kl_ctrl": ("ctrl.kind", "verl"),
    "kl_penalty": ("kl.estimator", "TRL/verl"),
    "kl_estimator": ("kl.estimator", "TRL"),
    "learning_rate": ("optim.lr", "TRL/transformers"),
    "lr": ("optim.lr", ""),
    "num_ppo_epochs": ("ppo.epochs", "TRL"),
    "ppo_epochs": ("ppo.epochs", "TRL/verl"),
    "cliprange": ("ppo.clip", "TRL"),
    "clip_ratio": ("ppo.clip", "verl"),
    "cliprange_value": ("ppo.vf_clip", "TRL"),
    "vf_coef": ("ppo.vf_coef", "TRL"),
    "num_mini_batches": ("ppo.minibatches", "TRL"),
    "response_length": ("sampling.response_len", "TRL/verl"),
    "max_new_tokens": ("sampling.response_len", "transformers"),
    "total_episodes": ("train.iterations", "TRL; klrl counts iterations of train.batch_size sequences"),
    "seed": ("train.seed", ""),
    "batch_size": ("train.batch_size", ""),
    "max_grad_norm": ("optim.max_grad_norm", ""),
    "weight_decay": ("optim.weight_decay", ""),
    "model_name_or_path": (
        "model.path",
        "transformers/TRL; a local directory, a .gguf, or a Hub name "
        "in the local Hugging Face cache: `klrl models` lists them",
    ),
}


def closest(name: str, valid: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The closest of ``valid`` to ``name`` (difflib, similarity at least ``cutoff``), or ``None``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=cutoff)
    return close[0] if close else None


def short(value: Any, n: int = 60) -> str:
    """A bounded ``repr`` (depth and length), safe on deeply nested values."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 2, n, n
    return r.repr(value)


def _kind(f: dataclasses.Field) -> type:
    return type(f.default) if f.default is not dataclasses.MISSING else object


def _check_value(section: str, f: dataclasses.Field, value: Any) -> Any:
    """The generic type/finite/range check of one field; returns the value to store."""
    name, kind = f"{section}.{f.name}", _kind(f)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {short(value)}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {short(value)}")
        if not INT_MIN <= value <= INT_MAX:
            raise ConfigError(f"{name}: must fit in int32 ([{INT_MIN}, {INT_MAX}]), got {value}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {short(value)}")
        value = float(value)
        if not (math.isfinite(value) or f.metadata.get("nonfinite")):
            raise ConfigError(f"{name}: must be a finite number (got {value})")
    elif kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {short(value)}")
        if "\x00" in value:
            raise ConfigError(f"{name}: must not contain a NUL character")
    return value


def section(name: str):
    """Class decorator: a frozen keyword-only dataclass named ``name`` on the command line, with the
    generic field checks (module docstring) run before its ``__post_init__``."""

    def wrap(cls: type) -> type:
        post = cls.__dict__.get("__post_init__")

        def __post_init__(self: Any) -> None:
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                checked = _check_value(name, f, value)
                if checked is not value:
                    object.__setattr__(self, f.name, checked)
            if post is not None:
                post(self)

        cls.__post_init__ = __post_init__
        cls = strict_init(dataclasses.dataclass(frozen=True, kw_only=True)(cls), name)
        cls.section_name = name
        return cls

    return wrap


def strict_init(cls: type, name: str, what: str = "field") -> type:
    """Wrap a dataclass's ``__init__``: positional or unknown keyword arguments raise
    :class:`UnknownFieldError` naming the closest valid name and all of them."""
    valid = tuple(f.name for f in dataclasses.fields(cls))
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise UnknownFieldError(f"{name}: takes keyword arguments only ({', '.join(valid)})")
        for k in kwargs:
            if k not in valid:
                raise UnknownFieldError(unknown_field(name, k, valid, what))
        init(self, **kwargs)

    cls.__init__ = __init__
    return cls


def unknown_field(section_name: str, field_name: str, valid: Iterable[str], what: str = "field") -> str:
    valid = list(valid)
    prefix = f"{section_name}." if section_name else ""
    near = closest(field_name, valid)
    hint = f"; did you mean {prefix}{near}?" if near else ""
    where = f"{prefix}{field_name}"
    return f"{where}: unknown {what}{hint} (valid: {', '.join(valid)})"
