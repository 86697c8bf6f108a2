"""The synthetic HMM language: exact likelihood, sampler, padding invariance, prompts."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.tasks import language as L


@pytest.fixture(scope="module")
def tiny() -> L.Language:
    return L.make_tiny_language(seed=3)


@pytest.fixture(scope="module")
def lang() -> L.Language:
    return L.make_language(0)


@pytest.fixture(scope="module")
def batch(lang) -> tuple[jax.Array, jax.Array]:
    return L.sample(lang, jax.random.key(2), 16, 20)


def _np_log_prob(lang: L.Language, seq: list[int]) -> float:
    """Independent float64 forward algorithm in probability space (unmasked tokens only)."""
    pi, a, b = (np.exp(np.asarray(m, np.float64)) for m in (lang.init, lang.trans, lang.emit))
    alpha = pi * b[:, seq[0]]
    for x in seq[1:]:
        alpha = (alpha @ a) * b[:, x]
    with np.errstate(divide="ignore"):
        return float(np.log(alpha.sum()))


def _enumerate(words: list[int], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """All sequences ``w_1..w_k EOS`` (k < max_len) and all ``w_1..w_max_len``, right-padded."""
    rows = [list(w) + [L.EOS] for k in range(max_len) for w in itertools.product(words, repeat=k)]
    rows += [list(w) for w in itertools.product(words, repeat=max_len)]
    tok = np.zeros((len(rows), max_len), np.int32)
    mask = np.zeros((len(rows), max_len), np.float32)
    for i, r in enumerate(rows):
        tok[i, : len(r)], mask[i, : len(r)] = r, 1
    return tok, mask


def test_tiny_language_probabilities_sum_to_one(tiny):
    words = [i for i in range(tiny.vocab_size) if i not in (L.PAD, L.EOS)]
    tok, mask = _enumerate(words, 6)
    total = float(jnp.exp(L.log_prob(tiny, tok, mask)).sum())
    assert abs(total - 1.0) < 1e-4, total
    # Ended mass grows with the horizon and is still < 1 (EOS is reached eventually).
    ended = (tok == L.EOS).any(1)
    assert 0.5 < float(jnp.exp(L.log_prob(tiny, tok[ended], mask[ended])).sum()) < 1.0


def test_log_prob_matches_independent_forward(tiny, lang, batch):
    tiny_tok, tiny_mask = L.sample(tiny, jax.random.key(1), 20, 12)
    for lg, (tok, mask) in ((tiny, (tiny_tok, tiny_mask)), (lang, batch)):
        lp = np.asarray(L.log_prob(lg, tok, mask))
        for i in range(tok.shape[0]):
            seq = [int(t) for t, m in zip(tok[i], mask[i], strict=True) if m > 0]
            np.testing.assert_allclose(lp[i], _np_log_prob(lg, seq), rtol=1e-4, atol=1e-4)
    # arbitrary (often impossible) 4-token strings of the tiny language, right-padded to the same shape
    seqs = np.random.default_rng(0).integers(1, tiny.vocab_size, size=(20, 4))
    tok = np.pad(seqs, ((0, 0), (0, 8)))
    lp = np.asarray(L.log_prob(tiny, tok, (tok > 0).astype(np.float32)))
    ref = np.array([_np_log_prob(tiny, list(s)) for s in seqs])
    finite = np.isfinite(ref)
    assert finite.any() and (~finite).any()
    np.testing.assert_allclose(lp[finite], ref[finite], rtol=1e-4, atol=1e-4)
    assert np.all(np.isneginf(lp[~finite]))


def test_sampler_matches_exact_probabilities(tiny):
    max_len, n = 4, 40_000
    words = [i for i in range(tiny.vocab_size) if i not in (L.PAD, L.EOS)]
    tok, mask = _enumerate(words, max_len)
    p = np.exp(np.asarray(L.log_prob(tiny, tok, mask), np.float64))
    index = {tuple(r[m > 0]): i for i, (r, m) in enumerate(zip(tok, mask, strict=True))}
    st, sm = map(np.asarray, L.sample(tiny, jax.random.key(7), n, max_len))
    counts = np.zeros(len(p))
    for r, m in zip(st, sm, strict=True):
        assert np.all(r[m == 0] == L.PAD) and np.all(np.diff(m) <= 0)  # padding only after the end
        counts[index[tuple(r[m > 0])]] += 1
    expected = n * p
    big = expected >= 5
    chi2 = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    chi2 += (counts[~big].sum() - expected[~big].sum()) ** 2 / max(expected[~big].sum(), 1e-9)
    df = big.sum()
    assert chi2 < df + 5 * np.sqrt(2 * df), (chi2, df)


def test_token_log_probs_sum_and_padding_invariance(lang, batch):
    tok, mask = batch
    tlp = L.token_log_probs(lang, tok, mask)
    lp = L.log_prob(lang, tok, mask)
    np.testing.assert_allclose(tlp.sum(-1), lp, rtol=1e-5)
    assert np.all(np.asarray(tlp)[np.asarray(mask) == 0] == 0)
    assert np.all(np.isfinite(lp))
    # left padding: shift every row right by 5 positions
    ltok = jnp.concatenate([jnp.zeros((16, 5), jnp.int32), tok], 1)
    lmask = jnp.concatenate([jnp.zeros((16, 5)), mask], 1)
    np.testing.assert_allclose(L.log_prob(lang, ltok, lmask), lp, rtol=1e-5)
    # padding in the middle (prompt | pad | response), with junk tokens under the zero mask
    mtok = jnp.concatenate([tok[:, :6], jnp.full((16, 5), 17, jnp.int32), tok[:, 6:]], 1)
    mmask = jnp.concatenate([mask[:, :6], jnp.zeros((16, 5)), mask[:, 6:]], 1)
    np.testing.assert_allclose(L.log_prob(lang, mtok, mmask), lp, rtol=1e-5)


def test_next_token_distribution_normalised(lang, batch):
    """sum_v p(v | prefix) = 1 for prefixes of several lengths (left-padded into one batch), also
    after EOS, where PAD follows with probability 1."""
    width, v = 9, lang.vocab_size
    tok = batch[0]
    prefixes = [np.asarray(tok[i])[:k] for i, k in zip(range(6), (1, 3, 4, 6, 7, 8), strict=True)]
    prefixes.append(np.asarray(L.encode(lang, "it is good . <eos>")))
    rows, masks = [], []
    for pre in prefixes:
        pad = width - 1 - len(pre)
        rows.append(
            np.concatenate([np.zeros((v, pad), np.int32), np.tile(pre, (v, 1)), np.arange(v)[:, None]], 1)
        )
        masks.append(np.concatenate([np.zeros((v, pad)), np.ones((v, len(pre) + 1))], 1))
    last = L.token_log_probs(lang, np.concatenate(rows), np.concatenate(masks))[:, -1].reshape(
        len(prefixes), v
    )
    np.testing.assert_allclose(jax.nn.logsumexp(last, axis=-1), 0.0, atol=1e-4)
    assert abs(float(last[-1, L.PAD])) < 1e-6  # after EOS: PAD with probability 1


def test_structure_of_default_language(lang):
    assert lang.vocab_size <= 150 and len(lang.words) == lang.vocab_size
    assert lang.words[L.PAD] == "<pad>" and lang.words[L.EOS] == "<eos>"
    for m in (lang.init, lang.trans, lang.emit):
        np.testing.assert_allclose(jnp.exp(m).sum(-1), 1.0, rtol=1e-5)
    s = np.asarray(lang.state_sentiment)
    cross = np.asarray(jnp.exp(lang.trans))[s[:, None] != s[None, :]]
    assert np.all(cross == 0)  # sentiment never changes
    names = ("is_special", "is_punct", "is_function", "is_noun", "is_verb", "is_adjective", "is_adverb")
    classes = np.stack([np.asarray(getattr(lang, k)) for k in names])
    assert np.all(classes.sum(0) == 1)  # a partition of the vocabulary
    sent = (
        np.asarray(lang.is_positive).astype(int)
        + np.asarray(lang.is_negative)
        + np.asarray(lang.is_neutral_sentiment)
    )
    assert np.all(sent == classes[3:].sum(0))  # every content word has exactly one sentiment
    # a positive sequence's adjectives are mostly positive, rarely negative
    emit = np.exp(np.asarray(lang.emit))
    adj_pos = (s == L.POS) & (np.asarray(lang.state_role) == lang.vocab.roles.index("ADJ"))
    row = emit[adj_pos][0]
    assert row[np.asarray(lang.is_positive)].sum() > 0.5 > 0.1 > row[np.asarray(lang.is_negative)].sum()
    # another seed: same words, different probabilities
    other = L.make_language(1)
    assert other.words == lang.words and not np.allclose(other.emit, lang.emit)


def test_default_language_length_and_entropy(lang):
    tok, mask = L.sample(lang, jax.random.key(0), 2048, 200)
    lengths = np.asarray(mask.sum(1))
    ended = float((np.asarray(tok) == L.EOS).any(1).mean())
    h = L.entropy_rate(lang, jax.random.key(1), n=2048, max_len=200)
    print(f"\nmean length {lengths.mean():.2f} (median {np.median(lengths)}), ended {ended:.4f}, "
          f"entropy rate {h:.3f} nats/token, vocab {lang.vocab_size}, states {lang.num_states}")  # fmt: skip
    assert 15 <= lengths.mean() <= 30
    assert ended > 0.99
    assert 1.5 < h < np.log(lang.vocab_size)
    assert L.decode(lang, tok[0], mask[0]).endswith("<eos>") or lengths[0] == 200


def test_prompts_left_padded_without_eos(lang):
    p_len = 8
    tok, mask = map(np.asarray, L.prompts(lang, jax.random.key(5), 512, p_len))
    assert tok.shape == mask.shape == (512, p_len) and tok.dtype == np.int32
    assert np.all(np.diff(mask, axis=1) >= 0)  # zeros then ones: left padding
    assert np.all(tok[mask == 0] == L.PAD) and np.all(tok[mask > 0] != L.PAD)
    assert not np.any(tok == L.EOS)
    lengths = mask.sum(1)
    assert lengths.min() >= 3 and lengths.max() == p_len and (lengths < 4).mean() < 0.05
    assert (lengths < p_len).mean() > 0.5
    assert np.all(np.isfinite(L.log_prob(lang, tok, mask)))


def test_encode_decode_roundtrip(lang):
    text = "the happy dog loves the lovely garden . <eos>"
    ids = L.encode(lang, text)
    assert lang.decode(ids) == text
    assert L.decode(lang, jnp.stack([ids, ids]), jnp.ones((2, len(ids)))) == text + "\n" + text
