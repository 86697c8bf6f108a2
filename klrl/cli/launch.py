"""What ``klrl train/sweep/study/resume`` (:mod:`klrl.cli.commands`) do once the config is checked: the
run or sweep itself (:func:`klrl.api.run`, :func:`klrl.api.sweep`, told that :func:`klrl.checks.preflight`
has run: ``checked=True``) with the user's mistakes as one line and exit 2 (:func:`guarded`), and its
summary printed."""

from __future__ import annotations

import sys
from typing import Any

import jax

from klrl import api  # (api.run, api.sweep looked up at the call: tests replace them)
from klrl.analysis.diagnosis import final_regime
from klrl.analysis.summary import summary_table
from klrl.cli.args import fail
from klrl.config import ConfigError, RunConfig
from klrl.data.prompts import PromptDataError
from klrl.distributed import is_main
from klrl.io.checkpoint import CheckpointError
from klrl.io.readers import RunDirError
from klrl.loop.reliability import RunStopped
from klrl.models.hf import CheckpointFormatError
from klrl.rewards import RewardFunctionError, RewardLoadError

__all__ = ["exit_status", "guarded", "run_one", "run_sweep", "stopped_line"]


def guarded(call: Any) -> Any:
    """``call()`` (a run or a sweep): the user's input or environment failing (a bad value, a damaged,
    locked or foreign checkpoint, a full disk, a bad model file, prompt file or reward function) is
    one line and exit 2 (also a host reward function failing during the run, after the last good state
    is checkpointed), the run stopping itself (guard, rollback limit) one line and exit 1; None
    after Ctrl-C."""

    try:
        return call()
    except (ConfigError, CheckpointError, RunDirError, CheckpointFormatError, PromptDataError,
            RewardLoadError, RewardFunctionError) as e:  # fmt: skip
        fail(str(e))
    except RunStopped as e:
        fail(str(e), 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return None


def run_sweep(
    members: list[RunConfig],
    axes: dict[str, Any],
    sweep_devices: int,
    resume: str | None,
    report: Any = None,
) -> int:
    """A sweep as a command (``report``: klrl.sweep's ``report=``): its summary table and diagnoses
    printed (process 0); the exit status."""

    results = guarded(
        lambda: api.sweep(members, sweep_devices=sweep_devices, resume=resume, report=report, checked=True)
    )
    if results is None:
        return 130
    stopped = results[0].info.get("stopped")
    if jax.process_index() == 0:
        print(summary_table(results, list(axes)))
        for i, r in enumerate(results):
            print(f"member {i:02d}: diagnosis {final_regime(r.metrics, r.config.diag)}")
        if results[0].dir is not None:
            print(f"sweep directory: {results[0].dir.parent}")
        done = results[0].info["iteration"] - results[0].info["start_iteration"]
        print(f"train time {results[0].info['train_s']:.1f}s for {len(members)} members x {done} iterations")
        if stopped:
            root = results[0].dir.parent if results[0].dir is not None else None
            print(stopped_line(stopped, results[0].info["iteration"], root))
    return exit_status(stopped)


def run_one(cfg: RunConfig, resume: str | None, report: Any = None) -> int:
    """One run as a command (``report``: klrl.run's ``report=``): its summary printed (process 0);
    the exit status."""

    result = guarded(lambda: api.run(cfg, resume=resume, report=report, checked=True))
    if result is None:
        return 130
    stopped = result.info.get("stopped")
    if is_main():  # several processes (--distributed): one summary, from the process that writes
        s = result.summary()
        print(f"run directory: {result.dir}")
        print(f"{'metric':<22}{'start':>12}{'end':>12}")
        for k, v in s.items():
            print(f"{k:<22}{v['start']:>12.4g}{v['end']:>12.4g}")
        done = result.info["iteration"] - result.info["start_iteration"]
        print(f"train time {result.info['train_s']:.1f}s for {done} iterations")
        if stopped:
            print(stopped_line(stopped, result.info["iteration"], result.dir))
    return exit_status(stopped)


def stopped_line(stopped: str, iteration: int, where: Any) -> str:
    """The summary's line for a run or sweep that stopped early (``stopped``: what stopped it)."""
    return (
        f"stopped by {stopped} at iteration {iteration} (checkpoint saved); "
        f"continue with: klrl resume {where}"
    )


def exit_status(stopped: str | None) -> int:
    """The exit status of a run or sweep that ended (``stopped``: the signal that stopped it, or
    None): 130 after SIGINT, else 0."""
    return 130 if stopped == "SIGINT" else 0
