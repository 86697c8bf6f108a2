"""The registries (klrl/registry.py): names come from the implementations, the config validates
against them, the plots read their labels; chex shape checks at the public maths functions."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo import advantages, control, kl, losses, shaping
from klrl.config import ConfigError, ControllerConfig, KLConfig, PPOConfig
from klrl.registry import ADVANTAGES, CONTROLLERS, ESTIMATORS, FAMILIES, TASKS, Registry


def test_registries_hold_the_built_in_names_in_order():
    assert CONTROLLERS.names() == control.KINDS == ("fixed", "proportional", "band", "pi", "dual")
    assert ESTIMATORS.names() == ("k1", "k2", "k3", "abs", "full")
    assert ADVANTAGES.names() == ("gae", "grpo", "rloo")
    assert "gpt" in FAMILIES and {"testbed", "wordclass", "peer"} <= set(TASKS)
    assert ESTIMATORS.get("k3") is kl.k3 and ESTIMATORS.meta("full")["inputs"] == "logits"
    assert [ADVANTAGES.meta(n)["critic"] for n in ADVANTAGES] == [True, False, False]


def test_registry_rejects_unknown_and_duplicate_names():
    r = Registry("widget", "klrl.registry")
    r.register("a", x=1)(len)
    assert r.names() == ("a",) and r.meta("a") == {"x": 1} and "a" in r and len(r) == 1
    with pytest.raises(ValueError, match="unknown widget 'b'; expected one of a"):
        r.get("b")
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        r.register("a")(max)
    r.remove("a")
    assert r.names() == ()


@pytest.mark.parametrize(
    "make,field,names",
    [
        (lambda: ControllerConfig(kind="lqr"), "ctrl.kind", "fixed, proportional, band, pi, dual"),
        (lambda: KLConfig(estimator="k4"), "kl.estimator", "k1, k2, k3, abs, full"),
        (lambda: PPOConfig(advantage="vtrace"), "ppo.advantage", "gae, grpo, rloo"),
    ],
)
def test_config_validates_names_against_the_registries(make, field, names):
    with pytest.raises(ConfigError, match=f"^{field}: must be one of {names} "):
        make()


def test_plot_labels_come_from_the_controller_registry():
    from klrl.analysis import plots
    from klrl.config import RunConfig

    for kind in CONTROLLERS:
        cfg = RunConfig().replace(ctrl={"kind": kind, "target": 2.0})
        text = plots.label(cfg)
        assert text.startswith("fixed beta=" if kind == "fixed" else f"{kind} target=2"), text
    assert "kp=0.1 ki=0.01" in plots.label(RunConfig().replace(ctrl={"kind": "pi", "target": 2.0}))
    # a kind registered with its label: the plots print it, with no table of their own to update
    old = CONTROLLERS._items["dual"]
    CONTROLLERS._items["dual"] = (old[0], {"label": lambda c: f"step={c.lr:g}!"})
    try:
        assert "step=0.01!" in plots.label(RunConfig().replace(ctrl={"kind": "dual", "target": 2.0}))
    finally:
        CONTROLLERS._items["dual"] = old


def test_chex_shape_checks_at_the_public_maths():
    x = jnp.zeros((2, 3))
    with pytest.raises(AssertionError):
        kl.estimate("k1", x, jnp.zeros((2, 4)), x)
    with pytest.raises(AssertionError):
        kl.estimate("full", x, x, x, jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 6)))
    with pytest.raises(AssertionError):
        advantages.gae(x, jnp.zeros((3, 2)), x, 1.0, 1.0)
    with pytest.raises(AssertionError):
        advantages.grpo(x, 2)
    with pytest.raises(AssertionError):
        losses.clipped_surrogate(x, x, jnp.zeros((2,)), 0.2)
    with pytest.raises(AssertionError):
        shaping.shaped_rewards(jnp.zeros((3,)), x, x, 0.1, "reward")
    chex.assert_shape(kl.estimate("k3", x, x, x), (2, 3))  # right shapes pass
    np.testing.assert_array_equal(np.asarray(shaping.shaped_rewards(jnp.ones(2), x, x + 1, 0.1, "reward")),
                                  [[0, 0, 1], [0, 0, 1]])  # fmt: skip
