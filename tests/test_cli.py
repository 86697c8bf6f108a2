"""The command line: bad input ends in one line naming the field and exit status 2, before any
task is built or anything compiles. Every case is a real ``python experiments/run.py``
subprocess; they are started together (module fixture) so the module costs about one start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "run.py"
TIMEOUT = 120  # generous for a loaded machine; a bad config must never get as far as pretraining

# name -> (arguments, field the error line must name, extra environment)
BAD = {
    "batch_size_zero": (["--train.batch_size", "0"], "train.batch_size", {}),
    "batch_not_divisible_by_devices": (
        ["--train.batch_size", "6", "--ppo.minibatches", "2"],
        "train.batch_size",
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    ),
    "minibatches_not_dividing": (
        ["--train.batch_size", "16", "--ppo.minibatches", "3"],
        "ppo.minibatches",
        {},
    ),
    "response_len_zero": (["--sampling.response_len", "0"], "sampling.response_len", {}),
    "negative_beta": (["--kl.beta", "-0.1"], "kl.beta", {}),
    "target_zero": (["--ctrl.target", "0"], "ctrl.target", {}),
    "horizon_zero": (["--ctrl.horizon", "0"], "ctrl.horizon", {}),
    "unknown_field": (["--kl.betta", "0.1"], "kl.betta", {}),
    "unparsable_float": (["--kl.beta", "abc"], "kl.beta", {}),
    "unparsable_bool": (["--sampling.use_eos", "maybe"], "sampling.use_eos", {}),
}


def _start(args: list[str], cache: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update({"KLRL_CACHE": str(cache), "JAX_PLATFORMS": "cpu", **extra_env})
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "--train.out_dir", str(cache / "runs")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Start every case at once, then collect ``name -> (status, stdout, stderr, cache)``."""
    procs = {}
    for name, (args, _, extra) in BAD.items():
        cache = tmp_path_factory.mktemp(f"cli-{name}")
        procs[name] = (_start(args, cache, extra), cache)
    cache = tmp_path_factory.mktemp("cli-help")
    procs["help"] = (_start(["--help"], cache, {}), cache)
    out = {}
    for name, (p, cache) in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            pytest.fail(
                f"{name}: still running after {TIMEOUT}s (did it start pretraining?)\n{stderr[-2000:]}"
            )
        out[name] = (p.returncode, stdout, stderr, cache)
    return out


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exits_2_with_one_line(results, name: str) -> None:
    status, stdout, stderr, cache = results[name]
    field = BAD[name][1]
    assert status == 2, (status, stderr[-2000:])
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert field in lines[0], lines[0]
    assert lines[0].startswith("error: ")
    # nothing was built: no cache entry, no run directory
    assert not any(cache.iterdir()), list(cache.iterdir())


def test_device_count_checked_before_the_task_is_built(results) -> None:
    status, _, stderr, cache = results["batch_not_divisible_by_devices"]
    assert status == 2
    assert "device" in stderr and "6 % 4" in stderr, stderr
    assert not any(cache.iterdir())


def test_help_lists_fields(results) -> None:
    status, stdout, stderr, _ = results["help"]
    assert status == 0, stderr
    for flag in ("--kl.beta", "--train.iterations", "--ctrl.target", "--ppo.minibatches", "--sampling.top_k"):
        assert flag in stdout, flag
    assert "initial KL coefficient" in stdout  # field help text is shown
