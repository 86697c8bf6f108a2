"""The README stays true to the tree: its package map names every package and root module of klrl/
and nothing else, its relative links (and those of docs/) point to files that exist, and its test
command is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXEMPT_ROOT = {"__init__.py", "__main__.py"}  # the package itself and ``python -m klrl``


def package_map(text: str) -> list[str]:
    """The entries of the first code block under ``## Package map``: ``klrl/pkg/`` or ``klrl/mod.py``."""
    section = text.split("\n## Package map", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.startswith("klrl/")]


def tree_entries(root: Path) -> list[str]:
    """``klrl/pkg/`` for every package directly below klrl/, ``klrl/mod.py`` for every root module."""
    pkg = root / "klrl"
    packages = [f"klrl/{d.name}/" for d in pkg.iterdir() if (d / "__init__.py").is_file()]
    modules = [f"klrl/{f.name}" for f in pkg.glob("*.py") if f.name not in EXEMPT_ROOT]
    return sorted(packages + modules)


def relative_links(text: str) -> list[str]:
    """Markdown link targets that are paths (no scheme, no pure anchor), without their anchor."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_package_map_matches_the_tree():
    named = package_map(README.read_text())
    assert len(named) == len(set(named)), "named twice: " + str(
        sorted({n for n in named if named.count(n) > 1})
    )
    tree = tree_entries(ROOT)
    assert sorted(named) == tree, (
        f"in the README, not in klrl/: {sorted(set(named) - set(tree))}; "
        f"in klrl/, not in the README: {sorted(set(tree) - set(named))}"
    )


def test_links_point_to_files_that_exist():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = [
        f"{page.relative_to(ROOT)}: {t}"
        for page in pages
        for t in relative_links(page.read_text())
        if not (page.parent / t).exists()
    ]
    assert relative_links(README.read_text()), "the README links nothing"
    assert not missing, missing


def test_readme_test_command_is_what_ci_runs():
    """``.ci/run`` runs exactly the README's test command (its steps, in order; pip's -q and CI's
    upgrade of pip aside), and the README's main command is the one the task fixes."""
    readme = README.read_text()
    (command,) = [ln for ln in readme.splitlines() if "pip install -e '.[test,hf]'" in ln]
    steps = [s.strip() for s in command.split("&&")][2:]  # after the venv's creation and activation
    ci = [ln.split("#")[0].strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    ci_steps = [
        s.strip() for ln in ci if ln.startswith(("python -m pip install", "ruff")) for s in ln.split("&&")
    ]
    ci_steps = [re.sub(r"^python -m pip install -q ", "pip install ", s) for s in ci_steps]
    ci_steps = [s for s in ci_steps if s != "pip install --upgrade pip"]  # CI's own, before the rest
    assert steps == ci_steps
    assert (
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python experiments/run.py"
        in readme
    )


# --- the test's own logic -----------------------------------------------------------------------------


def test_package_map_parser_and_tree(tmp_path):
    text = "# x\n\n## Package map\n\nintro\n\n```\nklrl/a/   first\nklrl/b.py  second\n  wrapped\n```\n"
    text += "\n## More\n\n```\nklrl/c/ not in the map\n```\n"
    assert package_map(text) == ["klrl/a/", "klrl/b.py"]
    for rel in (
        "klrl/__init__.py",
        "klrl/__main__.py",
        "klrl/a/__init__.py",
        "klrl/b.py",
        "klrl/files/x.txt",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert tree_entries(tmp_path) == ["klrl/a/", "klrl/b.py"]  # data directories are no packages


def test_relative_links_parser():
    text = "[a](docs/x.md) [b](https://e.org/y) [c](#anchor) [d](../z.md#sec) `[e](f)` [g](mailto:h)"
    assert relative_links(text) == ["docs/x.md", "../z.md", "f"]
