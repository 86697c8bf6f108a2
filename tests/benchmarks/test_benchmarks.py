"""The throughput benchmarks run and report what they promise (not how fast), and the peer task."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

FIELDS = (
    "iteration_s_median", "compile_s", "tokens_per_s", "total_tokens_per_s", "peak_rss_mb",
    "flops_per_iteration", "achieved_flops_per_s", "matmul_flops_per_s", "flop_utilisation",
)  # fmt: skip
PHASES = ("rollout", "scoring", "advantages", "update", "controller")


def _run(args: list[str], tmp_path: Path, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, KLRL_CACHE=str(tmp_path / "cache"))
    # cheaper CPU code generation: this checks the report, not the speed
    extra = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {extra}".strip()
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return proc, json.loads(last)


def test_throughput_smoke(tmp_path):
    _, out = _run(
        ["benchmarks/throughput.py", "--workload", "peer-small", "--iterations", "2"], tmp_path, 600
    )
    assert out["workload"] == "peer-small"
    for k in FIELDS:
        assert isinstance(out[k], int | float) and math.isfinite(out[k]) and out[k] >= 0, k
    assert out["iteration_s_median"] > 0 and out["flops_per_iteration"] > 0
    assert set(out["phases_s"]) == set(PHASES)
    for k in PHASES:
        assert math.isfinite(out["phases_s"][k]) and out["phases_s"][k] > 0, k
    assert out["response_length_mean"] == 16.0  # use_eos=False: every response is full length


def test_phase_cpu_smoke(tmp_path):
    _, out = _run(["benchmarks/phase_cpu.py", "--workload", "peer-small", "--calls", "1"], tmp_path, 600)
    assert set(out["cpu_s"]) == {"rollout", "scoring", "advantages", "update"}
    assert all(v > 0 for v in out["cpu_s"].values()) and out["cpu_sum_s"] > 0


def test_update_cost_smoke(tmp_path):
    """benchmarks/update_cost.py on the tiny GGUF: every part timed, the donated update and optimiser step
    beside the fresh ones, FLOPs and floors where counted."""
    _, out = _run(["benchmarks/update_cost.py", "--workload", "smollm2-smoke", "--rounds", "1",
                   "--remat", "block,none"], tmp_path, 600)  # fmt: skip
    parts = out["parts"]
    timed = {f"{p}[{m}]" for p in ("update", "update_donated", "grad_mb") for m in ("block", "none")}
    assert set(parts) == {"matmul", "scoring", "policy_fwd_mb", "opt_step", "opt_step_donated", *timed}
    for k, row in parts.items():
        assert row["s_median"] > 0 and len(row["s_all"]) == 1, k
    for m in ("block", "none"):  # the same update, fresh or donated: the same FLOPs counted and executed
        a, b = parts[f"update[{m}]"], parts[f"update_donated[{m}]"]
        assert a["executed_flops"] == b["executed_flops"] > 0 and a["counted_flops"] == b["counted_flops"]
        assert parts[f"grad_mb[{m}]"]["executed_flops"] == a["executed_flops"] / out["minibatches"]
    assert parts["update[block]"]["executed_flops"] > parts["update[none]"]["executed_flops"]  # recomputed
    assert out["matmul_gflop_per_s"] > 0


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU path")
def test_gpu_script_skips_without_gpu(tmp_path):
    _, out = _run(["benchmarks/gpu.py"], tmp_path, 120)
    assert out["skipped"] == "no gpu"


def test_gpu_script_cpu_smoke(tmp_path):
    """``gpu.py --cpu-smoke``: both workloads (the GPT one and SmolLM2's code path, with a tiny GGUF in
    its place) in bf16, one JSON line each with the update-phase MFU and the rollout tokens/s."""
    proc, last = _run(
        ["benchmarks/gpu.py", "--cpu-smoke", "--iterations", "2", "--warmup", "1", "--budget-s", "1"],
        tmp_path, 900,
    )  # fmt: skip
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["workload"] for r in rows] == ["gpu-smoke-bf16", "smollm2-smoke-bf16"] and rows[-1] == last
    for r in rows:
        assert r["dtype"] == "bfloat16" and r["response_length_mean"] == 8.0, r["workload"]
        for k in ("update_mfu", "rollout_tokens_per_s", "update_flops_per_s", "iteration_s_median"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["workload"], k)
        # the reported rate is the definition's: B * R over the rollout phase's time
        assert math.isclose(r["rollout_tokens_per_s"], r["batch"] * 8 / r["phases_s"]["rollout"])
        assert math.isclose(
            r["update_mfu"], r["update_flops"] / r["phases_s"]["update"] / r["bf16_matmul_flops_per_s"]
        )
    assert rows[1]["vocab"] == 256 and rows[1]["flops_by_part"]["value"] > 0  # Llama family, separate value


def test_iteration_flops_formula():
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    from types import SimpleNamespace

    from klrl.models.gpt import matmul_flops

    cfg = common.peer_config(d_model=64, prompt_len=8, response_len=16)
    task = SimpleNamespace(name="peer", vocab_size=256, prompt_len=8)  # what the count reads of a task
    f = common.iteration_flops(cfg, task)
    m, b = cfg.model, 64
    # hand count of one token's forward: L * (qkv + proj + mlp + attention) + LM head
    d = 64
    per_tok = 2 * (2 * d * 3 * d + 2 * d * d + 2 * 2 * d * 4 * d + 2 * 2 * 24 * d) + 2 * d * 256
    assert matmul_flops(m, 256, 1, 24) == per_tok
    assert f["reference"] == b * 24 * per_tok
    assert f["value"] == f["reward"] == b * 24 * (per_tok - 2 * d * 256)
    assert f["update"] == 3 * (f["reference"] + f["value"])  # 1 epoch: fwd + bwd of policy and value
    decode = sum(matmul_flops(m, 256, b, 8 + t + 1) for t in range(15))
    assert f["rollout"] == matmul_flops(m, 256, b * 8, 8) + decode
    assert f["total"] == sum(v for k, v in f.items() if k != "total")


def test_peer_task_reward_reads_last_real_token():
    from klrl.config import ModelConfig, RunConfig, SamplingConfig, TaskConfig
    from klrl.models.rollout import Rollout
    from klrl.tasks.peer import EOS, PAD, make_peer_task

    cfg = RunConfig(
        model=ModelConfig(n_layers=1, n_heads=2, d_model=16),
        sampling=SamplingConfig(response_len=6),
        task=TaskConfig(prompt_pool=32),
    )
    task = make_peer_task(cfg, prompt_len=4, vocab=32, seed=3)
    env = task.env
    assert (task.eos_id, task.pad_id, task.vocab_size, task.max_len) == (EOS, PAD, 32, 10)
    assert env["prompts"].shape == (32, 4) and bool(jnp.all(env["prompt_mask"] == 1))
    assert int(env["prompts"].min()) >= 2 and int(env["prompts"].max()) < 32
    assert "lm" not in env["reward_params"] and "v_head" in env["reward_params"]

    resp = jax.random.randint(jax.random.key(0), (3, 6), 2, 32)
    mask = jnp.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], jnp.float32)
    prompt = env["prompts"][:3]

    @jax.jit
    def reward(r):
        ro = Rollout(prompt, env["prompt_mask"][:3], r, mask, jnp.zeros((3, 6)), None, None)
        return task.reward_fn(env, ro)

    r0 = reward(resp)
    assert r0.shape == (3,) and bool(jnp.all(jnp.isfinite(r0)))
    # tokens after the last real one (mask 0) cannot change the reward
    r1 = reward(jnp.where(mask > 0, resp, PAD))
    assert jnp.allclose(r0, r1, atol=1e-5)
    # the last real token does
    r2 = reward(resp.at[0, 2].set((resp[0, 2] + 1 - 2) % 30 + 2))
    assert not jnp.allclose(r0[0], r2[0]) and jnp.allclose(r0[1:], r2[1:], atol=1e-5)


def test_lora_script_tiny(tmp_path):
    """``lora.py --workload tiny``: full, LoRA and a 4-member LoRA sweep, each in its own process, one JSON
    line each, then the summary; the counts against the tiny GGUF's shapes by hand."""
    proc, last = _run(["benchmarks/lora.py", "--workload", "tiny", "--iterations", "3"], tmp_path, 900)
    rows = {r["config"]: r for r in map(json.loads, proc.stdout.splitlines()[:-1])}
    assert list(rows) == ["tiny-full", "tiny-lora", "tiny-lora-sweep4"] and last["errors"] == {}
    full, lora, sweep = rows["tiny-full"], rows["tiny-lora"], rows["tiny-lora-sweep4"]
    for r in rows.values():
        assert r["iterations_timed"] == 3 and r["iteration_s_median"] > 0 and r["compile_s"] > 0, r["config"]
        assert r["peak_rss_mb"] >= r["rss_by_stage_mb"]["init"]["peak_rss_mb"] > 0
        assert r["opt_state_bytes"] >= 2 * r["params_bytes"]  # Adam: two moments per trained parameter
    # tiny.gguf: 2 layers, width 32, 4 query heads and 2 kv heads of 8, MLP 64; rank-8 adapters on
    # q (32->32), k, v (32->16), o (32->32), gate, up (32->64), down (64->32): 8 * (in + out) each
    per_model = 2 * 8 * (64 + 48 + 48 + 64 + 96 + 96 + 96)
    head = 32 + 1  # the value head: kernel [32, 1] and bias
    assert lora["trained_params"] == 2 * per_model + head  # policy's and critic's adapters
    base = full["base_bytes"] // 4  # float32 reference = the loaded model
    assert full["trained_params"] == 2 * base + head  # policy and a separate value model (its trunk + head)
    assert lora["base_bytes"] == full["base_bytes"]
    # the sweep: 4 members' adapters, one shared frozen base
    assert sweep["members"] == 4 and sweep["trained_params"] == 4 * lora["trained_params"]
    assert sweep["base_bytes"] == lora["base_bytes"]
    assert lora["full_model_matmul_flops"] == full["full_model_matmul_flops"]  # the same work
    assert sweep["full_model_matmul_flops"] == 4 * lora["full_model_matmul_flops"]
    assert lora["lora_matmul_flops"] > 0 and "lora_matmul_flops" not in full
    assert last["lora_s_over_full_s"] == lora["iteration_s_median"] / full["iteration_s_median"]
    assert last["sweep4_s_over_lora_s"] == sweep["iteration_s_median"] / lora["iteration_s_median"]
    assert last["lora_peak_rss_gb"] == lora["peak_rss_gb"] and last["lora_peak_rss_gb_aim"] == 2.5
