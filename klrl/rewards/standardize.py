"""``reward.standardize``: the task reward standardised against the reference policy's samples.

``r' = gain * r + bias``, ``gain = 1 / sigma``, ``bias = -mu / sigma``: ``mu`` and ``sigma`` (the
population std, ddof 0) are the mean and std of the raw task reward (e.g. the reward model's score)
of ``N = reward.standardize_samples`` responses sampled from the reference (= initial) policy on the
training prompts (drawn uniformly from the pool, sampled as in training: the ``sampling`` section and
the stop ids), so the initial policy's reward has mean 0 and std 1 and beta means the same across
reward models. Source: Ziegler et al. 2019, *Fine-Tuning Language Models from Human Preferences*
(lm-human-preferences normalises the reward model's output with a gain and a bias to mean 0, std 1
over samples of the initial policy, ``normalize_samples``); OpenRLHF's and TRL's reward normalisation.

* **Where it lives**: one float32 array ``env['reward_norm'] = [gain, bias]``, an argument of the
  compiled step (never a constant of the program), read by the wrapped reward inside the step
  (:func:`standardized`), before ``reward.missing_eos_penalty`` and the KL shaping; the held-out
  evaluation's reward is standardised with the same gain and bias. A sweep's members share the env:
  every member is scored by the same standardised reward (computed with the first member's
  ``train.seed``).
* **When**: once, at the start of a run or sweep (:func:`reward_norm_env`, called by ``klrl.run`` and
  ``klrl.sweep`` after ``make_train`` and before the first step); the values are recorded in
  ``task.json`` (``reward_norm``: gain, bias, mean, std, samples) and a resume reads them back from
  there, bit for bit, without sampling again.
* With ``make_train`` called directly: ``task = standardize_task(task)`` before it, then
  ``env, info = reward_norm_env(train, task.env, seed=...)`` and step with ``env``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.config import ConfigError
from klrl.io.checkpoint import CheckpointError
from klrl.models.rollout import generate

KEY = "reward_norm"
SALT = 0x5747  # folded into the run's seed: the standardisation's samples are not the training's


def identity() -> np.ndarray:
    """``[gain, bias] = [1, 0]``: the raw reward (the placeholder until :func:`reward_norm_env`)."""
    return np.array([1.0, 0.0], np.float32)


def standardized(reward: Any) -> Any:
    """``reward`` (a :class:`~klrl.tasks.base.JaxReward`) as ``env['reward_norm'][0] * r +
    env['reward_norm'][1]``; its params gain the identity ``reward_norm`` (float32 ``[2]``). A reward
    that already has a ``reward_norm`` is returned as it is (never standardised twice)."""
    if reward is None or KEY in getattr(reward, "params", {}):
        return reward  # (already standardised: wrapped once)
    if getattr(reward, "kind", None) != "jax":
        raise ConfigError("reward.standardize: needs a reward traced into the step (a JaxReward)")
    fn, from_hidden = reward.fn, getattr(reward, "from_hidden", None)

    def scaled(env: Any, r: jax.Array) -> jax.Array:
        norm = jnp.asarray(env[KEY], jnp.float32)
        return (norm[0] * r + norm[1]).astype(jnp.float32)

    def wrapped(env: Any, ro: Any) -> jax.Array:
        return scaled(env, fn(env, ro))

    def wrapped_hidden(env: Any, ro: Any, hidden: jax.Array) -> jax.Array:
        return scaled(env, from_hidden(env, ro, hidden))

    # the reward read from the reference's forward (JaxReward.from_hidden) is standardised alike, and so
    # is the reward of JaxReward.with_metrics (its metrics kept)
    extra = {} if from_hidden is None else {"from_hidden": wrapped_hidden}
    with_metrics = getattr(reward, "with_metrics", None)
    if with_metrics is not None:
        extra["with_metrics"] = lambda env, ro: (lambda r, m: (scaled(env, r), m))(*with_metrics(env, ro))
    params = {**reward.params, KEY: jnp.asarray(identity())}
    return dataclasses.replace(reward, fn=wrapped, params=params, **extra)


def standardize_task(task: Any) -> Any:
    """``task`` with its reward (and its held-out reward) wrapped by :func:`standardized`."""
    heldout = task.heldout
    if heldout is not None:
        heldout = dataclasses.replace(heldout, reward=standardized(heldout.reward))
    return dataclasses.replace(task, reward=standardized(task.reward), heldout=heldout)


def norm_of(scores: Any) -> np.ndarray:
    """``[gain, bias] = [1 / sigma, -mu / sigma]`` (float32) of ``scores`` (mean and population std,
    computed in float64). A non-finite score or ``sigma = 0`` is a :class:`ConfigError`."""
    s = np.asarray(scores, np.float64).reshape(-1)
    if not np.all(np.isfinite(s)):
        bad = int(np.sum(~np.isfinite(s)))
        raise ConfigError(
            f"reward.standardize: the task reward of {bad} of {s.size} reference samples is NaN or inf"
        )
    mean, std = float(np.mean(s)), float(np.std(s))
    if not std > 0:
        raise ConfigError(
            f"reward.standardize: the task reward of all {s.size} reference samples is {mean:.6g} "
            "(std 0): there is no scale to standardise by"
        )
    return np.array([1.0 / std, -mean / std], np.float32)


def reference_rewards(train: Any, env: Any, n: int, seed: int) -> np.ndarray:
    """The raw task reward ``[n]`` of ``n`` responses of the reference policy (``train``'s context:
    its initial policy parameters, sampling section and stop ids; the reward read with ``env``) to
    prompts drawn uniformly from the pool, in batches of ``train.batch_size``. Batch ``i`` uses
    ``fold_in(fold_in(PRNGKey(seed), SALT), i)`` (prompts, then one key per row)."""
    ctx = train.context
    cfg, task = ctx.cfg, ctx.task
    b = cfg.train.batch_size
    n_pool = int(np.shape(env["prompts"])[0])
    env = {**env, KEY: jnp.asarray(identity())}  # the raw reward

    @jax.jit
    def batch(params: Any, env: Any, key: jax.Array) -> jax.Array:
        k_prompt, k_sample = jax.random.split(key)
        idx = jax.random.randint(k_prompt, (b,), 0, n_pool)
        keys = jax.vmap(jax.random.fold_in, (None, 0))(k_sample, jnp.arange(b))
        ro = generate(ctx.models.policy, params, env["prompts"][idx], env["prompt_mask"][idx], keys,
                      cfg.sampling, ctx.stop_ids, task.pad_id)  # fmt: skip
        return task.reward.fn(env, ro._replace(prompt_idx=idx.astype(jnp.int32)))

    base = jax.random.fold_in(jax.random.PRNGKey(seed), SALT)
    out = [np.asarray(batch(ctx.policy_params, env, jax.random.fold_in(base, i))) for i in range(-(-n // b))]
    return np.concatenate(out)[:n]


def saved_norm(run_dir: str | Path) -> dict[str, Any] | None:
    """The ``reward_norm`` entry of ``run_dir/task.json`` (None if absent)."""
    path = Path(run_dir) / "task.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    entry = info.get(KEY) if isinstance(info, dict) else None
    return entry if isinstance(entry, dict) and {"gain", "bias"} <= set(entry) else None


def reward_norm_env(
    train: Any, env: Any, *, seed: int, resume: Any = None, log: Any = None
) -> tuple[Any, dict[str, Any]]:
    """``(env, info)``: with ``reward.standardize``, ``env`` with ``reward_norm`` set to ``[gain,
    bias]`` (:func:`norm_of` of :func:`reference_rewards`) and ``info = {'reward_norm': {...}}`` for
    ``task.json``; on a resume (``resume``: a :class:`klrl.io.resume.Resume`) the values recorded in
    its ``task.json``, not sampled again. Without it, ``(env, {})``. ``log``: a one-line note of the
    values (``True``: on stderr)."""
    cfg = train.context.cfg
    if not cfg.reward.standardize:
        return env, {}
    entry = saved_norm(resume.dir) if resume is not None else None
    if entry is None and resume is not None and not resume.fresh:
        raise CheckpointError(
            f"{resume.dir}/task.json: no reward_norm (the gain and bias of reward.standardize) to resume with"
        )
    if entry is None:
        n = cfg.reward.standardize_samples
        scores = reference_rewards(train, env, n, seed)
        check = getattr(train.context.task.reward, "check", None)
        if check is not None and not np.all(np.isfinite(scores)):
            check()  # a host reward function failed: its own one-line error
        norm = norm_of(scores)
        s64 = np.asarray(scores, np.float64)
        entry = {"gain": float(norm[0]), "bias": float(norm[1]), "mean": float(np.mean(s64)),
                 "std": float(np.std(s64)), "samples": int(n), "seed": int(seed)}  # fmt: skip
        if log is True:
            log = partial(print, file=sys.stderr, flush=True)
        if log:
            log(
                f"reward.standardize: reward of {n} reference samples: mean {entry['mean']:.4g}, "
                f"std {entry['std']:.4g} -> gain {entry['gain']:.4g}, bias {entry['bias']:.4g}"
            )
    else:
        norm = np.array([entry["gain"], entry["bias"]], np.float32)
        if not all(math.isfinite(float(x)) for x in norm):
            raise CheckpointError(f"{resume.dir}/task.json: reward_norm holds a non-finite gain or bias")
    return {**env, KEY: jnp.asarray(norm)}, {KEY: entry}
