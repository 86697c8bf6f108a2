"""The registries (klrl/registry.py): names come from the implementations, the config validates
against them, the plots read their labels; chex shape checks at the public maths functions."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.algo import advantages, control, kl, losses, shaping
from klrl.config import ConfigError, ControllerConfig, KLConfig, PPOConfig, TaskConfig
from klrl.registry import ADVANTAGES, CONTROLLERS, ESTIMATORS, FAMILIES, REWARDS, TASKS, Registry, is_adaptive


def test_the_registries_are_filled_by_their_home_modules():
    # each entry is the implementation its module defines, with the metadata its readers need
    assert CONTROLLERS.names() == control.KINDS == control.kinds()
    assert all(CONTROLLERS.get(k).__module__ == "klrl.algo.control" for k in CONTROLLERS)
    for n in ESTIMATORS:
        fn, meta = ESTIMATORS.entry(n)
        assert fn.__module__ == "klrl.algo.kl" and getattr(kl, fn.__name__) is fn
        assert meta["inputs"] in ("logp", "logits")
    for n in ADVANTAGES:
        assert advantages.needs_critic(n) is ADVANTAGES.meta(n)["critic"] and "grouped" in ADVANTAGES.meta(n)
    assert {"gpt", "gpt2", "llama"} <= set(FAMILIES) and {"testbed", "wordclass", "peer"} <= set(TASKS)
    assert set(REWARDS) >= {"positivity", "length", "arithmetic"}


def test_the_checkpointed_controller_codes_are_the_names():
    # ControllerParams.kind (in every checkpoint) is the code of the kind's name, pinned here (a changed
    # code would make every checkpoint of that kind unreadable); 0-4 are the older checkpoints' indices
    codes = {"fixed": 516673074, "proportional": 1188982677, "band": 1222681323, "pi": 1518973685,
             "dual": 2145018470}  # fmt: skip
    assert {k: control.code(k) for k in control.KINDS} == codes
    assert control.INDEXED == control.KINDS[:5] == ("fixed", "proportional", "band", "pi", "dual")


def test_names_where_and_describe():
    r = Registry("widget", "klrl.registry")
    r.register("a", big=True, help="the first")(len)
    r.register("b", big=False)(max)
    r.register("c")(min)
    assert r.names(where=lambda m: m.get("big", False)) == ("a",)
    assert r.names(where=lambda m: "big" in m) == ("a", "b")
    assert r.describe() == "a (the first), b, c"
    assert r.describe(where=lambda m: not m.get("big", True)) == "b"


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
    "make,field,registry",
    [
        (lambda: ControllerConfig(kind="lqr"), "ctrl.kind", CONTROLLERS),
        (lambda: KLConfig(estimator="k4"), "kl.estimator", ESTIMATORS),
        (lambda: KLConfig(loss_estimator="k4"), "kl.loss_estimator", ESTIMATORS),
        (lambda: ControllerConfig(estimator="k4"), "ctrl.estimator", ESTIMATORS),
        (lambda: PPOConfig(advantage="vtrace"), "ppo.advantage", ADVANTAGES),
    ],
)
def test_config_validates_names_against_the_registries(make, field, registry):
    with pytest.raises(ConfigError, match=f"^{field}: must be one of {', '.join(registry.names())} "):
        make()


@pytest.mark.parametrize(
    "section,field,registry",
    [
        (ControllerConfig, "kind", CONTROLLERS),
        (KLConfig, "estimator", ESTIMATORS),
        (KLConfig, "loss_estimator", ESTIMATORS),
        (ControllerConfig, "estimator", ESTIMATORS),
        (PPOConfig, "advantage", ADVANTAGES),
        (TaskConfig, "name", TASKS),
    ],
)
def test_config_help_lists_the_registry(section, field, registry):
    import dataclasses

    text = str({f.name: f for f in dataclasses.fields(section)}[field].metadata["help"])
    assert registry.describe() in text and all(n in text for n in registry)


def test_the_group_size_rule_reads_grouped_metadata():
    grouped = ADVANTAGES.names(where=lambda m: m["grouped"])
    assert grouped  # the built-ins have some
    for n in ADVANTAGES:
        if n in grouped:
            with pytest.raises(ConfigError, match=f"^ppo.group_size: must be >= 2 for ppo.advantage={n}"):
                PPOConfig(advantage=n, group_size=1)
            assert PPOConfig(advantage=n, group_size=2).group_size == 2
        else:
            assert PPOConfig(advantage=n, group_size=1).group_size == 1


def test_plot_labels_come_from_the_controller_registry():
    from klrl.analysis import plots
    from klrl.config import RunConfig

    for kind in CONTROLLERS:
        cfg = RunConfig().replace(ctrl={"kind": kind, "target": 2.0})
        text = plots.label(cfg)
        adaptive = CONTROLLERS.meta(kind).get("adaptive", True)  # a kind that never moves beta: no target
        assert text.startswith(f"{kind} target=2" if adaptive else f"{kind} beta="), text
    assert "kp=0.1 ki=0.01" in plots.label(RunConfig().replace(ctrl={"kind": "pi", "target": 2.0}))
    # a kind registered with its label: the plots print it, with no table of their own to update
    old = CONTROLLERS._items["dual"]
    CONTROLLERS._items["dual"] = (old[0], {"label": lambda c: f"step={c.lr:g}!"})
    try:
        assert "step=0.01!" in plots.label(RunConfig().replace(ctrl={"kind": "dual", "target": 2.0}))
    finally:
        CONTROLLERS._items["dual"] = old


def test_is_adaptive_reads_the_registration_not_the_name():
    assert not is_adaptive("fixed")
    assert all(is_adaptive(k) for k in CONTROLLERS if k != "fixed")
    CONTROLLERS.register("frozen_beta_test", adaptive=False)(lambda *a: a[:2])
    CONTROLLERS.register("moving_beta_test")(lambda *a: a[:2])  # no metadata: adaptive by default
    try:
        assert not is_adaptive("frozen_beta_test") and is_adaptive("moving_beta_test")
    finally:
        CONTROLLERS.remove("frozen_beta_test")
        CONTROLLERS.remove("moving_beta_test")
    with pytest.raises(ValueError, match="unknown controller"):
        is_adaptive("nosuch")


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


def test_the_declared_built_ins_are_the_ones_their_homes_register():
    """klrl's own entries are declared in klrl.registry (names and metadata, read without importing the
    implementations); each is registered, bare, by its home module, in the declared order."""
    from klrl.registry import BUILTIN

    for reg in (CONTROLLERS, ESTIMATORS, ADVANTAGES, TASKS, REWARDS):
        declared = tuple(name for name, _ in BUILTIN[reg.kind])
        assert reg.names()[: len(declared)] == declared
        for name, meta in BUILTIN[reg.kind]:
            fn, got = reg.entry(name)
            assert got == meta and fn.__module__.startswith(reg.home), (reg.kind, name, fn.__module__)
    r = Registry("widget", "klrl.registry", (("a", {"x": 1}),))
    assert r.names() == ("a",) and r.meta("a") == {"x": 1}
    with pytest.raises(ValueError, match="declared in klrl.registry, not registered"):
        r.get("a")
    with pytest.raises(ValueError, match="its metadata is declared in klrl.registry"):
        r.register("a", x=2)(len)
    r.register("a")(len)
    assert r.entry("a") == (len, {"x": 1})


def test_names_and_metadata_are_read_without_importing_the_implementations():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from klrl.registry import ADVANTAGES, CONTROLLERS, ESTIMATORS, REWARDS, TASKS, is_adaptive\n"
        "from klrl.config import RunConfig\n"
        "RunConfig()\n"
        "names = [r.describe() for r in (ADVANTAGES, CONTROLLERS, ESTIMATORS, REWARDS, TASKS)]\n"
        "assert not is_adaptive('fixed') and 'testbed' in TASKS, names\n"
        "homes = ('klrl.algo.control', 'klrl.algo.kl', 'klrl.algo.advantages', 'klrl.tasks', 'jax')\n"
        "assert not [m for m in homes if m in sys.modules], [m for m in homes if m in sys.modules]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
