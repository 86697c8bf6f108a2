"""Diversity of a set of responses, the signal that moves when a policy collapses onto one answer.

* :func:`distinct_n`: distinct word n-grams over all word n-grams of the set (Li et al. 2016).
* :func:`cross_prompt_duplicates`: the share of responses that are near-duplicates of a response to a
  *different* prompt: word-sequence similarity ``>= threshold`` (``difflib.SequenceMatcher.ratio`` on the
  word lists, ``2 M / (|a| + |b|)`` with ``M`` the matched words; Ratcliff & Obershelp 1988). Mode collapse
  across prompts (the same answer to every prompt) drives it to 1; a reference that answers each prompt
  scores near 0.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
    """Distinct word n-grams / word n-grams over ``texts`` (NaN when there are none)."""
    grams = [tuple(w[i : i + n]) for t in texts for w in [words(t)] for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def similarity(a: str, b: str) -> float:
    """``difflib.SequenceMatcher(None, words(a), words(b)).ratio()`` (1 for two texts without words)."""
    wa, wb = words(a), words(b)
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()


def _close(a: list[str], b: list[str], threshold: float) -> bool:
    if not a and not b:
        return True
    m = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return m.real_quick_ratio() >= threshold and m.quick_ratio() >= threshold and m.ratio() >= threshold


def cross_prompt_duplicates(
    texts: Sequence[str], prompts: Sequence[int], threshold: float = 0.7
) -> list[bool]:
    """Per response: whether a response to another prompt is at least ``threshold`` similar to it
    (:func:`similarity`; the same text given to two prompts counts). Each distinct text is compared once
    with each other (the ratio's upper bounds first)."""
    by_text: dict[str, set[int]] = {}
    for t, p in zip(texts, prompts, strict=True):
        by_text.setdefault(t, set()).add(int(p))
    uniq = list(by_text)
    toks = [words(t) for t in uniq]
    hit = [len(by_text[t]) > 1 for t in uniq]
    for i in range(len(uniq)):
        for j in range(i + 1, len(uniq)):
            if hit[i] and hit[j]:
                continue
            pi, pj = by_text[uniq[i]], by_text[uniq[j]]
            if pi == pj and len(pi) == 1:  # two answers to the same one prompt
                continue
            if _close(toks[i], toks[j], threshold):
                hit[i] = hit[j] = True
    dup = dict(zip(uniq, hit, strict=True))
    return [dup[t] for t in texts]


def duplicate_share(texts: Sequence[str], prompts: Sequence[int], threshold: float = 0.7) -> float:
    """The share of responses that are :func:`cross_prompt_duplicates` (NaN for none)."""
    d = cross_prompt_duplicates(texts, prompts, threshold)
    return sum(d) / len(d) if d else float("nan")
