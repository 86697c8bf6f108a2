"""Scale on paper: parameter counts, memory per device, meshes and step times for PPO with a critic.

Pure Python (no JAX, no klrl imports), so ``benchmarks/sharding.py`` can compare XLA's
``compiled.memory_analysis()`` against :func:`memory_per_device`. Every formula is stated in
``docs/scaling.md``; this file is its executable form.

    python benchmarks/scaling_model.py            # the tables of docs/scaling.md, JSON on the last line
    python benchmarks/scaling_model.py --markdown # the same as Markdown tables

Conventions: bytes are bytes (GiB = 2**30 only where a name says so); FLOPs count a multiply-add as
2; a "sequence" is prompt + response; sharding is over a mesh ``(data, fsdp, tensor)``: parameters
and optimiser state are split over ``fsdp * tensor`` devices (replicated over ``data``), the batch
over ``data * fsdp``, heads, FFN width and vocabulary over ``tensor``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder: RMSNorm, GQA attention with RoPE (no biases), SwiGLU MLP."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    tied: bool


# From each model's config.json (HF hub): SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B.
SHAPES = {
    "135M": Shape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True),
    "1B": Shape("Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, True),
    "8B": Shape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, False),
    "70B": Shape("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, False),
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator type: per-chip HBM (bytes), HBM bandwidth (bytes/s), dense bf16 peak (FLOP/s),
    per-chip ingress bandwidth inside the fast domain (``link_bw``: ICI on TPU, NVLink on GPU) and
    across it (``dcn_bw``); ``domain`` chips share the fast interconnect; ``tensor_max`` bounds the
    tensor axis."""

    name: str
    chips: int
    hbm: float
    hbm_bw: float
    peak: float
    link_bw: float
    dcn_bw: float
    domain: int
    tensor_max: int = 8


GIB = 2**30
# Cloud TPU docs (v5e, v5p pages) and NVIDIA's H100/H200 datasheets; see docs/scaling.md.
HARDWARE = {
    "v5e-256": Hardware("v5e-256", 256, 16 * GIB, 819e9, 197e12, 200e9, 200e9, 256),
    "v5p-128": Hardware("v5p-128", 128, 95 * GIB, 2765e9, 459e12, 600e9, 600e9, 128),
    "8xH100": Hardware("8xH100", 8, 80e9, 3.35e12, 989e12, 450e9, 50e9, 8),
    "8xH200": Hardware("8xH200", 8, 141e9, 4.8e12, 989e12, 450e9, 50e9, 8),
}


def bandwidth(hw: Hardware, chips: int) -> float:
    """Per-chip ingress bandwidth of a collective over ``chips`` chips: the slowest link on the ring."""
    return hw.link_bw if chips <= hw.domain else hw.dcn_bw


@dataclass(frozen=True)
class Workload:
    """The PPO workload of docs/scaling.md: ``batch`` prompts x 1 response per iteration."""

    batch: int = 512
    prompt_len: int = 512
    response_len: int = 512
    epochs: int = 4
    minibatches: int = 4
    frozen_bytes: int = 2  # reference and reward model in bf16 (4 = fp32)
    kv_bytes: int = 2  # bf16 KV cache
    act_bytes: int = 2  # bf16 activations
    keep_logits: bool = True  # klrl keeps [B, R, V] fp32 rollout and reference logits (exact-KL metric)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def minibatch(self) -> int:
        return self.batch // self.minibatches


# ---------------------------------------------------------------------------------------------------
# parameters and FLOPs


def layer_params(s: Shape) -> int:
    """q, k, v, o projections + gate, up, down + two RMSNorm scales."""
    attn = s.d_model * (s.n_heads + 2 * s.n_kv_heads) * s.head_dim + s.n_heads * s.head_dim * s.d_model
    return attn + 3 * s.d_model * s.d_ff + 2 * s.d_model


def n_params(s: Shape, head: str = "lm") -> int:
    """Total parameters. ``head='lm'``: embedding (+ an untied LM head) + layers + final norm.
    ``head='scalar'``: the value / reward model: the same trunk with a d -> 1 score head instead."""
    emb = s.vocab * s.d_model
    out = (0 if s.tied else emb) if head == "lm" else s.d_model
    return emb + s.n_layers * layer_params(s) + s.d_model + out


def matmul_params(s: Shape, head: str = "lm") -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not; a tied LM head
    does): FLOPs per token = 2 x this + attention."""
    return s.n_layers * (layer_params(s) - 2 * s.d_model) + (
        s.vocab * s.d_model if head == "lm" else s.d_model
    )


def forward_flops(s: Shape, tokens: int, context: float, head: str = "lm") -> float:
    """2 * matmul params per token + QK^T and AV: 4 * L * H * head_dim * context per token."""
    return tokens * (2 * matmul_params(s, head) + 4 * s.n_layers * s.n_heads * s.head_dim * context)


def sequence_flops(s: Shape, t: int, head: str = "lm") -> float:
    """A causal forward over t tokens: mean context t/2 (flash attention skips masked blocks)."""
    return forward_flops(s, t, t / 2, head)


def kv_bytes_per_token(s: Shape, kv_bytes: int = 2) -> int:
    """K and V for every layer and KV head (GQA: n_kv_heads, not n_heads)."""
    return 2 * s.n_layers * s.n_kv_heads * s.head_dim * kv_bytes


def kv_cache_bytes(s: Shape, batch: float, length: int, tensor: int = 1, kv_bytes: int = 2) -> float:
    """KV cache of ``batch`` sequences of ``length`` tokens on one device of a ``tensor``-way split:
    KV heads are split up to ``n_kv_heads`` ways and replicated beyond (GQA)."""
    return batch * length * kv_bytes_per_token(s, kv_bytes) / min(tensor, s.n_kv_heads)


# ---------------------------------------------------------------------------------------------------
# memory per device


def activation_bytes_per_token(s: Shape, tensor: int, act_bytes: int = 2, remat: bool = False) -> float:
    """Bytes kept per token for the backward pass of one layer stack, flash attention (no T x T
    scores). Per layer: norm inputs and outputs (4 d, replicated over ``tensor``), q, k, v after RoPE
    and the attention output (2 H hd + 2 KV hd), gate, up and their SwiGLU product (3 F), the latter
    split over ``tensor``. With ``remat`` (every block checkpointed): the L block inputs (d each) plus
    one block's working set while it is recomputed."""
    per_layer = act_bytes * (4 * s.d_model + (2 * s.n_heads * s.head_dim + 2 * s.n_kv_heads * s.head_dim
                                              + 3 * s.d_ff) / tensor)  # fmt: skip
    if remat:
        return s.n_layers * act_bytes * s.d_model + per_layer
    return s.n_layers * per_layer


def memory_per_device(
    shape: Shape,
    mesh: tuple[int, int, int] = (1, 1, 1),
    *,
    workload: Workload | None = None,
    microbatch: int | None = None,
    remat: bool = False,
) -> dict[str, float]:
    """Bytes per device of PPO with a same-size reference, value and reward model.

    ``mesh = (data, fsdp, tensor)``; ``microbatch``: sequences per device in one forward/backward
    (default: the whole per-device share of a minibatch, as klrl does: no gradient accumulation).

    Keys: ``params`` (policy fp32 master), ``optimizer`` (policy Adam m, v: fp32), ``value`` (value
    model: fp32 params + m + v), ``grads`` (fp32, policy and value: klrl differentiates both in one
    loss), ``reference`` and ``reward`` (frozen, ``workload.frozen_bytes`` per parameter),
    ``activations`` (update, policy + value, one microbatch of ``seq_len`` tokens, with the fp32
    logits and their gradient), ``kv_cache`` (rollout, bf16, the per-device share of the batch at full
    length), ``logits`` (kept rollout and reference [B, R, V] fp32 logits), ``persistent`` (the train
    state), ``peak`` = persistent + max(rollout: kv_cache + logits, update: grads + activations).
    """
    w = workload or Workload()
    data, fsdp, tensor = mesh
    shard = fsdp * tensor
    p_pol, p_val = n_params(shape, "lm"), n_params(shape, "scalar")
    b_roll = w.batch / (data * fsdp)
    mb = microbatch if microbatch is not None else w.minibatch / (data * fsdp)
    act_tok = activation_bytes_per_token(shape, tensor, w.act_bytes, remat)
    logit_tok = 8 * shape.vocab / tensor  # fp32 logits + fp32 gradient of the log-softmax
    out = {
        "params": 4 * p_pol / shard,
        "optimizer": 8 * p_pol / shard,
        "value": 12 * p_val / shard,
        "grads": 4 * (p_pol + p_val) / shard,
        "reference": w.frozen_bytes * p_pol / shard,
        "reward": w.frozen_bytes * p_val / shard,
        "activations": mb * w.seq_len * (2 * act_tok + logit_tok),
        "kv_cache": kv_cache_bytes(shape, b_roll, w.seq_len, tensor, w.kv_bytes),
        "logits": (2 * b_roll * w.response_len * shape.vocab * 4 / tensor) if w.keep_logits else 0.0,
    }
    out["persistent"] = sum(out[k] for k in ("params", "optimizer", "value", "reference", "reward"))
    out["peak"] = out["persistent"] + max(out["kv_cache"] + out["logits"], out["grads"] + out["activations"])
    return out


# ---------------------------------------------------------------------------------------------------
# meshes


def _pow2_divisors(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if d <= n and n % d == 0]


def candidates(shape: Shape, hw: Hardware, workload: Workload | None = None, chips: int | None = None,
               usable: float = 0.9) -> list[dict]:  # fmt: skip
    """Every (data, fsdp, tensor) x remat x gradient-accumulation over ``chips`` (default
    ``hw.chips``) whose peak fits ``usable * HBM``. tensor must divide the q and KV head counts and
    be at most ``hw.tensor_max``; ``data * fsdp`` must divide the minibatch; microbatch = the
    per-device share of a minibatch / accumulation steps."""
    w = workload or Workload()
    n = chips or hw.chips
    out = []
    for tensor in _pow2_divisors(min(hw.tensor_max, n)):
        if shape.n_heads % tensor or shape.n_kv_heads % tensor:
            continue
        for fsdp in _pow2_divisors(n // tensor):
            data = n // (tensor * fsdp)
            if w.minibatch % (data * fsdp):
                continue
            share = w.minibatch // (data * fsdp)
            for remat in (False, True):
                for accum in _pow2_divisors(share):
                    m = memory_per_device(shape, (data, fsdp, tensor), workload=w,
                                          microbatch=share // accum, remat=remat)  # fmt: skip
                    if m["peak"] <= usable * hw.hbm:
                        out.append({"mesh": (data, fsdp, tensor), "remat": remat, "accum": accum,
                                    "microbatch": share // accum, "chips": n, "memory": m})  # fmt: skip
    return out


def fit_mesh(shape: Shape, hw: Hardware, workload: Workload | None = None, chips: int | None = None,
             objective: str = "klrl", eff: Efficiency | None = None) -> dict | None:  # fmt: skip
    """The fitting configuration with the least estimated time: ``objective='klrl'``: update +
    klrl's same-mesh rollout; ``'update'``: the update alone (the trainer of a separate engine).
    If nothing fits on ``chips`` chips, the same on half as many (the spare chips can run other
    sweep members); None if nothing fits on one chip either."""
    w = workload or Workload()
    n = chips or hw.chips
    while n >= 1:
        cands = candidates(shape, hw, w, n)
        if cands:

            def cost(c):
                t = update_time(shape, hw, c, w, eff)["time"]
                return t + (rollout_klrl(shape, hw, c, w, eff) if objective == "klrl" else 0.0)

            return min(cands, key=cost)
        n //= 2
    return None


def fit_hosts(shape: Shape, hw: Hardware, workload: Workload | None = None, objective: str = "klrl",
              max_hosts: int = 16) -> dict | None:  # fmt: skip
    """For GPU hosts: the fewest hosts (1, 2, 4, ...) on all of whose chips :func:`fit_mesh` fits."""
    hosts = 1
    while hosts <= max_hosts:
        fit = fit_mesh(shape, hw, workload, chips=hw.chips * hosts, objective=objective)
        if fit is not None and fit["chips"] == hw.chips * hosts:
            return dict(fit, hosts=hosts)
        hosts *= 2
    return None


# ---------------------------------------------------------------------------------------------------
# time


@dataclass(frozen=True)
class Efficiency:
    """Assumed fractions of peak (docs/scaling.md says why)."""

    mfu_train: float = 0.40  # update and scoring (compute-bound matmuls)
    mfu_small: float = 0.20  # the same for the 135M model (d = 576: short matmuls, overhead-bound)
    hbm_eff: float = 0.70  # achieved fraction of HBM bandwidth in decode
    mfu_decode: float = 0.30  # decode when it turns compute-bound (large batch per replica)
    link_eff: float = 0.70  # achieved fraction of link bandwidth in collectives
    gather_bytes: int = 4  # klrl gathers its fp32 master weights (the cast to bf16 is after the gather)
    latency: float = 10e-6  # seconds per small collective (a decode step's tensor all-reduces)


def _mfu(shape: Shape, e: Efficiency) -> float:
    return e.mfu_small if shape.d_model < 1024 else e.mfu_train


def update_time(shape: Shape, hw: Hardware, fit: dict, workload: Workload | None = None,
                eff: Efficiency | None = None) -> dict[str, float]:  # fmt: skip
    """PPO update (policy + value, epochs x minibatches x accumulation steps): compute at the assumed
    MFU, and fsdp / data-parallel traffic; the phase takes the larger (they overlap at best).

    Per microbatch each device receives (fsdp-1)/fsdp of the (tensor-split) weights twice (forward,
    backward) at ``gather_bytes`` and reduce-scatters fp32 gradients; per minibatch the data axis
    all-reduces the fp32 gradient shard (2 (d-1)/d of it)."""
    w, e = workload or Workload(), eff or Efficiency()
    data, fsdp, tensor = fit["mesh"]
    chips = fit["chips"]
    passes = 4 if fit["remat"] else 3  # forward + backward (2x forward) [+ the recomputed forward]
    per_seq = sequence_flops(shape, w.seq_len) + sequence_flops(shape, w.seq_len, "scalar")
    flops = w.epochs * w.batch * passes * per_seq
    p = n_params(shape) + n_params(shape, "scalar")
    steps = w.epochs * w.minibatches * fit["accum"]
    fsdp_bytes = (2 * e.gather_bytes + 4) * p * (fsdp - 1) / (fsdp * tensor)
    dp_bytes = 2 * 4 * p / (fsdp * tensor) * (data - 1) / data
    # tensor: 2 all-reduces of [tokens, d] bf16 per block forward, 2 backward (x 2 (t-1)/t on a ring)
    tp_bytes = (
        4 * 2 * (tensor - 1) / tensor * fit["microbatch"] * w.seq_len * shape.d_model * 2 * shape.n_layers
    )
    tp_bytes *= 2 if fit["remat"] else 1  # remat repeats the forward's all-reduces
    # (the tensor term counts twice: policy and value)
    comm = (steps * fsdp_bytes / bandwidth(hw, fsdp * tensor)
            + w.epochs * w.minibatches * dp_bytes / bandwidth(hw, chips)
            + 2 * steps * tp_bytes / bandwidth(hw, tensor)) / e.link_eff  # fmt: skip
    compute = flops / (chips * hw.peak * _mfu(shape, e))
    return {"flops": flops, "compute": compute, "comm": comm, "time": max(compute, comm)}


def score_time(shape: Shape, hw: Hardware, chips: int, workload: Workload | None = None,
               eff: Efficiency | None = None) -> dict[str, float]:  # fmt: skip
    """Reference, value and reward forwards over the batch, and the prompt prefill: compute-bound."""
    w, e = workload or Workload(), eff or Efficiency()
    f_score = w.batch * (sequence_flops(shape, w.seq_len) + 2 * sequence_flops(shape, w.seq_len, "scalar"))
    f_prefill = w.batch * sequence_flops(shape, w.prompt_len)
    rate = chips * hw.peak * _mfu(shape, e)
    return {"flops": f_score, "score": f_score / rate, "prefill": f_prefill / rate}


def decode_time(shape: Shape, hw: Hardware, tp: int, seqs: float, weight_bytes: float, context: float,
                gather: float, workload: Workload | None = None,
                eff: Efficiency | None = None) -> float:  # fmt: skip
    """R decode steps of a group of ``tp`` chips holding ``seqs`` sequences. One step reads the
    weights (``weight_bytes`` per parameter, split over tp) and ``context`` positions of KV per
    sequence, does 2 matmul-params + attention FLOPs per sequence, and may wait ``gather`` seconds
    for weights: the step takes the largest of the three."""
    w, e = workload or Workload(), eff or Efficiency()
    kv = seqs * context * kv_bytes_per_token(shape, w.kv_bytes) / min(tp, shape.n_kv_heads)
    hbm = weight_bytes * n_params(shape) / tp + kv
    flops = seqs * forward_flops(shape, 1, context) / tp
    # tensor parallelism: 2 all-reduces of [seqs, d] bf16 per block per step, latency-bound when small
    tp_comm = 0.0
    if tp > 1:
        msg = 2 * (tp - 1) / tp * seqs * shape.d_model * 2 / (e.link_eff * bandwidth(hw, tp))
        tp_comm = 2 * shape.n_layers * (e.latency + msg)
    per_step = max(hbm / (e.hbm_eff * hw.hbm_bw), flops / (e.mfu_decode * hw.peak), gather) + tp_comm
    return w.response_len * per_step


def rollout_klrl(shape: Shape, hw: Hardware, fit: dict, workload: Workload | None = None,
                 eff: Efficiency | None = None) -> float:  # fmt: skip
    """klrl's sampler on the training mesh: a ``lax.scan`` of R steps over the per-device share of
    the batch, each step all-gathering the fsdp-sharded fp32 master weights (cast to bf16 after the
    gather), reading 4 bytes per parameter and the whole S-long KV cache (no paging)."""
    w, e = workload or Workload(), eff or Efficiency()
    data, fsdp, tensor = fit["mesh"]
    gather = e.gather_bytes * n_params(shape) * (fsdp - 1) / (fsdp * tensor)
    gather /= e.link_eff * bandwidth(hw, fsdp * tensor)
    return decode_time(shape, hw, tensor, w.batch / (data * fsdp), 4, w.seq_len, gather, w, e)


ENGINE_TP_MAX = 16  # an engine replica may span 16 chips (KV heads beyond 8 are replicated)


def engine_fits(shape: Shape, hw: Hardware, chips: int, tp: int, workload: Workload | None = None) -> bool:
    """bf16 weights and the KV of the replica's share of the batch in 90% of HBM (vLLM's default
    ``gpu_memory_utilization``)."""
    w = workload or Workload()
    kv = (
        (w.batch / (chips // tp))
        * w.seq_len
        * kv_bytes_per_token(shape, w.kv_bytes)
        / min(tp, shape.n_kv_heads)
    )
    return 2 * n_params(shape) / tp + kv <= 0.9 * hw.hbm


def rollout_engine(shape: Shape, hw: Hardware, chips: int, workload: Workload | None = None,
                   eff: Efficiency | None = None) -> dict[str, float]:  # fmt: skip
    """An inference engine (vLLM / sglang-jax style) on ``chips`` chips: replicas of ``tp`` chips
    (the fastest that fits, within the fast domain) holding bf16 weights, paged KV (only live
    positions are read: mean context P + R/2), the prefill compute-bound, and ``reshard``: each
    engine chip receiving its 2 P / tp bytes of bf16 weights from the trainer once per iteration."""
    w, e = workload or Workload(), eff or Efficiency()
    best = None
    for tp in _pow2_divisors(min(ENGINE_TP_MAX, hw.domain, chips)):
        if (shape.n_kv_heads % tp and tp < shape.n_kv_heads) or not engine_fits(shape, hw, chips, tp, w):
            continue
        decode = decode_time(shape, hw, tp, w.batch / (chips // tp), 2, w.prompt_len + w.response_len / 2,
                             0.0, w, e)  # fmt: skip
        reshard = 2 * n_params(shape) / tp / (e.link_eff * hw.link_bw)
        if best is None or decode + reshard < best["decode"] + best["reshard"]:
            best = {"tp": tp, "decode": decode, "reshard": reshard}
    if best is None:
        return {"tp": 0, "decode": float("inf"), "prefill": float("inf"), "reshard": float("inf")}
    best["prefill"] = w.batch * sequence_flops(shape, w.prompt_len) / (chips * hw.peak * _mfu(shape, e))
    return best


def data_only(
    shape: Shape, hw: Hardware, workload: Workload | None = None, chips: int | None = None
) -> dict | None:
    """klrl today (``klrl/step/parallel.py``: a data axis only, full replicas): the fitting
    ``(chips, 1, 1)`` configuration with the fewest accumulation steps, or None."""
    c = [c for c in candidates(shape, hw, workload, chips) if c["mesh"][1:] == (1, 1)]
    return min(c, key=lambda c: (c["remat"], c["accum"])) if c else None


def step_times(shape: Shape, hw: Hardware, workload: Workload | None = None, eff: Efficiency | None = None,
               gpu_hosts: bool | None = None) -> dict:  # fmt: skip
    """Seconds per iteration, three ways: ``klrl`` (everything on one mesh, klrl's sampler),
    ``colocated`` (an engine time-sharing the trainer's chips, trainer state offloaded while it runs:
    the offload is not counted), ``split`` (MaxText's ``trainer_devices_fraction = 0.5``: trainer on
    half the chips, engine on the other half, run one after the other)."""
    w, e = workload or Workload(), eff or Efficiency()
    hosts = hw.chips == 8 if gpu_hosts is None else gpu_hosts
    fit = fit_hosts(shape, hw, w) if hosts else fit_mesh(shape, hw, w, eff=e)
    if fit is None:
        return {"fits": False}
    chips = fit["chips"]
    up, sc = update_time(shape, hw, fit, w, e), score_time(shape, hw, chips, w, e)
    r_klrl = rollout_klrl(shape, hw, fit, w, e)
    eng = rollout_engine(shape, hw, chips, w, e)
    out = {"fits": True, "fit": fit, "update": up, "score": sc, "rollout_klrl": r_klrl, "engine": eng,
           "data_only": data_only(shape, hw, w, chips)}  # fmt: skip
    out["klrl"] = up["time"] + sc["score"] + sc["prefill"] + r_klrl
    out["colocated"] = up["time"] + sc["score"] + eng["prefill"] + eng["decode"] + eng["reshard"]
    half = fit_mesh(shape, hw, w, chips=chips // 2, objective="update", eff=e) if chips >= 2 else None
    if half is not None and half["chips"] == chips // 2:
        up2, sc2 = update_time(shape, hw, half, w, e), score_time(shape, hw, chips // 2, w, e)
        eng2 = rollout_engine(shape, hw, chips // 2, w, e)
        out["split_fit"] = half
        out["split"] = up2["time"] + sc2["score"] + eng2["prefill"] + eng2["decode"] + eng2["reshard"]
    else:
        out["split"] = None
    return out


# ---------------------------------------------------------------------------------------------------
# report


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def table(workload: Workload | None = None, eff: Efficiency | None = None) -> list[dict]:
    """One row per (size, hardware): mesh, memory per device, step time by phase."""
    w, e = workload or Workload(), eff or Efficiency()
    rows = []
    for size, shape in SHAPES.items():
        for hw in HARDWARE.values():
            t = step_times(shape, hw, w, e)
            row = {"size": size, "hardware": hw.name, "fits": t["fits"]}
            if t["fits"]:
                f = t["fit"]
                row.update(
                    chips=f["chips"], hosts=f.get("hosts"), mesh=list(f["mesh"]), remat=f["remat"],
                    accum=f["accum"], microbatch=f["microbatch"], memory_bytes=f["memory"],
                    update_compute_s=t["update"]["compute"], update_comm_s=t["update"]["comm"],
                    update_s=t["update"]["time"], score_s=t["score"]["score"],
                    prefill_s=t["score"]["prefill"],
                    rollout_klrl_s=t["rollout_klrl"], engine_tp=t["engine"]["tp"],
                    rollout_engine_s=t["engine"]["decode"], reshard_s=t["engine"]["reshard"],
                    step_klrl_s=t["klrl"], step_colocated_s=t["colocated"], step_split_s=t["split"],
                    split_mesh=list(t["split_fit"]["mesh"]) if t["split"] is not None else None,
                    data_only_peak=None if t["data_only"] is None else t["data_only"]["memory"]["peak"],
                    tokens_per_s_klrl=w.batch * w.response_len / t["rollout_klrl"],
                    tokens_per_s_engine=w.batch * w.response_len / t["engine"]["decode"],
                )  # fmt: skip
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| hardware | chips | mesh (d, f, t) | remat | accum x mb | persistent | KV | logits | grads+act "
            "| peak GiB | update s (compute / comm) | score+prefill s | rollout klrl s | engine tp | rollout "
            "engine s | reshard s | step: klrl / colocated / split s |")  # fmt: skip
    lines = []
    for size in SHAPES:
        lines += [f"\n### {size}\n", head, "|" + "---|" * 17]
        for r in (r for r in rows if r["size"] == size):
            if not r["fits"]:
                lines.append(f"| {r['hardware']} | - | does not fit |" + " |" * 14)
                continue
            m = r["memory_bytes"]
            split = "-" if r["step_split_s"] is None else f"{r['step_split_s']:.1f}"
            chips = f"{r['chips']}" + (f" ({r['hosts']} hosts)" if r["hosts"] and r["hosts"] > 1 else "")
            lines.append(
                f"| {r['hardware']} | {chips} | {tuple(r['mesh'])} | {'yes' if r['remat'] else 'no'} | "
                f"{r['accum']} x {r['microbatch']} | {_gib(m['persistent'])} | {_gib(m['kv_cache'])} | "
                f"{_gib(m['logits'])} | {_gib(m['grads'] + m['activations'])} | {_gib(m['peak'])} | "
                f"{r['update_s']:.1f} ({r['update_compute_s']:.1f} / {r['update_comm_s']:.1f}) | "
                f"{r['score_s'] + r['prefill_s']:.1f} | {r['rollout_klrl_s']:.1f} | {r['engine_tp']} | "
                f"{r['rollout_engine_s']:.1f} | {r['reshard_s']:.2f} | "
                f"{r['step_klrl_s']:.1f} / {r['step_colocated_s']:.1f} / {split} |"
            )
    return "\n".join(lines)


def per_size(workload: Workload | None = None) -> str:
    """Markdown: per-size counts that do not depend on the mesh (tensor = 1)."""
    w = workload or Workload()
    lines = ["| size | policy params | value/reward params | KV bytes/token | act bytes/token (no remat / "
             "remat) | 1 x S update act GiB (no remat / remat), policy+value+logits | train state GiB |",
             "|" + "---|" * 7]  # fmt: skip
    for size, s in SHAPES.items():
        a0, a1 = (
            activation_bytes_per_token(s, 1, w.act_bytes),
            activation_bytes_per_token(s, 1, w.act_bytes, True),
        )
        m0 = memory_per_device(s, (1, 1, 1), workload=w, microbatch=1)
        m1 = memory_per_device(s, (1, 1, 1), workload=w, microbatch=1, remat=True)
        lines.append(
            f"| {size} | {n_params(s) / 1e9:.4f} B | {n_params(s, 'scalar') / 1e9:.4f} B | "
            f"{kv_bytes_per_token(s, w.kv_bytes)} | {a0 / 1e6:.2f} MB / {a1 / 1e6:.3f} MB | "
            f"{_gib(m0['activations'])} / {_gib(m1['activations'])} | "
            f"{_gib(m0['persistent'] + m0['grads'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables before the JSON line")
    args = ap.parse_args(argv)
    w = Workload()
    rows = table(w)
    if args.markdown:
        print(per_size(w))
        print(markdown(rows))
    print(json.dumps({"workload": asdict(w), "efficiency": asdict(Efficiency()), "rows": rows}, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
