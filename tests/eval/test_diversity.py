"""klrl.eval.diversity against brute force over every pair of responses and hand values."""

from __future__ import annotations

import difflib

import numpy as np
import pytest

from klrl.eval import diversity


def _brute(texts, prompts, threshold):
    out = []
    for i, a in enumerate(texts):
        wa = diversity.words(a)
        hit = False
        for j, b in enumerate(texts):
            if j == i or prompts[j] == prompts[i]:
                continue
            wb = diversity.words(b)
            r = 1.0 if not wa and not wb else difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()
            hit = hit or r >= threshold
        out.append(hit)
    return out


def test_cross_prompt_duplicates_is_brute_force_over_pairs():
    rng = np.random.default_rng(0)
    vocab = "happy help you with today what can i the market road wind tree bridge".split()
    base = "i'm happy to help you with everything today what can i help you with"
    texts, prompts = [], []
    for p in range(12):
        for _ in range(3):
            if rng.random() < 0.3:  # a near-copy of one generic answer, a word or two changed
                w = base.split()
                w[rng.integers(len(w))] = vocab[rng.integers(len(vocab))]
                texts.append(" ".join(w))
            else:
                texts.append(" ".join(rng.choice(vocab, rng.integers(3, 9))))
            prompts.append(p)
    texts[5] = texts[6]  # the same text twice for one prompt: not a cross-prompt duplicate by itself
    got = diversity.cross_prompt_duplicates(texts, prompts, 0.7)
    want = _brute(texts, prompts, 0.7)
    assert got == want and 0 < sum(want) < len(want)


def test_distinct_n_and_share_by_hand():
    assert diversity.distinct_n(["a b a b", "a b"], 2) == pytest.approx(2 / 4)  # ab, ba, ab | ab
    assert np.isnan(diversity.distinct_n(["a"], 2))
    assert diversity.duplicate_share(["same words here", "same words here", "other"], [0, 1, 2]) == 2 / 3
    assert diversity.duplicate_share(["same words here", "same words here"], [0, 0]) == 0.0
