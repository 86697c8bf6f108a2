"""Text metrics (JAX, and the host dict) against Python-loop references and hand values."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from klrl.algo import textmetrics as tm

DIST = jax.jit(tm.distinct_n, static_argnums=2)
REP = jax.jit(tm.rep_n, static_argnums=2)


def ref_grams(row, mrow, n):
    return [tuple(row[i : i + n]) for i in range(len(row) - n + 1) if all(m > 0 for m in mrow[i : i + n])]


def ref_distinct(tokens, mask, n):
    grams = [g for row, mrow in zip(tokens, mask, strict=True) for g in ref_grams(list(row), list(mrow), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def ref_rep(tokens, mask, n):
    reps = []
    for row, mrow in zip(tokens, mask, strict=True):
        grams = ref_grams(list(row), list(mrow), n)
        if not grams:
            continue
        seen, repeated = set(), 0
        for g in grams:  # count the n-grams that repeat an earlier one
            if g in seen:
                repeated += 1
            seen.add(g)
        reps.append(repeated / len(grams))
    return sum(reps) / len(reps) if reps else 0.0


def random_batch(seed, b=6, r=10, vocab=4, prefix=True):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, r)).astype(np.int32)
    if prefix:
        mask = (np.arange(r) < rng.integers(0, r + 1, (b, 1))).astype(np.float32)
    else:
        mask = (rng.random((b, r)) < 0.7).astype(np.float32)
    return tokens, mask


def test_hand_values() -> None:
    t = np.array([[1, 2, 1, 2, 1, 2, 9], [3, 3, 3, 3, 9, 9, 9]], np.int32)
    m = np.array([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]], np.float32)
    # unigrams: 10 valid, distinct {1, 2, 3}; bigrams: 5 + 3 = 8, distinct {12, 21, 33}
    assert float(tm.distinct_n(t, m, 1)) == pytest.approx(3 / 10)
    assert float(DIST(t, m, 2)) == pytest.approx(3 / 8)
    # rep-2: row 0 has 5 bigrams, 2 distinct -> 3/5; row 1 has 3, 1 distinct -> 2/3
    assert float(REP(t, m, 2)) == pytest.approx((3 / 5 + 2 / 3) / 2)
    # rep-4: row 0 has 3 four-grams (1212, 2121, 1212) -> 1/3; row 1 has one -> 0
    assert float(tm.rep_n(t, m, 4)) == pytest.approx((1 / 3 + 0) / 2)
    np.testing.assert_array_equal(np.asarray(tm.response_length(m)), [6.0, 4.0])
    assert tm.stop_rate(t, m, (2,)) == 0.5 and tm.stop_rate(t, m, (2, 3)) == 1.0
    out = tm.text_metrics(t, m, stop_ids=(2,))
    assert out == {
        "text/distinct_1": pytest.approx(0.3), "text/distinct_2": pytest.approx(0.375),
        "text/rep_4": pytest.approx(1 / 6), "text/length_mean": 5.0, "text/length_min": 4.0,
        "text/length_max": 6.0, "text/stop_rate": 0.5,
    }  # fmt: skip
    assert all(type(v) is float for v in out.values())


def test_distinct_n_hand_computed() -> None:
    tok = np.array([[1, 2, 1, 2, 9], [1, 2, 3, 0, 0]])
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], np.float32)
    # unigrams 1 2 1 2 | 1 2 3 -> {1, 2, 3} / 7; bigrams 12 21 12 | 12 23 -> 3 / 5; trigrams 3 / 3
    assert float(DIST(tok, mask, 1)) == pytest.approx(3 / 7)
    assert float(DIST(tok, mask, 2)) == pytest.approx(3 / 5)
    assert float(DIST(tok, mask, 3)) == pytest.approx(1.0)
    assert float(DIST(tok, mask, 5)) == 0.0  # no complete 5-gram inside the mask
    assert float(DIST(tok, mask, 6)) == 0.0  # longer than the sequences
    # a masked hole breaks n-grams; n-grams never cross rows
    hole = np.array([[5, 6, 7, 5, 6]])
    assert float(DIST(hole, np.array([[1, 1, 0, 1, 1]]), 2)) == pytest.approx(1 / 2)
    rows = np.array([[4, 4], [4, 4]])
    assert float(DIST(rows, np.ones((2, 2)), 2)) == pytest.approx(1 / 2)
    assert float(DIST(rows, np.zeros((2, 2)), 1)) == 0.0
    with pytest.raises(ValueError, match="n must be >= 1"):
        tm.distinct_n(rows, np.ones((2, 2)), 0)


@pytest.mark.parametrize("prefix", [True, False])
def test_against_python_loops(prefix) -> None:
    dist, rep = DIST, REP
    for seed in range(25):
        t, m = random_batch(seed, prefix=prefix)
        for n in (1, 2, 3, 4):
            want_d, want_r = ref_distinct(t, m, n), ref_rep(t, m, n)
            # exact counts: the float32 rounding of the reference's quotient, bit for bit
            assert float(dist(t, m, n)) == float(np.float32(want_d)), (seed, n)
            assert float(rep(t, m, n)) == pytest.approx(want_r, abs=1e-6), (seed, n)


def test_large_ids_and_empty() -> None:
    t = np.array([[49151, 49150, 49151, 49150], [0, 49151, 49150, 7]], np.int32)
    m = np.ones_like(t, np.float32)
    assert float(DIST(t, m, 2)) == pytest.approx(ref_distinct(t, m, 2))
    z = np.zeros_like(m)
    assert float(DIST(t, z, 1)) == float(REP(t, z, 2)) == 0.0
    assert float(DIST(t, m, 5)) == float(REP(t, m, 5)) == 0.0  # R < n
    np.testing.assert_array_equal(np.asarray(jax.jit(tm.response_length)(m)), [4.0, 4.0])


def test_vmap_over_a_sweep_axis() -> None:
    batches = [random_batch(s) for s in range(3)]
    t = np.stack([b[0] for b in batches])
    m = np.stack([b[1] for b in batches])
    d = jax.jit(jax.vmap(lambda a, b: tm.distinct_n(a, b, 2)))(t, m)
    r = jax.jit(jax.vmap(lambda a, b: tm.rep_n(a, b, 3)))(t, m)
    np.testing.assert_allclose(np.asarray(d), [ref_distinct(a, b, 2) for a, b in batches], atol=1e-6)
    np.testing.assert_allclose(np.asarray(r), [ref_rep(a, b, 3) for a, b in batches], atol=1e-6)
