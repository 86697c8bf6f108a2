"""LoRA adapters (klrl.models.lora) and LoRA training: the forward against a NumPy reference of
``W + (alpha/r) A B``, B = 0 giving the base exactly, the targets, and the train step and sweep on one frozen
base (the base never copied, never changed; only adapters and heads trained; one base for all members)."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import ConfigError, RunConfig
from klrl.models import lora
from klrl.models.base import forward
from klrl.models.gpt import build_gpt
from klrl.models.pretrained import from_pretrained

DATA = Path(__file__).parents[1] / "data"
TOKENS = jnp.array([[0, 0, 3, 4, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
KEY_MASK = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], bool)


def families():
    out = []
    for name in ("tiny_llama", "tiny_gpt2", "tiny_gemma3"):
        model, params, _ = from_pretrained(DATA / name)
        out.append((name, model, params))
    gpt = build_gpt(RunConfig().model, 32, 16)
    out.append(("gpt", gpt, gpt.init(jax.random.PRNGKey(0))))
    return out


FAMILIES = families()


def numpy_merge(params, adapters, scale):
    """``W + scale * A @ B`` per adapted kernel, in NumPy float64 (the reference the forward must equal)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    flat = {lora_path: np.asarray(x, np.float64) for lora_path, x in _flat(adapters).items()}
    for path, a in flat.items():
        if not path.endswith("_lora_a"):
            continue
        b = flat[path[: -len("_lora_a")] + "_lora_b"]
        keys = path[: -len("_lora_a")].split("/")
        node = p
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = node[keys[-1]] + scale * np.matmul(a, b)
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flat(v, name + "/") if isinstance(v, dict) else {name: v})
    return out


@pytest.mark.parametrize("name,model,params", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_adapters_start_at_the_base_and_add_alpha_over_r_a_b(name, model, params):
    m = lora.LoRA(model, 4, 8.0)
    ad = m.init_adapters(params, jax.random.PRNGKey(1))
    b_leaves = [x for p, x in _flat(ad).items() if p.endswith("_lora_b")]
    assert b_leaves and all(not np.any(np.asarray(x)) for x in b_leaves)  # B = 0
    base = forward(model, params, TOKENS, KEY_MASK).logits
    np.testing.assert_array_equal(
        np.asarray(forward(m, lora.merge(params, ad), TOKENS, KEY_MASK).logits), base
    )
    ad = jax.tree.map(lambda x: 0.1 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), ad)
    got = forward(m, lora.merge(params, ad), TOKENS, KEY_MASK).logits
    want = forward(model, numpy_merge(params, ad, 2.0), TOKENS, KEY_MASK).logits
    assert float(jnp.max(jnp.abs(got - base))) > 0.05  # the adapters moved the logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    merged = lora.merged_kernels(params, ad, m.scale)
    np.testing.assert_allclose(
        np.asarray(forward(model, merged, TOKENS, KEY_MASK).logits), np.asarray(want), atol=2e-5, rtol=1e-5
    )


def test_targets_narrow_the_adapted_modules_and_a_miss_is_one_line():
    _, model, params = FAMILIES[0]
    assert lora.check(lora.LoRA(model, 2, 4.0, targets="q_proj|v_proj"), params) == [
        "layers/q_proj",
        "layers/v_proj",
    ]
    assert len(lora.check(lora.LoRA(model, 2, 4.0), params)) == 7  # q k v o gate up down
    with pytest.raises(ValueError, match=r"lora.targets: 'lm_head' matches no linear layer of the Llama"):
        lora.check(lora.LoRA(model, 2, 4.0, targets="lm_head"), params)
    with pytest.raises(ValueError, match="lora.rank: must be > 0"):
        lora.LoRA(model, 0, 4.0)


def test_split_and_merge_are_inverse():
    _, model, params = FAMILIES[1]
    m = lora.LoRA(model, 2, 4.0)
    ad = m.init_adapters(params, jax.random.PRNGKey(0))
    base, back = lora.split(lora.merge(params, ad))
    assert jax.tree.structure(base) == jax.tree.structure(params)
    assert jax.tree.structure(back) == jax.tree.structure(ad)
    # per layer (2 layers), A [in, 2] and B [2, out]: c_attn 32->96, c_proj 32->32, c_fc 32->128, mlp 128->32
    assert lora.count(ad) == 2 * (32 * 2 + 2 * 96 + 32 * 2 + 2 * 32 + 32 * 2 + 2 * 128 + 128 * 2 + 2 * 32)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"lora": {"rank": 4}, "kl": {"ref_update_every": 5}}, "lora.rank: the reference is the base"),
        ({"model": {"value_model": "lora"}}, "model.value_model: lora: the critic's adapters need"),
        ({"model": {"adapter": "x"}}, "model.adapter: needs model.path"),
        ({"model": {"ref_quant": "int3"}}, "model.ref_quant: must be one of"),
        ({"lora": {"targets": "("}}, "lora.targets: '\\(' is not a regular expression"),
        ({"lora": {"rank": -1}}, "lora.rank: must be >= 0"),
    ],
)
def test_combinations_that_cannot_work_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig().replace(**fields)


def test_model_lora_spelling_in_a_config_file():
    cfg = RunConfig.from_dict({"model": {"path": "x", "lora": {"rank": 8, "alpha": 4.0}}})
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.model.path) == (8, 4.0, "x")


# ---- the train step on one frozen base --------------------------------------------------------


@pytest.fixture(scope="module")
def lora_train(tiny_cfg, tiny_task):
    from klrl.step.train import make_train

    cfg = tiny_cfg.replace(lora={"rank": 4}, model={"value_model": "lora"}, optim={"lr": 3e-3})
    train = make_train(cfg, tiny_task)
    return cfg, train


def test_the_step_trains_adapters_and_heads_only_on_the_untouched_base(lora_train, tiny_task):
    cfg, train = lora_train
    state = train.init(0)
    assert state.ref_params is not None
    # the base is the task's very buffers: not copied into the state
    ptr = lambda t: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(t)]
    assert ptr(state.ref_params) == ptr(tiny_task.policy_params)
    pol, val = _flat(state.params["policy"]), _flat(state.params["value"])
    assert pol and all(k.endswith(("_lora_a", "_lora_b")) for k in pol)
    assert all(k.endswith(("_lora_a", "_lora_b")) or k.startswith("v_head/") for k in val)
    base_before = jax.tree.map(np.asarray, tiny_task.policy_params)
    b0 = {k: np.asarray(v) for k, v in pol.items()}
    env = train.context.task.env
    state, m = train.step(state, env)
    state, m = train.step(state, env)
    assert float(m["kl/exact_seq_sum"]) > 0  # the policy left the reference
    moved = [k for k, v in _flat(state.params["policy"]).items() if not np.array_equal(np.asarray(v), b0[k])]
    assert any(k.endswith("_lora_b") for k in moved)
    for a, b in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(base_before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # the frozen base is unchanged


def test_first_iteration_policy_equals_the_reference(lora_train):
    cfg, train = lora_train
    state = train.init(3)
    _, m = train.step(state, train.context.task.env)
    assert abs(float(m["kl/exact_seq_sum"])) < 1e-5  # B = 0: the policy is the base, KL 0 up to rounding


def test_sweep_members_share_one_base(tiny_cfg, tiny_task):
    import klrl.loop.build

    base = tiny_cfg.replace(lora={"rank": 4}, train={"iterations": 1})
    members = [base.replace(kl={"beta": b}) for b in (0.01, 0.1, 1.0)]
    prog, _ = klrl.loop.build.make_program(members, tiny_task, stacked=True, write=False)
    state = prog.init()
    ref_shapes = [x.shape for x in jax.tree.leaves(state.ref_params)]
    assert ref_shapes == [x.shape for x in jax.tree.leaves(tiny_task.policy_params)]  # no members' axis
    assert all(x.shape[0] == 3 for x in jax.tree.leaves(state.params))
    new, metrics = prog.step(state, prog.env)
    assert metrics["ctrl/beta"].shape == (3,)
    for a, b in zip(jax.tree.leaves(new.ref_params), jax.tree.leaves(tiny_task.policy_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "fields",
    [
        {"lora": {"rank": 4}, "model": {"value_model": "head", "remat": "full", "logits": "chunked"}},
        {"lora": {"critic_rank": 4}, "model": {"value_model": "lora"}},  # full fine-tuning, a LoRA critic
        {"lora": {"rank": 4}, "model": {"value_model": "separate", "ref_quant": "int8"}},  # QLoRA
        {"lora": {"rank": 4, "targets": "qkv"}, "model": {"ref_dtype": "bfloat16"}, "ppo": {"grad_accum": 2}},
    ],
    ids=["head-remat-chunked", "full-ft-lora-critic", "qlora-int8-separate", "qkv-bf16-base-accum"],
)
def test_every_combination_trains(tiny_cfg, tiny_task, fields):
    """Each combination compiles and takes a step; the first iteration's policy is the reference
    (KL ~ 0: B = 0, or full fine-tuning from the reference) and its update moves the trained parameters."""
    from klrl.step.train import make_train

    train = make_train(tiny_cfg.replace(**fields), tiny_task)
    state = train.init(1)
    before = jax.tree.map(np.asarray, state.params)
    state, m = train.step(state, train.context.task.env)
    assert abs(float(m["kl/exact_seq_sum"])) < 1e-4
    assert np.isfinite(float(m["loss/total"]))
    changed = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True)
    ]
    assert any(changed)


def test_a_reward_adapter_sits_on_the_policys_base_buffers(tmp_path):
    """``model.reward_path`` = a PEFT SEQ_CLS adapter: the reward model is the policy's base (the same
    buffers, not a copy) with its own adapters and score head."""
    from klrl.models.heads import detach
    from klrl.models.peft import save_adapter
    from klrl.tasks.text import reward_model

    _, model, params = FAMILIES[0]
    m = lora.LoRA(model, 2, 4.0)
    ad = jax.tree.map(lambda x: x + 0.01, m.init_adapters(params, jax.random.PRNGKey(0)))
    head = {"kernel": jnp.ones((model.hidden_size, 1)), "bias": jnp.zeros(1)}
    save_adapter(tmp_path / "rm", m, ad, base_name="tiny_llama", score=head)
    cfg = RunConfig().replace(model={"path": str(DATA / "tiny_llama"), "reward_path": str(tmp_path / "rm")})
    rm, rparams = reward_model(cfg, model, params)
    assert isinstance(rm, lora.LoRA)
    trunk, got_head = detach(rparams)
    base, adapters = lora.split(trunk)
    ptr = lambda t: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(t)]
    assert ptr(base) == ptr(params)
    np.testing.assert_array_equal(np.asarray(got_head["kernel"]), np.ones((model.hidden_size, 1)))
    assert lora.count(adapters) == lora.count(ad)


def test_running_reward_normalisation_in_the_step(tiny_cfg, tiny_task):
    """``ppo.normalize_reward`` in the compiled step: after two iterations the moments in the optimiser state
    are the NumPy mean and population variance of both batches' task rewards (as logged), and the shaped
    reward is built from the normalised task reward (its batch mean over the sequences is ~ -beta KL)."""
    from klrl.rewards import running
    from klrl.step.train import make_train

    train = make_train(tiny_cfg.replace(ppo={"normalize_reward": True}), tiny_task)
    state, env, seen = train.init(0), train.context.task.env, []
    for _ in range(2):
        state, m = train.step(state, env)
        seen.append(float(m["reward/task"]))
    mom = running.read(state.opt_state)
    assert float(mom.count) == 2 * tiny_cfg.train.batch_size
    np.testing.assert_allclose(float(mom.mean), np.mean(seen), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_a_lora_target_error_comes_before_the_task_notes(tmp_path, capsys):
    """Issue 41: the prompts' truncation note was printed before the LoRA targets' error (and the
    adapters', both found in make_train); now the error is the one line (the notes follow every check)."""
    from conftest import one_line_error

    from klrl.cli import main

    gguf = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
    argv = ["train", "--model.path", str(gguf), "--lora.rank", "4", "--lora.targets", "zzz",
            "--data.prompt_len", "16", "--data.limit", "8", "--sampling.response_len", "4",
            "--train.batch_size", "4", "--train.iterations", "1",
            "--train.out_dir", str(tmp_path)]  # fmt: skip
    line = one_line_error(capsys, main, argv)
    assert line.startswith("error: lora.targets: 'zzz' matches no linear layer"), line


# ---- what LoRA's step does not compute or hold --------------------------------------------------


def _dot_shapes(jaxpr) -> list[tuple[tuple[int, ...], int]]:
    """``(output shape, contracted size)`` of every ``dot_general`` in ``jaxpr`` and the jaxprs it calls
    (scan, cond, pjit, remat, shard_map, custom derivatives)."""
    from jax.extend import core as jcore

    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            size = math.prod(eqn.invars[0].aval.shape[i] for i in contract)
            out.append((tuple(eqn.outvars[0].aval.shape), size))
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    out += _dot_shapes(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    out += _dot_shapes(sub)
    return out


def _kernel_shapes(params) -> set[tuple[int, int]]:
    """``(in, out)`` of every dense kernel of ``params`` (leaves named ``kernel``), sorted."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    return {
        tuple(sorted((x.shape[0], math.prod(x.shape[1:])))) for p, x in flat if str(p[-1].key) == "kernel"
    }


def _as_matrices(dots: list, skip_contracting: int = 0) -> set[tuple[int, int]]:
    """The matrix outputs among ``dots`` (dimensions sorted: a kernel's gradient may come out transposed),
    but those contracting ``skip_contracting`` (the rank: ``A B``, the adapters folded into the base for
    the rollout, ``klrl.step.train.rollout_policy``, is not a gradient; a weight gradient contracts the
    tokens)."""
    return {tuple(sorted(s)) for s, k in dots if len(s) == 2 and k != skip_contracting}


def test_the_lora_step_computes_no_weight_gradient_of_the_base(tiny_cfg, tiny_task, lora_train):
    """No matmul of the LoRA step (rollout, scoring, PPO update) produces a tensor of a base kernel's
    shape ``[in, out]``: the backward takes the activations' gradient through the frozen base and the
    adapters' ``[in, r]`` / ``[r, out]`` gradients, never ``dL/dW``. The same check on full fine-tuning of
    the same model finds every kernel's gradient (so the check can see one)."""
    from klrl.step.train import make_train

    kernels = _kernel_shapes(tiny_task.policy_params)
    assert kernels
    _, train = lora_train
    state = train.init(0)
    env = train.context.task.env
    lora_jaxpr = jax.make_jaxpr(train.step)(state, env).jaxpr
    lora_dots = _as_matrices(_dot_shapes(lora_jaxpr), skip_contracting=train.context.models.policy.rank)
    assert not kernels & lora_dots, sorted(kernels & lora_dots)
    full = make_train(tiny_cfg.replace(model={"value_model": "head"}), tiny_task)
    full_jaxpr = jax.make_jaxpr(full.step)(full.init(0), full.context.task.env).jaxpr
    full_dots = _as_matrices(_dot_shapes(full_jaxpr))
    assert kernels <= full_dots, sorted(kernels - full_dots)


def test_no_optimizer_state_exists_for_the_frozen_base(lora_train, tiny_task):
    """Adam's moments cover the adapters and heads only: every floating leaf of the optimiser state has the
    shape of a trained (adapter or head) leaf, and their total size is a small multiple of the adapters'."""
    _, train = lora_train
    state = train.init(0)
    trained = {tuple(x.shape) for x in jax.tree.leaves(state.params)}
    moments = [
        x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim
    ]
    assert moments and all(tuple(x.shape) in trained for x in moments)
    n_trained = sum(x.size for x in jax.tree.leaves(state.params))
    assert sum(x.size for x in moments) == 2 * n_trained  # mu and nu, nothing else
    assert n_trained < sum(x.size for x in jax.tree.leaves(tiny_task.policy_params)) / 4


def test_the_rollout_samples_from_the_adapters_folded_into_the_base(lora_train):
    """The rollout's policy (``rollout_policy``: ``W + (alpha / r) A B`` folded once per iteration, the base
    model) is the adapted policy: with non-zero adapters its logits match the LoRA forward's (float32
    rounding), and they differ from the base's (so the fold is not a no-op)."""
    from klrl.step.train import merges_for_rollout, rollout_policy

    _, train = lora_train
    ctx, state = train.context, train.init(0)
    pol = jax.tree.map(lambda x: x + 0.05 * jnp.sign(x + 0.5), state.params["policy"])
    state = state._replace(params={**state.params, "policy": pol})
    assert merges_for_rollout(ctx, state)
    model, params = rollout_policy(ctx, state)
    assert model is ctx.models.policy.base
    merged = forward(model, params, TOKENS, KEY_MASK).logits
    adapted = forward(ctx.models.policy, lora.merge(state.ref_params, pol), TOKENS, KEY_MASK).logits
    base = forward(model, state.ref_params, TOKENS, KEY_MASK).logits
    np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(adapted - base))) > 1e-2
