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


# --- the README's command lines parse -----------------------------------------------------------------


def command_lines(text: str) -> list[str]:
    """The ``klrl ...`` lines of the page's code blocks (a trailing ``# comment``, ``[optional]`` parts
    and ``...`` dropped; a line continued with a backslash joined)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line.startswith("klrl "):
                continue
            line = re.sub(r"\s+#.*$", "", line)
            line = re.sub(r"\[[^\]]*\]", "", line).replace("...", "")
            out.append(" ".join(line.split()))
    return out


def parse_command(line: str) -> None:
    """Parse one ``klrl`` command line with the command's real parser (nothing is run): a flag or
    value the parser refuses is the one-line error and ``SystemExit(2)``."""
    import shlex

    from klrl.cli import commands
    from klrl.cli.args import config_from_args, parse
    from klrl.cli.flags import PARSERS

    cmd, *rest = shlex.split(line)[1:]
    if cmd == "models":
        assert rest == [], line
        return
    if cmd in PARSERS:
        PARSERS[cmd]().parse_args(rest)
        return
    assert cmd in commands.COMMANDS, f"{line}: not a klrl command"
    ns = parse(commands._command_parser(cmd), rest, positional_axes=cmd == "sweep")
    if cmd in ("train", "sweep", "study") and not getattr(ns, "config", None):
        config_from_args(ns)  # the values' types and ranges: RunConfig's checks


def test_every_command_line_of_the_readme_and_docs_parses(capsys):
    """Each ``klrl ...`` command in a code block of the README (and of docs/) parses with the real
    parser, and the LoRA flags are written one way, ``--lora.FIELD``, as ``--help`` lists them
    (issue 48: the README wrote ``--model.lora.rank``)."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    lines = [(p, ln) for p in pages for ln in command_lines(p.read_text())]
    assert sum(p == README for p, _ in lines) >= 15, "the README's commands were not found"
    bad = []
    for page, line in lines:
        try:
            parse_command(line)
        except SystemExit as e:
            bad.append(f"{page.name}: {line}: {capsys.readouterr().err.strip()} (exit {e.code})")
        if "--model.lora." in line:
            bad.append(f"{page.name}: {line}: writes --model.lora.*, --help lists --lora.*")
    assert not bad, "\n".join(bad)
    from klrl.cli import commands

    shown = commands._command_parser("train").format_help()
    assert "--lora.rank" in shown and "--model.lora" not in shown
