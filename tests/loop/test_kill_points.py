"""kill -9 at every phase boundary of the training loop, then a resume: bit for bit (issue 41, item 1).

Each kill point is a subprocess (``klrl train`` / ``klrl sweep``) killed with SIGKILL by the test-only
fault point ``KLRL_FAULT=<phase>:<iteration>`` (:mod:`klrl.loop.fault`: before/after a row is written,
after a checkpoint's save was started, after it was committed) or by ``os._exit(1)`` inside the host
reward function; the directory is then resumed in this process and its ``metrics.jsonl`` must equal an
uninterrupted reference run's, byte for byte (one reference per kind). Kinds: a single testbed run, a
2-member testbed sweep, a testbed LoRA run (adapters on the policy and the critic), and a LoRA run of
the text task on the tiny GGUF with a host reward function. All have 4 iterations and checkpoints 2 and
4, so the rows of iterations 2 and 3 are written while checkpoint 2 is being saved in the background
(the window of the reported failure). Kill points: 7 for a run, 4 for a sweep, 2 for a LoRA run, 1 in
the reward function (about 140 CPU s in all: the fork runner, tests/fork_runner.py, imports klrl once;
the testbed's programs come from the session's compile cache, the reward run's, which calls back to the
host, are compiled by every process).

Before the fix, every kill point with rows but no committed checkpoint (row-after:0, row-after:1,
save-started:2, row-after:2 and row-after:3 when checkpoint 2 was still in flight, the reward's exit)
was refused ("no complete checkpoint ... N metrics lines were written before the first one"): the
test prints, per point, the rows left on disk and the checkpoint resumed from (0: none committed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import base_config, cli_args, lines, xla_flags

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf"

# the boundaries of a 4-iteration run checkpointed at 2 and 4 that leave distinct directories: rows 0-3
# each written, checkpoint 2 being saved and committed, checkpoint 4 being saved (left out, for the
# CPU budget: row-before:0, a kill before any row, as tests/loop/test_reliability.py's kill during the
# compile; row-before:2, the directory save-started:2 leaves; save-committed:4, a finished run)
RUN_POINTS = ["row-after:0", "row-after:1", "save-started:2", "save-committed:2", "row-after:2",
              "row-after:3", "save-started:4"]  # fmt: skip
SWEEP_POINTS = ["row-after:0", "save-started:2", "save-committed:2", "row-after:2"]
LORA_POINTS = ["save-started:2", "row-after:2"]
# os._exit(1) in the host reward function's call 4 (call 1 is the check before the compile, call k + 2
# scores iteration k): iteration 2, while checkpoint 2 is being saved
REWARD_POINTS = ["reward:4"]

REWARD = """
import os
calls = {"n": 0}

def score(completions, **kwargs):
    calls["n"] += 1
    if os.environ.get("KLRL_TEST_REWARD_EXIT") == str(calls["n"]):
        os._exit(1)
    return [float(len(c) % 3) for c in completions]
"""


def _env(jax_cache) -> dict[str, str]:
    """The fork runner's environment (read at its start: the session's code generation and compile cache)."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(jax_cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=str(ROOT))  # fmt: skip
    env.pop("KLRL_FAULT", None)
    return env


@pytest.fixture(scope="module")
def runner(jax_cache):
    """tests/fork_runner.py: ``klrl ARGS`` in a forked child, klrl imported once for all kill points."""
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fork_runner.py")], env=_env(jax_cache),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    yield p
    p.stdin.close()
    p.wait(timeout=60)


def _killed(runner, cmd: list[str], out: Path, name: str, point: str) -> Path:
    """``klrl CMD`` into ``out/name`` killed at ``point`` (a fault point, or ``reward:N``: the reward
    function's call N exits); the directory it left."""
    phase, n = point.split(":")
    env = {"KLRL_TEST_REWARD_EXIT": n} if phase == "reward" else {"KLRL_FAULT": point}
    argv = [*cmd, "--train.out_dir", str(out), "--train.name", name]
    log = out / f"{name}.log"
    runner.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n")
    runner.stdin.flush()
    status = json.loads(runner.stdout.readline())["status"]
    assert status == (1 if phase == "reward" else -9), (point, status, log.read_text()[-2000:])
    return out / name


def _rows(d: Path, names: list[str]) -> list[list[bytes]]:
    return [lines(d / n / "metrics.jsonl") for n in names]


def _check(point: str, ref: list[list[bytes]], d: Path, names: list[str], resume) -> tuple[int, int]:
    """Resume ``d`` and compare; returns (rows on disk after the kill, rows the resume kept)."""
    before = _rows(d, names)
    assert all(r == x[: len(r)] for r, x in zip(before, ref, strict=True)), point  # a prefix, no torn row
    resume(d)
    after = _rows(d, names)
    assert after == ref, point
    event = json.loads(lines(d / names[0] / "events.jsonl")[-1])
    assert event["event"] == "resume", point
    return len(before[0]), int(event["iteration"])


def _cfg(cache_dir):
    return base_config(cache_dir, iterations=4, checkpoint_every=2, keep_checkpoints=10)


def _reward_cfg(tmp: Path):
    """A LoRA run of the text task on the tiny GGUF with a host reward function (REWARD)."""
    from klrl.config import RunConfig

    (tmp / "rewards.py").write_text(REWARD)
    return RunConfig.from_dict(
        {
            "model": {"path": str(GGUF)},
            "lora": {"rank": 4},
            "task": {"name": "text"},
            "reward": {"fn": f"{tmp / 'rewards.py'}:score"},
            "data": {"prompt_len": 16, "limit": 8},
            "sampling": {"response_len": 4},
            "ppo": {"epochs": 1, "minibatches": 2},
            "optim": {"lr": 1e-3},
            "train": {"iterations": 4, "batch_size": 4, "quiet": True, "checkpoint_every": 2,
                      "keep_checkpoints": 10},
        }
    )  # fmt: skip


def _cpu(runner) -> float:
    """CPU seconds of this process, the fork runner and the children it waited for."""
    t = os.times()
    with open(f"/proc/{runner.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return t.user + t.system + ticks


def _report(kind: str, results: list[tuple[str, int, int]], t0: tuple[float, float], runner) -> None:
    wall, cpu = time.time() - t0[0], _cpu(runner) - t0[1]
    print(
        f"\n{kind}: {len(results)} of {len(results)} kill points resumed bit for bit ({wall:.0f} s wall, "
        f"{cpu:.0f} CPU s): " + ", ".join(f"{p} ({n} rows on disk, resumed from {s})" for p, n, s in results)
    )


def test_kill9_at_every_boundary_of_a_run_resumes_bit_for_bit(runner, tiny_task, cache_dir, tmp_path):
    import klrl

    t0, cfg = (time.time(), _cpu(runner)), _cfg(cache_dir)
    ref = [lines(klrl.run(cfg.replace(train={"out_dir": str(tmp_path), "name": "ref"}), task=tiny_task).dir
                 / "metrics.jsonl")]  # fmt: skip
    assert len(ref[0]) == 4
    results = []
    for k, point in enumerate(RUN_POINTS):
        d = _killed(runner, ["train", *cli_args(cfg)], tmp_path, f"k{k}", point)
        n, s = _check(point, ref, d, ["."], lambda d: klrl.run(cfg, task=tiny_task, resume=d))
        results.append((point, n, s))
    _report("run", results, t0, runner)


def test_kill9_at_every_boundary_of_a_sweep_resumes_bit_for_bit(runner, tiny_task, cache_dir, tmp_path):
    from klrl.api import sweep
    from klrl.config.sweep import grid

    t0, cfg = (time.time(), _cpu(runner)), _cfg(cache_dir)
    members = grid(cfg, {"kl.beta": [0.01, 0.1]})
    full = sweep(members, task=tiny_task, out_dir=tmp_path / "ref")
    names = [r.dir.name for r in full]
    ref = _rows(tmp_path / "ref", names)
    assert ref[0] != ref[1] and len(ref[0]) == 4
    results = []
    for k, point in enumerate(SWEEP_POINTS):
        d = _killed(runner, ["sweep", "kl.beta=0.01,0.1", *cli_args(cfg)], tmp_path, f"k{k}", point)
        n, s = _check(point, ref, d, names, lambda d: sweep(members, task=tiny_task, resume=d))
        results.append((point, n, s))
    _report("sweep", results, t0, runner)


def test_kill9_at_every_boundary_of_a_lora_run_resumes_bit_for_bit(runner, tiny_task, cache_dir, tmp_path):
    """The testbed with LoRA adapters on the policy and the critic (the frozen base left out of the
    checkpoints: klrl.loop.frozen)."""
    import klrl

    t0 = (time.time(), _cpu(runner))
    cfg = _cfg(cache_dir).replace(lora={"rank": 4}, model={"value_model": "lora"}, optim={"lr": 3e-3})
    ref = [lines(klrl.run(cfg.replace(train={"out_dir": str(tmp_path), "name": "ref"}), task=tiny_task).dir
                 / "metrics.jsonl")]  # fmt: skip
    results = []
    for k, point in enumerate(LORA_POINTS):
        d = _killed(runner, ["train", *cli_args(cfg)], tmp_path, f"k{k}", point)
        n, s = _check(point, ref, d, ["."], lambda d: klrl.run(cfg, task=tiny_task, resume=d))
        results.append((point, n, s))
    _report("lora", results, t0, runner)


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_exit_inside_the_reward_function_resumes_bit_for_bit(runner, tmp_path):
    """``os._exit(1)`` inside a host reward function (a LoRA run of the text task on the tiny GGUF;
    its step, which calls back to the host, is compiled anew by every process: one kill point)."""
    import klrl

    t0, cfg = (time.time(), _cpu(runner)), _reward_cfg(tmp_path)
    ref = [
        lines(klrl.run(cfg.replace(train={"out_dir": str(tmp_path), "name": "ref"})).dir / "metrics.jsonl")
    ]
    assert len(ref[0]) == 4
    results = []
    for k, point in enumerate(REWARD_POINTS):
        d = _killed(runner, ["train", *cli_args(cfg)], tmp_path, f"k{k}", point)
        n, s = _check(point, ref, d, ["."], lambda d: klrl.run(cfg, resume=d))
        results.append((point, n, s))
    _report("reward", results, t0, runner)
