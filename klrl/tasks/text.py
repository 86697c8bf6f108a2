"""``task.name=text``: RLHF on a pretrained causal LM (``model.path``: an HF directory or a ``.gguf``).

* **Policy and reference**: :func:`klrl.models.from_pretrained` of ``model.path`` (compute dtype
  ``model.dtype``, float32 parameters).
* **Tokenizer**: the checkpoint's (``tokenizer.json`` or the GGUF's); its stop ids (several for
  SmolLM2) end a response.
* **Prompts**: :func:`klrl.data.prompts.load_prompts` of the ``data`` section (default the shipped
  ``klrl:instructions``), left-padded to ``data.prompt_len``; a prompt that already carries the
  chat template is not wrapped again, a long one is cut inside its user content (the template and
  the generation prompt kept). Both are counted: one log line, ``task.json`` and the metrics
  ``data/prompts_templated``, ``data/prompts_truncated``. A ``data`` field set without effect on
  these files is an error (:func:`klrl.data.prompts.check_fields`), raised before the model is read.
* **Reward**: a frozen reward model read at the last real response token (a
  :class:`~klrl.tasks.base.JaxReward`; its parameters travel in ``env['reward_params']``):
  ``model.reward_path`` an HF ``*ForSequenceClassification`` directory (its bias-free ``score``
  head, ``r = score . h_last``, as transformers reads it at the last non-pad token), or a causal LM
  (its trunk with a fresh scalar head); ``model.reward_path=''`` (or ``model.path`` itself) takes the
  policy's trunk with a fresh scalar head. Such a reward model's trunk is then the frozen reference:
  the train step reads the reward from the reference's forward (one trunk forward less per
  iteration; :attr:`klrl.step.context.Context.reward_on_reference`).
* **Host text rewards** (``reward.fn``, ``reward.weights``): instead of a reward model, text
  rewards on the decoded responses (:func:`host_text_reward`).
* **Value model** (:func:`value_models`): ``model.value_model=head`` is a head on the policy
  trunk (:func:`klrl.step.train.build_models`); ``separate`` is a trunk read from ``model.value_path``
  (default ``model.path``) with a fresh value head.

Every bad file is a :class:`klrl.models.hf.CheckpointFormatError` (one line), raised before
anything compiles.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.algo.logprobs import token_logprobs
from klrl.algo.textmetrics import distinct_n, rep_n
from klrl.config import ConfigError, RunConfig
from klrl.data.prompts import PromptPool, check_fields, counts_line, load_prompts
from klrl.models import lora as lora_lib
from klrl.models import peft
from klrl.models.base import forward
from klrl.models.heads import ScalarHead, ValueHead, attach, detach
from klrl.models.hf import CheckpointFormatError, load_hf, read_config
from klrl.models.pretrained import from_pretrained, save_pretrained
from klrl.models.rollout import Rollout, response_slice, sequence
from klrl.rewards import make_host_reward, parse_specs
from klrl.rewards.model import format_note
from klrl.tasks.base import Evaluators, HeldOut, JaxReward, Task, TokenPool, register_task

Array = jax.Array


def compute_dtype(cfg: RunConfig) -> Any:
    return jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32


def check_model_paths(cfg: RunConfig) -> None:
    """Every checkpoint path the config names must exist (:class:`ConfigError` naming the field)."""
    m = cfg.model
    for name in ("path", "value_path", "reward_path", "eval_path"):
        p = getattr(m, name)
        if p and not Path(p).exists():
            raise ConfigError(f"model.{name}: {p}: no such file or directory")
    if cfg.task.name == "text" and not m.path:
        raise ConfigError("model.path: task.name=text needs a pretrained model (an HF directory or a .gguf)")


def is_sequence_classifier(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_dir():
        return False
    archs = read_config(p).get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs)


def _load(path: str, dtype: Any, tokenizer: bool = False):
    return from_pretrained(path, dtype=dtype, tokenizer=tokenizer)


def reward_model(cfg: RunConfig, policy: Any = None, policy_params: Any = None, seed: int = 0):
    """``(trunk, trunk+head params)`` of the frozen reward model ``cfg.model.reward_path`` (see the
    module docstring); a fresh head is drawn from ``seed``."""
    path, dtype = cfg.model.reward_path, compute_dtype(cfg)
    if path and (Path(path) / peft.CONFIG).is_file() and policy is not None:
        # a PEFT reward-model adapter (SEQ_CLS) on the policy's base: the base's buffers, shared, plus its own
        # adapters and score head (klrl.models.peft.load_reward_adapter)
        model, adapters, head = peft.load_reward_adapter(
            path, policy, policy_params, base_name=cfg.model.path
        )
        return model, attach(lora_lib.merge(policy_params, adapters), head)
    if path and is_sequence_classifier(path):
        model, params, score = load_hf(path, dtype=dtype, score=True, put=jnp.asarray)
        score = np.asarray(score, np.float32)
        if score.shape[0] != 1:
            raise CheckpointFormatError(
                f"{path}: a reward model has one label (num_labels=1), this score head has {score.shape[0]}"
            )
        head = {"kernel": jnp.asarray(score.T), "bias": jnp.zeros((1,), jnp.float32)}
        return model, attach(params, head)
    if path and not (policy is not None and cfg.model.path and _same_file(path, cfg.model.path)):
        model, params, _ = _load(path, dtype)
    else:  # the policy's own checkpoint: its buffers, shared (the env is never donated)
        model, params = policy, policy_params
    head = ScalarHead(model.hidden_size).init(jax.random.key(seed))
    return model, attach(params, head)


def _same_file(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def model_reward(model: Any, params: Any) -> JaxReward:
    """A :class:`JaxReward`: the scalar head at the last real response token of prompt + response.
    It names its trunk (``JaxReward.trunk``), so a train step whose frozen reference is that trunk
    reads the reward from the reference's hidden states (``JaxReward.from_hidden``)."""
    head = ScalarHead(model.hidden_size)

    def from_hidden(env: Any, ro: Rollout, hidden: Array) -> Array:
        return head.score(detach(env["reward_params"])[1], hidden, ro.mask)

    def reward_fn(env: Any, ro: Rollout) -> Array:
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        trunk = detach(env["reward_params"])[0]
        return from_hidden(env, ro, forward(model, trunk, tokens, key_mask, logits=False).hidden)

    trunk = (model, detach(params)[0])
    return JaxReward(reward_fn, {"reward_params": params}, from_hidden=from_hidden, trunk=trunk)


def host_text_reward(cfg: RunConfig, tok: Any, texts: list, columns: dict) -> JaxReward:
    """``reward.fn`` (:func:`klrl.rewards.make_host_reward`) as a traced reward: the host functions
    score the decoded responses of the pool rows ``ro.prompt_idx`` (the rollout's sampled prompt
    indices; the dataset's other columns are passed by the same index). A failing function scores NaN
    on every row, so the step's guard rejects the iteration; the run loop then calls the reward's
    ``check`` (its message: :class:`klrl.rewards.RewardFunctionError`) and ends the run."""
    specs, weights = parse_specs(cfg.reward.fn, cfg.reward.weights)
    host = make_host_reward(specs, weights, tok, texts, columns, stop_after_error=True,
                            timeout=cfg.reward.timeout, completions=cfg.reward.completions)  # fmt: skip

    def with_metrics(env: Any, ro: Rollout) -> tuple[Array, dict[str, Array]]:
        if ro.prompt_idx is None:
            raise ValueError("host text reward: the rollout carries no prompt_idx (set by the train step)")
        scores, error, all_none = host.with_all_none(ro.prompt_idx, ro.response, ro.mask)
        return jnp.where(error == 0, scores, jnp.nan).astype(jnp.float32), {"reward/all_none_frac": all_none}

    def reward_fn(env: Any, ro: Rollout) -> Array:
        return with_metrics(env, ro)[0]

    return JaxReward(reward_fn, check=host.check, with_metrics=with_metrics)


def text_evaluators(
    r_len: int, eval_model: Any = None, eval_params: Any = None, prompt_counts: dict[str, int] | None = None
) -> Evaluators:
    """The text task's metrics of each iteration's samples (over the global batch, on token ids):

    * ``text/distinct_1``, ``text/distinct_2``: distinct n-grams / n-grams in the batch (Li et al.
      2016); ``text/rep_4``: the fraction of a response's 4-grams repeating an earlier one, averaged
      over responses (seq-rep-4, Welleck et al. 2019; logged when ``sampling.response_len >= 4``);
      :mod:`klrl.algo.textmetrics`;
    * with an evaluator LM (``model.eval_path``): ``eval/independent_ppl = exp(-sum_b sum_t m_bt
      log p_eval(y_bt | prompt, y_<t) / sum_b sum_t m_bt)`` over the batch, its token-weighted
      perplexity of the samples (the reference's is ``eval/ref_ppl``, logged by every run);
    * ``prompt_counts`` (:func:`prompt_counts`): constants of the run, logged with every iteration's
      metrics: ``data/prompts_templated`` (training prompts that already carried the chat template,
      not wrapped again) and ``data/prompts_truncated`` (training prompts cut to ``data.prompt_len``).
    """

    def per_example(env: Any, ro: Rollout) -> dict[str, Array]:
        if eval_model is None:
            return {}
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        p = ro.prompt.shape[1]
        logits = response_slice(forward(eval_model, env["eval_lm_params"], tokens, key_mask).logits, p, r_len)
        logp = token_logprobs(logits.astype(jnp.float32), ro.response) * ro.mask
        return {"_eval_nll_sum": -jnp.sum(logp, axis=-1), "_eval_len": jnp.sum(ro.mask, axis=-1)}

    def batch(env: Any, ro: Rollout, reward: Array, evals: dict[str, Array]) -> dict[str, Array]:
        out = {
            "text/distinct_1": distinct_n(ro.response, ro.mask, 1),
            "text/distinct_2": distinct_n(ro.response, ro.mask, 2) if r_len >= 2 else jnp.float32(0.0),
        }
        if r_len >= 4:
            out["text/rep_4"] = rep_n(ro.response, ro.mask, 4)
        if "_eval_nll_sum" in evals:
            n = jnp.maximum(jnp.sum(evals["_eval_len"]), 1.0)
            out["eval/independent_ppl"] = jnp.exp(jnp.sum(evals["_eval_nll_sum"]) / n)
        out.update({k: jnp.float32(v) for k, v in (prompt_counts or {}).items()})
        return out

    params = {"eval_lm_params": eval_params} if eval_model is not None else {}
    return Evaluators(per_example=per_example, batch=batch, params=params)


def eval_lm(cfg: RunConfig, policy: Any) -> tuple[Any, Any]:
    """``(model, params)`` of ``model.eval_path`` (or ``(None, None)``); the policy's vocabulary."""
    if not cfg.model.eval_path:
        return None, None
    model, params, _ = _load(cfg.model.eval_path, compute_dtype(cfg))
    if model.vocab_size != policy.vocab_size:
        raise CheckpointFormatError(
            f"model.eval_path: {cfg.model.eval_path}: vocabulary of {model.vocab_size} tokens, the policy's "
            f"has {policy.vocab_size} (the evaluator reads the policy's token ids)"
        )
    return model, params


def value_models(cfg: RunConfig, task: Task) -> dict[str, Any]:
    """``make_train``'s ``value=`` and ``value_params=`` for ``model.value_model=separate`` on a
    pretrained model: the trunk of ``model.value_path`` (default: the policy's) with a fresh value
    head (drawn from ``train.seed``); ``{}`` otherwise."""
    if not cfg.model.path or cfg.model.value_model != "separate":
        return {}
    if cfg.model.value_path and cfg.model.value_path != cfg.model.path:
        model, params, _ = _load(cfg.model.value_path, compute_dtype(cfg))
    else:
        model, params = task.policy, task.policy_params  # init_state copies it into the state
    head = ValueHead(model.hidden_size).init(jax.random.key(cfg.train.seed + 1))
    return {"value": model, "value_params": attach(params, head)}


def prompt_counts(pool: PromptPool) -> dict[str, int]:
    """``data/prompts_templated`` and ``data/prompts_truncated`` of a training pool (see
    :mod:`klrl.data.prompts`): metrics of every iteration, and fields of ``task.json``."""
    return {"data/prompts_templated": pool.n_templated, "data/prompts_truncated": pool.n_truncated}


def _report_counts(cfg: RunConfig, splits: Any) -> dict[str, Any]:
    """The prompt counts of the training (and held-out) pool for ``task.json``, with each pool's
    one-line note where there are any (:func:`klrl.data.prompts.counts_line`) in ``notes``: the run
    logs them once its checks have passed (:func:`klrl.loop.build.make_program`), so that they never come
    before the one line of a user error."""
    info: dict[str, Any] = prompt_counts(splits.train)
    lines = [counts_line(splits.train, cfg.data)]
    if splits.eval is not None:
        info.update({k.replace("data/", "data/heldout_"): v for k, v in prompt_counts(splits.eval).items()})
        lines.append(counts_line(splits.eval, cfg.data, "held-out prompts"))
    notes = [line for line in lines if line is not None]
    return {**info, "notes": notes} if notes else info


def make_text_task(cfg: RunConfig, log: Any = None, *, prompts: TokenPool | None = None) -> Task:
    """The text task of ``cfg`` (module docstring); ``prompts`` replaces the ``data`` section's pool.
    The prompts that already carried the chat template and those cut to ``data.prompt_len`` are
    counted in ``task.info`` (``task.json``; its ``notes``: one line the run logs) and as metrics
    (:func:`prompt_counts`)."""
    check_model_paths(cfg)
    if prompts is None:
        check_fields(cfg.data)  # before the model is read
    t0 = time.time()
    policy, params, tok = _load(cfg.model.path, compute_dtype(cfg), tokenizer=True)
    if log is not None:
        log(f"loaded {cfg.model.path} ({type(policy).__name__}) in {time.time() - t0:.1f} s")
    if tok is None:
        raise CheckpointFormatError(f"{cfg.model.path}: no tokenizer.json (task text needs the tokenizer)")
    info: dict[str, Any] = {"model_path": str(cfg.model.path)}
    held, counts = None, None
    if prompts is None:
        splits = load_prompts(cfg.data, tok)
        prompts = TokenPool(jnp.asarray(splits.train.tokens), jnp.asarray(splits.train.mask, jnp.float32))
        info["prompts"] = splits.train.source
        texts, columns = splits.train.prompts, splits.train.columns
        held, counts = splits.eval, prompt_counts(splits.train)
        info.update(_report_counts(cfg, splits))
    else:
        texts, columns = [tok.decode([int(i) for i in row]) for row in np.asarray(prompts.prompts)], {}
    if cfg.reward.fn:
        reward = host_text_reward(cfg, tok, texts, columns)
        info["reward"] = cfg.reward.fn
    else:
        reward = model_reward(*reward_model(cfg, policy, params, seed=cfg.train.seed + 2))
        info["reward"] = cfg.model.reward_path or "policy trunk, fresh scalar head, frozen"
        if cfg.model.reward_path:  # logged with the prompt notes, once the run's checks have passed
            info["notes"] = [
                *info.get("notes", []),
                format_note(cfg.model.reward_path, cfg.data, cfg.sampling),
            ]
    heldout = None
    if held is not None and len(held):
        pool = TokenPool(jnp.asarray(held.tokens), jnp.asarray(held.mask, jnp.float32))
        h_reward = host_text_reward(cfg, tok, held.prompts, held.columns) if cfg.reward.fn else reward
        heldout = HeldOut(pool, h_reward, list(held.prompts))
        info["heldout_prompts"] = len(held)
    if log is not None:
        log(
            f"text task: {cfg.model.path}, {int(np.shape(prompts.prompts)[0])} prompts, "
            f"reward {info['reward']}"
        )
    return Task(
        name="text",
        tokenizer=tok,
        prompts=prompts,
        prompt_len=prompts.width,
        reward=reward,
        policy=policy,
        policy_params=params,
        info=info,
        evaluators=text_evaluators(cfg.sampling.response_len, *eval_lm(cfg, policy), prompt_counts=counts),
        prompt_texts=list(texts),
        heldout=heldout,
    )


@register_task("text")
def make_text(cfg: RunConfig, log: Any = None) -> Task:
    """``task.name=text``: the pretrained ``model.path`` on the ``data`` section's prompts."""
    return make_text_task(cfg, log)


def save_policy(task: Task, state: Any, out_dir: str | Path, cfg: RunConfig | None = None) -> Path:
    """The final policy (value head dropped) as an HF directory (:func:`klrl.models.save_pretrained`).
    With LoRA adapters (``cfg.lora.rank`` > 0; ``state.params['policy']`` holds them) the adapters are
    folded into the float base (:func:`klrl.models.lora.merged_kernels`, PEFT's ``merge_and_unload``)
    and also written alone in PEFT's format in ``out_dir/adapter`` (:func:`klrl.models.peft.save_adapter`;
    its base recorded by :func:`klrl.models.peft.base_reference`: a ``.gguf`` base is not one peft
    loads, ``klrl export RUN_DIR OUT_DIR`` writes the float base beside the adapter)."""
    trunk = detach(jax.device_get(state.params["policy"]))[0]
    if cfg is None or cfg.lora.rank <= 0:
        return save_pretrained(task.policy, trunk, task.tokenizer, out_dir)
    model = lora_lib.LoRA(task.policy, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    merged = lora_lib.merged_kernels(jax.device_get(task.policy_params), trunk, model.scale)
    out = save_pretrained(task.policy, merged, task.tokenizer, out_dir)
    name, revision = peft.base_reference(cfg.model.path)  # a Hub id, else the absolute path
    peft.save_adapter(Path(out) / "adapter", model, trunk, base_name=name, revision=revision)
    return out
