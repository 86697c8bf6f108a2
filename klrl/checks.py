"""Every check of a run or a sweep that needs no compiled code, in one place and in the order it runs.

1. **The configuration** (:func:`check_config`): the members of a sweep differ only in sweepable
   fields and split over the sweep device groups; a resume and the quality rollback write
   (``write=True``); every ``model.*`` checkpoint path given is one the run reads
   (:func:`check_model_fields`); no field is set without effect
   (:func:`klrl.config.relevance.check_relevance`). Before anything is read or built.
2. **The task and the models against the policy** (:func:`check_task`, :func:`check_parts`): the
   sampling lengths and ``top_k`` against the task's vocabulary and lengths; the task's parts
   (prompt source, tokenizer, reward) against each other and against the policy that trains; the
   user's host reward functions called once each (:func:`check_text_reward`); a policy that can be
   written back when ``model.path`` is set (:func:`check_export`); on the
   chunked logits path, a chunked form for every KL estimator of the logits in use
   (:func:`klrl.step.chunked.check_estimators`). Once the task is built, before anything compiles.
3. **The devices** (:func:`check_devices`, :func:`check_device_count`): the batch, minibatches and
   groups split over the data devices, and the devices asked for are there.

:func:`preflight` is the one entry for every door: :func:`klrl.api.run`, :func:`klrl.api.sweep` (a resume
included) and every ``klrl`` command that trains call it once, before anything is built: the paths the
run opens and writes (:mod:`klrl.io.paths`), the model paths resolved, 1, 2 on the shape of a built-in
task (:func:`klrl.tasks.base.builtin_task_shape`), the reward functions loaded, and a single run's device
count (:func:`preflight_dpo`: the same for :func:`klrl.api.dpo` and ``klrl dpo``). The API then runs
:func:`check_program` (2 and 3; the device split before the parts, whose reward
is traced on one device's share of the batch) on the task it built; nothing below them checks again
(``make_train`` trusts its input). The command line runs :func:`preflight` itself (before it joins a
distributed run, which checks its device count once joined; ``klrl ... --check`` runs it, then
:func:`check_text_task`, the text task's checks of the built task made on its files alone), turns its
error into one line and exit 2, and tells the API (``checked=True``). A failure is a
:class:`ConfigError` naming the field or the part: the same line through either door
(``tests/cli/test_preflight_doors.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.algo.advantages import needs_critic
from klrl.config import ConfigError, RunConfig
from klrl.config.dpo import DPOConfig
from klrl.config.relevance import check_relevance
from klrl.config.sweep import check_members
from klrl.io.paths import check_dpo_paths, check_run_dir_writable, check_special_fields, check_writable_dir
from klrl.loop.user import from_config as user_hooks
from klrl.models.base import CausalLM
from klrl.models.catalog import MODEL_FIELDS, resolve_model_path, resolve_model_paths
from klrl.models.gpt import GPT
from klrl.models.hf import CheckpointFormatError
from klrl.models.pretrained import pretrained_header
from klrl.models.rollout import Rollout
from klrl.rewards import RewardLoadError
from klrl.rewards.host import HostReward as TextReward
from klrl.rewards.host import RewardFunctionError, load_reward_fn, parse_specs
from klrl.step.chunked import check_estimators
from klrl.step.context import build_models
from klrl.step.parallel import mesh_from_config
from klrl.step.train import check_adapters
from klrl.tasks.base import OWN_MODEL_TASKS, JaxReward, Task, builtin_task_shape
from klrl.tasks.pretrain import cache_root
from klrl.tasks.text import check_fields, check_model_paths, host_text_reward, load_prompts

__all__ = [
    "check_config", "check_device_count", "check_devices", "check_parts", "check_program", "check_reward",
    "check_export", "check_lora_widths", "check_model_fields", "check_reward_fns", "check_run_paths",
    "check_task", "check_text_reward", "check_text_task",
    "preflight", "preflight_dpo", "text_reward",
]  # fmt: skip
MODES = ("run", "sweep")  # preflight's modes: one run, or a sweep's stacked members
BUILTIN_TASKS = (*OWN_MODEL_TASKS, "text")  # the tasks whose shape is known unbuilt (builtin_task_shape)


def _check(cond: bool, name: str, rule: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {rule}")


# ---- 1. the configuration --------------------------------------------------------------------------
def check_config(
    members: list[RunConfig],
    *,
    stacked: bool,
    write: bool = True,
    resume: Any = None,
    sweep_devices: int = 1,
    task_given: bool = False,
) -> None:
    """The rules of a run (one member, ``stacked=False``) or a sweep (``stacked``) that need neither
    the task nor the devices: the members (:func:`klrl.config.sweep.check_members`) and their split
    over ``sweep_devices`` groups; a resume (``resume``: its directory) and the quality rollback
    (``train.rollback_metric``, ``train.rollback_guards``) need ``write``. ``task_given``: the caller
    brings its own task (the rules on ``task.name`` of :func:`~klrl.config.relevance.check_relevance`
    do not apply to it)."""
    check_members(members)
    n = len(members)
    if n % sweep_devices:
        raise ConfigError(f"sweep: {n} members do not split over {sweep_devices} sweep device groups")
    if resume is not None and not write:
        where = "sweep writes to its sweep directory" if stacked else "run writes to its run directory"
        raise ConfigError(f"resume: a resumed {where} (write=True)")
    tc = members[0].train
    if tc.guards() and not write:
        where = "train.rollback_metric" if tc.rollback_metric else "train.rollback_guards"
        raise ConfigError(f"{where}: the quality rollback needs checkpoints (write=True)")
    for m in members:
        check_model_fields(m, stacked=stacked)  # (the only place they are checked)
    if resume is None:  # a resume's config is the run's own (config.json); the CLI checks the flags given
        check_relevance(members, task_given=task_given)
    check_lora_widths(members[0])
    if members[0].log.wandb and not _installed("wandb"):  # before anything compiles
        raise ConfigError("log.wandb: the wandb package is not installed (pip install 'klrl[wandb]')")


def preflight(
    members: list[RunConfig],
    mode: str,
    *,
    write: bool = True,
    resume: Any = None,
    run_dir: Any = None,
    sweep_devices: int = 1,
    task_given: bool = False,
    devices: bool = True,
    log: Any = None,
) -> list[RunConfig]:
    """Every check of ``members`` (``mode``: ``"run"``, one member, or ``"sweep"``) that needs neither a
    built task nor a compiled step, once, for every door (:func:`klrl.api.run`, :func:`klrl.api.sweep`,
    a resume, and each ``klrl`` command that trains, which turns the error into one line and exit 2):

    1. no ``model.*``/``data.*``/``reward.fn``/... path is a named pipe, socket or device
       (:func:`klrl.io.paths.check_special_fields`); with ``write``, the directories the run writes can
       be written (:func:`check_run_paths`: ``train.out_dir`` or ``run_dir``, the resumed directory
       ``resume``, the task cache);
    2. a Hub name in a ``model.*`` path resolved to its snapshot in the local Hugging Face cache,
       fetched there when it is not (:func:`klrl.models.catalog.resolve_model_paths`; ``log(line)`` once
       per name resolved);
    3. :func:`check_config` (the members, the ``model.*`` fields of each, relevance, LoRA widths,
       W&B), the user's ``train.hooks`` and ``train.metric_fns`` (each imported:
       :func:`klrl.loop.user.from_config`);
    4. unless the caller brings its own task (``task_given``): the checkpoint paths that must exist
       (:func:`klrl.tasks.text.check_model_paths`), a built-in task's vocabulary and lengths
       (:func:`check_task` on :func:`klrl.tasks.base.builtin_task_shape`) and every ``reward.fn``
       entry loads (:func:`check_reward_fns`);
    5. a single run's ``train.devices`` against the devices there are (:func:`check_device_count`;
       ``devices=False``: not yet, the command line's ``--distributed`` checks it once it has joined).

    Returns the members resolved. A failure is a :class:`ConfigError` naming the field."""
    if mode not in MODES:
        raise ValueError(f"preflight: mode must be one of {', '.join(MODES)}, got {mode!r}")
    stacked = mode == "sweep"
    check_special_fields(members)  # before anything opens a path
    if write:
        check_run_paths(members[0], resume=resume, run_dir=run_dir)
    resolved = [resolve_model_paths(m, log) for m in members]
    lines = [
        f"model.{f}: {getattr(old.model, f)} is {getattr(m.model, f)} (the local Hugging Face cache)"
        for old, m in zip(members, resolved, strict=True)
        for f in MODEL_FIELDS
        if getattr(old.model, f) != getattr(m.model, f)
    ]
    for line in dict.fromkeys(lines) if log is not None else ():  # once each, whatever the members
        log(line)
    check_config(resolved, stacked=stacked, write=write, resume=resume, sweep_devices=sweep_devices,
                 task_given=task_given)  # fmt: skip
    for m in resolved:
        user_hooks(m)  # train.hooks and train.metric_fns: each module:function imports and is a function
    if not task_given:
        for m in resolved:
            check_model_paths(m)  # a missing checkpoint before anything is built
        for m in resolved:
            if m.task.name in BUILTIN_TASKS:  # (a task registered elsewhere: checked once it is built)
                check_task(m, builtin_task_shape(m))
        check_reward_fns(resolved[0])
    if devices and not stacked:
        check_device_count(resolved[0])
    return resolved


def preflight_dpo(
    pairs: Any,
    *,
    cfg: DPOConfig,
    betas: list[float],
    seeds: list[int],
    model_path: Any = None,
    model_given: bool = False,
    run_dir: Any = None,
    resume: bool = False,
) -> Any:
    """:func:`preflight` for a DPO run (:func:`klrl.api.dpo` and ``klrl dpo`` alike, before any model or
    pairs are read): the paths (:func:`klrl.io.paths.check_dpo_paths`: ``pairs`` no named pipe,
    ``run_dir`` new and writable or, with ``resume``, a DPO run directory that can be written), each of
    ``betas`` a valid ``dpo.beta``, ``betas`` and ``seeds`` not empty, and unless the caller brings the
    model (``model_given``) ``model_path`` given and, resolved (a ``klrl models`` or Hub name), there.
    Returns ``model_path`` resolved. A failure is a :class:`ConfigError` naming the field."""
    check_dpo_paths(pairs, run_dir, resume)
    for b in betas:
        DPOConfig(**{**dataclasses.asdict(cfg), "beta": b})  # each beta checked as dpo.beta
    if not betas or not seeds:
        raise ConfigError("dpo: betas and seeds must not be empty")
    if model_given:
        return model_path
    if model_path is None:
        raise ConfigError("model.path: required (or model=(family, params, tokenizer))")
    model_path = resolve_model_path(str(model_path))
    if not Path(model_path).exists():
        raise ConfigError(f"model.path: {model_path}: no such file or directory")
    return model_path


def check_run_paths(cfg: RunConfig, *, resume: Any = None, run_dir: Any = None) -> None:
    """The directories a run writes, tried (:func:`klrl.io.paths.check_writable_dir`): a new run's
    ``run_dir`` (the API's argument) or ``train.out_dir`` (and ``train.name`` in it), a resumed
    directory ``resume`` and its files (:func:`klrl.io.paths.check_run_dir_writable`), and the task's
    cache (named by the field or the environment variable it came from)."""
    if resume is not None:
        if Path(resume).is_dir():  # (a directory that is not there: the resume says so, reading it)
            check_run_dir_writable(resume, "resume")
    elif run_dir is not None:
        check_writable_dir(run_dir, "run_dir")
    else:
        check_writable_dir(cfg.train.out_dir, "train.out_dir")
        if cfg.train.name:  # the run directory itself (a name too long, a loop or a file there)
            check_writable_dir(Path(cfg.train.out_dir) / cfg.train.name, "train.name")
    if cfg.task.cache_dir:
        what = "task.cache_dir"
    elif os.environ.get("KLRL_CACHE"):
        what = "the task cache ($KLRL_CACHE)"
    else:
        what = "the task cache (~/.cache/klrl; $KLRL_CACHE or --task.cache_dir sets another)"
    check_writable_dir(cache_root(cfg.task.cache_dir), what)


def check_reward_fns(cfg: RunConfig) -> None:
    """Every ``reward.fn`` entry loads (a built-in name, ``module:function`` or ``file.py:function``)."""
    if not cfg.reward.fn.strip():
        return
    try:
        for spec in parse_specs(cfg.reward.fn, cfg.reward.weights)[0]:
            load_reward_fn(spec)
    except RewardLoadError as e:
        raise ConfigError(f"reward.fn: {e}") from None


def check_text_task(cfg: RunConfig) -> None:
    """``klrl ... --check`` on the text task: the checks the run makes once it has read ``model.path``,
    without reading a weight (:func:`klrl.models.pretrained.pretrained_header`: the config or GGUF
    metadata and the tokenizer): the prompt file tokenized as the run does
    (:func:`klrl.data.prompts.load_prompts`), each host reward function called once on it
    (:func:`check_text_reward`, held-out pool included) and the LoRA targets and ranks against the
    model's layers (:func:`klrl.step.train.check_adapters` on the shapes). Raises what the run raises
    (:class:`ConfigError`, :class:`klrl.data.prompts.PromptDataError`, a checkpoint format error).
    Not part of :func:`preflight`: the run makes these checks itself once the task is built."""
    if cfg.task.name != "text" or not cfg.model.path:
        return
    check_fields(cfg.data)
    policy, tok = pretrained_header(cfg.model.path)
    if tok is None:
        raise CheckpointFormatError(f"{cfg.model.path}: no tokenizer.json (task text needs the tokenizer)")
    splits = load_prompts(cfg.data, tok)
    if cfg.reward.fn:
        for pool, where in ((splits.train, ""), (splits.eval, " (held-out)")):
            if pool is not None and len(pool):
                reward = host_text_reward(cfg, tok, pool.prompts, pool.columns)
                check_text_reward(reward, np.asarray(pool.tokens), np.asarray(pool.mask), where)
    if (cfg.lora.rank or cfg.model.value_model == "lora") and not cfg.model.adapter:
        base = jax.eval_shape(policy.init, jax.random.PRNGKey(0))
        check_adapters(build_models(cfg, policy), base, cfg.lora.critic_rank)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # (a module set to None in sys.modules, e.g. blocked)
        return False


def check_lora_widths(cfg: RunConfig) -> None:
    """``lora.rank`` (and ``lora.critic_rank``) at most the width ``min(in, out)`` of every layer it
    adapts, on a built-in task's own GPT: from the shapes alone (``jax.eval_shape``), before the task or
    any adapter is built (a pretrained ``model.path``'s layers are checked once it is read, before its
    adapters are built: :func:`klrl.step.train.check_adapters`)."""
    if cfg.task.name not in OWN_MODEL_TASKS or (cfg.lora.rank == 0 and cfg.model.value_model != "lora"):
        return
    shape = builtin_task_shape(cfg)
    policy = GPT(cfg.model, shape.vocab_size, shape.max_len)
    base = jax.eval_shape(policy.init, jax.random.PRNGKey(0))
    check_adapters(build_models(cfg, policy), base, cfg.lora.critic_rank)


def check_model_fields(cfg: RunConfig, *, stacked: bool = False) -> None:
    """The ``model.*`` checkpoint paths are read by the run they are given to: a built-in task that
    trains klrl's own GPT (:data:`klrl.tasks.base.OWN_MODEL_TASKS`) reads none of them;
    ``model.reward_path`` is not read when ``reward.fn`` scores the responses; ``model.value_path``
    only by ``model.value_model=separate`` in a single run (a sweep's members draw a fresh value model
    each). The task built for a ``model.path`` must also be able to write its policy back
    (:func:`check_export`, once it is built)."""
    m, name = cfg.model, cfg.task.name
    given = [f for f in ("path", "value_path", "reward_path", "eval_path") if getattr(m, f)]
    if given and name in OWN_MODEL_TASKS:
        raise ConfigError(
            f"model.{given[0]}: task {name} does not read it (it trains klrl's own GPT, sized by "
            f"model.n_layers/d_model/n_heads); a pretrained model trains with task.name=text"
        )
    if m.reward_path and cfg.reward.fn:
        raise ConfigError(
            f"model.reward_path: not read when reward.fn is given (the functions {cfg.reward.fn} score the "
            "responses); give one of them"
        )
    if m.value_path and m.value_model != "separate":
        raise ConfigError(
            f"model.value_path: read only with model.value_model=separate (got {m.value_model})"
        )
    if m.value_path and not needs_critic(cfg.ppo.advantage):
        raise ConfigError(f"model.value_path: ppo.advantage={cfg.ppo.advantage} trains no value model")
    if m.value_path and stacked:
        raise ConfigError(
            "model.value_path: a sweep's members draw a fresh value model each; the value trunk of "
            "model.value_path is read by single runs only"
        )


# ---- 2. the task and the models against the policy ---------------------------------------------------
def check_task(cfg: RunConfig, task: Any) -> None:
    """Rules that need the task's vocabulary and lengths (``task``: a :class:`~klrl.tasks.base.Task`,
    or the :class:`~klrl.config.TaskShape` of :func:`klrl.tasks.base.builtin_task_shape` before it is
    built)."""
    s, v = cfg.sampling, int(task.vocab_size)
    _check(
        s.top_k <= v, "sampling.top_k", f"must be <= the task's vocabulary size {v} (0 = off), got {s.top_k}"
    )
    total = int(task.prompt_len) + s.response_len
    _check(
        total <= int(task.max_len),
        "sampling.response_len",
        f"prompt ({task.prompt_len}) + response ({s.response_len}) tokens exceed the task's "
        f"max_len {task.max_len}",
    )


def _check_prompts(task: Task) -> None:
    env = task.env
    pr, pm = env.get("prompts"), env.get("prompt_mask")
    if pr is None or pm is None:
        raise ConfigError(f"task {task.name} prompts: the prompt source gives no prompts/prompt_mask arrays")
    if np.ndim(pr) != 2 or np.shape(pm) != np.shape(pr):
        raise ConfigError(
            f"task {task.name} prompts: expected prompts [N, P] and prompt_mask of the same shape, "
            f"got {np.shape(pr)} and {np.shape(pm)}"
        )
    if task.prompts.width != task.prompt_len or np.shape(pr)[1] != task.prompt_len:
        raise ConfigError(
            f"task {task.name} prompts: the prompt source is {np.shape(pr)[1]} tokens wide, the task's "
            f"prompt_len is {task.prompt_len} (task.prompt_len); they must be equal"
        )
    if not jnp.issubdtype(jnp.asarray(pr).dtype, jnp.integer):
        raise ConfigError(
            f"task {task.name} prompts: token ids must be integers, got {jnp.asarray(pr).dtype}"
        )


def check_parts(task: Task, policy: CausalLM, response_len: int, batch: int) -> None:
    """The task's parts against each other and against ``policy`` (the model that trains): the
    prompt source's arrays, the tokenizer's ids in the policy's vocabulary, the policy's positions,
    the reward (in the graph, ``[batch]`` float32 for ``batch`` rows: :func:`check_reward`)."""
    _check_prompts(task)
    tok = task.tokenizer
    if tok.vocab_size > policy.vocab_size:
        raise ConfigError(
            f"task {task.name} tokenizer: {tok.vocab_size} token ids, the policy's vocabulary has only "
            f"{policy.vocab_size} (policy.vocab_size)"
        )
    ids = (tok.pad_id, *tok.stop_ids)
    if not tok.stop_ids or any(not 0 <= int(i) < policy.vocab_size for i in ids):
        raise ConfigError(
            f"task {task.name} tokenizer: pad id {tok.pad_id} and stop ids {tuple(tok.stop_ids)} must be "
            f"ids of the policy's vocabulary [0, {policy.vocab_size})"
        )
    if policy.max_len < task.prompt_len + response_len:
        raise ConfigError(
            f"policy: {policy.max_len} positions (max_len) < prompt_len {task.prompt_len} + "
            f"sampling.response_len {response_len}"
        )
    check_reward(task, batch, response_len)


def check_reward(task: Task, batch: int, response_len: int) -> None:
    """Trace the reward on an abstract rollout of ``batch`` rows: it must give ``[batch]`` float32.
    Then the user's host text reward functions behind it (and behind the held-out reward), if any:
    :func:`check_text_reward`."""
    b, p, r = batch, task.prompt_len, response_len
    i32 = jax.ShapeDtypeStruct((b, p), jnp.int32)
    f32 = jax.ShapeDtypeStruct((b, p), jnp.float32)
    rr = jax.ShapeDtypeStruct((b, r), jnp.float32)
    idx = jax.ShapeDtypeStruct((b,), jnp.int32)
    ro = Rollout(i32, f32, jax.ShapeDtypeStruct((b, r), jnp.int32), rr, rr, None, None, idx)
    env = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), task.env)
    out = jax.eval_shape(task.reward.fn, env, ro)
    if not hasattr(out, "shape") or tuple(out.shape) != (b,) or out.dtype != jnp.float32:
        got = f"{tuple(out.shape)} {out.dtype}" if hasattr(out, "shape") else type(out).__name__
        raise ConfigError(f"task {task.name} reward: must return [B] = ({b},) float32 per batch, got {got}")
    env = task.env
    check_text_reward(task.reward, env["prompts"], env["prompt_mask"])
    if task.heldout is not None:
        check_text_reward(
            task.heldout.reward, env["heldout_prompts"], env["heldout_prompt_mask"], " (held-out)"
        )


PROBE_ROWS = 4  # prompts of the pool the reward functions are called on before compiling


def text_reward(reward: Any) -> TextReward | None:
    """The host text reward (:class:`klrl.rewards.host.HostReward`) behind a task's reward: the
    object whose ``check`` the reward carries (:func:`klrl.tasks.text.host_text_reward`), or None."""
    host = getattr(getattr(reward, "check", None), "__self__", None)
    return host if isinstance(host, TextReward) else None


def check_text_reward(reward: Any, prompts: Any, mask: Any, where: str = "") -> None:
    """One call of each host reward function behind ``reward`` (none: nothing to do), as training
    will call it, before anything compiles: on the first :data:`PROBE_ROWS` prompts of its pool
    (``prompts``, ``mask``), each prompt's own decoded text standing in for its completion
    (:meth:`klrl.rewards.host.HostReward.probe`). Its signature was checked when it was loaded
    (:func:`klrl.rewards.host.check_signature`). A failure (it raises or exits, returns the wrong
    number of values, a non-number, a value not finite in float32) is a :class:`ConfigError` naming
    the function."""
    host = text_reward(reward)
    if host is None:
        return
    rows = min(PROBE_ROWS, int(np.shape(prompts)[0]))
    p, m = np.asarray(prompts[:rows]), np.asarray(mask[:rows])
    texts = [host.decode(p[i], m[i])[0] for i in range(rows)]
    try:
        host.probe(list(range(rows)), texts)
    except RewardFunctionError as e:
        raise ConfigError(f"{e}{where}") from None


def check_export(task: Task, policy: CausalLM) -> None:
    """A run on ``model.path`` ends by writing the trained policy as an HF directory
    (:func:`klrl.tasks.text.save_policy`): the policy that trains must be a pretrained family klrl
    writes back (``params_to_hf``, ``hf_config``), with a tokenizer that saves itself. A task whose
    policy is not (e.g. klrl's own GPT) does not train ``model.path``: refused before anything
    compiles, not after the last iteration."""
    lacks = [a for a in ("params_to_hf", "hf_config") if not callable(getattr(policy, a, None))]
    if not callable(getattr(task.tokenizer, "save", None)):
        lacks.append("a tokenizer with save()")
    if lacks:
        raise ConfigError(
            f"model.path: task {task.name} trains a {type(policy).__name__} policy, not the model of "
            f"model.path, and it cannot be written back as an HF directory (no {lacks[0]}); drop "
            "model.path, or train the pretrained model with task.name=text"
        )


# ---- 3. the devices --------------------------------------------------------------------------------
def check_devices(cfg: RunConfig, n_devices: int) -> None:
    """The batch, each minibatch and the groups split evenly over ``n_devices`` data devices."""
    b = cfg.train.batch_size
    _check(
        b % n_devices == 0,
        "train.batch_size",
        f"must be divisible by the device count ({b} % {n_devices} != 0)",
    )
    _check(
        (b // cfg.ppo.minibatches) % n_devices == 0,
        "ppo.minibatches",
        f"each minibatch ({b // cfg.ppo.minibatches}) must split evenly over {n_devices} devices",
    )
    _check(
        (b // n_devices) % cfg.ppo.group_size == 0,
        "ppo.group_size",
        f"each device's share ({b // n_devices}) must hold whole groups of {cfg.ppo.group_size}",
    )


def check_device_count(cfg: RunConfig) -> None:
    """``train.devices`` against the devices there are (after ``--distributed``: all processes'),
    then :func:`check_devices` on the data axis the run's mesh will have."""
    n = jax.device_count()
    if cfg.train.devices > n:
        raise ConfigError(f"train.devices: asked for {cfg.train.devices} devices, {n} available")
    if cfg.train.mesh:  # the data axis of train.mesh (its sizes against the devices there are)
        check_devices(cfg, mesh_from_config(cfg.train).shape["data"])
    else:
        check_devices(cfg, cfg.train.devices or n)


# ---- the program: 2 and 3 on the built task ----------------------------------------------------------
def check_program(
    members: list[RunConfig],
    task: Task,
    n_data: int,
    *,
    policy: CausalLM | None = None,
    reward: JaxReward | None = None,
) -> None:
    """The task and the models against the policy, and the devices, for ``members`` on ``task`` with
    ``n_data`` data devices per member; ``policy`` and ``reward`` are what ``make_train`` gets instead
    of the task's (None: the task's). The devices come before the parts: the reward is traced on one
    device's share of the batch, which must then be a whole one."""
    for m in members:
        check_task(m, task)  # lengths, top_k and vocabulary against the task
    base = members[0]
    check_devices(base, n_data)
    parts = task if reward is None else dataclasses.replace(task, reward=reward)
    policy = task.policy if policy is None else policy
    if any(m.model.path for m in members):
        check_export(task, policy)
    check_parts(parts, policy, base.sampling.response_len, base.train.batch_size // n_data)
    check_estimators(base, policy.vocab_size)  # a KL estimator of the logits needs a chunked form there
