"""The defaults the docs state are the config's (klrl.config: the dataclass defaults), so a changed default
cannot leave a page behind: every "`section.field` ... default X" in docs/*.md and README.md, every row of
a "| field | default | meaning |" table, and docs/names.md's table of every field and its default (which
must list every section and field; the failure prints the row to paste)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from klrl.config import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
DEFAULTS = {f"{s}.{f.name}": f.default for s, c in SECTIONS.items() for f in dataclasses.fields(c)}

_FIELD = r"`(?:--)?([a-z_]+\.[a-z_]+)"
# `--kl.beta` ... (default 0.05) / `model.logits`, default `auto` / `--log.wandb_mode auto` (the default)
AFTER = re.compile(_FIELD + r"(?:[ =][^`]*)?`[^`\n]{0,16}?\b(?:klrl's )?default:?\s+(`[^`]*`|-?\d[\w.+-]*)")
INSIDE = re.compile(_FIELD + r"[ =]([^`]+)`,?\s*\((?:the |klrl's )?default\)")
ROW = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \| ([^|]+) \|")


def same(doc: str, default: object) -> bool:
    """Whether the docs' spelling ``doc`` of a value is ``default``."""
    v = doc.strip().strip("`")
    v = "" if v in ("''", '""') else v
    if isinstance(default, bool):
        return v.lower() in (("true", "on") if default else ("false", "off"))
    if isinstance(default, int | float):
        try:
            return float(v) == float(default)
        except ValueError:
            return False
    return v == default


def stated_defaults() -> list[tuple[str, str, str]]:
    """(page, field, the value stated as its default) for every statement found."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for pattern in (AFTER, INSIDE):
            for m in pattern.finditer(text):
                value = m.group(2).strip("`")
                if value in DEFAULTS:  # "(default: `model.path`)": another field's value, not a literal
                    continue
                out.append((page.name, m.group(1), m.group(2)))
        in_table = False
        for line in text.splitlines():
            if line.startswith("| field | default |"):
                in_table = True
            elif not line.startswith("|"):
                in_table = False
            elif in_table and (m := ROW.match(line)):
                out.append((page.name, m.group(1), m.group(2)))
    return out


def test_every_stated_default_is_the_configs():
    found = stated_defaults()
    assert len(found) >= 15  # the patterns still find what the pages say
    unknown = [(p, f) for p, f, _ in found if f not in DEFAULTS]
    assert not unknown, f"not config fields: {unknown}"
    wrong = [f"{p}: {f} default {v} (the config's: {DEFAULTS[f]!r})" for p, f, v in found
             if not same(v, DEFAULTS[f])]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def names_rows() -> dict[str, str]:
    return {
        s: f"| `{s}` | " + ", ".join(f"`{f.name}`={f.default!r}" for f in dataclasses.fields(c)) + " |"
        for s, c in SECTIONS.items()
    }


def test_names_md_lists_every_field_with_its_default():
    text = (ROOT / "docs" / "names.md").read_text()
    missing = [row for row in names_rows().values() if row not in text.splitlines()]
    assert not missing, "docs/names.md's config table should have these rows:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("doc", "default", "ok"),
    [("`head`", "head", True), ("`head`", "auto", False), ("16.0", 16.0, True), ("1e-05", 1e-5, True),
     ("`''`", "", True), ("true", True, True), ("0", False, False), ("x", 3, False)],
)  # fmt: skip
def test_same(doc, default, ok):
    assert same(doc, default) is ok
