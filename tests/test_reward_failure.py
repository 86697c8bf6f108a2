"""A host reward function failing during a run (raises, returns NaN, returns the wrong number of
values): the run ends with one stderr line naming the function and the problem, exit 2, the last
good state checkpointed (the failing iteration is not accepted) and metrics.jsonl intact; for a single
run and for a sweep. Also: the rollout's prompt indices reach the reward with the dataset's columns."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error

from klrl.cli import legacy_main

GGUF = Path(__file__).parent / "data" / "tiny_gguf" / "tiny.gguf"

REWARDS = """
import math
calls = {"n": 0}

def _count():
    calls["n"] += 1
    return calls["n"]

def boom(prompts, completions):
    if _count() >= 3:
        raise ValueError("boom at call 3")
    return [1.0] * len(completions)

def nan(prompts, completions):
    n = _count()
    return [math.nan if n >= 3 and i == 1 else 0.5 for i in range(len(completions))]

def short(prompts, completions):
    n = _count()
    return [0.0] * (len(completions) - (1 if n >= 3 else 0))

def topic(prompts, completions, topic):
    # the shipped prompts' topic column is a substring of the prompt of the same row
    assert all(t in p for p, t in zip(prompts, topic)), list(zip(prompts, topic))
    return [float(len(t)) for t in topic]
"""

MESSAGES = {
    "boom": r"reward function {f}:boom: raised ValueError: boom at call 3",
    "nan": r"reward function {f}:nan: returned nan for completion \(?[0-9, ]*\)? \(prompt row \d+\)",
    "short": r"reward function {f}:short: returned \d+ values for \d+ completions",
}


def _argv(tmp_path: Path, fn: str, name: str, *extra: str, iterations: int = 5) -> list[str]:
    f = tmp_path / "rewards.py"
    f.write_text(REWARDS)
    return ["--task.name", "text", "--model.path", str(GGUF), "--reward.fn", f"{f}:{fn}",
            "--data.prompt_len", "16", "--data.limit", "8", "--sampling.response_len", "4",
            "--ppo.epochs", "1", "--ppo.minibatches", "2", "--train.batch_size", "4",
            "--train.iterations", str(iterations), "--train.checkpoint_every", "1",
            "--train.out_dir", str(tmp_path),
            "--train.name", name, "--train.quiet", "true", *extra]  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _latest_step(run: Path) -> int:
    return max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def _fails(capsys, argv) -> str:
    return one_line_error(capsys, legacy_main, argv)


def _check_failed_run(tmp_path: Path, line: str, fn: str, run: Path) -> None:
    assert re.match("error: " + MESSAGES[fn].format(f=re.escape(str(tmp_path / "rewards.py"))), line), line
    assert line.endswith(f"; last good state: checkpoint 2 in {run / 'checkpoints'}"), line
    # calls 1 and 2 (iterations 0 and 1) scored; the third call failed: iteration 2 was not accepted
    rows = _lines(run / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(r["guard/skipped"] == 0.0 for r in rows)
    assert _latest_step(run) == 2
    assert (run / "config.json").is_file() and not (run / "report.md").exists()


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
@pytest.mark.parametrize("fn", ["nan", "short"])
def test_failing_reward_ends_a_run_after_the_last_good_checkpoint(capsys, tmp_path, fn):
    run = tmp_path / "r"
    _check_failed_run(tmp_path, _fails(capsys, _argv(tmp_path, fn, "r")), fn, run)


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_raising_reward_ends_the_run_and_its_checkpoint_resumes_exactly(capsys, tmp_path):
    """The checkpoint written at the failure is the state after the accepted iterations: with the
    function fixed (the same file), resuming gives the metrics of a run that never failed, bit for bit."""
    import klrl
    from klrl.io.readers import read_run

    run = tmp_path / "r"
    _check_failed_run(tmp_path, _fails(capsys, _argv(tmp_path, "boom", "r")), "boom", run)
    (tmp_path / "rewards.py").write_text(REWARDS.replace('raise ValueError("boom at call 3")', "pass"))
    cfg, _ = read_run(run)
    cfg = cfg.replace(train={"iterations": 3})
    resumed = klrl.run(cfg, resume=run)
    fresh = klrl.run(cfg.replace(train={"name": "fresh"}))
    assert len(resumed.metrics["reward/task"]) == 3
    for k in ("kl/k1_seq_sum", "reward/task", "loss/policy", "guard/skipped"):
        np.testing.assert_array_equal(resumed.metrics[k], fresh.metrics[k])


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_failing_reward_ends_a_sweep(capsys, tmp_path):
    line = _fails(capsys, _argv(tmp_path, "boom", "s", "--sweep", "kl.beta=0.1,1"))
    root = tmp_path / "s"
    assert "raised ValueError: boom at call 3" in line and "last good state: checkpoint 2" in line, line
    assert _latest_step(root) == 2
    members = json.loads((root / "sweep.json").read_text())["members"]
    assert len(members) == 2
    for m in members:
        assert [r["iteration"] for r in _lines(root / m / "metrics.jsonl")] == [0, 1]


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_host_reward_gets_the_rows_columns_by_the_rollouts_prompt_index(tmp_path):
    from klrl.io.readers import read_run

    assert legacy_main(_argv(tmp_path, "topic", "t", iterations=2)) == 0
    _, rows = read_run(tmp_path / "t")
    assert len(rows) == 2 and all(np.isfinite(r["reward/task"]) and r["reward/task"] > 3 for r in rows)
