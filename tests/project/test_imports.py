"""klrl's import graph: packages import downward only, nothing imports in a cycle, and imports sit at the
top of their module except for optional dependencies and the command line's fast start.

Every ``import`` statement (module level or inside a function) is an edge from the importing module to
the klrl module it names. The layering test reads :data:`ALLOWED` (package -> packages it may import);
the root modules belong to the layer :data:`ROOT_LAYERS` names, the package root ``klrl/__init__.py``
(the public API, which imports everything) and ``klrl/__main__.py`` are exempt. The cycle test leaves
``TYPE_CHECKING`` blocks out (they do not run); the layering test counts them (a type is a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_readme import README, package_map  # the README's package map, as test_readme.py reads it

ROOT = Path(__file__).resolve().parents[2]

# package -> the packages (layers) its modules import, besides its own, in the README's package map
# order: a layer imports only layers above it, and every allowance is used (an import that goes away
# takes its allowance with it: test_every_allowance_is_used)
_TABLE = {
    "registry": "",
    "config": "registry",
    "data": "config",
    "algo": "registry config",
    "models": "registry config data",
    "distributed": "",
    "io": "config distributed",
    "rewards": "registry config data models io",
    "tasks": "registry config data algo models rewards",
    "step": "registry config algo models distributed rewards tasks",
    "eval": "config data algo models io tasks",
    "analysis": "registry config io",
    "loop": "registry config algo models distributed io rewards tasks step",
    "api": "config algo models distributed io rewards tasks step analysis loop",
    "cli": "config data models distributed io rewards tasks eval analysis loop api",
}
LAYERS = list(_TABLE)  # bottom first, as the README lists them
ALLOWED: dict[str, set[str]] = {k: {k, *v.split()} for k, v in _TABLE.items()}
# the modules at the root of klrl/ (klrl/NAME.py) and the layer each belongs to
ROOT_LAYERS = {"api": "api", "checks": "api", "registry": "registry", "distributed": "distributed"}
EXEMPT = {"klrl", "klrl.__main__"}  # the package root (the public API) and ``python -m klrl``

# imports inside a function: optional dependencies, imported where they are needed (first-level names)
OPTIONAL = {
    "matplotlib",
    "pandas",
    "pyarrow",
    "datasets",
    "IPython",
    "wandb",
    "huggingface_hub",
    "vaderSentiment",
}
# the command line imports inside its functions, so that ``klrl --help`` does not import jax
# (:func:`test_the_command_line_starts_without_jax`; tests/cli/test_cli.py runs it)
FAST_START = ("klrl/cli/",)
# what ``klrl --help`` and ``klrl COMMAND --help`` must not import at module level, directly or not
HEAVY = {"jax", "jaxlib", "flax", "optax", "orbax", "chex", "tensorboardX", "matplotlib", "safetensors"}
# (file, imported module) -> why it is imported inside a function
INNER_ALLOWED = {
    ("klrl/io/checkpoint.py", "orbax.checkpoint._src"): "a private orbax module, patched only where this "
    "orbax version has it (an ImportError is the answer 'nothing to patch')",
    ("klrl/analysis/aggregate.py", "scipy.stats"): "about 0.5 s at import on top of jax; only the "
    "confidence intervals of seed-aggregated tables need the Student-t quantile",
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, type_checking: bool = False):
    """Every import statement as ``(node, inside_function)``; ``TYPE_CHECKING`` blocks if asked."""

    def visit(node: ast.AST, inner: bool):
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, inner
            fn = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from visit(child, inner or fn)

    yield from visit(tree, False)


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str], top: str = "klrl") -> list[str]:
    """The klrl modules (or ``top``'s) one import statement names (``from klrl.x import y``: y may be a
    module)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        found = [resolve(a.name) for a in node.names if a.name.split(".")[0] == top]
    elif node.module and node.level == 0 and node.module.split(".")[0] == top:
        found = []
        for a in node.names:
            full = f"{node.module}.{a.name}"
            found.append(full if full in modules else resolve(node.module))
    else:
        found = []
    return list(dict.fromkeys(m for m in found if m))  # once each, in order


def _imports(tree: ast.AST, modules: set[str], here: str) -> set[str]:
    """The modules ``here`` imports (its edges in the cycle test's graph)."""
    out = {t for node, _ in _statements(tree) for t in _targets(node, modules)}
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


def _sources(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(f, root): f for f in sorted((root / "klrl").rglob("*.py"))}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the klrl modules it imports, without the package root ``klrl``."""
    files = _sources(root)
    modules = set(files)
    edges = {m: _imports(ast.parse(f.read_text()), modules, m) for m, f in files.items()}
    edges.pop("klrl", None)
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


def layer(module: str, packages: set[str]) -> str | None:
    """The layer of a klrl module: its package below ``klrl``, or a root module's entry in ROOT_LAYERS
    (None: a root module no layer holds, or the package root ``klrl`` itself)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    if ".".join(parts[:2]) in packages:
        return parts[1]
    return ROOT_LAYERS.get(parts[1])


def layer_imports(root: Path = ROOT):
    """``(file, line, target, from layer, to layer)`` for every import of a klrl module (``TYPE_CHECKING``
    blocks included) in a module of a layer; a module of no layer as ``(file, None, None, None, None)``."""
    files = _sources(root)
    modules = set(files)
    packages = {m for m, f in files.items() if f.name == "__init__.py"}
    for here, f in files.items():
        if here in EXEMPT:
            continue
        rel = f.relative_to(root)
        src = layer(here, packages)
        if src not in ALLOWED:
            yield rel, None, None, None, None
            continue
        for node, _ in _statements(ast.parse(f.read_text()), type_checking=True):
            for target in _targets(node, modules):
                yield rel, node.lineno, target, src, layer(target, packages)


def layering_violations(root: Path = ROOT) -> list[str]:
    """``file:line: import (from -> to)`` for every import of a klrl module outside :data:`ALLOWED`."""
    out = []
    for rel, line, target, src, dst in layer_imports(root):
        if src is None:
            out.append(f"{rel}: a module of no layer (add it to ROOT_LAYERS or move it into a package)")
        elif dst not in ALLOWED[src]:
            out.append(f"{rel}:{line}: imports {target} ({src} -> {dst or 'no layer'})")
    return out


def used_layers(root: Path = ROOT) -> dict[str, set[str]]:
    """Layer -> the other layers its modules import (the table as the code has it)."""
    used: dict[str, set[str]] = {k: set() for k in ALLOWED}
    for _, _, _, src, dst in layer_imports(root):
        if src is not None and dst is not None and dst != src:
            used[src].add(dst)
    return used


def optional_modules(root: Path = ROOT) -> set[str]:
    """The klrl modules whose import pulls in an optional dependency: one imported at their top, or
    a klrl module at their top that does (``klrl.analysis.plots``: matplotlib). Importing one of them
    inside a function defers that dependency, as importing it directly would."""
    files = _sources(root)
    modules = set(files)
    direct, top = set(), {}
    for m, f in files.items():
        nodes = [node for node, inner in _statements(ast.parse(f.read_text())) if not inner]
        top[m] = {t for node in nodes for t in _targets(node, modules)}
        for node in nodes:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] in OPTIONAL for n in names):
                direct.add(m)
    return {m for m in files if closure(top, m) & direct}


def inner_import_violations(root: Path = ROOT) -> list[str]:
    """``file:line: module`` for every import inside a function that is not an optional dependency
    (nor a klrl module that imports one, :func:`optional_modules`), not in the command line (fast
    start) and not in :data:`INNER_ALLOWED`."""
    files = _sources(root)
    modules, deferred = set(files), optional_modules(root)
    out = []
    for f in files.values():
        rel = f.relative_to(root).as_posix()
        if rel.startswith(FAST_START):
            continue
        for node, inner in _statements(ast.parse(f.read_text()), type_checking=True):
            if not inner:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = ["." * node.level + (node.module or "")]
            targets = _targets(node, modules)
            if targets and set(targets) <= deferred:
                continue
            for name in names:
                if name.split(".")[0] not in OPTIONAL and (rel, name) not in INNER_ALLOWED:
                    out.append(f"{rel}:{node.lineno}: {name}")
    return out


def closure(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or not (itself included)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges.get(m, ()))
    return seen


def _packages() -> set[str]:
    return {m for m, f in _sources().items() if f.name == "__init__.py"}


# --- the tree ---------------------------------------------------------------------------------------


def test_no_import_cycle_in_klrl():
    edges = graph()
    # the graph is real: the step imports models, the loop imports the step
    packages = _packages()
    arrows = {(layer(m, packages), layer(d, packages)) for m, deps in edges.items() for d in deps}
    assert {("step", "models"), ("loop", "step"), ("api", "loop")} <= arrows
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_packages_import_downward_only():
    bad = layering_violations()
    assert not bad, "imports outside the layering table:\n" + "\n".join(bad)


def test_imports_inside_functions_are_optional_dependencies_or_the_cli():
    bad = inner_import_violations()
    assert not bad, "imports inside functions (move them to the top of the module):\n" + "\n".join(bad)


def test_results_reads_runs_without_the_training_stack():
    """A run directory is read back with NumPy: klrl.analysis.results and everything it imports stay
    within config, io and the registry, and none of them imports jax, orbax, TensorBoard or matplotlib
    at module level (so plots, the report and a notebook load runs without building anything). The
    run-result type is klrl.io.results (the run loop builds results with it, below analysis); the
    reader adds load_run and load_sweep on top of it."""
    edges, files, packages = graph(), _sources(), _packages()
    reached = closure(edges, "klrl.analysis.results")
    assert {layer(m, packages) for m in reached} <= {"analysis", "config", "io", "registry"}, reached
    assert [m for m in reached if layer(m, packages) == "analysis"] == ["klrl.analysis.results"]
    assert {"klrl.io.results", "klrl.io.readers"} <= reached, reached
    typed = closure(edges, "klrl.io.results")
    assert {m for m in typed if layer(m, packages) == "io"} == {"klrl.io.results"}, typed
    # io.results imports the config (which imports the registry) and nothing else
    assert {layer(m, packages) for m in typed} == {"io", "config", "registry"}, typed
    heavy = {"jax", "flax", "optax", "orbax", "tensorboardX", "matplotlib"}
    for m in reached:
        for node, inner in _statements(ast.parse(files[m].read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert inner or not {n.split(".")[0] for n in names} & heavy, (m, names)


def test_only_the_command_line_attaches_a_report():
    """The run loop and the Python API never write a report (the command line does, after a run);
    the plots are drawn for the report, and in analysis only."""
    edges, packages = graph(), _packages()
    report = sorted(m for m, deps in edges.items() if "klrl.analysis.report" in deps)
    plots = sorted(m for m, deps in edges.items() if "klrl.analysis.plots" in deps)
    assert report and {layer(m, packages) for m in report} == {"cli"}, report
    assert "klrl.analysis.report" in plots and {layer(m, packages) for m in plots} == {"analysis"}, plots


# --- experiments/ --------------------------------------------------------------------------------------


def experiments_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """experiments/ as a package: module -> the ``experiments.*`` modules it imports, and the problems:
    an import of a sibling by its bare name (it needs experiments/ on ``sys.path``) or a ``sys.path``
    edit outside the one guarded block of a script run by path (``if not __package__:``)."""
    found = sorted((root / "experiments").glob("*.py"))
    files = {f"experiments.{f.stem}".removesuffix(".__init__"): f for f in found}
    modules, stems = set(files), {f.stem for f in files.values()}
    edges, bad = {}, []
    for m, f in files.items():
        tree, rel = ast.parse(f.read_text()), f.relative_to(root)
        nodes = [node for node, _ in _statements(tree, type_checking=True)]
        edges[m] = {t for node in nodes for t in _targets(node, modules, "experiments")} - {m}
        for node in nodes:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [f"{rel}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in stems]
        guarded = {
            id(c)
            for g in ast.walk(tree)
            if isinstance(g, ast.If) and ast.unparse(g.test) == "not __package__"
            for c in ast.walk(g)
        }
        for c in ast.walk(tree):
            if isinstance(c, ast.Attribute) and ast.unparse(c) == "sys.path" and id(c) not in guarded:
                bad.append(f"{rel}:{c.lineno}: sys.path")
    return edges, bad


def test_experiments_is_a_package_without_cycles_or_path_edits():
    assert (ROOT / "experiments" / "__init__.py").is_file()
    edges, bad = experiments_graph()
    assert ("experiments.study" in edges["experiments.adaptive"]) and edges["experiments.llm_turn"]
    assert not bad, "\n".join(bad)
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


# --- the test's own logic on a fake tree -------------------------------------------------------------


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    tree = ast.parse(
        "import klrl.x\nif TYPE_CHECKING:\n    import klrl.y\ndef f():\n    from klrl import z\n"
    )
    assert _imports(tree, {"klrl", "klrl.x", "klrl.y", "klrl.z"}, "klrl.w") == {"klrl.x", "klrl.z"}
    assert closure({"a": {"b"}, "b": {"c"}, "d": {"a"}}, "a") == {"a", "b", "c"}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_layering_on_a_fake_tree(tmp_path):
    root = _write(
        tmp_path,
        {
            "klrl/__init__.py": "from klrl.cli import main\n",  # exempt
            "klrl/__main__.py": "from klrl.cli import main\n",  # exempt
            "klrl/api.py": "from klrl.loop import driver\n",  # api -> loop: allowed
            "klrl/registry.py": "import json\n",
            "klrl/stray.py": "",  # a root module of no layer
            "klrl/cli/__init__.py": "from klrl.api import run\n",
            "klrl/loop/__init__.py": "",
            "klrl/loop/driver.py": "from klrl.step import train\n",
            "klrl/step/__init__.py": "",
            "klrl/step/train.py": "from klrl.models import gpt, rollout\nimport klrl.step.stages\n",
            "klrl/step/stages.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from klrl.loop.driver import Loop\n",  # step -> loop, typed only
            "klrl/models/__init__.py": "",
            "klrl/models/gpt.py": "from klrl import registry\n\n\ndef f():\n"
            "    from klrl.api import run, sweep\n",  # models -> api, reported once
            "klrl/config/__init__.py": "from klrl import __version__\n",  # the root: upward
        },
    )
    assert sorted(layering_violations(root)) == [
        "klrl/config/__init__.py:1: imports klrl (config -> no layer)",
        "klrl/models/gpt.py:5: imports klrl.api (models -> api)",
        "klrl/step/stages.py:3: imports klrl.loop.driver (step -> loop)",
        "klrl/stray.py: a module of no layer (add it to ROOT_LAYERS or move it into a package)",
    ]
    packages = {"klrl.cli", "klrl.loop", "klrl.step", "klrl.models", "klrl.config"}
    assert [layer(m, packages) for m in ("klrl.api", "klrl.checks", "klrl.registry", "klrl.step.x")] == [
        "api",
        "api",
        "registry",
        "step",
    ]
    assert layer("klrl", packages) is None and layer("klrl.stray", packages) is None


def test_the_table_points_downward():
    """The table is itself acyclic (a layer imports only layers listed above it) and names only layers."""
    for i, k in enumerate(LAYERS):
        assert ALLOWED[k] - {k} <= set(LAYERS[:i]), (k, sorted(ALLOWED[k] - set(LAYERS[:i]) - {k}))
    assert find_cycle({k: v - {k} for k, v in ALLOWED.items()}) is None
    assert all(v <= set(ALLOWED) and k in v for k, v in ALLOWED.items())
    assert set(ROOT_LAYERS.values()) <= set(ALLOWED)


def test_every_allowance_is_used():
    """An allowance no import uses is stale (it would let a new upward import pass unseen): drop it."""
    used = used_layers()
    unused = {k: sorted(v - {k} - used[k]) for k, v in ALLOWED.items() if v - {k} - used[k]}
    assert not unused, f"allowed, imported by no module: {unused}"


def test_the_readme_lists_the_layers_in_the_table_order():
    """The README's package map is the import order: its entries' layers, bottom first, are the table's
    (root modules of one layer side by side: ``klrl/checks.py`` and ``klrl/api.py``)."""

    def entry_layer(entry: str) -> str:
        name = entry.removeprefix("klrl/").rstrip("/")
        return ROOT_LAYERS[name.removesuffix(".py")] if name.endswith(".py") else name

    order = [entry_layer(e) for e in package_map(README.read_text())]
    assert [x for i, x in enumerate(order) if i == 0 or x != order[i - 1]] == LAYERS, order


def test_inner_imports_on_a_fake_tree(tmp_path):
    root = _write(
        tmp_path,
        {
            "klrl/__init__.py": "",
            "klrl/cli/args.py": "def main():\n    import jax\n",  # fast start
            "klrl/analysis/plots.py": "import matplotlib\n\n\ndef f():\n    import matplotlib.pyplot\n",
            "klrl/analysis/aggregate.py": "def t():\n    from scipy.stats import t\n",  # allow-listed
            "klrl/loop/driver.py": "class Loop:\n    def run(self):\n        from klrl.step import train\n"
            "        import os, pandas\n",
            "klrl/io/lazy.py": "f = lambda: None\n\n\nasync def g():\n    from . import x\n",
            # plots imports matplotlib at its top, plotkit through plots: both defer it; results does not
            "klrl/analysis/plotkit.py": "from klrl.analysis import plots\n",
            "klrl/analysis/results.py": "import numpy\n",
            "klrl/analysis/report.py": "def write():\n    from klrl.analysis import plotkit, plots\n"
            "    from klrl.analysis import results\n",
        },
    )
    assert sorted(inner_import_violations(root)) == [
        "klrl/analysis/report.py:3: klrl.analysis",
        "klrl/io/lazy.py:5: .",
        "klrl/loop/driver.py:3: klrl.step",
        "klrl/loop/driver.py:4: os",
    ]


def test_the_allow_list_names_imports_that_exist():
    """An entry of INNER_ALLOWED whose import has moved to the top is stale: drop it."""
    inner = set()
    for f in _sources().values():
        for node, is_inner in _statements(ast.parse(f.read_text())):
            if is_inner and isinstance(node, ast.ImportFrom):
                inner.add((f.relative_to(ROOT).as_posix(), node.module))
            elif is_inner:
                inner |= {(f.relative_to(ROOT).as_posix(), a.name) for a in node.names}
    assert set(INNER_ALLOWED) <= inner, set(INNER_ALLOWED) - inner
    assert all(len(why) > 20 for why in INNER_ALLOWED.values())


def top_level_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the klrl modules it imports at module level (``TYPE_CHECKING`` left out), with the
    packages they are in (importing ``klrl.a.b`` runs ``klrl/a/__init__.py``), the root ``klrl`` too."""
    files = _sources(root)
    modules = set(files)
    out = {}
    for m, f in files.items():
        deps = {t for node, inner in _statements(ast.parse(f.read_text())) if not inner
                for t in _targets(node, modules)}  # fmt: skip
        for t in list(deps):
            parts = t.split(".")
            deps |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules}
        out[m] = deps - {m}
    return out


def heavy_at_top(modules: set[str], root: Path = ROOT) -> list[str]:
    """``module: name`` for every :data:`HEAVY` import at the top of ``modules``."""
    files, out = _sources(root), []
    for m in sorted(modules):
        for node, inner in _statements(ast.parse(files[m].read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"{m}: {n}" for n in names if not inner and n.split(".")[0] in HEAVY]
    return out


def test_the_command_line_starts_without_jax():
    """FAST_START's promise: ``from klrl.cli import main`` (the ``klrl`` script) reaches, at module level,
    only modules that import nothing of :data:`HEAVY` at their top: the package root is lazy (PEP 562),
    the command line imports the training stack inside its functions, and what the parsers read (the
    config, the registries' declared names, the run-directory readers) is light."""
    reached = closure(top_level_edges(), "klrl.cli") | {"klrl"}
    assert {"klrl.cli.commands", "klrl.cli.args", "klrl.cli.legacy", "klrl.config"} <= reached, reached
    assert not {"klrl.api", "klrl.checks", "klrl.cli.launch", "klrl.tasks", "klrl.algo.kl"} & reached, reached
    bad = heavy_at_top(reached)
    assert not bad, "modules the command line imports at start-up import heavy packages:\n" + "\n".join(bad)
