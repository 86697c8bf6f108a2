"""What a sweep's members may differ in, and the grid of a sweep's axes.

A sweep (:func:`klrl.api.sweep`) is one compiled program over stacked train states, so its members
may differ only in what lives in the train state: the initial beta (``kl.beta``), the controller
(``ctrl.kind`` and every numeric ``ctrl`` field), the seed (``train.seed``) and the peak learning
rate (``optim.lr``, an optax injected hyper-parameter); ``train.name`` only names the member.
Everything else fixes array shapes or the program and must be equal across members
(:func:`check_members`: a difference is a :class:`ConfigError` naming the field).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from klrl.config.run import ConfigError, RunConfig

__all__ = ["SWEEPABLE", "check_members", "grid", "parse_axis"]

# fields a member may change; all else must match the first member
SWEEPABLE = {
    ("kl", "beta"),
    ("optim", "lr"),
    ("train", "seed"),
    ("train", "name"),
    *(
        ("ctrl", f.name)
        for f in dataclasses.fields(RunConfig().ctrl)
        if f.name not in ("unit", "estimator", "drives")
    ),
}


def grid(base: RunConfig, axes: dict[str, list[Any]]) -> list[RunConfig]:
    """The Cartesian product of ``{'section.field': [values]}`` applied to ``base``."""
    names = list(axes)
    out = []
    for values in itertools.product(*(axes[n] for n in names)):
        upd: dict[str, dict[str, Any]] = {}
        for n, v in zip(names, values, strict=True):
            section, field = n.split(".", 1)
            upd.setdefault(section, {})[field] = v
        out.append(base.replace(**upd))
    return out


def parse_axis(spec: str, base: RunConfig) -> tuple[str, list[Any]]:
    """``'kl.beta=0.01,0.1'`` -> ``('kl.beta', [0.01, 0.1])``, values typed like the field."""
    if "=" not in spec:
        raise ConfigError(f"--sweep: expected section.field=v1,v2,... (got {spec!r})")
    name, raw = spec.split("=", 1)
    if "." not in name or not hasattr(base, name.split(".")[0]):
        raise ConfigError(f"--sweep: unknown field {name!r}")
    section, field = name.split(".", 1)
    sub = getattr(base, section)
    if not hasattr(sub, field):
        raise ConfigError(f"--sweep: unknown field {name!r}")
    kind = type(getattr(sub, field))

    def typed(v: str) -> Any:
        v = v.strip()
        if kind is bool:
            if v.lower() not in ("1", "true", "0", "false"):
                raise ValueError(f"not a boolean: {v!r}")
            return v.lower() in ("1", "true")
        return kind(v)

    try:
        return name, [typed(v) for v in raw.split(",")]
    except ValueError as e:
        raise ConfigError(f"--sweep {name}: {e}") from e


def check_members(members: list[RunConfig]) -> None:
    """There are members, and they differ only in :data:`SWEEPABLE` fields."""
    if not members:
        raise ConfigError("sweep: no members")
    first = members[0].to_dict()
    for m in members[1:]:
        d = m.to_dict()
        for section, fields in d.items():
            for k, v in fields.items():
                if v != first[section][k] and (section, k) not in SWEEPABLE:
                    raise ConfigError(
                        f"{section}.{k}: cannot differ between sweep members (it fixes the program)"
                    )
