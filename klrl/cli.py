"""Command-line parsing generated from the config dataclasses.

``--section.field value`` for every field of :class:`klrl.config.RunConfig`;
booleans take ``true/false``. ``--help`` lists every field with its meaning and
default. Errors (unknown field, unparsable value, a rule broken) end in one
line naming the field and exit status 2, before anything compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, NoReturn

from klrl.config import ConfigError, RunConfig

_SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}  # type: ignore[misc]


def fail(message: str, status: int = 2) -> NoReturn:
    """One line on stderr, then exit: the user-error path."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {s!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2, no usage dump
        fail(message)


def build_parser(description: str = "", extra: Any = None) -> argparse.ArgumentParser:
    p = _Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                allow_abbrev=False)  # fmt: skip
    if extra is not None:
        extra(p)
    for section, factory in _SECTIONS.items():
        cls = type(factory())
        g = p.add_argument_group(section, (cls.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(cls):
            g.add_argument(
                f"--{section}.{f.name}",
                dest=f"{section}.{f.name}",
                default=argparse.SUPPRESS,
                metavar=type(f.default).__name__.upper(),
                help=f"{f.metadata.get('help', '')} (default: {f.default!r})",
            )
    return p


def config_from_args(ns: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """Apply ``--section.field`` values from ``ns`` onto ``base`` (default config)."""
    base = base or RunConfig()
    updates: dict[str, dict[str, Any]] = {}
    for dest, raw in vars(ns).items():
        if "." not in dest:
            continue
        section, name = dest.split(".", 1)
        default = getattr(getattr(base, section), name)
        kind = type(default)
        try:
            if kind is bool:
                value: Any = _parse_bool(raw)
            elif kind is int:
                value = int(raw)
            elif kind is float:
                value = float(raw)
            else:
                value = str(raw)
        except ValueError:
            fail(f"{dest}: expected {kind.__name__}, got {raw!r}")
        updates.setdefault(section, {})[name] = value
    try:
        return base.replace(**updates)
    except ConfigError as e:
        fail(str(e))
    except TypeError as e:  # e.g. from a malformed base
        fail(str(e))
