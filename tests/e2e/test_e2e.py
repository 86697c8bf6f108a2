"""End to end from ``experiments/run.py``: every KL placement, estimator family and advantage
estimator runs a few iterations on the built-in task with finite metrics."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "reward-k1": "--kl.placement reward --kl.estimator k1",
    "sequence-k3": "--kl.placement sequence --kl.estimator k3",
    "loss-k2-seqmean": "--kl.placement loss --kl.loss_coef 0.05 --kl.loss_estimator k2 "
    "--kl.loss_agg seq_mean",
    "reward+loss-full-ctrl-loss": "--kl.placement reward+loss --kl.estimator full --kl.loss_coef 0.05 "
    "--ctrl.kind pi --ctrl.drives loss --ctrl.target 0.5 --ctrl.unit token_mean",
    "grpo": "--ppo.advantage grpo --ppo.group_size 4 --kl.placement loss --kl.loss_coef 0.04",
    "rloo": "--ppo.advantage rloo --ppo.group_size 4 --kl.estimator abs",
    "separate-value-ref-ema": "--model.value_model separate --kl.ref_update_every 1 --kl.ref_mix 0.5 "
    "--ctrl.kind dual --ctrl.target 1.0 --ctrl.unit seq_sum",
}


def _run_main():
    spec = importlib.util.spec_from_file_location("klrl_run_cli", ROOT / "experiments" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("case", list(CASES))
def test_cli_runs_each_mode(case, tiny_cfg, tmp_path):
    t = tiny_cfg
    tk = t.task
    argv = (
        f"--task.name wordclass --task.cache_dir {tk.cache_dir} --task.pretrain_steps {tk.pretrain_steps} "
        f"--task.pretrain_batch {tk.pretrain_batch} --task.pretrain_len {tk.pretrain_len} "
        f"--task.prompt_len {tk.prompt_len} --task.prompt_pool {tk.prompt_pool} "
        "--model.n_layers 1 --model.d_model 32 --model.n_heads 2 --sampling.response_len 8 "
        "--train.batch_size 16 --train.iterations 2 --train.devices 1 --train.quiet true "
        f"--train.out_dir {tmp_path} --train.name {case} --ppo.minibatches 2 --ppo.epochs 1 {CASES[case]}"
    ).split()
    assert _run_main()(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / case / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        bad = {k: v for k, v in row.items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, f"{case}: non-finite metrics {bad}"
    names = set(rows[0])
    assert {"kl/k1_seq_sum", "kl/k1_seq_token_mean", "kl/exact_seq_sum", "ctrl/beta", "loss/policy"} <= names
    if "loss" in case or "grpo" in case:
        assert any(k.startswith("kl/loss_") for k in names)
    if case in ("grpo", "rloo"):
        assert "loss/value" not in names  # critic-free: no value function is built
