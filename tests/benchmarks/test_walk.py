"""benchmarks/walk.py: the walk from ``klrl train`` to the jitted step (issue 39) enters the API once and
never climbs the layering except through the one callback the API hands the program builder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

WALK = Path(__file__).resolve().parents[2] / "benchmarks" / "walk.py"


def _walk():
    spec = importlib.util.spec_from_file_location("walk_bench", WALK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_walk_enters_the_api_once_and_goes_down(tiny_cfg, tiny_task, tmp_path):
    walk = _walk()  # (tiny_task: the reference pretrained and cached before the walk, not traced)
    flags = ["--model.n_layers", "1", "--model.d_model", "32", "--model.n_heads", "2",
             "--task.cache_dir", tiny_cfg.task.cache_dir, "--task.pretrain_steps", "100",
             "--task.pretrain_batch", "32", "--task.pretrain_len", "16", "--task.prompt_len", "6",
             "--task.prompt_pool", "256", "--sampling.response_len", "8",
             "--train.batch_size", str(tiny_cfg.train.batch_size), "--train.iterations", "1",
             "--train.out_dir", str(tmp_path), "--train.quiet", "true"]  # fmt: skip
    calls, stack = walk.trace(flags, "run_one")
    s = walk.summary(calls, stack, "run_one")
    assert s["api_entries"] == 1, s["entries"]
    assert s["climb_pairs"] == {"klrl.loop.build -> klrl.checks": 1}, s["climb_pairs"]  # check_program
    # the stack when the step is traced: cli -> api -> loop -> step, each layer once and in order
    layers = [walk.layer(f.split(":")[0]) for f in s["stack_at_step"]]
    assert layers == sorted(layers, reverse=True), s["stack_at_step"]
    assert s["stack_at_step"][-1] == "klrl.step.train:step_fn"
    # a climb is counted: a call from klrl.step into klrl.api is one
    fake = walk.summary([("klrl.step.train", "klrl.api"), ("klrl.api", "klrl.api")], stack, "run_one")
    assert fake["climbs"] == 1 and fake["api_entries"] == 1
