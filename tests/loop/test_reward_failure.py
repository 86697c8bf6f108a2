"""A host reward function failing during a run (raises, calls sys.exit(), raises KeyboardInterrupt,
returns NaN, a value that is inf in float32, the wrong number of values): the run ends with one
stderr line naming the function and the problem, exit 2, the last good state checkpointed (the
failing iteration is not accepted) and metrics.jsonl intact; for a single run and for a sweep.
A function that fails on its first call (a wrong signature, a TRL conversational reward, sys.exit at
import) is one line before anything compiles, for a run, a sweep and a resume.
Also: the rollout's prompt indices reach the reward with the dataset's columns.

The functions count their calls: call 1 is the check before compiling
(:func:`klrl.checks.check_text_reward`), calls 2 and 3 score iterations 0 and 1, call 4 fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error

from klrl.cli import legacy_main

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"

REWARDS = """
import math
import sys
calls = {"n": 0}

def _count():
    calls["n"] += 1
    return calls["n"]

def boom(prompts, completions):
    if _count() >= 4:
        raise ValueError("boom at call 4")
    return [1.0] * len(completions)

def nan(prompts, completions):
    n = _count()
    return [math.nan if n >= 4 and i == 1 else 0.5 for i in range(len(completions))]

def short(prompts, completions):
    n = _count()
    return [0.0] * (len(completions) - (1 if n >= 4 else 0))

def exits(completions, **kwargs):
    if _count() >= 4:
        sys.exit(3)
    return [1.0] * len(completions)

def huge(completions, **kwargs):  # finite in Python, inf in float32
    n = _count()
    return [1e39 if n >= 4 and i == 1 else 0.5 for i in range(len(completions))]

def nothing(completions, **kwargs):  # no opinion on anything: the third such batch ends the run
    _count()
    return [None] * len(completions)

def hangs(completions, **kwargs):  # call 4 does not return until the test releases it
    if _count() >= 4:
        import os, time
        while not os.path.exists(__file__ + ".release"):
            time.sleep(0.05)
    return [1.0] * len(completions)

def spins(completions, **kwargs):  # call 4 never returns (a busy loop: it takes the GIL between switches)
    if _count() >= 4:
        while True:
            pass
    return [1.0] * len(completions)

def topic(prompts, completions, topic):
    # the shipped prompts' topic column is a substring of the prompt of the same row
    assert all(t in p for p, t in zip(prompts, topic)), list(zip(prompts, topic))
    return [float(len(t)) for t in topic]
"""

MESSAGES = {
    "boom": r"reward function {f}:boom: raised ValueError: boom at call 4",
    "nan": r"reward function {f}:nan: returned nan for completion \(?[0-9, ]*\)? \(prompt row \d+\)",
    "short": r"reward function {f}:short: returned \d+ values for \d+ completions",
    "exits": r"reward function {f}:exits: called sys.exit\(3\)",
    "huge": r"reward function {f}:huge: returned 1e\+39 for completion \d+ \(prompt row \d+\) "
    r"\(inf in float32",
    "hangs": r"reward function {f}:hangs: did not return within 2 s \(reward\.timeout; its call is left "
    r"running\)",
    "nothing": r"reward function {f}:nothing: returned None for every completion of 3 consecutive batches "
    r"\(4 completions in the last\): no task reward to learn from",
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
    # calls 2 and 3 (iterations 0 and 1) scored; the fourth call failed: iteration 2 was not accepted
    rows = _lines(run / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(r["guard/skipped"] == 0.0 for r in rows)
    assert _latest_step(run) == 2
    assert (run / "config.json").is_file() and not (run / "report.md").exists()


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
# end to end: one exception-less failure of each path (a value, a count, a BaseException, float32); a
# KeyboardInterrupt and the weighted sum's overflow take the same paths, under jit in test_host_reward.py
@pytest.mark.parametrize("fn", ["nan", "short", "exits", "huge"])
def test_failing_reward_ends_a_run_after_the_last_good_checkpoint(capsys, tmp_path, fn):
    """sys.exit() is the function's failure like any exception (a real Ctrl-C is SIGINT, handled by
    the run's StopSignals: it never reaches the function); values are checked in float32."""
    run = tmp_path / "r"
    argv = _argv(tmp_path, fn, "r")
    _check_failed_run(tmp_path, _fails(capsys, argv), fn, run)


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_a_reward_that_never_scores_ends_the_run_and_all_none_is_logged(capsys, tmp_path):
    """Issue 41: every function returning None for every completion of 3 consecutive batches (here the
    only function, iterations 0, 1 and 2) ends the run like a failure, at the last good checkpoint; the
    iterations before log reward/all_none_frac = 1 (before: the run reached exit 0 with reward 0)."""
    run = tmp_path / "r"
    _check_failed_run(tmp_path, _fails(capsys, _argv(tmp_path, "nothing", "r")), "nothing", run)
    rows = _lines(run / "metrics.jsonl")
    assert [r["reward/all_none_frac"] for r in rows] == [1.0, 1.0]
    assert [r["reward/task"] for r in rows] == [0.0, 0.0]


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_a_reward_that_does_not_return_ends_the_run_as_one_that_raises(capsys, tmp_path):
    """Issue 52: a call still running after reward.timeout seconds is the function's failure: one line
    naming it, the last good state checkpointed, the lock released (before: the run waited for ever,
    holding its lock)."""
    from klrl.io.lock import run_lock

    run = tmp_path / "r"
    try:
        line = _fails(capsys, _argv(tmp_path, "hangs", "r", "--reward.timeout", "2"))
    finally:
        (tmp_path / "rewards.py.release").touch()  # the call left running returns
    _check_failed_run(tmp_path, line, "hangs", run)
    assert not (run / ".klrl.lock").exists()
    with run_lock(run):  # free: another process may resume it
        pass


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_a_process_whose_reward_never_returns_exits(tmp_path):
    """The command as a process, the call spinning for ever on its thread: exit 2 in bounded time, one
    line on stderr, checkpoint 2 committed (Python cannot stop the thread; it is a daemon, so the
    process ends anyway)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root), KLRL_CACHE=str(tmp_path / "cache"))
    argv = [sys.executable, "-m", "klrl", "train", *_argv(tmp_path, "spins", "r", "--reward.timeout", "2")]
    p = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    assert "spins: did not return within 2 s (reward.timeout" in lines[0], lines
    assert lines[0].endswith(f"last good state: checkpoint 2 in {tmp_path / 'r' / 'checkpoints'}"), lines
    assert _latest_step(tmp_path / "r") == 2 and not (tmp_path / "r" / ".klrl.lock").exists()


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_raising_reward_ends_the_run_and_its_checkpoint_resumes_exactly(capsys, tmp_path):
    """The checkpoint written at the failure is the state after the accepted iterations: with the
    function fixed (the same file), resuming gives the metrics of a run that never failed, bit for bit."""
    import klrl
    from klrl.io.readers import read_run

    run = tmp_path / "r"
    _check_failed_run(tmp_path, _fails(capsys, _argv(tmp_path, "boom", "r")), "boom", run)
    (tmp_path / "rewards.py").write_text(REWARDS.replace('raise ValueError("boom at call 4")', "pass"))
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
    assert "raised ValueError: boom at call 4" in line and "last good state: checkpoint 2" in line, line
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


# ---- checked before anything compiles ----------------------------------------------------------------

FIRST_CALL = """
import sys

def positional(prompts, texts):  # no 'completions'
    return [0.0] * len(texts)

def conversational(completions, **kwargs):  # TRL's conversational form: string prompts give strings
    return [float(len(c[0]["content"])) for c in completions]

def exits(completions, **kwargs):
    sys.exit(5)

def interrupt(completions, **kwargs):
    raise KeyboardInterrupt

def huge(completions, **kwargs):
    return [1e39] * len(completions)

def needs_answer(completions, answer):  # the shipped prompts have no 'answer' column
    return [0.0] * len(completions)

def ok(completions, **kwargs):
    return [1.0] * len(completions)
"""

FIRST_CALL_MESSAGES = {
    "positional": "takes no 'completions' argument by name (its signature: positional(prompts, texts))",
    "conversational": "raised TypeError: string indices must be integers, not 'str' (completions are plain "
    "strings (the decoded text), not TRL conversational message lists (those come for conversation prompts, "
    "or with reward.completions=messages): use c, not c[0]['content']) "
    "(a call before compiling",
    "exits": "called sys.exit(5) (a call before compiling",
    "interrupt": "raised KeyboardInterrupt (a call before compiling",
    "huge": "returned 1e+39 for completion 0 (prompt row 0) (inf in float32",
    "needs_answer": "requires argument 'answer', which klrl does not pass",
}


@pytest.fixture
def nothing_compiles(monkeypatch):
    """``make_train`` (the compile's entry) fails the test if a run reaches it."""
    import klrl.loop.build

    def reached(*a, **k):
        raise AssertionError("make_train was reached: the reward function was not checked before compiling")

    monkeypatch.setattr(klrl.loop.build, "make_train", reached)


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
@pytest.mark.parametrize("fn", list(FIRST_CALL_MESSAGES))
@pytest.mark.parametrize("mode", ["train", "sweep"])
def test_a_function_failing_its_first_call_is_one_line_before_compiling(
    capsys, tmp_path, nothing_compiles, fn, mode
):
    f = tmp_path / "first.py"
    f.write_text(FIRST_CALL)
    argv = _argv(tmp_path, fn, "r", *(["--sweep", "kl.beta=0.1,1"] if mode == "sweep" else []))
    argv[argv.index("--reward.fn") + 1] = f"{f}:{fn}"
    line = _fails(capsys, argv)
    assert line.startswith("error: ") and f"reward function {f}:{fn}: " in line, line
    assert FIRST_CALL_MESSAGES[fn] in line, line
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_module_exiting_at_import_is_one_line(capsys, tmp_path, nothing_compiles):
    f = tmp_path / "exits.py"
    f.write_text("import sys\nsys.exit(5)\n")
    argv = _argv(tmp_path, "ok", "r")
    argv[argv.index("--reward.fn") + 1] = f"{f}:f"
    line = _fails(capsys, argv)
    assert line == f"error: reward.fn: reward '{f}:f': {f} does not import (it called sys.exit(5))", line


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_a_resume_checks_the_function_before_compiling(capsys, tmp_path, monkeypatch):
    """A run made with a good function, resumed after the file changed to a conversational reward:
    refused in one line before the compile; the run directory is untouched."""
    f = tmp_path / "first.py"
    f.write_text(FIRST_CALL)
    argv = _argv(tmp_path, "ok", "r", iterations=1)
    argv[argv.index("--reward.fn") + 1] = f"{f}:ok"
    assert legacy_main(argv) == 0
    run = tmp_path / "r"
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    f.write_text(FIRST_CALL.replace("def ok(", "def ok_(").replace("def conversational(", "def ok("))
    import klrl.loop.build

    monkeypatch.setattr(klrl.loop.build, "make_train", lambda *a, **k: pytest.fail("make_train was reached"))
    line = _fails(capsys, ["--resume", str(run), "--train.iterations", "2"])
    assert f"reward function {f}:ok: raised TypeError: string indices must be integers" in line, line
    assert "completions are plain strings" in line
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before


CONVERSATIONAL = """
import json, os

def trl_style(prompts, completions, **kwargs):  # as TRL's docs write a conversational reward
    with open(os.environ["KLRL_TEST_SEEN"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions}) + "\\n")
    return [float(len(c[0]["content"])) for c in completions]

def plain(completions, **kwargs):
    return [float(len(c.split())) for c in completions]
"""


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
@pytest.mark.parametrize("fn,extra", [("trl_style", ()), ("plain", ("--reward.completions", "text"))])
def test_conversation_prompts_give_trl_message_lists_end_to_end(capsys, tmp_path, monkeypatch, fn, extra):
    """A prompt file of TRL conversations and a TRL conversational reward: the reward is called with
    ``[{"role": "assistant", "content": ...}]`` per completion (TRL's rule) and the run goes on to
    compile; ``--reward.completions text`` gives a string function the text."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {w}."}]}) + "\n"
                            for w in ("hi", "yes", "no", "ok")))  # fmt: skip
    f = tmp_path / "conv.py"
    f.write_text(CONVERSATIONAL)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("KLRL_TEST_SEEN", str(seen))
    import klrl.loop.build

    class Compiled(Exception):
        pass

    def reached(*a, **k):
        raise Compiled

    monkeypatch.setattr(klrl.loop.build, "make_train", reached)
    argv = _argv(tmp_path, fn, "r", "--data.path", str(data), *extra)
    argv[argv.index("--reward.fn") + 1] = f"{f}:{fn}"
    argv[argv.index("--data.limit") + 1] = "4"
    with pytest.raises(Compiled):
        legacy_main(argv)
    if fn == "trl_style":
        call = json.loads(seen.read_text().splitlines()[0])
        assert call["prompts"][0] == [{"role": "user", "content": "Say hi."}]
        assert [c[0]["role"] for c in call["completions"]] == ["assistant"] * len(call["prompts"])
        assert all(len(c) == 1 and isinstance(c[0]["content"], str) for c in call["completions"])
