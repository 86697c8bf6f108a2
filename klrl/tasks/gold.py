"""The gold reward: an exact, cheap stand-in for a human judging a response to a prompt.

For a prompt ``x`` and response ``y`` (``|y|`` unmasked tokens, EOS counted) from a :class:`Language`:

    P = #distinct positive words in y,     N = #distinct negative words in y
    f(m) = 1 - exp(-m / k)                                    (diminishing returns, f < 1)
    sentiment(y) = w_s * (f(P) - f(N))
    ll(y | x) = (1/|y|) sum_{t in y} max(log p(y_t | x, y_<t), floor)     (nats per token)
    penalty(y | x) = c * relu(tau - ll(y | x))
    gold(x, y) = sentiment(y) - penalty(y | x)

Without the floor, ``ll = (log p(x + y) - log p(x)) / |y|`` exactly. Repeating a word counts once,
so "good good good ..." earns ``f(1)`` at most and pays the fluency penalty; fluent text with several
distinct positive words earns more. ``tau`` is a low quantile of ``ll`` on the language's own samples
(:func:`typical_ll_threshold`), so typical real continuations are not penalised. A response with no
EOS is scored like any other prefix; an empty response gets :func:`gold_min`, the infimum of gold.
Because the sentiment is fixed per sequence in the language, switching sentiment relative to the
prompt lowers ``ll``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from klrl.tasks.language import Language, sample, token_log_probs


class GoldParams(NamedTuple):
    """Parameters of :func:`gold_reward` (a pytree of floats, safe to pass into ``jit``)."""

    sentiment_weight: float = 1.0  # w_s: the sentiment term lies in (-w_s, w_s)
    sentiment_scale: float = 2.0  # k in f(m) = 1 - exp(-m / k), m = number of distinct words
    fluency_weight: float = 2.0  # c: penalty per nat/token below the threshold
    ll_threshold: float = -3.35  # tau (nats/token); make_gold_params derives it from the language
    min_token_logp: float = -12.0  # floor on each conditional token log-prob (impossible tokens)


DEFAULT_PARAMS = GoldParams()


class GoldTerms(NamedTuple):
    """Components of the gold reward, each ``[n]``."""

    reward: jax.Array
    sentiment: jax.Array
    fluency_penalty: jax.Array
    ll_per_token: jax.Array  # floored mean conditional log-prob per response token (0 if empty)
    num_positive: jax.Array  # distinct positive words
    num_negative: jax.Array  # distinct negative words
    length: jax.Array  # response tokens (unmasked)


def _present(tokens: jax.Array, mask: jax.Array, vocab_size: int) -> jax.Array:
    """``[n, V]`` bool: word ``v`` occurs at an unmasked position of the row."""
    onehot = jax.nn.one_hot(tokens, vocab_size, dtype=jnp.float32) * (mask > 0)[..., None]
    return onehot.max(axis=-2) > 0


def response_log_probs(
    lang: Language,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    resp_tokens: jax.Array,
    resp_mask: jax.Array,
) -> jax.Array:
    """``log p(y_t | x, y_<t)`` per response position ``[n, T_resp]`` (0 where masked)."""
    tokens = jnp.concatenate([jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(resp_tokens, jnp.int32)], 1)
    mask = jnp.concatenate([jnp.asarray(prompt_mask, jnp.float32), jnp.asarray(resp_mask, jnp.float32)], 1)
    return token_log_probs(lang, tokens, mask)[:, prompt_tokens.shape[1] :]


def _ll_per_token(lp: jax.Array, mask: jax.Array, floor: float | jax.Array) -> tuple[jax.Array, jax.Array]:
    on = mask > 0
    n = on.sum(-1)
    total = jnp.where(on, jnp.maximum(lp, floor), 0.0).sum(-1)
    return total / jnp.maximum(n, 1), n


def gold_min(params: GoldParams = DEFAULT_PARAMS) -> jax.Array | float:
    """The infimum of gold: ``-w_s - c * relu(tau - floor)`` (the reward of an empty response)."""
    p = params
    return -p.sentiment_weight - p.fluency_weight * jnp.maximum(p.ll_threshold - p.min_token_logp, 0.0)


@jax.jit
def gold_terms(
    lang: Language,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    resp_tokens: jax.Array,
    resp_mask: jax.Array,
    params: GoldParams = DEFAULT_PARAMS,
) -> GoldTerms:
    """All terms of the gold reward (see the module docstring); batched over rows, jit-able."""
    p = params
    resp_mask = jnp.asarray(resp_mask, jnp.float32)
    present = _present(jnp.asarray(resp_tokens, jnp.int32), resp_mask, lang.vocab_size)
    n_pos = (present & lang.is_positive).sum(-1).astype(jnp.float32)
    n_neg = (present & lang.is_negative).sum(-1).astype(jnp.float32)
    f = lambda m: 1.0 - jnp.exp(-m / p.sentiment_scale)
    sentiment = p.sentiment_weight * (f(n_pos) - f(n_neg))
    lp = response_log_probs(lang, prompt_tokens, prompt_mask, resp_tokens, resp_mask)
    ll, n = _ll_per_token(lp, resp_mask, p.min_token_logp)
    penalty = p.fluency_weight * jax.nn.relu(p.ll_threshold - ll)
    reward = jnp.where(n > 0, sentiment - penalty, gold_min(p))
    return GoldTerms(reward, sentiment, penalty, ll, n_pos, n_neg, n)


def gold_reward(
    lang: Language,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    resp_tokens: jax.Array,
    resp_mask: jax.Array,
    params: GoldParams = DEFAULT_PARAMS,
) -> jax.Array:
    """``gold(x, y) = w_s (f(P) - f(N)) - c relu(tau - ll(y|x))``, ``[n]`` float32."""
    return gold_terms(lang, prompt_tokens, prompt_mask, resp_tokens, resp_mask, params).reward


@jax.jit
def oracle_ppl(
    lang: Language,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    resp_tokens: jax.Array,
    resp_mask: jax.Array,
) -> jax.Array:
    """Per-sequence oracle perplexity ``exp(-(log p(x + y) - log p(x)) / |y|)``, ``[n]``.

    Unfloored: an impossible response gives ``inf``; an empty one gives 1.
    """
    lp = response_log_probs(lang, prompt_tokens, prompt_mask, resp_tokens, resp_mask)
    ll, _ = _ll_per_token(lp, jnp.asarray(resp_mask), -jnp.inf)
    return jnp.exp(-ll)


def typical_ll_threshold(
    lang: Language,
    key: jax.Array,
    n: int = 8192,
    prompt_len: int = 8,
    response_len: int = 16,
    quantile: float = 0.01,
) -> float:
    """``quantile`` of ``ll(y | x)`` over real continuations: sequences of ``prompt_len +
    response_len`` tokens are sampled, split after ``k ~ U[max(2, prompt_len // 2), prompt_len]``
    tokens (as in :func:`~klrl.tasks.language.prompts`); empty continuations are dropped."""
    ks, kk = jax.random.split(key)
    tokens, mask = sample(lang, ks, n, prompt_len + response_len)
    lo = min(max(2, prompt_len // 2), prompt_len)
    k = jax.random.randint(kk, (n, 1), lo, prompt_len + 1)
    pos = jnp.arange(prompt_len + response_len)[None, :]
    resp = (pos >= k) & (pos < k + response_len) & (mask > 0)
    ll, m = _ll_per_token(token_log_probs(lang, tokens, mask), resp, -jnp.inf)
    return float(jnp.quantile(ll[m > 0], quantile))


def make_gold_params(
    lang: Language,
    key: jax.Array | None = None,
    *,
    prompt_len: int = 8,
    response_len: int = 16,
    quantile: float = 0.01,
    **overrides: float,
) -> GoldParams:
    """:class:`GoldParams` with ``ll_threshold`` from :func:`typical_ll_threshold` (key defaults to
    ``PRNGKey(0)``); other fields from ``overrides`` or the defaults."""
    key = jax.random.key(0) if key is None else key
    tau = typical_ll_threshold(lang, key, prompt_len=prompt_len, response_len=response_len, quantile=quantile)
    return GoldParams(**{"ll_threshold": tau, **overrides})
