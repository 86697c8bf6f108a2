"""Beta controllers for the KL coefficient, optax/rlax-style.

A :class:`Controller` is a pair of pure functions ``init(beta0) -> state`` and
``update(state, observed_kl, n_sequences) -> state``. Every kind shares one
state type, :class:`ControllerState`, whose :class:`ControllerParams` hold the
kind as an int32 code of its name (:func:`code`) and every knob as a scalar array;
:func:`update` dispatches on that code with ``lax.switch`` (:func:`branch`). So states of
different kinds can be stacked (``jax.tree.map(jnp.stack, *states)``) and
updated together under ``jax.vmap(update)``, and a sweep can ``vmap`` over
params built by :func:`make_params`. ``state.beta`` is *the* coefficient.

Rules (``KL`` = the observed KL, in whatever unit ``target`` is in):

* fixed: beta unchanged.
* proportional (Ziegler et al. 2019): :func:`proportional_step`.
* band (Schulman et al. 2017, PPO paper sec. 4): :func:`band_step`.
* pi (proportional-integral on the relative error): :func:`pi_step`.
* dual (Lagrangian dual ascent on ``KL <= target``): :func:`dual_step`.

For every kind, on each :func:`update`:

* warm-up: while ``steps < warmup_iters`` the update ignores the KL and beta
  stays at ``warmup_beta`` (the integral does not move); the first
  ``warmup_iters`` observations are discarded, and the adaptive rule then
  takes over starting from ``warmup_beta``. (A fixed controller with a
  warm-up stays at ``warmup_beta``.)
* a non-finite KL leaves beta and the integral unchanged.
* beta is clipped to ``[beta_min, beta_max]``.
* ``steps`` is incremented.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from klrl.config import ControllerConfig
from klrl.registry import CONTROLLERS

Array = jax.Array
ArrayLike = jax.typing.ArrayLike

_INT_FIELDS = ("kind", "warmup_iters")


class ControllerParams(NamedTuple):
    """Knobs of every kind; every leaf a scalar array so sweeps can vmap over them."""

    kind: Array  # int32, the kind's code (code(name))
    target: Array
    horizon: Array
    clip: Array
    band: Array
    factor: Array
    kp: Array
    ki: Array
    integral_max: Array
    step_clip: Array
    lr: Array
    warmup_iters: Array  # int32
    warmup_beta: Array
    beta_min: Array
    beta_max: Array


class ControllerState(NamedTuple):
    """The controller's state; lives in the train state and is checkpointed with it."""

    beta: Array  # float32 scalar, THE coefficient
    integral: Array  # float32, PI's error integral (0 for the other kinds)
    steps: Array  # int32, updates done so far
    params: ControllerParams


class Controller(NamedTuple):
    """``init(beta0) -> ControllerState``; ``update(state, observed_kl, n_sequences) -> ControllerState``."""

    init: Callable[[ArrayLike], ControllerState]
    update: Callable[[ControllerState, ArrayLike, ArrayLike], ControllerState]


# ---- parameters -----------------------------------------------------------------------------------


def make_params(cfg: ControllerConfig) -> ControllerParams:
    """The :class:`ControllerParams` of a (validated) config, as scalar arrays."""
    values: dict[str, Any] = {f: getattr(cfg, f) for f in ControllerParams._fields if f != "kind"}
    values["kind"] = code(cfg.kind)
    return ControllerParams(
        **{k: jnp.asarray(v, jnp.int32 if k in _INT_FIELDS else jnp.float32) for k, v in values.items()}
    )


# ---- per-kind maths ---------------------------------------------------------------------------------


def proportional_step(beta: Array, kl: Array, n: Array, p: ControllerParams) -> Array:
    """Proportional rule of Ziegler et al. 2019 (openai/lm-human-preferences, ``AdaptiveKLController``).

    ``e = clip(KL / target - 1, -clip, clip)``; ``beta <- beta * (1 + e * n / horizon)``,
    with ``n`` the number of sequences (episodes) in the batch. Also trlx, verl, OpenRLHF.
    """
    e = jnp.clip(kl / p.target - 1.0, -p.clip, p.clip)
    return beta * (1.0 + e * n / p.horizon)


def band_step(beta: Array, kl: Array, p: ControllerParams) -> Array:
    """Adaptive KL penalty of the PPO paper (Schulman et al. 2017, sec. 4).

    ``KL > target * band -> beta * factor``; ``KL < target / band -> beta / factor``;
    otherwise (boundaries included) unchanged. Paper: band 1.5, factor 2.
    """
    up = kl > p.target * p.band
    down = kl < p.target / p.band
    return jnp.where(up, beta * p.factor, jnp.where(down, beta / p.factor, beta))


def pi_step(beta: Array, integral: Array, kl: Array, p: ControllerParams) -> tuple[Array, Array]:
    """Multiplicative proportional-integral control on the relative error.

    ``e = (KL - target) / target``; ``I <- clip(I + e, -integral_max, integral_max)`` (anti-windup);
    ``u = clip(kp * e + ki * I, -step_clip, step_clip)``; ``beta <- beta * (1 + u)``.
    Since the update is multiplicative, ``log beta`` already integrates ``e`` (``ki = 0`` is
    pure integral action on ``log beta``); ``ki`` adds a second integrator.
    Returns ``(beta, integral)``.
    """
    e = (kl - p.target) / p.target
    integral = jnp.clip(integral + e, -p.integral_max, p.integral_max)
    u = jnp.clip(p.kp * e + p.ki * integral, -p.step_clip, p.step_clip)
    return beta * (1.0 + u), integral


def dual_step(beta: Array, kl: Array, p: ControllerParams) -> Array:
    """Projected dual (sub)gradient ascent on the Lagrange multiplier of ``KL <= target``.

    ``beta <- max(0, beta + lr * (KL - target))`` (e.g. Boyd & Vandenberghe, dual ascent;
    the Lagrange-penalty form of constrained RL, cf. rlax's MPO Lagrange penalty).
    """
    return jnp.maximum(0.0, beta + p.lr * (kl - p.target))


# The registry of controllers: each kind is one ``lax.switch`` branch
# ``(beta, integral, kl, n, params) -> (beta, integral)``, registered here under a name declared in
# klrl.registry (BUILTIN) with a ``label`` (the gains plots and reports print), a ``help`` (``ctrl.kind``'s
# help string), ``knobs`` (the ctrl fields it reads, beside the ones every kind reads: klrl.config.sweep) and
# ``adaptive=False`` for the one kind that never moves beta. A new kind is one more decorated function
# (plus its test; a built-in's name and metadata in klrl.registry); a new knob is a field of
# ControllerConfig and ControllerParams.
@CONTROLLERS.register("fixed")
def _b_fixed(beta: Array, integral: Array, kl: Array, n: Array, p: ControllerParams) -> tuple[Array, Array]:
    return beta, integral


@CONTROLLERS.register("proportional")
def _b_prop(beta: Array, integral: Array, kl: Array, n: Array, p: ControllerParams) -> tuple[Array, Array]:
    return proportional_step(beta, kl, n, p), integral


@CONTROLLERS.register("band")
def _b_band(beta: Array, integral: Array, kl: Array, n: Array, p: ControllerParams) -> tuple[Array, Array]:
    return band_step(beta, kl, p), integral


@CONTROLLERS.register("pi")
def _b_pi(beta: Array, integral: Array, kl: Array, n: Array, p: ControllerParams) -> tuple[Array, Array]:
    return pi_step(beta, integral, kl, p)


@CONTROLLERS.register("dual")
def _b_dual(beta: Array, integral: Array, kl: Array, n: Array, p: ControllerParams) -> tuple[Array, Array]:
    return dual_step(beta, kl, p), integral


KINDS: tuple[str, ...] = CONTROLLERS.names()  # the built-in kinds: fixed, proportional, band, pi, dual


def kinds() -> tuple[str, ...]:
    """Every registered kind, a later registration (a kind written outside this module) included; the
    order of :func:`update`'s ``lax.switch`` branches."""
    return CONTROLLERS.names()


# older checkpoints hold ``ControllerParams.kind`` as an index into the built-in kinds: 0-4 read as these
# kinds (a name's code is >= 2**16, so the two never meet)
INDEXED = ("fixed", "proportional", "band", "pi", "dual")


def code(kind: str) -> int:
    """``ControllerParams.kind`` of the kind named ``kind``, as a checkpoint holds it: the CRC-32 of the
    name folded into ``[2**16, 2**31)`` (an int32). It depends on the name alone, so a checkpoint
    resumes whatever was registered since, before or after its kind."""
    return 2**16 + zlib.crc32(kind.encode()) % (2**31 - 2**16)


def _codes() -> dict[int, int]:
    """``code -> branch index`` (the position in :func:`kinds`) of every registered kind and of the
    :data:`INDEXED` codes; a :class:`ValueError` if two names share a code."""
    names = kinds()
    out = {code(n): i for i, n in enumerate(names)}
    if len(out) < len(names):
        raise ValueError(
            f"controllers {', '.join(names)}: two names have the same code (klrl.algo.control.code)"
        )
    return {**out, **{i: names.index(n) for i, n in enumerate(INDEXED) if n in names}}


def branch(kind: ArrayLike) -> Array:
    """The branch index (position in :func:`kinds`) of a (traced) ``ControllerParams.kind`` code; 0
    for an unknown code (:func:`kind_name` names it)."""
    table = _codes()
    codes = jnp.asarray(list(table), jnp.int32)
    match = codes == jnp.asarray(kind, jnp.int32)
    return jnp.asarray(list(table.values()), jnp.int32)[jnp.argmax(match)]


# ---- init / update (shared by every kind) -------------------------------------------------------


def _bound(beta: Array, p: ControllerParams) -> Array:
    return jnp.clip(beta, p.beta_min, p.beta_max)


def init_state(params: ControllerParams, beta0: ArrayLike) -> ControllerState:
    """Initial state: ``beta = warmup_beta if warmup_iters > 0 else beta0``, clipped to the bounds.

    ``beta0`` may be traced (no Python branching on values), so ``jax.vmap(init_state)`` works.
    """
    beta0 = jnp.asarray(beta0, jnp.float32)
    beta = jnp.where(params.warmup_iters > 0, params.warmup_beta, beta0)
    return ControllerState(
        beta=_bound(beta, params),
        integral=jnp.zeros((), jnp.float32),
        steps=jnp.zeros((), jnp.int32),
        params=params,
    )


def update(state: ControllerState, observed_kl: ArrayLike, n_sequences: ArrayLike) -> ControllerState:
    """One controller step for a state of any kind (dispatch on ``state.params.kind``).

    Args:
      state: the current state.
      observed_kl: scalar KL of this batch, in the unit of ``params.target``.
      n_sequences: global number of sequences in the batch (used by proportional).

    Returns:
      The new state; see the module docstring for warm-up, non-finite KL and bounds.
    """
    p = state.params
    kl = jnp.asarray(observed_kl, jnp.float32)
    n = jnp.asarray(n_sequences, jnp.float32)
    finite = jnp.isfinite(kl)
    kl_safe = jnp.where(finite, kl, p.target)  # keep nan/inf out of every branch
    branches = tuple(CONTROLLERS.get(k) for k in kinds())
    beta, integral = lax.switch(branch(p.kind), branches, state.beta, state.integral, kl_safe, n, p)
    warm = state.steps < p.warmup_iters
    move = finite & ~warm
    beta = jnp.where(warm, p.warmup_beta, jnp.where(move, beta, state.beta))
    integral = jnp.where(move, integral, state.integral)
    return ControllerState(
        beta=_bound(beta.astype(jnp.float32), p),
        integral=integral.astype(jnp.float32),
        steps=state.steps + 1,
        params=p,
    )


# ---- constructors -----------------------------------------------------------------------------------


def from_config(cfg: ControllerConfig) -> Controller:
    """The controller described by ``cfg`` (``ctrl.*``); ``init(beta0)`` takes ``kl.beta``."""
    params = make_params(cfg)
    return Controller(init=lambda beta0: init_state(params, beta0), update=update)


def _make(kind: str, **kw: Any) -> Controller:
    # Through ControllerConfig so constructor arguments get the same validation as the CLI.
    return from_config(ControllerConfig(kind=kind, **kw))


def fixed(
    *, warmup_iters: int = 0, warmup_beta: float = 0.1, beta_min: float = 0.0, beta_max: float = 1e6
) -> Controller:
    """beta never moves (after an optional warm-up at ``warmup_beta``, it stays there)."""
    return _make(
        "fixed", warmup_iters=warmup_iters, warmup_beta=warmup_beta, beta_min=beta_min, beta_max=beta_max
    )


def proportional(target: float, horizon: float = 10000.0, clip: float = 0.2, **common: Any) -> Controller:
    """Ziegler et al. 2019 proportional controller (:func:`proportional_step`).

    ``common``: ``warmup_iters``, ``warmup_beta``, ``beta_min``, ``beta_max``.
    """
    return _make("proportional", target=target, horizon=horizon, clip=clip, **common)


def band(target: float, band: float = 1.5, factor: float = 2.0, **common: Any) -> Controller:
    """PPO-paper band rule (:func:`band_step`). ``common`` as in :func:`proportional`."""
    return _make("band", target=target, band=band, factor=factor, **common)


def pi(
    target: float,
    kp: float = 0.1,
    ki: float = 0.01,
    integral_max: float = 10.0,
    step_clip: float = 0.5,
    **common: Any,
) -> Controller:
    """Proportional-integral controller (:func:`pi_step`). ``common`` as in :func:`proportional`."""
    return _make("pi", target=target, kp=kp, ki=ki, integral_max=integral_max, step_clip=step_clip, **common)


def dual(target: float, lr: float = 0.01, **common: Any) -> Controller:
    """Lagrangian dual ascent (:func:`dual_step`). ``common`` as in :func:`proportional`."""
    return _make("dual", target=target, lr=lr, **common)


def with_warmup(ctrl: Controller, warmup_iters: int, warmup_beta: float) -> Controller:
    """``ctrl`` with beta held at ``warmup_beta`` for ``warmup_iters`` updates, then handed over."""
    checked = ControllerConfig(warmup_iters=warmup_iters, warmup_beta=warmup_beta)  # validation only

    def init(beta0: ArrayLike) -> ControllerState:
        params = ctrl.init(beta0).params._replace(
            warmup_iters=jnp.asarray(checked.warmup_iters, jnp.int32),
            warmup_beta=jnp.asarray(checked.warmup_beta, jnp.float32),
        )
        return init_state(params, beta0)

    return Controller(init=init, update=update)


def kind_name(state_or_params: ControllerState | ControllerParams) -> str:
    """The kind of a concrete (not traced, not stacked) state or params, as a string; a
    :class:`ValueError` for a code no registered kind has (a checkpoint of a kind not registered now)."""
    p = state_or_params.params if isinstance(state_or_params, ControllerState) else state_or_params
    table = _codes()
    if int(p.kind) not in table:
        raise ValueError(
            f"controller code {int(p.kind)}: no registered kind has it (registered: {', '.join(kinds())})"
        )
    return kinds()[table[int(p.kind)]]


__all__ = [
    "KINDS",
    "kinds",
    "INDEXED",
    "code",
    "branch",
    "Controller",
    "ControllerParams",
    "ControllerState",
    "make_params",
    "init_state",
    "update",
    "proportional_step",
    "band_step",
    "pi_step",
    "dual_step",
    "from_config",
    "fixed",
    "proportional",
    "band",
    "pi",
    "dual",
    "with_warmup",
    "kind_name",
]
