"""klrl.eval.score's judge: NLL with and without the prompt and the relevance (PMI) against a NumPy
reference built from the judge's logits of each unpadded sequence; its format apart from the policy's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from klrl.eval import score
from klrl.eval.score import RAW_SEP, Judge, JudgeError
from klrl.models.base import forward
from klrl.models.pretrained import from_pretrained

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
PROMPTS = ["ab cd", "ef gh ij kl mn", "q"]
TEXTS = ["ab ab cd", "zz", "", "ef gh"]
IDX = [0, 1, 2, 1]


@pytest.fixture(scope="module")
def tiny():
    return from_pretrained(GGUF)


def _nll64(model, params, context: list[int], ids: list[int]) -> float:
    """``-sum_t log p(ids_t | context, ids<t)`` from the logits of the unpadded sequence, in float64."""
    if not ids:
        return 0.0
    seq = jnp.asarray([context + ids], jnp.int32)
    logits = np.asarray(forward(model, params, seq, jnp.ones_like(seq)).logits[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    c = len(context)
    return -float(sum(logp[c - 1 + t, i] for t, i in enumerate(ids)))


def test_raw_judge_nll_and_relevance_match_a_numpy_reference(tiny):
    model, params, tok = tiny
    judge = Judge("tiny", model, params, tok, chat_template=False)
    rel = judge.relevance(TEXTS, PROMPTS, IDX, batch=3)
    for m, (text, i) in enumerate(zip(TEXTS, IDX, strict=True)):
        ids = tok.encode(text)
        cond = _nll64(model, params, [tok.bos_id, *tok.encode(PROMPTS[i] + RAW_SEP)], ids)
        alone = _nll64(model, params, [tok.bos_id], ids)
        assert rel["tokens"][m] == len(ids)
        np.testing.assert_allclose(rel["nll_cond"][m], cond, rtol=2e-5, atol=1e-4)
        np.testing.assert_allclose(rel["nll_text"][m], alone, rtol=2e-5, atol=1e-4)
        if ids:
            np.testing.assert_allclose(rel["pmi"][m], (alone - cond) / len(ids), rtol=1e-4, atol=1e-4)
            assert cond > 0 and alone > 0
        else:
            assert np.isnan(rel["pmi"][m])
    assert np.ptp(rel["pmi"][[0, 1, 3]]) > 1e-3  # the prompts change the likelihoods: not vacuous


def test_templated_judge_reads_the_prompt_in_its_own_template(tiny):
    """With its chat template the context is the rendered user turn with the generation prompt."""
    model, params, tok = tiny
    judge = Judge("tiny", model, params, tok, chat_template=True)
    nll, n = judge.nll(TEXTS[:2], PROMPTS, IDX[:2])
    for m in range(2):
        text = tok.apply_chat_template(
            [{"role": "user", "content": PROMPTS[IDX[m]]}], add_generation_prompt=True
        )
        want = _nll64(model, params, tok.encode(text), tok.encode(TEXTS[m]))
        np.testing.assert_allclose(nll[m], want, rtol=2e-5, atol=1e-4)


def test_the_judges_format_defaults_to_its_own_template_or_raw_text(tiny, monkeypatch):
    model, params, tok = tiny
    assert Judge.load(str(GGUF)).chat_template is True  # the tiny GGUF carries a template
    bare = dataclasses.replace(tok, chat_template=None)
    monkeypatch.setattr(score, "from_pretrained", lambda path: (model, params, bare))
    assert Judge.load("bare").chat_template is False
    with pytest.raises(JudgeError, match="judge.chat_template true.*no chat template"):
        Judge.load("bare", chat_template=True)
    nobos = dataclasses.replace(bare, bos_id=None)
    monkeypatch.setattr(score, "from_pretrained", lambda path: (model, params, nobos))
    with pytest.raises(JudgeError, match="no BOS"):
        Judge.load("nobos")
