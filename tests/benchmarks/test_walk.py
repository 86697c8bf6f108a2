"""benchmarks/walk.py: the walk from ``klrl train`` to the jitted step (issue 39) enters the API once, never
climbs the layering except through the one callback the API hands the program builder, and enters no room
a second time before it has left it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

WALK = Path(__file__).resolve().parents[2] / "benchmarks" / "walk.py"


def _walk():
    spec = importlib.util.spec_from_file_location("walk_bench", WALK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_walk_enters_the_api_once_and_goes_down_without_coming_back(tiny_cfg, tiny_task, tmp_path):
    walk = _walk()  # (tiny_task: the reference pretrained and cached before the walk, not traced)
    flags = ["--model.n_layers", "1", "--model.d_model", "32", "--model.n_heads", "2",
             "--task.cache_dir", tiny_cfg.task.cache_dir, "--task.pretrain_steps", "100",
             "--task.pretrain_batch", "32", "--task.pretrain_len", "16", "--task.prompt_len", "6",
             "--task.prompt_pool", "256", "--sampling.response_len", "8",
             "--train.batch_size", str(tiny_cfg.train.batch_size), "--train.iterations", "1",
             "--train.out_dir", str(tmp_path / "run"), "--train.quiet", "true"]  # fmt: skip
    # the first walk fills the task's caches (a cache miss calls the task back to build: pretrain.cached),
    # the second is measured, as benchmarks/NOTES.md's numbers are (every cache warm)
    walk.trace([*flags[:-4], "--train.out_dir", str(tmp_path / "warm"), *flags[-2:]], "run_one")
    w = walk.trace(flags, "run_one")
    s = walk.summary(w, "run_one")
    assert s["api_entries"] == 1, s["entries"]
    assert s["climb_pairs"] == {"klrl.loop.build -> klrl.checks": 1}, s["climb_pairs"]  # check_program
    # the stack when the step is traced: cli -> api -> loop -> step, each layer once and in order
    layers = [walk.layer(f.split(":")[0]) for f in s["stack_at_step"]]
    assert layers == sorted(layers, reverse=True), s["stack_at_step"]
    assert s["stack_at_step"][-1] == "klrl.step.train:step_fn"
    # where the step is made: cli -> api -> loop.build -> step, in order too
    mods = [f.split(":")[0] for f in s["stack_at_make"]]
    mods = [m for i, m in enumerate(mods) if i == 0 or m != mods[i - 1]]  # (a module's frames in a row: once)
    assert mods[-3:] == [
        "klrl.loop.build",
        "klrl.step.train",
        "klrl.step.parallel",
    ], s["stack_at_make"]
    layers = [walk.layer(f.split(":")[0]) for f in s["stack_at_make"]]
    assert layers == sorted(layers, reverse=True), s["stack_at_make"]
    assert s["spine"] == ["klrl.cli.launch", "klrl.api", "klrl.loop.build", "klrl.step.train",
                          "klrl.step.parallel", "klrl.loop.driver"]  # fmt: skip
    assert s["reentered"] == {}, s["reentered"]  # no room on the stack twice, at any call of the walk
    # a climb is counted: a call from klrl.step into klrl.api is one
    calls = [("klrl.step.train", "klrl.api"), ("klrl.api", "klrl.api")]
    fake = walk.summary(walk.Walk(calls, w.stack, [], {}), "run_one")
    assert fake["climbs"] == 1 and fake["api_entries"] == 1
    # a room entered again from a room it called is counted; staying in one room is not
    assert walk._twice(["a", "b", "a"]) == ["a"] and walk._twice(["a", "a", "b", "c"]) == []
