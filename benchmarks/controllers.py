"""Beta controllers on a simulated KL plant: settling time, overshoot, oscillation.

The plant: the KL observed at iteration ``t`` responds to the coefficient ``beta_t`` as

    m_t  = lag * m_{t-1} + (1 - lag) * log(a_t / beta_t)      (log of the noise-free KL)
    KL_t = exp(m_t) * exp(noise * eps_t),  eps_t ~ N(0, 1)    (multiplicative lognormal noise)

With ``lag = 0`` (the default) this is ``KL = a / beta * exp(noise)``: the stationary
RLHF picture where a stronger penalty buys proportionally less KL. ``lag > 0`` adds a
first-order delay (the policy needs a few iterations to move). The default run has
``a`` doubling at the midpoint (the reward model "pulls harder"), so every controller
faces two step responses.

Judging (stated once, used by the tests too): the KL a controller is judged on is the
trailing mean of the observed KL over ``WINDOW`` steps, restarted at each segment
(before/after the step in ``a``), so it is robust to the noise. A segment *settles* at
the first step after which that smoothed KL stays within ``+-TOL`` of the target until
the segment ends (``None`` if it never does). *Overshoot* is the largest excursion of
the smoothed KL past the target, on the side opposite the segment's initial error, in
percent of the target. *Oscillation* is measured on the settled tail (second half of
each segment): the number of sign changes of the raw error ``KL - target`` and the
total variation of ``log beta``.

Run ``python benchmarks/controllers.py``: a readable table, then the whole table as one
JSON object on the last line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from klrl.algo import control

TARGET = 6.0  # nats per sequence, the lm-human-preferences sentiment target
A0 = 0.6  # plant gain before the step: KL = A0 / beta, so beta* = 0.1
BETA0 = 0.04  # initial beta: KL starts at 2.5 x target
STEPS = 600
N_SEQ = 64  # sequences per batch (proportional's n)
NOISE = 0.05  # sigma of the multiplicative lognormal noise
WINDOW = 10  # trailing-mean window of the judged KL
TOL = 0.10  # settled = within +-10% of the target
KP_SWEEP = (0.1, 0.2, 0.4)
LAG = 0.8  # the delayed plant of the kp sweep
SWEEP_SEEDS = 32


def step_a(t: int, steps: int = STEPS) -> float:
    """Plant gain: ``A0``, doubling at the midpoint."""
    return A0 * (2.0 if t >= steps // 2 else 1.0)


def plant_controllers() -> dict[str, control.Controller]:
    """The controllers of the plant table, with gains suited to this plant."""
    return {
        "fixed": control.fixed(),
        # n / horizon = 0.1: a 10-step time constant near the target, at most 2% per step far from it
        "proportional": control.proportional(TARGET, horizon=640.0),
        "band": control.band(TARGET),  # PPO-paper defaults: band 1.5, factor 2
        "band_tight": control.band(TARGET, band=1.1, factor=1.05),
        "pi": control.pi(TARGET, kp=0.2, ki=0.01),
        # loop gain lr * TARGET / beta* = 0.3 before the step, 0.15 after
        "dual": control.dual(TARGET, lr=0.005),
    }


@jax.jit
def _rollout(state: control.ControllerState, log_a: jax.Array, eps: jax.Array, n: jax.Array, lag: jax.Array):
    def body(carry, xs):
        st, m = carry
        log_a_t, eps_t = xs
        m = lag * m + (1.0 - lag) * (log_a_t - jnp.log(jnp.maximum(st.beta, 1e-12)))
        kl = jnp.exp(m + eps_t)
        return (control.update(st, kl, n), m), (st.beta, kl, jnp.exp(m))

    m0 = log_a[0] - jnp.log(jnp.maximum(state.beta, 1e-12))
    _, (beta, kl, kl_mean) = lax.scan(body, (state, m0), (log_a, eps))
    return beta, kl, kl_mean


_rollout_seeds = jax.jit(jax.vmap(_rollout, in_axes=(None, None, 0, None, None)))


def simulate(
    controller: control.Controller,
    steps: int = STEPS,
    a_fn: Callable[[int], float] = step_a,
    noise: float = NOISE,
    seed: int | Sequence[int] = 0,
    *,
    beta0: float = BETA0,
    n_sequences: int = N_SEQ,
    lag: float = 0.0,
) -> dict[str, np.ndarray]:
    """Run ``controller`` on the plant for ``steps`` iterations.

    ``a_fn(t)`` is the plant gain at iteration ``t`` (any Python function). ``seed`` is an int, or a
    sequence of ints for a leading seed axis on the outputs. Returns numpy arrays ``beta`` (the beta
    used at each iteration), ``kl`` (observed), ``kl_mean`` (noise-free) and ``a``.
    """
    a = np.array([a_fn(t) for t in range(steps)], np.float32)
    seeds = [seed] if isinstance(seed, int) else list(seed)
    eps = np.stack([np.random.default_rng(s).standard_normal(steps) for s in seeds]).astype(np.float32)
    eps *= np.float32(noise)
    out = _rollout_seeds(controller.init(beta0), jnp.log(a), eps, jnp.float32(n_sequences), jnp.float32(lag))
    beta, kl, kl_mean = (np.asarray(x) for x in out)
    if isinstance(seed, int):
        beta, kl, kl_mean = beta[0], kl[0], kl_mean[0]
    return {"beta": beta, "kl": kl, "kl_mean": kl_mean, "a": a}


def segments(steps: int = STEPS) -> list[tuple[int, int]]:
    """The two halves of the run (before and after the step in ``a``)."""
    return [(0, steps // 2), (steps // 2, steps)]


def trailing_mean(x: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """Trailing mean over ``window`` steps (expanding over the first ``window - 1``)."""
    c = np.cumsum(np.asarray(x, np.float64))
    out = c.copy()
    out[window:] = c[window:] - c[:-window]
    return out / np.minimum(np.arange(1, len(x) + 1), window)


def settling(kl: np.ndarray, target: float = TARGET, tol: float = TOL, window: int = WINDOW) -> int | None:
    """First index after which the trailing-mean KL stays within ``+-tol`` of ``target``; None if never."""
    ok = np.abs(trailing_mean(kl, window) / target - 1.0) <= tol
    if not ok[-1]:
        return None
    bad = np.flatnonzero(~ok)
    return 0 if len(bad) == 0 else int(bad[-1]) + 1


def overshoot(kl: np.ndarray, target: float = TARGET, window: int = WINDOW) -> float:
    """Largest excursion (% of target) of the trailing-mean KL past the target, opposite the initial error."""
    sm = trailing_mean(kl, window)
    side = np.sign(sm[0] - target)
    return float(max(0.0, np.max(-side * (sm - target)) / target * 100.0))


def oscillation(kl: np.ndarray, beta: np.ndarray, target: float = TARGET) -> tuple[int, float]:
    """(sign changes of ``kl - target``, total variation of ``log beta``) over the arrays given."""
    err = np.sign(np.asarray(kl, np.float64) - target)
    tv = float(np.sum(np.abs(np.diff(np.log(np.asarray(beta, np.float64))))))
    return int(np.sum(err[1:] != err[:-1])), tv


def metrics(run: dict[str, np.ndarray], target: float = TARGET) -> dict[str, Any]:
    """Per-segment settling/overshoot/final error and tail oscillation of one (single-seed) run."""
    out: dict[str, Any] = {"settle": [], "overshoot_pct": [], "final_err_pct": []}
    sign_changes, tv = 0, 0.0
    for start, stop in segments(len(run["kl"])):
        kl, beta = run["kl"][start:stop], run["beta"][start:stop]
        out["settle"].append(settling(kl, target))
        out["overshoot_pct"].append(round(overshoot(kl, target), 2))
        out["final_err_pct"].append(round(float(trailing_mean(kl)[-1] / target - 1.0) * 100.0, 2))
        tail = (start + stop) // 2 - start
        s, v = oscillation(kl[tail:], beta[tail:], target)
        sign_changes, tv = sign_changes + s, tv + v
    out["tail_sign_changes"] = sign_changes
    out["tail_tv_log_beta"] = round(tv, 4)
    return out


def kp_sweep(kps: Sequence[float] = KP_SWEEP, lag: float = 0.0, seeds: int = SWEEP_SEEDS) -> dict[str, Any]:
    """PI with ``ki = 0`` and each ``kp``: tail oscillation (mean over seeds), noise-free overshoot."""
    table: dict[str, Any] = {}
    for kp in kps:
        ctrl = control.pi(TARGET, kp=kp, ki=0.0)
        runs = simulate(ctrl, seed=range(seeds), lag=lag)
        per_seed = [metrics({k: v[i] for k, v in runs.items() if k != "a"}) for i in range(seeds)]
        clean = metrics(simulate(ctrl, noise=0.0, lag=lag))
        table[str(kp)] = {
            "tail_sign_changes": round(float(np.mean([m["tail_sign_changes"] for m in per_seed])), 2),
            "tail_tv_log_beta": round(float(np.mean([m["tail_tv_log_beta"] for m in per_seed])), 4),
            "settle": per_seed[0]["settle"],
            "noise_free_overshoot_pct": clean["overshoot_pct"],
            "noise_free_settle": clean["settle"],
        }
    return table


def plant_table() -> dict[str, Any]:
    """Everything the plant tests check, as one JSON-able dict."""
    return {
        "plant": {
            "target": TARGET,
            "a0": A0,
            "a_step": "x2 at the midpoint",
            "beta0": BETA0,
            "steps": STEPS,
            "n_sequences": N_SEQ,
            "noise_sigma": NOISE,
            "judged_on": f"trailing mean of observed KL over {WINDOW} steps, restarted per segment",
            "tol": TOL,
        },
        "controllers": {name: metrics(simulate(c)) for name, c in plant_controllers().items()},
        "pi_kp_sweep": {"ki": 0.0, "static": kp_sweep(lag=0.0), f"lag_{LAG}": kp_sweep(lag=LAG)},
    }


def format_table(table: dict[str, Any]) -> str:
    """The plant table as readable text."""
    lines = [
        f"plant: {table['plant']}",
        f"{'controller':<14}{'settle':>14}{'overshoot %':>18}{'final err %':>18}{'sign ch.':>10}{'TV':>8}",
    ]
    for name, m in table["controllers"].items():
        lines.append(
            f"{name:<14}{str(m['settle']):>14}{str(m['overshoot_pct']):>18}{str(m['final_err_pct']):>18}"
            f"{m['tail_sign_changes']:>10}{m['tail_tv_log_beta']:>8.3f}"
        )
    for plant, sweep in table["pi_kp_sweep"].items():
        if plant == "ki":
            continue
        lines.append(f"PI, ki=0, {plant} plant (sign changes and TV: mean over {SWEEP_SEEDS} seeds)")
        for kp, m in sweep.items():
            lines.append(
                f"  kp={kp:<5} sign changes {m['tail_sign_changes']:7.2f}"
                f"  TV log beta {m['tail_tv_log_beta']:.4f}"
                f"  noise-free overshoot % {m['noise_free_overshoot_pct']}  settle {m['settle']}"
            )
    return "\n".join(lines)


def main() -> None:
    table = plant_table()
    print(format_table(table))
    sys.stdout.flush()
    print(json.dumps(table))


if __name__ == "__main__":
    main()
