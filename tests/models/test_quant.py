"""klrl.models.quant: weight-only int8/int4 references, against a NumPy absmax dequantisation."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from jax.sharding import PartitionSpec as P

from klrl.config import ModelConfig
from klrl.models import quant
from klrl.models.base import causal_mask, forward, positions_from_mask, spec_for
from klrl.models.gpt import build_gpt
from klrl.models.pretrained import from_pretrained

DATA = Path(__file__).parents[1] / "data"
# the linear layers of the blocks, by hand (HF names): what must be quantised, and nothing else
LINEARS = {
    "tiny_llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "tiny_gpt2": ("c_attn", "c_proj", "c_fc", "mlp_c_proj"),
}
STACK = {"tiny_llama": "layers", "tiny_gpt2": "h"}


@functools.cache
def load(name):
    return from_pretrained(DATA / name, tokenizer=False)[:2]


@functools.cache
def quantized(name, kind):
    return quant.quantize(*load(name), kind)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gpt2"])
def loaded(request):
    return request.param, *load(request.param)


def batch(vocab: int):
    tokens = jnp.asarray((np.arange(24).reshape(2, 12) * 37 + 5) % vocab, jnp.int32)
    mask = jnp.asarray(np.arange(12)[None] >= np.array([[0], [3]]), jnp.float32)  # row 1 left-padded
    return tokens, mask


def absmax_np(w: np.ndarray, bits: int, tile: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy, stacked kernels ``w [L, in, out]``: ``s = max|W_blk| / (2^(b-1) - 1/2)`` over blocks of
    ``tile`` inputs (the whole input axis when None) of each output column, ``W / s`` and the
    dequantised ``clip(round(W / s), -2^(b-1), 2^(b-1) - 1) * s`` (round half to even), all
    ``[L, in, out]``."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    n, i, o = w.shape
    t = tile or i
    blk = w.astype(np.float64).reshape(n, i // t, t, o)
    s = np.broadcast_to(np.abs(blk).max(axis=2, keepdims=True) / (hi + 0.5), blk.shape)
    x = blk / s
    deq = np.clip(np.round(x), lo, hi) * s
    return s.reshape(n, i, o), x.reshape(n, i, o), deq.reshape(n, i, o)


def qwix_kernels(name, qp):
    """The dequantised kernels of the quantised tree (``qwix.dequantize`` per layer)."""
    return {
        k: np.asarray(jax.vmap(qwix.dequantize)(qp["params"][STACK[name]][k]["kernel"].array))
        for k in LINEARS[name]
    }


@pytest.mark.parametrize("kind,bits,tile", [("int8", 8, None), ("int4", 4, 32)])
def test_kernels_are_numpy_absmax(loaded, kind, bits, tile):
    """Each block kernel is NumPy's absmax quantisation. The largest ``|W / s|`` of a block is the
    tie ``2^(b-1) - 1/2`` exactly, which float32 rounding of ``W / s`` decides either way: there (and
    only within 1e-3 of a half step) the two may differ by one step."""
    name, model, params = loaded
    _, qp = quantized(name, kind)
    for k, got in qwix_kernels(name, qp).items():
        s, x, want = absmax_np(np.asarray(params["params"][STACK[name]][k]["kernel"]), bits, tile)
        tie = np.abs(np.abs(x - np.floor(x)) - 0.5) < 1e-3
        err = np.abs(got - want) / s
        assert np.all(err[~tie] < 1e-4), (k, err[~tie].max())
        assert np.all(err[tie] < 1 + 1e-4), k
        assert tie.sum() <= 2 * x.shape[0] * x.shape[2] * (x.shape[1] // (tile or x.shape[1])), k


def test_logits_are_the_dequantised_float_model(loaded):
    """The quantised forward is the float forward over the dequantised kernels, up to float32
    rounding (``(x @ Q) s`` vs ``x @ (Q s)``, ~1e-6 relative): atol 1e-4 on logits of size ~2."""
    name, model, params = loaded
    for kind in ("int8", "int4"):
        qm, qp = quantized(name, kind)
        tokens, mask = batch(model.vocab_size)
        got = jax.jit(lambda p, qm=qm: forward(qm, p, tokens, mask).logits)(qp)
        p = jax.tree.map(np.asarray, params)
        for k, w in qwix_kernels(name, qp).items():
            p["params"][STACK[name]][k]["kernel"] = w
        np.testing.assert_allclose(got, forward(model, p, tokens, mask).logits, atol=1e-4, rtol=0)


def rel_rms(a, b, mask):
    m = np.asarray(mask, bool)
    a, b = np.asarray(a)[m], np.asarray(b)[m]
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.std(b))


def test_int8_close_to_float_int4_looser(loaded):
    """Relative RMS logit error vs float32 (measured on these random tiny models: int8 ~1.5%,
    int4 ~20%). Per-channel int8 rounds each weight by at most ``s/2 = max|W|/255``; int4's step is
    17x coarser, so its error must be several times int8's."""
    name, model, params = loaded
    tokens, mask = batch(model.vocab_size)
    ref = forward(model, params, tokens, mask).logits
    err = {k: rel_rms(forward(*quantized(name, k), tokens, mask).logits, ref, mask) for k in ("int8", "int4")}
    assert err["int8"] < 0.03, err
    assert err["int4"] < 0.4, err
    assert err["int4"] > 4 * err["int8"], err


def test_memory(loaded):
    """int8 kernels: one byte per weight plus a float32 scale per output column (~1/4 of float32);
    int4: one byte per value in XLA:CPU's buffers, half a byte packed, plus a scale per 32 inputs."""
    name, model, params = loaded
    stack = STACK[name]
    kern = {k: np.asarray(v["kernel"]) for k, v in params["params"][stack].items() if k in LINEARS[name]}
    f32 = sum(w.size * 4 for w in kern.values())
    for kind, value_bytes, scales in (
        ("int8", 1.0, lambda w: w.shape[0] * w.shape[2]),
        ("int4", 0.5, lambda w: w.shape[0] * w.shape[1] // 32 * w.shape[2]),
    ):
        _, qp = quantized(name, kind)
        qk = [qp["params"][stack][k]["kernel"] for k in kern]
        packed = sum(w.size * value_bytes + 4 * scales(w) for w in kern.values())
        assert quant.nbytes(qk, packed=True) == packed
        assert quant.nbytes(qk) == sum(w.size + 4 * scales(w) for w in kern.values())  # unpacked on CPU
        rest = {k: v for k, v in qp["params"].items() if k != stack}
        assert quant.nbytes(rest) == quant.nbytes({k: v for k, v in params["params"].items() if k != stack})
    _, q8 = quantized(name, "int8")
    ratio = quant.nbytes([q8["params"][stack][k]["kernel"] for k in kern]) / f32
    assert 0.25 < ratio < 0.25 * (1 + 4 / 32) + 1e-9  # the scales: 4 bytes per >= 32 weights


def test_kv_cache_decode_matches_full_forward(loaded):
    name, model, params = loaded
    qm, qp = quantized(name, "int4")
    tokens, mask = batch(model.vocab_size)
    full = np.asarray(forward(qm, qp, tokens, mask).logits)
    apply = jax.jit(qm.apply)
    b, s = tokens.shape
    pos, att = positions_from_mask(mask), causal_mask(mask)
    out = apply(qp, tokens[:, :5], pos[:, :5], att[:, :5], qm.init_cache(b, s), 0)
    got, cache = [np.asarray(out.logits)], out.cache
    for i in range(5, s):
        out = apply(qp, tokens[:, i : i + 1], pos[:, i : i + 1], att[:, i : i + 1], cache, jnp.int32(i))
        got.append(np.asarray(out.logits))
        cache = out.cache
    m = np.asarray(mask, bool)
    np.testing.assert_allclose(np.concatenate(got, 1)[m], full[m], atol=1e-5 * np.abs(full).max())


def test_head_jit_vmap_device_put(loaded):
    """``head`` is the float head of ``apply``'s hidden states; the tree jits, vmaps and moves."""
    name, model, params = loaded
    qm, qp = quantized(name, "int8")
    tokens, mask = batch(model.vocab_size)
    out = forward(qm, qp, tokens, mask)
    np.testing.assert_allclose(qm.head(qp, out.hidden), out.logits, atol=1e-5)
    qp = jax.device_put(qp, jax.devices()[0])
    two = jax.tree.map(lambda a: jnp.stack([a, a]), qp)
    got = jax.jit(jax.vmap(lambda p: forward(qm, p, tokens, mask).logits))(two)
    np.testing.assert_allclose(got[1], out.logits, atol=1e-5)
    assert (qm.vocab_size, qm.hidden_size, qm.max_len) == (model.vocab_size, model.hidden_size, model.max_len)
    assert hash(qm) == hash(quant.quantize(model, params, "int8")[0])  # a static jit argument
    # model.ref_dtype=bfloat16 casts the floating leaves, the scales among them: still runs
    bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, qp)
    assert rel_rms(forward(qm, bf, tokens, mask).logits, out.logits, mask) < 0.05


def test_partition_rules_place_values_like_kernels():
    model, params = load("tiny_llama")
    qm, qp = quantized("tiny_llama", "int8")
    specs = spec_for(qm.partition_rules(), qp)["params"]
    assert specs["layers"]["q_proj"]["kernel"].array.qvalue == P(None, "fsdp", "tensor")
    assert specs["layers"]["o_proj"]["kernel"].array.qvalue == P(None, "tensor", "fsdp")
    assert specs["layers"]["q_proj"]["kernel"].array.scale == P()
    assert specs["embed_tokens"]["embedding"] == P("tensor", "fsdp")


def test_klrl_gpt_family():
    """klrl's own gpt (no top-level "params" key, blocks in a Python loop) against NumPy too."""
    model = build_gpt(ModelConfig(), 64, 16)
    params = jax.jit(model.init)(jax.random.key(0))
    qm, qp = quant.quantize(model, params, "int8")
    tokens, mask = batch(64)
    p = jax.tree.map(np.asarray, params)
    for i in range(2):
        for lin in ("qkv", "proj", "fc", "out"):
            got = np.asarray(qwix.dequantize(qp[f"h{i}"][lin]["kernel"].array))
            s, _, want = absmax_np(p[f"h{i}"][lin]["kernel"][None], 8, None)
            assert np.mean(np.abs(got - want[0]) < 1e-4 * s[0]) > 0.99  # all but the ties
            p[f"h{i}"][lin]["kernel"] = got
    want = jax.jit(lambda p: forward(model, p, tokens, mask).logits)(p)
    out = jax.jit(lambda p: forward(qm, p, tokens, mask))(qp)
    np.testing.assert_allclose(out.logits, want, atol=1e-4)
    np.testing.assert_allclose(qm.head(qp, out.hidden), want, atol=1e-4)


def test_qlora_provider_over_rule_args():
    """``rule_args`` + ``module_path`` make a QLoRA provider; ``quantize_params_for`` fills its base
    (quantised) and, with a key, its fresh adapters: lora_b starts at 0, so the logits are PTQ's."""
    model, params = load("tiny_llama")
    qm, qp = quantized("tiny_llama", "int8")
    rule = qwix.LoraRule(module_path=quant.module_path(model), rank=2, alpha=4.0, **quant.rule_args("int8"))
    lora = qwix.apply_lora_to_model(model.module, qwix.LoraProvider([rule]))
    t = jnp.zeros((1, 2), jnp.int32)
    lp = quant.quantize_params_for(lora, params, (t, t, jnp.ones((1, 2, 2), bool)), key=jax.random.key(1))
    assert lp["params"]["layers"]["q_proj"]["kernel_lora_a"].shape == (2, 32, 2)
    tokens, mask = batch(model.vocab_size)
    got = lora.apply(lp, tokens, positions_from_mask(mask), causal_mask(mask)).logits
    np.testing.assert_allclose(got, forward(qm, qp, tokens, mask).logits, atol=1e-6)


def test_none_is_identity_and_errors_are_one_line():
    model, params = load("tiny_llama")
    assert quant.quantize(model, params, "none") == (model, params)
    assert quant.rule_args("none") == {}
    one_of = r"^model\.ref_quant: must be one of none, int8, int4 \(got 'int3'\)$"
    with pytest.raises(ValueError, match=one_of):
        quant.quantize(model, params, "int3")
    with pytest.raises(ValueError, match=r"^model\.ref_quant: ") as e:
        quant.check(object(), "int8")
    assert "\n" not in str(e.value) and "object" in str(e.value)
    quant.check(object(), "none")  # nothing to quantise: any family
