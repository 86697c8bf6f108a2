"""Command-line parsing generated from the config dataclasses.

``--section.field value`` for every field of :class:`klrl.config.run.RunConfig`; booleans take
``true/false``; ``--config FILE`` (JSON or YAML, the layout of a run directory's ``config.json``)
sets the base the flags override. ``--help`` lists every field with its meaning and default.

Errors (unknown flag, unparsable value, a rule broken, a path that cannot be used) end in one line
naming the field and exit status 2, before anything compiles. An unknown flag gets a "did you mean"
(difflib over klrl's flags), and the names TRL and verl use (``--kl_coef``, ``--target_kl``,
``--learning_rate``, ...) are mapped to klrl's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import yaml

from klrl.config import SECTIONS, ConfigError, RunConfig, aliases, field_names
from klrl.config.fields import GPT_ONLY
from klrl.config.schema import ALIASES, closest, short
from klrl.io import paths
from klrl.io.readers import RunDirError, read_json, read_text

_FLOAT = re.compile(r"^-(\d|\.\d|inf|nan|infinity)", re.IGNORECASE)
SWEEP_SYNTAX = "expected --sweep section.field=v1,v2 (e.g. --sweep kl.beta=0.01,0.1)"


def fail(message: str, status: int = 2) -> NoReturn:
    """One line on stderr, then exit: the user-error path."""
    line = " ".join(str(message).split())  # one line, whatever the message held
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(status)


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {s!r}")


_REPEATABLE = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction)


def repeated_flag(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The error for a flag that takes a value given twice in ``argv`` (two spellings of one field,
    ``--lora.rank`` and ``--model.lora.rank``, count as one), None when there is none; flags meant to
    repeat (``--sweep``, ``--prompt``) are not counted. Refused rather than last-wins: one of the two
    values would be dropped without a word, and the base-plus-override habit has a spelling that keeps
    both visible (``--config base.yaml --kl.beta 0.2``: flags override the file)."""
    seen: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            break
        name, eq, value = token.partition("=")
        action = parser._option_string_actions.get(name) if token.startswith("--") else None
        if action is None or action.nargs == 0:
            continue
        if not eq and i < len(argv):
            value, i = argv[i], i + 1
        if isinstance(action, _REPEATABLE):
            continue
        if action.dest in seen:
            first, v0 = seen[action.dest]
            again = name if name == first else f"{name} (the same as {first})"
            hint = (" (flags override --config FILE: a base plus an override is --config base.yaml and the "
                    "flag)") if "--config" in parser._option_string_actions else ""  # fmt: skip
            return f"{again}: given twice ({short(v0)}, then {short(value)}); give it once{hint}"
        seen[action.dest] = (name, value)
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2, no usage dump
        fail(message)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's, refusing a flag given twice (:func:`repeated_flag`)."""
        argv = sys.argv[1:] if args is None else list(args)
        message = repeated_flag(self, argv)
        if message is not None:
            self.error(message)
        return super().parse_known_args(argv, namespace)


def build_parser(
    description: str = "",
    extra: Any = None,
    prog: str | None = None,
    fields: bool = True,
    shown: Callable[[str], bool] | None = None,
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """The parser of a command: ``--config`` and a flag per config field (``fields``), the
    command's own flags added by ``extra(parser)``. ``shown(section.field)``: whether ``--help`` lists
    a field (default: every one; the others are parsed all the same); ``shown`` rejecting every field
    also hides ``--config``. klrl's built-in GPT's fields (:data:`GPT_ONLY`) get their own heading."""
    p = _Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                allow_abbrev=False, prog=prog, epilog=epilog)  # fmt: skip
    if not fields:
        return p
    show = shown or (lambda name: True)
    any_shown = any(show(n) for n in field_names())
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a JSON or YAML file of {section: {field: value}} (a run's config.json works); "
                        "the flags override it" if any_shown else argparse.SUPPRESS)  # fmt: skip
    if extra is not None:
        extra(p)
    for name, cls in SECTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        g = gpt = p  # a section with no field shown: no heading
        if any(show(f"{name}.{f}") for f in names if name != "model" or f not in GPT_ONLY):
            g = gpt = p.add_argument_group(
                name, " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
            )
        if name == "model" and any(show(f"model.{f}") for f in GPT_ONLY):
            gpt = p.add_argument_group(f"{name} (klrl's built-in GPT only)", GPT_HELP)
        for f in dataclasses.fields(cls):
            help_ = f"{f.metadata.get('help', '')} (default: {f.default!r})"
            dest, metavar = f"{name}.{f.name}", type(f.default).__name__.upper()
            (gpt if name == "model" and f.name in GPT_ONLY else g).add_argument(
                f"--{dest}",
                dest=dest,
                default=argparse.SUPPRESS,
                metavar=metavar,
                help=help_ if show(dest) else argparse.SUPPRESS,
            )
            if name == "lora":  # an older spelling, still read; --help, README and docs write --lora.FIELD
                hidden = {"default": argparse.SUPPRESS, "metavar": metavar, "help": argparse.SUPPRESS}
                g.add_argument(f"--model.lora.{f.name}", dest=dest, **hidden)
    return p


GPT_HELP = (
    "the testbed tasks' policy; ignored with --model.path, whose config.json or GGUF header fixes "
    "the architecture"
)


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def unknown_flag_message(token: str, flags: list[str]) -> str:
    """The error for an argument the parser does not know: a flag from TRL/verl, a typo, a field
    without its section, or a stray value."""
    if not token.startswith("-"):
        return f"unexpected argument {token!r} (values follow their flag: --section.field VALUE)"
    name = token.split("=", 1)[0]
    bare = name.lstrip("-")
    if bare in ALIASES:
        target, where = ALIASES[bare]
        note = f" ({where})" if where else ""
        return f"{name}: not a klrl flag; klrl's is --{target}{note}"
    if bare.split(".", 1)[0] not in SECTIONS and (target := aliases.lookup(bare)):  # TRL/verl/OpenRLHF
        note = aliases.FLAG_NOTES.get(aliases.matched_key(bare) or "")
        note = f" ({note})" if note else ""
        return f"{name}: not a klrl flag; klrl's is --{target}{note}"
    if "." in bare:
        sec, fld = bare.split(".", 1)
        shown = sec
        if sec == "model" and fld.startswith("lora."):  # the older --model.lora.FIELD spelling of lora.FIELD
            sec, fld, shown = "lora", fld[len("lora.") :], "lora"
        if sec in SECTIONS:
            valid = [f.name for f in dataclasses.fields(SECTIONS[sec])]
            near = closest(fld, valid)
            if near is not None:
                return f"{shown}.{fld}: unknown field; did you mean --{shown}.{near}?"
            # another spelling, nearly the same (model.lora_rank); else the valid names say more
            near = closest(bare, [f[2:] for f in flags if "." in f], cutoff=0.85)
            near = near and near.removeprefix("model.")  # model.lora.X: written lora.X (one spelling)
            hint = f"; did you mean --{near}?" if near else f" (valid: {', '.join(valid)})"
            return f"{shown}.{fld}: unknown field{hint}"
        near = closest(bare, field_names())
        if near is None and closest(sec, SECTIONS):
            return f"{bare}: unknown section {sec!r}; did you mean {closest(sec, SECTIONS)}?"
        hint = f"; did you mean --{near}?" if near else f" (sections: {', '.join(SECTIONS)})"
        return f"{name}: unknown flag{hint}"
    owners = [n for n in field_names() if n.split(".", 1)[1] == bare.replace("-", "_")]
    if owners:
        return (
            f"{name}: unknown flag; config fields take their section: {' or '.join('--' + o for o in owners)}"
        )
    near = closest(name, flags) or closest(name.replace("_", "-"), flags)
    if near is None:  # a field's name misspelt without its section (--rnak): the sections that have it
        field = closest(bare.replace("-", "_"), {n.split(".", 1)[1] for n in field_names()})
        near = " or ".join(f"--{n}" for n in field_names() if n.split(".", 1)[1] == field) or None
    return f"{name}: unknown flag" + (f"; did you mean {near}?" if near else "")


def _join_values(argv: list[str], flags: set[str]) -> list[str]:
    """``--f -inf`` -> ``--f=-inf``: argparse takes a value starting with '-' for a flag otherwise."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if a in flags and "." in a and nxt is not None and _FLOAT.match(nxt) and nxt not in flags:
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def parse(
    parser: argparse.ArgumentParser, argv: list[str], positional_axes: bool = False
) -> argparse.Namespace:
    """``parser.parse_args`` with the teaching errors (:func:`unknown_flag_message`, the ``--sweep``
    syntax). ``positional_axes``: bare ``section.field=v1,v2`` arguments are sweep axes."""
    flags = _flags(parser)
    ns, rest = parser.parse_known_args(_join_values(list(argv), set(flags)))
    dashed = [t for t in rest if t.startswith("-")]
    if dashed:
        fail(unknown_flag_message(dashed[0], flags))
    if positional_axes:
        ns.sweep = [*ns.sweep, *rest]
        rest = []
    for spec in getattr(ns, "sweep", None) or []:
        if "=" not in spec:
            after = f" {rest[0]}" if rest else ""
            fail(f"--sweep {spec}{after}: {SWEEP_SYNTAX}")
    if rest:
        fail(unknown_flag_message(rest[0], flags))
    return ns


def overrides_of(ns: argparse.Namespace) -> list[str]:
    """The ``section.field`` names set on the command line."""
    return [d for d in vars(ns) if "." in d and d.split(".", 1)[0] in SECTIONS]


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the later value
    without a word); a merge key (``<<: *base``) overriding a merged value is YAML's own and allowed."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                earlier = first.get(key)
                first.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if earlier is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} at line {key_node.start_mark.line + 1} (first at "
                    f"line {earlier}; a key may appear once, the later value would silently replace the "
                    "earlier)", key_node.start_mark)  # fmt: skip
        return super().construct_mapping(node, deep=deep)


def load_config_file(path: str) -> RunConfig:
    """``--config FILE``: a JSON or YAML mapping ``{section: {field: value}}``."""
    p = Path(path)
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            d = yaml.load(read_text(p), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except RunDirError as e:
            fail(f"--config: {e}")
        except yaml.constructor.ConstructorError as e:
            if "duplicate key" not in str(e.problem):
                fail(f"--config: {p}: not valid YAML ({type(e).__name__}: {short(str(e), 80)})")
            fail(f"--config: {p}: {e.problem}")
        except (yaml.YAMLError, RecursionError) as e:
            fail(f"--config: {p}: not valid YAML ({type(e).__name__}: {short(str(e), 80)})")
    else:
        try:
            d = read_json(p)
        except RunDirError as e:
            fail(f"--config: {e}")
    try:
        return RunConfig.from_dict(d)
    except ConfigError as e:
        fail(f"--config {p}: {e}")
    except RecursionError:
        fail(f"--config {p}: nested too deeply")


def _typed(dest: str, raw: Any, default: Any) -> Any:
    kind = type(default)
    try:
        if kind is bool:
            return _parse_bool(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return str(raw)
    except (ValueError, OverflowError):
        fail(f"{dest}: expected {kind.__name__}, got {short(raw)}")


def config_from_args(ns: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """Apply ``--section.field`` values from ``ns`` onto ``base`` (else ``--config FILE``, else the
    default config). ``--model.path`` on the default task (``testbed``, not given) selects
    ``task.name=text``: RLHF on that pretrained model."""
    if base is None and getattr(ns, "config", None):
        base = load_config_file(ns.config)
    base = base or RunConfig()
    updates: dict[str, dict[str, Any]] = {}
    for dest in overrides_of(ns):
        section, name = dest.split(".", 1)
        value = _typed(dest, getattr(ns, dest), getattr(getattr(base, section), name))
        updates.setdefault(section, {})[name] = value
    # a pretrained model given on the command line, on the default task: the text task (RLHF on that model)
    new_model = updates.get("model", {}).get("path") and not base.model.path
    if new_model and "name" not in updates.get("task", {}) and base.task.name == "testbed":
        updates.setdefault("task", {})["name"] = "text"
    try:
        return base.replace(**updates)
    except ConfigError as e:  # UnknownFieldError included
        fail(str(e))


# ---- paths (klrl.io.paths: ConfigErrors), as one line and exit 2 for the commands that are not runs ----
def _or_fail(check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    try:
        check(*args, **kwargs)
    except ConfigError as e:
        fail(str(e))


def check_special(path: str | os.PathLike | None, what: str) -> None:
    """:func:`klrl.io.paths.check_special`: one line, exit 2."""
    _or_fail(paths.check_special, path, what)


def check_new_path(path: str | os.PathLike, what: str, *, directory: bool) -> None:
    """:func:`klrl.io.paths.check_new_path`: one line, exit 2."""
    _or_fail(paths.check_new_path, path, what, directory=directory)


def check_run_dir_writable(run_dir: str | os.PathLike, what: str) -> None:
    """:func:`klrl.io.paths.check_run_dir_writable` (``klrl report``): one line, exit 2."""
    _or_fail(paths.check_run_dir_writable, run_dir, what)


def check_coordinator(address: str | None) -> None:
    """``HOST:PORT`` with a port in 1..65535."""
    if address is None:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        fail(f"--coordinator: expected HOST:PORT with a port in 1..65535, got {short(address)}")
