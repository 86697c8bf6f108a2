"""klrl.algo.dpo: the DPO/IPO/robust/hinge losses and the reward metrics against TRL 1.12's own
``DPOTrainer._compute_loss`` (tests/data/dpo_golden.json, written by tests/data/make_dpo_goldens.py from
the same logits), and against NumPy on hand values (cDPO, which TRL 1.12 no longer computes)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo.dpo import LOSS_TYPES, completion_logps, pair_losses, pair_metrics, sigmoid_loss

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "dpo_golden.json").read_text())


def _golden_logratios():
    g = GOLDEN
    ids, comp = np.array(g["input_ids"]), np.array(g["completion_mask"], np.float32)
    logps = completion_logps(jnp.array(g["logits"], jnp.float32), jnp.array(ids), jnp.array(comp))
    b = ids.shape[0] // 2
    ref = np.array(g["ref_chosen_logps"] + g["ref_rejected_logps"], np.float32)
    h = np.asarray(logps) - ref
    n = comp.sum(1)  # TRL's IPO divides by the (unshifted) completion_mask's count
    return np.asarray(logps), h[:b], h[b:], n[:b], n[b:]


def test_completion_logps_match_numpy_loop():
    g = GOLDEN
    ids, comp, logits = np.array(g["input_ids"]), np.array(g["completion_mask"]), np.array(g["logits"])
    want = []
    for i in range(ids.shape[0]):
        s = 0.0
        for t in range(1, ids.shape[1]):
            if comp[i, t]:
                z = logits[i, t - 1].astype(np.float64)
                s += z[ids[i, t]] - np.log(np.sum(np.exp(z - z.max()))) - z.max()
        want.append(s)
    got = _golden_logratios()[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    b = ids.shape[0] // 2
    np.testing.assert_allclose(got[:b].mean(), GOLDEN["cases"][0]["logps_chosen"], rtol=1e-6)
    np.testing.assert_allclose(got[b:].mean(), GOLDEN["cases"][0]["logps_rejected"], rtol=1e-6)


@pytest.mark.parametrize(
    "case", GOLDEN["cases"], ids=lambda c: f"{c['loss_type']}-b{c['beta']}-ls{c['label_smoothing']}"
)
def test_losses_and_metrics_equal_trl(case):
    _, hc, hr, nc, nr = _golden_logratios()
    ls = case["label_smoothing"]
    if case["loss_type"] == "sigmoid":
        ls = 0.0  # TRL 1.12 ignores label_smoothing for sigmoid (klrl's cDPO: the NumPy test below)
    per = pair_losses(
        case["loss_type"], hc, hr, case["beta"], label_smoothing=ls, chosen_len=nc, rejected_len=nr
    )
    np.testing.assert_allclose(float(jnp.mean(per)), case["loss"], rtol=1e-6, atol=1e-6)
    m = pair_metrics(jnp.array(hc), jnp.array(hr), jnp.float32(case["beta"]))
    for k in ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"):
        np.testing.assert_allclose(float(m[f"dpo/{k}"]), case[k], rtol=1e-6, atol=1e-6)
    assert GOLDEN["trl"].startswith("1.12")


def test_losses_on_hand_values():
    hc = np.array([2.0, -1.0, 0.5], np.float32)
    hr = np.array([1.0, 1.0, 0.5], np.float32)
    d = hc - hr  # 1, -2, 0
    beta, eps = 0.5, 0.25
    lsig = lambda z: -np.log1p(np.exp(-z))  # log sigmoid
    np.testing.assert_allclose(pair_losses("sigmoid", hc, hr, beta), -lsig(beta * d), rtol=1e-6)
    assert abs(float(pair_losses("sigmoid", hc, hr, beta)[2]) - np.log(2)) < 1e-6  # delta 0: log 2
    cdpo = -(1 - eps) * lsig(beta * d) - eps * lsig(-beta * d)
    np.testing.assert_allclose(pair_losses("sigmoid", hc, hr, beta, label_smoothing=eps), cdpo, rtol=1e-6)
    robust = (-(1 - eps) * lsig(beta * d) + eps * lsig(-beta * d)) / (1 - 2 * eps)
    np.testing.assert_allclose(pair_losses("robust", hc, hr, beta, label_smoothing=eps), robust, rtol=1e-6)
    np.testing.assert_allclose(pair_losses("hinge", hc, hr, beta), np.maximum(0, 1 - beta * d), rtol=1e-6)
    nc, nr = np.array([4.0, 1.0, 0.0]), np.array([2.0, 2.0, 5.0])  # a 0 count is clamped to 1
    ipo = (hc / np.maximum(nc, 1) - hr / np.maximum(nr, 1) - 1 / (2 * beta)) ** 2
    np.testing.assert_allclose(
        pair_losses("ipo", hc, hr, beta, chosen_len=nc, rejected_len=nr), ipo, rtol=1e-6
    )
    assert (
        abs(float(pair_losses("ipo", hc, hr, beta, chosen_len=nc, rejected_len=nr)[0]) - 1.0) < 1e-6
    )  # 2/4 - 1/2 - 1


def test_sigmoid_gradient_and_beta_as_an_array():
    # d/d delta of -log sigmoid(beta delta) = -beta sigmoid(-beta delta)
    d = jnp.array([0.3, -1.0])
    g = jax.grad(lambda x: jnp.sum(sigmoid_loss(x, jnp.float32(2.0))))(d)
    np.testing.assert_allclose(np.asarray(g), -2.0 / (1 + np.exp(2.0 * np.array([0.3, -1.0]))), rtol=1e-6)
    f = jax.jit(jax.vmap(lambda b: jnp.mean(pair_losses("sigmoid", d, jnp.zeros(2), b))))
    betas = jnp.array([0.1, 1.0], jnp.float32)
    want = [np.mean(np.log1p(np.exp(-b * np.array([0.3, -1.0])))) for b in (0.1, 1.0)]
    np.testing.assert_allclose(np.asarray(f(betas)), want, rtol=1e-6)


def test_unknown_loss_and_ipo_without_lengths():
    with pytest.raises(ValueError, match="dpo.loss"):
        pair_losses("nope", jnp.zeros(1), jnp.zeros(1), 0.1)
    with pytest.raises(ValueError, match="token counts"):
        pair_losses("ipo", jnp.zeros(1), jnp.zeros(1), 0.1)
    assert set(LOSS_TYPES) == {"sigmoid", "ipo", "robust", "hinge"}
