"""What a sweep's members may differ in, and the grid of a sweep's axes.

A sweep (:func:`klrl.api.sweep`) is one compiled program over stacked train states, so its members
may differ only in what lives in the train state: the initial beta (``kl.beta``), the controller
(``ctrl.kind`` and every numeric ``ctrl`` field), the seed (``train.seed``) and the peak learning
rate (``optim.lr``, an optax injected hyper-parameter); ``train.name`` only names the member.
Everything else fixes array shapes or the program and must be equal across members
(:func:`check_members`: a difference is a :class:`ConfigError` naming the field).

A sweep's axes (``--sweep section.field=v1,v2``, :func:`parse_axis` and :func:`grid`) must each
change the members' maths: a field that is per-run bookkeeping (:data:`BOOKKEEPING`: ``train.name``,
``train.out_dir``, ``train.quiet``, ...) or one that fixes the program is refused by name, and so is
a grid with two members that would be the same run (a value given twice; a controller knob the
members' controller does not read, e.g. ``ctrl.kp`` with ``ctrl.kind=fixed``: :func:`unread`). The
flags given beside a sweep or the study (:func:`check_overrides`) must be used: one the sweep sets
per member (an axis; the study's beta and controller) is refused by name, and so is a ``ctrl`` knob
no member's controller reads. Refused, not silently ignored: the user asked for something the run
would not do.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from klrl.config.fields import ControllerConfig
from klrl.config.run import ConfigError, RunConfig
from klrl.registry import CONTROLLERS

__all__ = ["BOOKKEEPING", "KNOBS", "SWEEPABLE", "check_members", "check_overrides", "ctrl_knobs", "grid",
           "parse_axis", "unread"]  # fmt: skip

# fields a member may change; all else must match the first member
SWEEPABLE = {
    ("kl", "beta"),
    ("kl", "loss_coef"),  # in the train state as beta is (the driven coefficient or ``other_coef``)
    ("optim", "lr"),
    ("train", "seed"),
    ("train", "name"),
    *(
        ("ctrl", f.name)
        for f in dataclasses.fields(RunConfig().ctrl)
        if f.name not in ("unit", "estimator", "drives")
    ),
}


# per-run bookkeeping: where and how a run is written and shown, not its maths; one value per sweep
BOOKKEEPING = {
    *(("train", f) for f in ("name", "out_dir", "quiet", "log_every", "checkpoint_every", "keep_checkpoints",
                             "samples_every", "samples_n", "metric_aliases", "hooks", "metric_fns")),
    *(("diag", f.name) for f in dataclasses.fields(RunConfig().diag)),
    *(("log", f.name) for f in dataclasses.fields(RunConfig().log)),
}  # fmt: skip

# the ctrl fields every controller kind reads (warmup_beta too when warmup_iters > 0), or that are not
# the controller's (which KL it observes, what beta drives); the rest are knobs some kinds read
_EVERY_KIND = ("kind", "unit", "estimator", "drives", "warmup_iters", "beta_min", "beta_max")
KNOBS = tuple(
    f.name for f in dataclasses.fields(ControllerConfig) if f.name not in (*_EVERY_KIND, "warmup_beta")
)


def ctrl_knobs(kind: str) -> tuple[str, ...]:
    """The knobs (:data:`KNOBS`) the controller ``kind`` reads: its registration's ``knobs``
    (``@CONTROLLERS.register(name, knobs=(...))``; klrl's own in :data:`klrl.registry.BUILTIN`); a
    kind registered without them is taken to read every knob."""
    knobs = CONTROLLERS.meta(kind).get("knobs", KNOBS)
    if unknown := set(knobs) - set(KNOBS):
        raise ValueError(
            f"controller {kind!r}: knobs {', '.join(sorted(unknown))} are not ctrl knobs ({', '.join(KNOBS)})"
        )
    return tuple(knobs)


def unread(cfg: RunConfig) -> set[str]:
    """The sweepable fields ``cfg``'s maths does not read: the ``ctrl`` knobs its controller kind
    ignores (:func:`ctrl_knobs`), ``ctrl.warmup_beta`` without a warm-up, ``kl.beta`` with one (the
    warm-up's beta is the start: :func:`klrl.algo.control.init_state`) and ``train.name``."""
    c = cfg.ctrl
    out = {"train.name"} | {f"ctrl.{k}" for k in set(KNOBS) - set(ctrl_knobs(c.kind))}
    if c.warmup_iters > 0:
        out.add("kl.beta" if c.drives == "reward" else "kl.loss_coef")
    else:
        out.add("ctrl.warmup_beta")
    return out


def _effective(cfg: RunConfig) -> tuple:
    """``cfg`` less what its maths does not read (:func:`unread`): equal for two members that are
    the same run."""
    skip = unread(cfg)
    d = cfg.to_dict()
    return tuple((s, k, repr(v)) for s, fs in d.items() for k, v in fs.items() if f"{s}.{k}" not in skip)


def grid(base: RunConfig, axes: dict[str, list[Any]]) -> list[RunConfig]:
    """The Cartesian product of ``{'section.field': [values]}`` applied to ``base``. Every axis must
    be sweepable and not bookkeeping (:func:`check_axis`), and no two members may be the same run
    (a value given twice, or a difference only in what their maths does not read: :func:`unread`);
    :class:`ConfigError` naming the axis otherwise."""
    names = list(axes)
    for n in names:
        check_axis(n)
        vals = list(axes[n])
        twice = [v for i, v in enumerate(vals) if v in vals[:i]]
        if twice:
            raise ConfigError(
                f"--sweep {n}: value {twice[0]!r} given twice (two members would be the same run)"
            )
    out, seen = [], {}
    for values in itertools.product(*(axes[n] for n in names)):
        upd: dict[str, dict[str, Any]] = {}
        for n, v in zip(names, values, strict=True):
            section, field = n.split(".", 1)
            upd.setdefault(section, {})[field] = v
        member = base.replace(**upd)
        key = _effective(member)
        if key in seen:
            raise ConfigError(_same_run(names, seen[key], values, member))
        seen[key] = values
        out.append(member)
    return out


def _same_run(names: list[str], a: tuple, b: tuple, member: RunConfig) -> str:
    differ = [n for n, x, y in zip(names, a, b, strict=True) if x != y]
    what = ", ".join(f"{n}={x!r} and {y!r}" for n, x, y in zip(names, a, b, strict=True) if x != y)
    ctrl = f" with ctrl.kind={member.ctrl.kind}" if any(n.startswith("ctrl.") for n in differ) else ""
    warm = f" with ctrl.warmup_iters={member.ctrl.warmup_iters}" if member.ctrl.warmup_iters else ""
    return (
        f"--sweep {differ[0]}: two members would be the same run ({what}): their maths does not "
        f"read {', '.join(differ)}{ctrl or warm}"
    )


def check_axis(name: str) -> None:
    """``section.field`` may be a sweep axis: it is sweepable (:data:`SWEEPABLE`) and changes the
    members' maths (not :data:`BOOKKEEPING`, ``train.name`` included)."""
    section, field = name.split(".", 1)
    if (section, field) in BOOKKEEPING:
        raise ConfigError(
            f"--sweep {name}: per-run bookkeeping, one value for the whole sweep (it does not change a "
            "member's maths; the members are named after their swept values)"
        )
    if (section, field) not in SWEEPABLE:
        raise ConfigError(f"--sweep {name}: cannot differ between sweep members (it fixes the program)")


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

    check_axis(name)
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
                if v != first[section][k] and (section, k) in BOOKKEEPING - SWEEPABLE:
                    raise ConfigError(
                        f"{section}.{k}: cannot differ between sweep members (per-run bookkeeping: one "
                        "value for the whole sweep)"
                    )
                if v != first[section][k] and (section, k) not in SWEEPABLE:
                    raise ConfigError(
                        f"{section}.{k}: cannot differ between sweep members (it fixes the program)"
                    )


def check_overrides(given: list[str], base: RunConfig, members: list[RunConfig], by: str) -> None:
    """The fields set by flags (``given``: ``section.field`` names, already applied to ``base``)
    beside a sweep or the study (``by``: ``'--sweep'``, ``'the study'``) are used by its
    ``members``: none is one the sweep sets per member (an axis, the study's beta and controller:
    a member's value differs from ``base``'s), and a ``ctrl`` knob (or the starting ``kl.beta``) is
    read by some member's controller (:func:`unread`). :class:`ConfigError` naming the first flag that
    is not: the flag would be ignored."""
    for name in given:
        section, field = name.split(".", 1)
        values = [getattr(getattr(m, section), field) for m in members]
        if any(v != getattr(getattr(base, section), field) for v in values):
            shown = ", ".join(dict.fromkeys(f"{v:g}" if isinstance(v, float) else str(v) for v in values))
            how = "" if by == "--sweep" else f"; choose the values with --sweep {name}=v1,v2"
            raise ConfigError(
                f"{name}: set per member by {by} ({shown}), so the value given would be ignored{how}"
            )
        if (section == "ctrl" or name in ("kl.beta", "kl.loss_coef")) and all(
            name in unread(m) for m in members
        ):
            kinds = ", ".join(dict.fromkeys(m.ctrl.kind for m in members))
            raise ConfigError(
                f"{name}: read by no member of {by} (ctrl.kind {kinds}, ctrl.warmup_iters "
                f"{members[0].ctrl.warmup_iters}), so the value given would be ignored"
            )
    seen: dict[tuple, int] = {}
    for j, m in enumerate(members):
        i = seen.setdefault(_effective(m), j)
        if i != j:
            a, b = members[i].to_dict(), m.to_dict()
            differ = [f"{s}.{k}" for s in a for k in a[s] if a[s][k] != b[s][k]]
            raise ConfigError(
                f"{by}: members {i} and {j} would be the same run: their maths does not read "
                f"{', '.join(differ)} (ctrl.kind {m.ctrl.kind}, ctrl.warmup_iters {m.ctrl.warmup_iters})"
            )
