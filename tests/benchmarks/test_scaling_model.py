"""benchmarks/scaling_model.py: parameter counts against the published totals, memory against hand
arithmetic, and the bandwidth bound of decode against a hand figure."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling_model.py"
_spec = importlib.util.spec_from_file_location("scaling_model", _PATH)
sm = importlib.util.module_from_spec(_spec)
sys.modules["scaling_model"] = sm
_spec.loader.exec_module(sm)


# published totals (model cards / safetensors metadata), in the rounding the cards use
@pytest.mark.parametrize(
    "size, total, digits",
    [("135M", 134.5e6, 0.05e6), ("1B", 1.236e9, 0.0005e9), ("8B", 8.03e9, 0.005e9), ("70B", 70.6e9, 0.05e9)],
)
def test_parameter_counts_match_published_totals(size, total, digits):
    assert abs(sm.n_params(sm.SHAPES[size]) - total) <= digits


def _hf_tensor_shapes(s):
    """An independent count: the tensor shapes of a transformers LlamaForCausalLM state dict."""
    shapes = {"model.embed_tokens.weight": (s.vocab, s.d_model), "model.norm.weight": (s.d_model,)}
    if not s.tied:
        shapes["lm_head.weight"] = (s.vocab, s.d_model)
    for i in range(s.n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (s.n_heads * s.head_dim, s.d_model),
            p + "self_attn.k_proj.weight": (s.n_kv_heads * s.head_dim, s.d_model),
            p + "self_attn.v_proj.weight": (s.n_kv_heads * s.head_dim, s.d_model),
            p + "self_attn.o_proj.weight": (s.d_model, s.n_heads * s.head_dim),
            p + "mlp.gate_proj.weight": (s.d_ff, s.d_model),
            p + "mlp.up_proj.weight": (s.d_ff, s.d_model),
            p + "mlp.down_proj.weight": (s.d_model, s.d_ff),
            p + "input_layernorm.weight": (s.d_model,),
            p + "post_attention_layernorm.weight": (s.d_model,),
        }
    return shapes


@pytest.mark.parametrize("size", list(sm.SHAPES))
def test_parameter_count_equals_state_dict_sum(size):
    s = sm.SHAPES[size]
    assert sm.n_params(s) == sum(math.prod(v) for v in _hf_tensor_shapes(s).values())
    # the value / reward model: the untied LM head (if any) replaced by a d -> 1 score head
    assert sm.n_params(s, "scalar") == sm.n_params(s) - (0 if s.tied else s.vocab * s.d_model) + s.d_model


def test_exact_counts():
    assert sm.n_params(sm.SHAPES["135M"]) == 134_515_008
    assert sm.n_params(sm.SHAPES["8B"]) == 8_030_261_248


def test_memory_smollm2_by_hand():
    """SmolLM2-135M, one device, microbatch 1 sequence of 1024 tokens, no remat."""
    m = sm.memory_per_device(sm.SHAPES["135M"], (1, 1, 1), microbatch=1)
    p, pv = 134_515_008, 134_515_584  # policy; value/reward (tied embedding + a 576 -> 1 head)
    assert m["params"] == 4 * p == 538_060_032
    assert m["optimizer"] == 8 * p
    assert m["value"] == 12 * pv
    assert m["grads"] == 4 * (p + pv)
    assert m["reference"] == 2 * p and m["reward"] == 2 * pv
    # KV: 2 (k, v) x 30 layers x 3 KV heads x 64 x 2 bytes = 23 040 B/token; 512 sequences x 1024
    assert m["kv_cache"] == 512 * 1024 * 23_040 == 12_079_595_520
    # per token per layer: 2 B x (4 x 576 + 2 x 9 x 64 + 2 x 3 x 64 + 3 x 1536) = 16 896 B; x 30 layers,
    # x 2 (policy + value), + fp32 logits and their gradient 8 x 49 152; x 1024 tokens
    assert m["activations"] == 1024 * (2 * 30 * 16_896 + 8 * 49_152) == 1_440_743_424
    # kept rollout and reference logits: 2 x 512 x 512 x 49 152 x 4 B
    assert m["logits"] == 2 * 512 * 512 * 49_152 * 4
    assert m["peak"] == m["persistent"] + max(m["kv_cache"] + m["logits"], m["grads"] + m["activations"])


def test_sharding_divides_state_and_batch():
    s = sm.SHAPES["8B"]
    one = sm.memory_per_device(s, (1, 1, 1), microbatch=1)
    m = sm.memory_per_device(s, (2, 4, 8), microbatch=1)
    for k in ("params", "optimizer", "value", "grads", "reference", "reward"):
        assert m[k] == pytest.approx(one[k] / 32)  # fsdp x tensor
    assert m["kv_cache"] == pytest.approx(one["kv_cache"] / (2 * 4 * 8))  # batch / (data fsdp), KV heads / 8
    assert sm.memory_per_device(s, (1, 1, 16), microbatch=1)["kv_cache"] == pytest.approx(one["kv_cache"] / 8)
    # 70B: 2 x 80 layers x 8 KV heads x 128 x 2 B = 320 KiB per token
    assert sm.kv_cache_bytes(sm.SHAPES["70B"], 512, 1024) == 512 * 1024 * 327_680 == 160 * 2**30
    remat = sm.memory_per_device(s, (1, 1, 1), microbatch=1, remat=True)
    assert remat["activations"] < one["activations"] / 4


def test_decode_is_bandwidth_bound_by_hand():
    """Batch-1 bf16 decode of Llama-3.1-8B on one H100 at full bandwidth: every token reads
    2 x 8.03e9 bytes; 3.35e12 / 16.06e9 = 208.6 tokens/s."""
    eff = sm.Efficiency(hbm_eff=1.0)
    w = sm.Workload(response_len=1)
    t = sm.decode_time(sm.SHAPES["8B"], sm.HARDWARE["8xH100"], 1, 1, 2, 0, 0.0, w, eff)
    assert 1 / t == pytest.approx(3.35e12 / (2 * 8_030_261_248))


def test_fits():
    h100 = sm.HARDWARE["8xH100"]
    assert sm.data_only(sm.SHAPES["8B"], h100) is None  # 260 GiB of train state per replica
    assert sm.fit_mesh(sm.SHAPES["70B"], h100) is None  # one host holds 640 GB, the state is ~2.5 TB
    fit = sm.fit_hosts(sm.SHAPES["70B"], h100)
    assert fit is not None and fit["hosts"] > 1 and fit["memory"]["peak"] <= 0.9 * h100.hbm


def test_main_prints_json(capsys):
    assert sm.main([]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["size"] for r in out["rows"]} == set(sm.SHAPES)
