"""tests/ mirrors klrl/: every package ``klrl/<package>/`` has its ``tests/<package>/`` (``klrl/data``'s is
``tests/data_pkg``: ``tests/data`` holds the goldens), and pytest's ``pythonpath`` in pyproject.toml lists
every folder of tests/ that holds test modules (a test module is imported by name from another folder)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RENAMED = {"data": "data_pkg"}  # klrl package -> its tests folder, where the name is taken


def _packages(root: Path) -> set[str]:
    return {p.parent.name for p in (root / "klrl").glob("*/__init__.py")}


def _test_folders(root: Path) -> set[str]:
    return {p.parent.name for p in (root / "tests").glob("*/test_*.py")}


def missing_mirrors(root: Path = ROOT) -> list[str]:
    """The ``klrl/<package>/`` without a ``tests/<package>/`` holding a test module, sorted."""
    have = _test_folders(root)
    return sorted(f"klrl/{p}/" for p in _packages(root) if RENAMED.get(p, p) not in have)


def test_every_package_has_its_tests_folder():
    assert _packages(ROOT) >= {"algo", "config", "loop", "step"}  # (the glob finds the packages)
    assert missing_mirrors() == []


def test_a_package_without_tests_is_named(tmp_path):
    for d in ("klrl/algo", "klrl/newpkg", "klrl/data", "tests/algo", "tests/data_pkg"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("klrl/algo/__init__.py", "klrl/newpkg/__init__.py", "klrl/data/__init__.py"):
        (tmp_path / f).touch()
    (tmp_path / "tests/algo/test_kl.py").touch()
    assert missing_mirrors(tmp_path) == ["klrl/data/", "klrl/newpkg/"]  # tests/data_pkg is empty
    (tmp_path / "tests/data_pkg/test_chat.py").touch()
    assert missing_mirrors(tmp_path) == ["klrl/newpkg/"]


def test_pytest_imports_every_tests_folder_by_name():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    paths = ini["pythonpath"]
    assert {f"tests/{d}" for d in _test_folders(ROOT)} <= set(paths)
