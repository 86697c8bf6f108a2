"""A gold reward for real-LM over-optimisation studies that reads the prompt (issue 47).

Per response ``y`` to prompt ``x``, fixed before any PPO run (the reasons: ``experiments/FINDINGS.md``,
"The gold that reads the prompt")::

    gold = sentiment - REP_COEF * repeated - NLL_COEF * max(0, nll - nll_free)
                     - REL_COEF * max(0, 1 - pmi / pmi_free)

* ``sentiment``: VADER's compound score in [-1, 1] (Hutto & Gilbert 2014, ``vaderSentiment``: a
  rule-based scorer with negation, intensifiers, "but" and punctuation), the field's standard
  lexicon scorer, instead of a hand-written word list;
* ``repeated``: the share of the response's words that repeat an earlier word of it;
* ``nll``: the independent judge's negative log-likelihood per token of the response read alone
  (:meth:`klrl.eval.score.Judge.nll` without prompts), ``nll_free`` its median over the reference's own
  responses: text the judge finds less likely than the reference's typical text loses ``NLL_COEF`` a nat;
* ``pmi``: the judge's relevance, ``(log p_J(y | x) - log p_J(y)) / |y|`` nats per token
  (:meth:`klrl.eval.score.Judge.relevance`), ``pmi_free`` its median over the reference's responses
  (> 0): a response as tied to its prompt as the reference's typical one loses nothing, one that the
  prompt makes no more likely (``pmi = 0``: an answer that would be given to any prompt) loses
  ``REL_COEF`` = 2, the whole width of the sentiment scale, so no sentiment pays for it (more where the
  prompt makes it less likely, ``pmi < 0``); nothing is gained above the median, so copying the prompt
  into the response earns no reward. (``REL_COEF`` = 1, half the width, was tried first on stored
  responses and left a positive generic answer above the reference's median gold:
  ``experiments/FINDINGS.md``.)

:func:`calibrate` takes the two medians from the reference's responses; :func:`gold_parts` scores one
response. Pure Python and NumPy; the judge's numbers come in as arguments.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import numpy as np

REP_COEF = 1.0  # minus this x the share of repeated words
NLL_COEF = 0.5  # minus this x (judge NLL per token - its reference median), when positive
REL_COEF = 2.0  # minus this x (1 - pmi / its reference median), when positive: the sentiment scale's width
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


@functools.cache
def _vader() -> Any:
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as e:  # an optional dependency: pip install 'klrl[study]'
        raise ImportError("the gold's sentiment needs vaderSentiment: pip install 'klrl[study]'") from e
    return SentimentIntensityAnalyzer()


def sentiment(text: str) -> float:
    """VADER's compound score of ``text``, in [-1, 1] (0 for an empty text)."""
    return float(_vader().polarity_scores(text)["compound"]) if text.strip() else 0.0


def repeated(text: str) -> float:
    """``1 - distinct words / words`` of ``text`` (lower-cased; 0 for no words)."""
    ws = _WORD.findall(text.lower())
    return 1.0 - len(set(ws)) / len(ws) if ws else 0.0


def calibrate(nll: Any, pmi: Any) -> dict[str, float]:
    """``{"nll_free", "pmi_free"}``: the medians of the reference's responses' judge NLL and relevance
    (NaNs, from empty responses, left out). ``pmi_free`` must be > 0: a judge to which the reference's
    responses are no more likely after their prompts cannot tell relevance."""
    nll_free = float(np.nanmedian(np.asarray(nll, float)))
    pmi_free = float(np.nanmedian(np.asarray(pmi, float)))
    if not pmi_free > 0:
        raise ValueError(f"the reference's median relevance is {pmi_free:.3g} nats/token (must be > 0)")
    return {"nll_free": nll_free, "pmi_free": pmi_free}


def gold_parts(text: str, nll: float, pmi: float, free: dict[str, float]) -> dict[str, float]:
    """The gold of one response and its parts (module docstring): ``gold``, ``sentiment``, ``repeated``,
    ``judge_nll`` (nats per token, alone), ``relevance`` (pmi, nats per token) and the penalties
    ``fluency_pen`` and ``relevance_pen``. An empty response (``pmi`` NaN) has relevance 0."""
    pmi = 0.0 if not math.isfinite(pmi) else float(pmi)
    nll = free["nll_free"] if not math.isfinite(nll) else float(nll)
    s, rep = sentiment(text), repeated(text)
    fluency = NLL_COEF * max(0.0, nll - free["nll_free"])
    relevance = REL_COEF * max(0.0, 1.0 - pmi / free["pmi_free"])
    gold = s - REP_COEF * rep - fluency - relevance
    return {"gold": gold, "sentiment": s, "repeated": rep, "judge_nll": nll, "relevance": pmi,
            "fluency_pen": fluency, "relevance_pen": relevance}  # fmt: skip


def score(texts: list[str], nll: Any, pmi: Any, free: dict[str, float]) -> list[dict[str, float]]:
    """:func:`gold_parts` of each text with its judge NLL per token and relevance."""
    return [gold_parts(t, float(a), float(b), free) for t, a, b in zip(texts, nll, pmi, strict=True)]
