"""A synthetic language with an exact likelihood: a hidden Markov model over words.

The hidden state is a pair ``z = (s, r)``: a latent *sentiment* ``s`` in {positive, negative,
neutral}, drawn once per sequence from a prior and never changed (the transition matrix is
block-diagonal in ``s``), and a *syntactic role* ``r`` (DET, ADJ, NOUN, VERB, ADV, COP, ...).
Roles give plausible clause structure (``DET ADJ* NOUN VERB ADV? ... PUNCT``); the sentiment biases
which adjectives, adverbs, nouns, verbs and '!' are emitted. The role END emits EOS and moves to the
absorbing role DONE, which emits PAD, so a sampled sequence is ``w_1 .. w_k EOS PAD PAD ...``.

With ``pi = exp(init)``, ``A = exp(trans)``, ``B = exp(emit)`` the probability of a token prefix is

    p(x_1..x_T) = sum_{z_1..z_T} pi(z_1) B(z_1, x_1) prod_{t>1} A(z_{t-1}, z_t) B(z_t, x_t),

computed exactly by the forward algorithm. ``p`` is a *prefix* probability: the probability that
the language's sequence starts with the tokens given; if they include EOS, it includes ending there.

Probabilities come from a hand-designed skeleton whose non-zero entries are multiplied by
independent ``Gamma(g, 1/g)`` factors (mean 1) and renormalised, so different seeds give different
but similar languages. The words never depend on the seed. Only construction uses NumPy; sampling
and scoring are batched JAX, usable inside ``jit`` / ``vmap`` / ``shard_map``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PAD = 0
EOS = 1
SENTIMENTS = ("positive", "negative", "neutral")
POS, NEG, NEU = 0, 1, 2

# Word classes in vocabulary order (after PAD and EOS). Sentiment-bearing classes end in _pos/_neg/_neu.
_LEXICON: dict[str, tuple[str, ...]] = {
    "stop": (".", "!"),
    "comma": (",",),
    "det": ("the", "a", "this", "that", "every", "my"),
    "pron": ("it", "she", "he", "someone", "everyone"),
    "prep": ("of", "in", "with", "on", "near", "for"),
    "conj": ("and", "but", "so"),
    "cop": ("is", "was", "seems", "looks", "feels"),
    "int": ("very", "really", "quite", "truly", "rather"),
    "noun_pos": ("gift", "party", "smile", "sunshine", "victory", "hug"),
    "noun_neg": ("storm", "mess", "failure", "disaster", "insult", "accident"),
    "noun_neu": ("dog", "cat", "house", "garden", "road", "river", "city", "teacher", "child")
    + ("book", "table", "window", "tree", "door", "train", "car", "friend", "market"),
    "verb_pos": ("loves", "enjoys", "helps", "celebrates", "admires"),
    "verb_neg": ("hates", "breaks", "ruins", "fears", "destroys"),
    "verb_neu": ("walks", "sees", "opens", "carries", "finds", "reads", "moves", "holds", "waits")
    + ("turns", "writes", "visits", "watches", "follows"),
    "adj_pos": ("good", "great", "happy", "wonderful", "lovely", "kind", "bright", "beautiful")
    + ("excellent", "cheerful", "brilliant", "delightful", "pleasant", "charming"),
    "adj_neg": ("bad", "terrible", "sad", "awful", "ugly", "cruel", "angry", "horrible", "nasty")
    + ("gloomy", "miserable", "boring", "rude", "dreadful"),
    "adj_neu": ("old", "small", "large", "red", "blue", "green", "quiet", "tall", "wooden", "new"),
    "adv_pos": ("gladly", "happily", "warmly", "brilliantly", "gently", "kindly"),
    "adv_neg": ("sadly", "badly", "angrily", "poorly", "rudely", "terribly"),
    "adv_neu": ("slowly", "quickly", "today", "again", "often", "later", "there", "now"),
}

ROLES = ("DET", "ADJ", "NOUN", "PRON", "VERB", "ADV", "COP", "INT", "PADJ")
ROLES += ("ODET", "OADJ", "ONOUN", "PREP", "CONJ", "COMMA", "STOP", "END", "DONE")

_INIT = {"DET": 0.7, "PRON": 0.3}
_TRANS: dict[str, dict[str, float]] = {
    "DET": {"ADJ": 0.4, "NOUN": 0.6},
    "ADJ": {"ADJ": 0.15, "NOUN": 0.85},
    "NOUN": {"VERB": 0.6, "COP": 0.4},
    "PRON": {"VERB": 0.6, "COP": 0.4},
    "VERB": {"ADV": 0.3, "ODET": 0.35, "PREP": 0.15, "COMMA": 0.05, "STOP": 0.15},
    "ADV": {"STOP": 0.5, "COMMA": 0.25, "PREP": 0.25},
    "COP": {"INT": 0.3, "PADJ": 0.6, "ODET": 0.1},
    "INT": {"PADJ": 1.0},
    "PADJ": {"STOP": 0.55, "COMMA": 0.25, "CONJ": 0.2},
    "ODET": {"OADJ": 0.4, "ONOUN": 0.6},
    "OADJ": {"OADJ": 0.1, "ONOUN": 0.9},
    "ONOUN": {"STOP": 0.4, "COMMA": 0.2, "PREP": 0.15, "CONJ": 0.15, "ADV": 0.1},
    "PREP": {"ODET": 1.0},
    "CONJ": {"DET": 0.6, "PRON": 0.4},
    "COMMA": {"CONJ": 0.6, "DET": 0.25, "PRON": 0.15},
    "STOP": {"END": 0.5, "DET": 0.32, "PRON": 0.18},
    "END": {"DONE": 1.0},
    "DONE": {"DONE": 1.0},
}
# Role -> emitted word class; a class ending in "*" is mixed over sentiments by the table below.
_ROLE_CLASS = {"DET": "det", "ODET": "det", "PRON": "pron", "PREP": "prep", "CONJ": "conj", "COP": "cop"}
_ROLE_CLASS |= {"INT": "int", "COMMA": "comma", "ADV": "adv*", "VERB": "verb*", "NOUN": "noun*"}
_ROLE_CLASS |= {"ONOUN": "noun*", "ADJ": "adj*", "OADJ": "adj*", "PADJ": "adj*"}
# Class weights (same-sentiment, neutral, opposite) in a positive/negative sequence; a neutral
# sequence uses (neutral_mix, rest split evenly between positive and negative).
_MIX = {"adj": (0.7, 0.26, 0.04), "adv": (0.7, 0.26, 0.04)}
_MIX |= {"noun": (0.2, 0.77, 0.03), "verb": (0.2, 0.77, 0.03)}
_NEUTRAL_MIX = {"adj": 0.8, "adv": 0.8, "noun": 0.9, "verb": 0.9}
_BANG = (0.25, 0.2, 0.05)  # p('!' | STOP) per sentiment
_PRIOR = (0.3, 0.3, 0.4)  # sentiment prior (positive, negative, neutral)


@jax.tree_util.register_static
@dataclass(frozen=True)
class Vocab:
    """Static (hashable, leaf-free) metadata: the word strings and role names (seed-independent, so
    languages of different seeds share a tree structure and can be stacked for ``vmap``)."""

    words: tuple[str, ...]
    roles: tuple[str, ...]


class Language(NamedTuple):
    """The HMM as a pytree of arrays (``S`` hidden states, ``V`` words); ``vocab`` is static.

    ``init [S]``, ``trans [S, S]`` (row = from), ``emit [S, V]`` are natural-log probabilities
    (``-inf`` for impossible). Boolean masks over the vocabulary give word classes.
    """

    init: jax.Array
    trans: jax.Array
    emit: jax.Array
    state_sentiment: jax.Array  # [S] int32, index into SENTIMENTS
    state_role: jax.Array  # [S] int32, index into vocab.roles
    is_positive: jax.Array  # [V] bool: positive noun/verb/adjective/adverb
    is_negative: jax.Array  # [V] bool
    is_neutral_sentiment: jax.Array  # [V] bool: content word that is neither positive nor negative
    is_noun: jax.Array
    is_verb: jax.Array
    is_adjective: jax.Array
    is_adverb: jax.Array
    is_function: jax.Array  # det, pron, prep, conj, copula, intensifier
    is_punct: jax.Array
    is_special: jax.Array  # PAD and EOS
    vocab: Vocab

    @property
    def words(self) -> tuple[str, ...]:
        return self.vocab.words

    @property
    def vocab_size(self) -> int:
        return self.emit.shape[-1]

    @property
    def num_states(self) -> int:
        return self.init.shape[-1]

    def decode(self, tokens: jax.Array | np.ndarray, mask: jax.Array | np.ndarray | None = None) -> str:
        return decode(self, tokens, mask)


def _log(p: np.ndarray) -> jax.Array:
    with np.errstate(divide="ignore"):
        return jnp.asarray(np.log(p), dtype=jnp.float32)


def _perturb(rng: np.random.Generator, p: np.ndarray, g: float) -> np.ndarray:
    """``p_i * Gamma(g, 1/g)`` on the support of ``p``, renormalised (``g = inf``: no change)."""
    if not np.isfinite(g):
        return p / p.sum()
    q = p * rng.gamma(g, 1.0 / g, size=p.shape)
    return q / q.sum()


def _assemble(words, classes, roles, init, trans, emit, sent) -> Language:
    """Turn NumPy probabilities and ``classes`` (name -> bool[V]) into a :class:`Language`."""
    v = len(words)
    c = {k: jnp.asarray(classes.get(k, np.zeros(v, bool))) for k in ("pos", "neg", "function", "punct")}
    c |= {k: jnp.asarray(classes.get(k, np.zeros(v, bool))) for k in ("noun", "verb", "adj", "adv")}
    content = c["noun"] | c["verb"] | c["adj"] | c["adv"]
    return Language(
        init=_log(init),
        trans=_log(trans),
        emit=_log(emit),
        state_sentiment=jnp.asarray(sent[0], jnp.int32),
        state_role=jnp.asarray(sent[1], jnp.int32),
        is_positive=c["pos"],
        is_negative=c["neg"],
        is_neutral_sentiment=content & ~c["pos"] & ~c["neg"],
        is_noun=c["noun"],
        is_verb=c["verb"],
        is_adjective=c["adj"],
        is_adverb=c["adv"],
        is_function=c["function"],
        is_punct=c["punct"],
        is_special=jnp.arange(v) < 2,
        vocab=Vocab(tuple(words), tuple(roles)),
    )


def make_language(
    seed: int = 0, *, noise: float = 8.0, trans_noise: float = 30.0, word_noise: float = 3.0
) -> Language:
    """The default language: 147 words, 3 sentiments x 18 roles = 54 hidden states.

    ``noise`` / ``trans_noise`` are the Gamma shapes of the multiplicative perturbations of the
    emission / transition skeletons (larger = closer to the skeleton); ``word_noise`` is the Gamma
    shape of per-word popularities within a class (shared by all roles emitting that class). The
    mean sequence length (EOS included) is about 20-28 tokens across seeds (24.7 for seed 0).
    """
    rng = np.random.default_rng(seed)
    words = ["<pad>", "<eos>"] + [w for ws in _LEXICON.values() for w in ws]
    index = {w: i for i, w in enumerate(words)}
    cls = {k: np.array([index[w] for w in ws]) for k, ws in _LEXICON.items()}
    v, nr = len(words), len(ROLES)
    pop = {k: _perturb(rng, np.ones(len(ws)), word_noise) for k, ws in cls.items()}
    ri = {r: i for i, r in enumerate(ROLES)}
    s_count = 3 * nr
    init, trans, emit = np.zeros(s_count), np.zeros((s_count, s_count)), np.zeros((s_count, v))
    for s in range(3):
        off = s * nr
        for r, p in _INIT.items():
            init[off + ri[r]] = _PRIOR[s] * p
        for r, row in _TRANS.items():
            skel = np.zeros(nr)
            for r2, p in row.items():
                skel[ri[r2]] = p
            nz = skel > 0
            skel[nz] = _perturb(rng, skel[nz], trans_noise)
            trans[off + ri[r], off : off + nr] = skel
        for r in ROLES:
            e = _emission(rng, s, r, v, cls, pop, noise)
            emit[off + ri[r]] = e / e.sum()
    init /= init.sum()
    sent = (np.repeat(np.arange(3), nr), np.tile(np.arange(nr), 3))
    return _assemble(words, _word_classes(cls, v), ROLES, init, trans, emit, sent)


def _emission(rng, s: int, r: str, v: int, cls: dict, pop: dict, noise: float) -> np.ndarray:
    """Role ``r``'s unnormalised emission over the ``v`` words in sentiment ``s`` (draws from ``rng``
    in a fixed order: the language of a seed depends on it)."""
    e = np.zeros(v)
    kind = _ROLE_CLASS.get(r, "")
    if r == "END":
        e[EOS] = 1.0
    elif r == "DONE":
        e[PAD] = 1.0
    elif r == "STOP":
        e[cls["stop"]] = _perturb(rng, np.array([1.0 - _BANG[s], _BANG[s]]), noise)
    elif kind.endswith("*"):
        base = kind[:-1]
        if s == NEU:
            w_neu = _NEUTRAL_MIX[base]
            w_pos = w_neg = (1.0 - w_neu) / 2
        else:
            same, neu, opp = _MIX[base]
            w_pos, w_neg, w_neu = (same, opp, neu) if s == POS else (opp, same, neu)
        for suffix, w in (("pos", w_pos), ("neg", w_neg), ("neu", w_neu)):
            e[cls[f"{base}_{suffix}"]] = w * _perturb(rng, pop[f"{base}_{suffix}"], noise)
    else:
        e[cls[kind]] = _perturb(rng, pop[kind], noise)
    return e


def _word_classes(cls: dict, v: int) -> dict[str, np.ndarray]:
    """Boolean ``[v]`` masks of the word classes: content classes, sentiments, function words, punctuation."""

    def mask(*names: str) -> np.ndarray:
        m = np.zeros(v, bool)
        for k in names:
            m[cls[k]] = True
        return m

    content = ("noun", "verb", "adj", "adv")
    classes = {k: mask(*(f"{k}_{x}" for x in ("pos", "neg", "neu"))) for k in content}
    classes |= {x: mask(*(f"{k}_{x}" for k in content)) for x in ("pos", "neg")}
    classes |= {"function": mask("det", "pron", "prep", "conj", "cop", "int"), "punct": mask("stop", "comma")}
    return classes


def make_tiny_language(seed: int = 0, noise: float = 8.0) -> Language:
    """A 6-word, 12-state language for exhaustive tests: ``<pad> <eos> good bad dog cat``.

    3 sentiments x roles (ADJ, NOUN, END, DONE); ADJ emits good/bad (biased by sentiment),
    NOUN emits dog/cat; ADJ -> {ADJ, NOUN}, NOUN -> {ADJ, END}, END -> DONE.
    """
    rng = np.random.default_rng(seed)
    words = ("<pad>", "<eos>", "good", "bad", "dog", "cat")
    roles = ("ADJ", "NOUN", "END", "DONE")
    nr, s_count = len(roles), 3 * len(roles)
    init, trans, emit = np.zeros(s_count), np.zeros((s_count, s_count)), np.zeros((s_count, len(words)))
    good = (0.8, 0.2, 0.5)
    for s in range(3):
        o = s * nr
        init[o : o + 2] = _PRIOR[s] * _perturb(rng, np.array([0.5, 0.5]), noise)
        trans[o, o : o + 2] = _perturb(rng, np.array([0.3, 0.7]), noise)
        trans[o + 1, [o, o + 2]] = _perturb(rng, np.array([0.4, 0.6]), noise)
        trans[o + 2, o + 3] = trans[o + 3, o + 3] = 1.0
        emit[o, 2:4] = _perturb(rng, np.array([good[s], 1 - good[s]]), noise)
        emit[o + 1, 4:6] = _perturb(rng, np.array([0.6, 0.4]), noise)
        emit[o + 2, EOS] = emit[o + 3, PAD] = 1.0
    init /= init.sum()
    onehot = lambda *ids: np.isin(np.arange(len(words)), ids)
    classes = {"pos": onehot(2), "neg": onehot(3), "adj": onehot(2, 3), "noun": onehot(4, 5)}
    sent = (np.repeat(np.arange(3), nr), np.tile(np.arange(nr), 3))
    return _assemble(words, classes, roles, init, trans, emit, sent)


def _cdf(logp: jax.Array) -> jax.Array:
    """Row-wise cumulative distribution, normalised so that the last entry is exactly 1."""
    c = jnp.cumsum(jnp.exp(logp), axis=-1)
    return c / c[..., -1:]


def _draw(cdf: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw: ``#{i : cdf_i < u}`` for ``u`` in (0, 1); zero-probability entries are never hit."""
    return (cdf < u[..., None]).sum(-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("n", "max_len"))
def sample(lang: Language, key: jax.Array, n: int, max_len: int) -> tuple[jax.Array, jax.Array]:
    """Ancestral sampling: ``z_1 ~ init``, ``x_t ~ emit[z_t]``, ``z_{t+1} ~ trans[z_t]`` (``lax.scan``,
    inverse-CDF draws with one uniform each).

    Returns ``tokens [n, max_len] int32`` and ``mask [n, max_len] float32``; EOS has mask 1, the PAD
    positions after it mask 0. Sequences not ended by ``max_len`` are truncated (no EOS).
    """
    emit_cdf, trans_cdf = _cdf(lang.emit), _cdf(lang.trans)
    u = jnp.maximum(jax.random.uniform(key, (max_len + 1, 2, n)), 1e-30)
    z0 = _draw(jnp.broadcast_to(_cdf(lang.init), (n, lang.init.shape[0])), u[0, 0])

    def step(z: jax.Array, ut: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = _draw(emit_cdf[z], ut[0])
        return _draw(trans_cdf[z], ut[1]), x

    _, xs = jax.lax.scan(step, z0, u[1:])
    tokens = xs.T
    return tokens, (tokens != PAD).astype(jnp.float32)


@jax.jit
def token_log_probs(lang: Language, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-position ``log p(x_t | x_<t)`` from the normalised forward algorithm; ``[n, T]``.

    With the predictive state distribution ``q_t(z) = p(z_t = z | x_<t)`` (``q_1 = pi``):

        c_t = log sum_z q_t(z) B(z, x_t)                        (= log p(x_t | x_<t))
        f_t(z) = q_t(z) B(z, x_t) / exp(c_t),    q_{t+1} = f_t A.

    Positions with ``mask == 0`` are skipped (``q`` unchanged, output 0), so padding may sit anywhere
    (left-padded prompts, prompt + response). An impossible token gives ``-inf`` and is skipped for
    the state update. ``sum_t c_t = log_prob``.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    on = jnp.asarray(mask) > 0
    emit_t = lang.emit.T  # [V, S]
    a = jnp.exp(lang.trans)
    q0 = jnp.broadcast_to(lang.init, (tokens.shape[0], lang.init.shape[0]))

    def step(q: jax.Array, inp: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x, m = inp
        joint = q + emit_t[x]  # [n, S]
        c = jax.nn.logsumexp(joint, axis=-1)
        ok = m & (c > -jnp.inf)
        f = jnp.exp(jnp.where(ok[:, None], joint - c[:, None], -jnp.inf))
        q_next = jnp.log(jnp.matmul(f, a, precision=jax.lax.Precision.HIGHEST))
        return jnp.where(ok[:, None], q_next, q), jnp.where(m, c, 0.0)

    _, c = jax.lax.scan(step, q0, (tokens.T, on.T))
    return c.T


def log_prob(lang: Language, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Exact prefix log-likelihood ``log p(x_1..x_T)`` of the unmasked tokens, ``[n]``.

    ``log p = sum_t log p(x_t | x_<t)`` over unmasked positions (see :func:`token_log_probs`).
    """
    return token_log_probs(lang, tokens, mask).sum(-1)


def entropy_rate(lang: Language, key: jax.Array, n: int = 4096, max_len: int = 256) -> float:
    """Monte-Carlo per-token entropy in nats: ``-sum_i log p(x^i) / sum_i |x^i|`` over samples
    (EOS counted as a token, PAD after it not)."""
    tokens, mask = sample(lang, key, n, max_len)
    return float(-log_prob(lang, tokens, mask).sum() / mask.sum())


@functools.partial(jax.jit, static_argnames=("n", "prompt_len"))
def prompts(lang: Language, key: jax.Array, n: int, prompt_len: int) -> tuple[jax.Array, jax.Array]:
    """Prefixes of sampled sequences, LEFT-padded to ``prompt_len``: ``(tokens, mask) [n, prompt_len]``.

    The prefix length is uniform in ``[max(2, prompt_len // 2), prompt_len]`` (capped at
    ``prompt_len``), shortened to exclude EOS if the sampled sequence ends earlier (rare): a prompt
    never contains EOS. Padded positions hold PAD with mask 0.
    """
    ks, kl = jax.random.split(key)
    tokens, mask = sample(lang, ks, n, prompt_len)
    lo = min(max(2, prompt_len // 2), prompt_len)
    want = jax.random.randint(kl, (n,), lo, prompt_len + 1)
    avail = ((mask > 0) & (tokens != EOS)).sum(-1)
    length = jnp.minimum(want, avail)
    src = jnp.arange(prompt_len)[None, :] - (prompt_len - length)[:, None]
    valid = src >= 0
    out = jnp.take_along_axis(tokens, jnp.clip(src, 0, prompt_len - 1), axis=1)
    return jnp.where(valid, out, PAD).astype(jnp.int32), valid.astype(jnp.float32)


def decode(lang: Language, tokens: jax.Array | np.ndarray, mask: jax.Array | np.ndarray | None = None) -> str:
    """Words of the unmasked tokens joined by spaces (one line per row for a 2-D input)."""
    t = np.asarray(tokens)
    m = np.ones(t.shape, bool) if mask is None else np.asarray(mask) > 0
    if t.ndim == 2:
        return "\n".join(decode(lang, r, mr) for r, mr in zip(t, m, strict=True))
    return " ".join(lang.words[int(i)] for i, keep in zip(t, m, strict=True) if keep)


def encode(lang: Language, text: str) -> jax.Array:
    """Token ids of space-separated words (``<eos>`` for EOS); raises ``KeyError`` on unknown words."""
    index = {w: i for i, w in enumerate(lang.words)}
    return jnp.asarray([index[w] for w in text.split()], jnp.int32)
