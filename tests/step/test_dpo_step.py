"""klrl.step.dpo: one DPO iteration on the tiny GGUF (LoRA) against a Python-loop reference (each
sequence forwarded alone, unpadded; NumPy log-softmax and loss; a hand-written clipped AdamW); beta as a
float32 array in the state; a sweep of 5 betas is one compiled program whose members equal single runs;
the held-out exact KL is 0 at the start (the adapters' B = 0: the policy is the reference)."""

from __future__ import annotations

import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import DataConfig, SamplingConfig
from klrl.config.dpo import DPOConfig
from klrl.models import lora as lora_lib
from klrl.models.base import forward
from klrl.models.pretrained import from_pretrained
from klrl.rewards.pairs import encode_as_ppo, heldout_prompts
from klrl.step import dpo as S

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
WORDS = "ab cd ef gh ij kl mn op".split()
DATA, SAMPLING = DataConfig(chat_template=False, prompt_len=4), SamplingConfig(response_len=6)


def marker_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` pairs whose chosen response holds ``yes`` and whose rejected one does not."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        filler = [rng.choice(WORDS) for _ in range(2)]
        chosen = list(filler)
        chosen.insert(rng.randrange(3), "yes")
        rej = [*filler, rng.choice(WORDS)]
        rows.append({"prompt": rng.choice(WORDS), "chosen": " ".join(chosen), "rejected": " ".join(rej)})
    return rows


@pytest.fixture(scope="module")
def tiny():
    model, base, tok = from_pretrained(GGUF)
    pairs = encode_as_ppo(marker_pairs(12), tok, DATA, SAMPLING)
    return model, base, tok, pairs


def _seq_logp(model, params, ids: np.ndarray, plen: int) -> jax.Array:
    """log pi(response | prompt) of one unpadded sequence: a forward of it alone, a log-softmax
    per response position written out."""
    t = jnp.asarray(ids)[None]
    logits = forward(model, params, t, jnp.ones_like(t, jnp.float32)).logits[0].astype(jnp.float32)
    total = 0.0
    for pos in range(max(plen, 1), len(ids)):
        z = logits[pos - 1]
        total = total + z[ids[pos]] - jax.scipy.special.logsumexp(z)
    return total


def _reference_loss(lora, base, adapters, pairs, rows, beta, loss, family=None):
    """The mean loss of ``rows``: LoRA (``adapters`` beside ``base``) or, with ``family``, full
    fine-tuning (``adapters`` the whole model's parameters)."""
    params = lora_lib.merge(base, adapters) if family is None else adapters
    policy = lora if family is None else family
    ref = lora.base if family is None else family
    losses = []
    for i in rows:
        h = []
        for side in ("chosen", "rejected"):
            n = int(getattr(pairs, f"{side}_mask")[i].sum())
            ids, plen = getattr(pairs, side)[i, :n], int(getattr(pairs, f"{side}_prompt_len")[i])
            h.append(_seq_logp(policy, params, ids, plen) - _seq_logp(ref, base, ids, plen))
        d = h[0] - h[1]
        if loss == "sigmoid":
            losses.append(jnp.log1p(jnp.exp(-beta * d)))
        else:  # ipo: per-token means
            nc = (pairs.completion("chosen")[i]).sum()
            nr = (pairs.completion("rejected")[i]).sum()
            losses.append((h[0] / nc - h[1] / nr - 1 / (2 * beta)) ** 2)
    return sum(losses) / len(losses)


def _adamw_clip(params, grads_list, lr, clip, b1=0.9, b2=0.999, eps=1e-8):
    """Hand AdamW (no weight decay) with global-norm clipping over successive gradient functions."""
    leaves, tree = jax.tree.flatten(params)
    p = [np.asarray(x, np.float64) for x in leaves]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t, grad_fn in enumerate(grads_list, start=1):
        g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grad_fn(jax.tree.unflatten(tree, p)))]
        norm = np.sqrt(sum(np.sum(x**2) for x in g))
        g = [x * min(1.0, clip / norm) for x in g]
        for k in range(len(p)):
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mh, vh = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            p[k] = p[k] - lr * mh / (np.sqrt(vh) + eps)
    return jax.tree.unflatten(tree, p)


@pytest.mark.parametrize("loss,full", [("sigmoid", False), ("ipo", False), ("sigmoid", True)])
def test_iteration_matches_a_python_loop(tiny, loss, full):
    model, base, _, pairs = tiny
    cfg = DPOConfig(loss=loss, lr=1e-2 if not full else 1e-3, batch_size=4, minibatches=2, max_grad_norm=0.5)
    lora = lora_lib.LoRA(model, 2, 4.0)
    prog = S.DPOProgram(model, None if full else lora, cfg)
    family = model if full else None
    beta = 0.5
    state = S.init_state(prog, base, 3, beta)
    # B = 0 at init: nudge the adapters so the first gradient is not only through B
    state = state._replace(params=jax.tree.map(lambda x: x + 0.01, state.params))
    state = state._replace(opt_state=prog.optimizer.init(state.params))
    rows = np.asarray(S.batch_indices(state, len(pairs), 4))
    new, metrics = jax.jit(lambda s, b, d: S.dpo_iteration(prog, s, b, d))(state, base, S.PairData.of(pairs))

    f = lambda r: (
        lambda a: jax.grad(lambda q: _reference_loss(lora, base, q, pairs, r, beta, loss, family))(a)
    )
    want = _adamw_clip(state.params, [f(rows[:2]), f(rows[2:])], cfg.lr, cfg.max_grad_norm)
    for got, ref in zip(jax.tree.leaves(new.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=2e-6)
    first = float(_reference_loss(lora, base, state.params, pairs, rows[:2], beta, loss, family))
    assert int(new.iteration) == 1 and new.beta.dtype == jnp.float32
    assert (
        np.isfinite(float(metrics["dpo/loss"])) and float(metrics["dpo/loss"]) != first
    )  # 2nd minibatch moved
    assert not np.allclose(
        np.asarray(jax.tree.leaves(new.params)[0]), np.asarray(jax.tree.leaves(state.params)[0])
    )


def test_five_betas_are_one_program_and_members_equal_single_runs(tiny):
    model, base, tok, pairs = tiny
    cfg = DPOConfig(lr=1e-2, batch_size=4, minibatches=2)
    prog = S.DPOProgram(model, lora_lib.LoRA(model, 2, 4.0), cfg)
    betas = [0.01, 0.03, 0.1, 0.3, 1.0]
    data = S.PairData.of(pairs)
    step = S.make_sweep_step(prog)
    states = S.stack([S.init_state(prog, base, 0, b) for b in betas])
    assert states.beta.dtype == jnp.float32 and states.beta.shape == (5,)
    for _ in range(2):
        states, m = step(states, base, data)
    assert step._cache_size() == 1  # one compiled program for the 5 members, reused
    assert m["dpo/loss"].shape == (5,)
    one = S.stack([S.init_state(prog, base, 0, 0.3)])
    for _ in range(2):
        one, m1 = step(one, base, data)
    assert step._cache_size() == 2  # (a sweep of one is another shape: a second compile)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(S.member(states, 3).params), strict=True):
        np.testing.assert_allclose(
            np.asarray(a[0]), np.asarray(b), rtol=1e-4, atol=1e-6
        )  # vmap: sums reordered
    np.testing.assert_allclose(float(m1["dpo/loss"][0]), float(m["dpo/loss"][3]), rtol=1e-5)
    # the same seed draws the same batches: only beta differs, and the members moved differently
    a0, a4 = (np.asarray(jax.tree.leaves(S.member(states, j).params)[1]) for j in (0, 4))
    assert not np.allclose(a0, a4)

    prompts, pmask = heldout_prompts(pairs, 4, tok.pad_id)
    held = S.Heldout(data.take(jnp.arange(4)), jnp.asarray(prompts), jnp.asarray(pmask))
    ev = S.make_sweep_eval(prog, SAMPLING, tuple(tok.stop_ids), tok.pad_id)
    start = S.stack([S.init_state(prog, base, 0, b) for b in betas])
    m0 = S.to_host(ev(start, base, held))
    np.testing.assert_allclose(m0["kl/exact_seq_sum"], 0.0, atol=1e-5)  # B = 0: the policy is the reference
    np.testing.assert_allclose(m0["eval/dpo/loss"], np.log(2), rtol=1e-5)  # delta = 0: log 2
    m2 = S.to_host(ev(states, base, held))
    assert np.all(m2["kl/exact_seq_sum"] > 1e-4) and np.all(m2["kl/exact_seq_sum"] >= -1e-6)
