"""Shared fixtures: a tiny run configuration and its task, built (pretrained) once per session.

``KLRL_CACHE`` points at a session temporary directory for the whole session, so no test
(nor any subprocess a test starts) writes to ``~/.cache``.

Compile time is most of the suite's CPU time (a tiny train step: ~10 s of XLA:CPU compile, ~0.1 s to
run), so for the whole session, its xdist workers and every subprocess they start (environment
variables, set here before JAX starts):

* ``XLA_FLAGS`` asks XLA:CPU for cheaper code generation (:data:`CHEAP_XLA`: LLVM at -O0, ~40% less
  compile time); the HLO passes (fusion, buffer assignment, the sharding partitioner) are unchanged,
  so are the programs' results up to float rounding. The compiled code runs slower (the testbed's
  training loops ~1.5x), a loss only where a test trains for long. Subprocesses that set their own
  ``XLA_FLAGS`` take :func:`xla_flags`, so a run and its resumption in another process use the same code;
* one persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, a temporary directory removed at
  the end) serves every program compiled twice in the session: the same step built again by
  another test, a resumed run in a fresh process, the same CLI run in another test file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

CHEAP_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_OWNER = "KLRL_TEST_XLA_CACHE_OWNER"


def xla_flags(devices: int | None = None) -> str:
    """``XLA_FLAGS`` for a subprocess: the session's cheaper code generation, and ``devices`` forced
    host devices when given."""
    return CHEAP_XLA + ("" if devices is None else f" --xla_force_host_platform_device_count={devices}")


if _OWNER not in os.environ:  # the first pytest process (xdist's controller): its workers inherit this
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CHEAP_XLA}".strip()
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="klrl-test-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ[_OWNER] = str(os.getpid())


def pytest_unconfigure(config):
    if os.environ.get(_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def tiny_config(cache_dir: str = ""):
    """A tiny but complete RunConfig: fast to pretrain and to compile."""
    from klrl.config import RunConfig

    return RunConfig().replace(
        model={"n_layers": 1, "d_model": 32, "n_heads": 2},
        task={
            "name": "wordclass",
            "pretrain_steps": 100,
            "pretrain_batch": 32,
            "pretrain_len": 16,
            "prompt_len": 6,
            "prompt_pool": 256,
            "cache_dir": cache_dir,
        },
        sampling={"response_len": 8},
        train={"batch_size": 16, "iterations": 3, "devices": 1, "quiet": True},
        ppo={"minibatches": 2, "epochs": 2},
    )


# ---- the optional [hf] extra: torch, transformers, peft (the parity tests' references) -----------

IN_CI = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
HF_PACKAGES = ("torch", "transformers", "peft")
HAVE_HF = all(importlib.util.find_spec(p) is not None for p in HF_PACKAGES)
# skip a test that needs the [hf] extra where it is not installed, except in CI (CI=true), which installs
# it (.ci/run, the README's test command): there the test runs and fails on the import, never skips
needs_hf = pytest.mark.skipif(
    not HAVE_HF and not IN_CI, reason="torch, transformers, peft: pip install -e '.[hf]'"
)


def hf_import(name: str):
    """``import name`` (torch, transformers or peft): a skip where it is missing, a failure in CI."""
    if IN_CI:
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name}: pip install -e '.[hf]'")


@pytest.fixture(scope="session", autouse=True)
def _public_names_bound():
    """``klrl.run``, ``klrl.sweep``, ... bound before any test patches them, as importing klrl bound them
    before it became lazy (PEP 562): a test that patches ``klrl.api.run`` and then ``klrl.run`` saves, and
    later restores, the real function, not the patched one it would otherwise look up first."""
    import klrl

    for name in klrl.__all__:
        if name != "plots":  # (matplotlib: imported by the tests that draw)
            getattr(klrl, name)


# no test reaches the network: a Hub name not in the (temporary) cache is refused, not fetched
# (klrl.models.catalog.fetch_hub_model; tests/models/test_catalog_fetch.py serves one from 127.0.0.1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def klrl_cache_env(tmp_path_factory):
    """Every cache lookup of the session (and of its subprocesses) lands in a temporary directory."""
    path = str(tmp_path_factory.mktemp("klrl-cache-env"))
    old = os.environ.get("KLRL_CACHE")
    os.environ["KLRL_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("KLRL_CACHE", None)
    else:
        os.environ["KLRL_CACHE"] = old


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("klrl-cache"))


@pytest.fixture(scope="session")
def tiny_cfg(cache_dir):
    return tiny_config(cache_dir)


@pytest.fixture(scope="session")
def tiny_task(tiny_cfg):
    """The wordclass task of ``tiny_cfg``: its reference is pretrained here, once per session."""
    from klrl.tasks.wordclass import make_task

    return make_task(tiny_cfg)


@pytest.fixture(scope="session")
def tiny_gguf_run(tmp_path_factory):
    """A 2-iteration run of the text task on the committed tiny GGUF (``tests/data/tiny_gguf``),
    checkpointed every iteration; shared by tests/tasks/test_tasks_text.py (the saved policy) and
    tests/cli/test_export.py (its export), which only read its directory."""
    import warnings

    import klrl
    from klrl.config import RunConfig
    from klrl.data.prompts import PromptTruncationWarning

    out = tmp_path_factory.mktemp("tiny-gguf-run")
    cfg = RunConfig.from_dict(
        {
            "model": {"path": str(Path(__file__).parent / "data" / "tiny_gguf" / "tiny.gguf")},
            "task": {"name": "text"},
            "data": {"prompt_len": 16, "limit": 8},
            "sampling": {"response_len": 4},
            "ppo": {"epochs": 1, "minibatches": 2},
            "optim": {"lr": 1e-3},
            "train": {"iterations": 2, "batch_size": 4, "out_dir": str(out), "name": "r", "quiet": True,
                      "checkpoint_every": 1},
        }
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTruncationWarning)
        return klrl.run(cfg)


# ---- helpers shared by the checkpoint and reliability tests -----------------------------------

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "run.py"


@pytest.fixture(scope="module")
def jax_cache():
    """The session's persistent compilation cache (see the module's docstring; JAX in this process
    already uses it), for the modules that name it to their subprocesses."""
    path = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


def base_config(cache_dir: str, **train):
    from conftest import tiny_config

    return tiny_config(cache_dir).replace(
        task={"name": "wordclass"}, train={"quiet": True, "checkpoint_every": 2, **train}
    )


def cli_args(cfg) -> list[str]:
    """``--section.field value`` for every field of ``cfg`` that differs from the default."""
    from klrl.config import RunConfig

    d, default = cfg.to_dict(), RunConfig().to_dict()
    out = []
    for sec, fields in d.items():
        for k, v in fields.items():
            if v != default[sec][k]:
                out += [f"--{sec}.{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """``experiments/run.py`` in this process: (exit status, stderr)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("klrl_experiments_run", SCRIPT)
    cli_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_run)
    try:
        status = cli_run.main(argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def lines(path: Path) -> list[bytes]:
    data = path.read_bytes() if path.exists() else b""
    return [x + b"\n" for x in data.split(b"\n")[:-1]]


def one_line_error(capsys, fn, argv) -> str:
    """Run ``fn(argv)`` (a command-line entry point) expecting a user error: exit status 2 and
    exactly one line on stderr, which is returned."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]
