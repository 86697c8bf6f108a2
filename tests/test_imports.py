"""No import cycle anywhere in klrl/: every ``import`` statement (module level or inside a function,
``TYPE_CHECKING`` blocks aside) is an edge; the graph of klrl's modules must be acyclic.

The package root ``klrl/__init__.py`` (the public API, which imports everything) is left out:
``from klrl import __version__`` names it, not a module below it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "klrl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: set[str], here: str) -> set[str]:
    out: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("klrl"):
                    out.add(resolve(a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("klrl"):
            for a in node.names:  # ``from klrl.x import y``: y may itself be a module
                full = f"{node.module}.{a.name}"
                out.add(full if full in modules else resolve(node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(None)
    # importing ``klrl.pkg.mod`` first runs ``klrl/pkg/__init__.py``: an edge to that package too
    # (not to the root ``klrl``, nor to a package ``here`` is inside, which is already importing)
    for target in list(out):
        parts = target.split(".")
        for i in range(2, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg in modules and not here.startswith(pkg + "."):
                out.add(pkg)
    out.discard(here)
    return out


def graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    edges = {_module_name(f): _imports(ast.parse(f.read_text()), modules, _module_name(f)) for f in files}
    edges.pop("klrl")
    return {m: {d for d in deps if d != "klrl"} for m, deps in edges.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (c := dfs(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (c := dfs(m)):
            return c
    return None


def test_no_import_cycle_in_klrl():
    edges = graph()
    assert "klrl.step.train" in edges and "klrl.models.gpt" in edges["klrl.step.train"]  # the graph is real
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    tree = ast.parse(
        "import klrl.x\nif TYPE_CHECKING:\n    import klrl.y\ndef f():\n    from klrl import z\n"
    )
    assert _imports(tree, {"klrl", "klrl.x", "klrl.y", "klrl.z"}, "klrl.w") == {"klrl.x", "klrl.z"}


def test_results_is_a_leaf_and_nothing_imports_the_report():
    edges = graph()
    assert edges["klrl.analysis.results"] <= {
        "klrl.config.run",
        "klrl.io",
        "klrl.io.logging",
        "klrl.io.readers",
    }
    assert edges["klrl.io.readers"] <= {"klrl.config.run", "klrl.config.schema"}  # (so results stays a leaf)
    importers = sorted(
        m for m, deps in edges.items() if {"klrl.analysis.report", "klrl.analysis.plots"} & deps
    )
    # only the report reads the plots; only the command line (klrl.cli.commands) attaches a report
    assert importers == ["klrl.cli.commands", "klrl.analysis.report"], importers
