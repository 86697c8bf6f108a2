"""A schema fuzz (issue 41, item 6): every field of the config schema x {0, negative, NaN, inf, huge, wrong
type, empty}, given to ``klrl train`` in this process (``klrl.cli.commands.main``, ``SystemExit`` caught,
stderr captured), on the command line and, for the wrong types the command line cannot spell, in a
``--config`` JSON file. Every case must end in exit status 2, exactly one line on stderr naming the
field, and nothing written (no run directory, no cache) and nothing built (the task builders, the
train step and the run are replaced by functions that fail the case if reached).

Which cases are generated is derived from the schema, not listed by hand: a value is *valid* for its
field, and skipped, when the config accepts it (the field's type and the section's ``__post_init__``
rules, then :meth:`RunConfig.__post_init__`'s cross-field rules) and so do the config-only checks every
run passes first (:func:`klrl.checks.check_config`: a model path the task reads, no field without
effect, LoRA ranks within the layers' widths); the command line's one rewrite (``--model.path`` on the
default task selects ``task.name=text``) is applied first. Everything else is invalid and tested.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from klrl.checks import check_config
from klrl.config import SECTIONS, ConfigError, RunConfig

FIELDS = [(s, f) for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
# the command line's spelling of each probe, by the field's type (its default's)
_NUMBERS = {"zero": "0", "negative": "-1", "nan": "nan", "inf": "inf"}
CLI = {
    int: {**_NUMBERS, "huge": "99999999999", "wrong_type": "ten", "empty": ""},
    float: {**_NUMBERS, "huge": "1e300", "wrong_type": "ten", "empty": ""},
    bool: {**_NUMBERS, "huge": "99999999999", "wrong_type": "ten", "empty": ""},
    str: {**_NUMBERS, "huge": "x" * 5000, "empty": ""},
}  # fmt: skip
# wrong types a JSON --config can hold and the command line cannot
JSON = {int: ["3", 1.5, True, None], float: ["0.1", True, [1.0]], bool: ["true", 1, None], str: [5, [], None]}


def _typed(kind: type, raw: str):
    """The command line's reading of ``raw`` (klrl.cli.args); ValueError where it cannot."""
    if kind is bool:
        v = raw.strip().lower()
        if v not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(raw)
        return v in ("1", "true", "yes", "on")
    return kind(raw)


def valid(section: str, name: str, value) -> bool:
    """Whether the schema and the config-only checks accept ``value`` for ``section.name``."""
    upd = {section: {name: value}}
    if (section, name) == ("model", "path") and value:  # the command line's one rewrite
        upd["task"] = {"name": "text"}
    try:
        cfg = RunConfig().replace(**upd)
        check_config([cfg], stacked=False)
    except (ConfigError, TypeError, ValueError, OverflowError):
        return False
    return True


def _cases() -> list[tuple[str, str, str, object]]:
    out = []
    for s, f in FIELDS:
        kind = type(f.default)
        for probe, raw in CLI[kind].items():
            try:
                ok = valid(s, f.name, _typed(kind, raw))
            except (ValueError, OverflowError):
                ok = False
            if not ok:
                out.append((f"{s}.{f.name}", "cli", probe, raw))
        for value in JSON[kind]:
            if not valid(s, f.name, value):
                out.append((f"{s}.{f.name}", "json", "wrong_type", value))
    return out


CASES = _cases()


class Reached(AssertionError):
    pass


@pytest.fixture
def nothing_is_built(monkeypatch, tmp_path):
    import klrl
    import klrl.api
    import klrl.cli.launch
    import klrl.loop.build
    import klrl.step.train

    def reached(what):
        def f(*a, **k):
            raise Reached(f"{what} was reached: the input was not refused before anything was built")

        return f

    for obj, name in ((klrl.loop.build, "build_task"), (klrl.api, "run"), (klrl, "run"), (klrl.api, "sweep"),
                      (klrl.step.train, "make_train"), (klrl.api, "make_program"),
                      (klrl.cli.launch, "run_one"), (klrl.cli.launch, "run_sweep")):  # fmt: skip
        monkeypatch.setattr(obj, name, reached(f"{obj.__name__}.{name}"))
    import klrl.cli.commands

    for name in ("run_one", "run_sweep"):
        monkeypatch.setattr(klrl.cli.commands, name, reached(f"klrl.cli.commands.{name}"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("KLRL_CACHE", str(work / "cache"))
    monkeypatch.chdir(work)
    return work


def test_there_are_enough_cases():
    assert len(CASES) >= 150, len(CASES)
    assert {p for _, _, p, _ in CASES} == {"zero", "negative", "nan", "inf", "huge", "wrong_type", "empty"}


@pytest.mark.parametrize("field,how,probe,value", CASES, ids=[f"{f}-{h}-{p}" for f, h, p, _ in CASES])
def test_an_invalid_value_is_one_line_exit_2_and_nothing_written(field, how, probe, value, nothing_is_built,
                                                                 tmp_path, capsys):  # fmt: skip
    from klrl.cli.commands import main

    work = nothing_is_built
    section, name = field.split(".", 1)
    if how == "cli":
        argv = ["train", f"--{field}={value}"]
    else:
        cfg_file = tmp_path / "config.json"  # outside the working directory, where runs would go
        cfg_file.write_text(json.dumps({section: {name: value}}))
        argv = ["train", "--config", str(cfg_file)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2, (argv[:3], err[-500:])
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv[:3], err[-1000:])
    spellings = (field, f"model.lora.{name}") if section == "lora" else (field,)
    assert any(s in lines[0] for s in spellings), (argv[:3], lines[0])
    assert list(work.iterdir()) == [], list(work.rglob("*"))  # no run directory, no cache
