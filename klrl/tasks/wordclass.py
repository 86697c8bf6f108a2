"""The built-in task of the default run: make positive words frequent.

Language: the synthetic HMM language of :mod:`klrl.tasks.language`.
Reference: a small GPT pretrained on samples of it (cached by config hash).
Reward: the fraction of response tokens that are positive-sentiment words,
a JAX function of the tokens. It is hackable on purpose (repeating one positive
word maximises it); the research testbed adds a gold reward and a learned proxy.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from klrl.config import RunConfig, TaskConfig
from klrl.data.prompts import check_unused
from klrl.data.vocab import WordTokenizer
from klrl.models.gpt import GPT
from klrl.tasks import language as L
from klrl.tasks.base import JaxReward, Task, TokenPool, register_task
from klrl.tasks.pretrain import cached, fingerprint, model_payload, pretrain

Array = jax.Array


def positive_fraction(is_positive: Array, tokens: Array, mask: Array) -> Array:
    """``[B]``: sum_t m_t [y_t positive] / max(sum_t m_t, 1)."""
    hit = is_positive[tokens].astype(jnp.float32) * mask
    return jnp.sum(hit, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)


def reference_policy(
    cfg: RunConfig, lang: L.Language, max_len: int, log: Callable[[str], None] | None = None
):
    """Pretrain (or load from the cache) the reference policy on the language."""
    t = cfg.task
    model = GPT(cfg.model, lang.vocab_size, max_len)
    payload = {
        "kind": "reference",
        "language_seed": t.seed,
        "words": len(lang.words),
        "language": fingerprint(lang),
        **model_payload(cfg.model, lang.vocab_size, max_len),
        **pretraining(t),
    }
    build = lambda: pretrain_on(model, lang, t, max_len, 1000, log)
    return cached("ref", payload, build, t.cache_dir, log)


def pretraining(t: TaskConfig) -> dict:
    """The ``task.pretrain_*`` settings, as a cache payload records them."""
    return {
        "steps": t.pretrain_steps,
        "batch": t.pretrain_batch,
        "lr": t.pretrain_lr,
        "seq_len": t.pretrain_len,
    }


def pretrain_on(model: GPT, lang: L.Language, t: TaskConfig, max_len: int, seed_offset: int, log) -> tuple:
    """``model`` pretrained on sentences of ``lang`` with the ``task.pretrain_*`` settings, from the key
    ``task.seed + seed_offset``: :func:`klrl.tasks.pretrain.pretrain`'s ``(params, info)``."""
    sample = lambda k, n: L.sample(lang, k, n, t.pretrain_len)
    return pretrain(model, sample, key=jax.random.key(t.seed + seed_offset), steps=t.pretrain_steps,
                    batch=t.pretrain_batch, lr=t.pretrain_lr, seq_len=max_len, log=log)  # fmt: skip


def tokenizer(lang: L.Language) -> WordTokenizer:
    """The language's words as a tokenizer: PAD pads, EOS is the one stop id."""
    return WordTokenizer(tuple(lang.words), pad_id=L.PAD, stop_ids=(L.EOS,))


@register_task("wordclass")
def make_task(cfg: RunConfig, log: Callable[[str], None] | None = None) -> Task:
    """The wordclass task of ``cfg``; it generates its prompts (a ``data`` field set is an error)."""
    check_unused(cfg.data, "wordclass")
    t = cfg.task
    lang = L.make_language(t.seed)
    max_len = max(t.pretrain_len, t.prompt_len + cfg.sampling.response_len)
    params, info = reference_policy(cfg, lang, max_len, log)
    prompts, pmask = L.prompts(lang, jax.random.key(t.seed + 2000), t.prompt_pool, t.prompt_len)
    info = dict(info, entropy_rate=L.entropy_rate(lang, jax.random.key(t.seed + 3000), 2048, 128))

    def reward_fn(env, ro):
        return positive_fraction(env["is_positive"], ro.response, ro.mask)

    return Task(
        name="wordclass",
        tokenizer=tokenizer(lang),
        prompts=TokenPool(prompts, pmask),
        prompt_len=t.prompt_len,
        reward=JaxReward(reward_fn, {"is_positive": lang.is_positive}),
        policy=GPT(cfg.model, lang.vocab_size, max_len),
        policy_params=params,
        info=info,
    )
