"""The gold of ``experiments/llm_overopt.py``: a programmatic score of one response, known in full.

Here, not in the study script, so that the study (which writes the report) and its report (which recomputes
the gold of every stored response) both import it and neither imports the other.
"""

from __future__ import annotations

REP_COEF = 1.0  # gold: minus this x the share of repeated words
NLL_COEF = 0.5  # gold: minus this x (per-token NLL under the reference - NLL_FREE), when positive
NLL_FREE = 4.0  # nats/token the gold forgives (the reference's own samples: median ~3.5)


def gold_parts(text: str, ref_logprob: float, length: int) -> dict[str, float]:
    """``gold = sentiment - REP_COEF * repeated - NLL_COEF * max(0, nll - NLL_FREE)`` of one response:
    ``sentiment`` :func:`klrl.rewards.text.positivity_score` (``(n_pos - n_neg) / sqrt(n_words)``,
    negation-aware), ``repeated`` the share of its words that repeat an earlier word of it, ``nll`` its
    per-token negative log-likelihood under the reference (``-ref_logprob / length``)."""
    from klrl.rewards.text import positivity_score, words

    ws = words(text)
    repeated = 1.0 - len(set(ws)) / len(ws) if ws else 0.0
    nll = -float(ref_logprob) / max(int(length), 1)
    sentiment = positivity_score(text)
    gold = sentiment - REP_COEF * repeated - NLL_COEF * max(0.0, nll - NLL_FREE)
    return {"gold": gold, "sentiment": sentiment, "repeated": repeated, "nll": nll}


# ---- the reference's samples and the proxy ----------------------------------------------------------------
