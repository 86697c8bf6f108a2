"""The gold reward ranks hand-written responses as designed and resists repetition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.tasks import gold as G
from klrl.tasks import language as L

P_LEN, R_LEN = 8, 16
EXAMPLES = {
    "fluent_positive": "is happy , and the kind child loves the lovely garden . <eos>",
    "fluent_neutral": "is quiet , and the small child reads the old book . <eos>",
    "fluent_negative": "is sad , and the cruel child hates the ugly garden . <eos>",
    "repeated_positive": "good good good good good good good good good good good good",
    "repeated_fluent": "is good . the good dog is good . the good cat is good . <eos>",
    "adjective_salad": "good great happy wonderful lovely kind bright beautiful excellent cheerful",
    "empty": "",
}


@pytest.fixture(scope="module")
def lang() -> L.Language:
    return L.make_language(0)


@pytest.fixture(scope="module")
def params(lang) -> G.GoldParams:
    return G.make_gold_params(lang, jax.random.key(0), prompt_len=P_LEN, response_len=R_LEN)


def _batch(lang: L.Language, pairs: list[tuple[str, str]], rows: int = 16) -> tuple[jax.Array, ...]:
    """Left-padded prompts and right-padded responses from (prompt, response) texts; padded with
    empty rows to ``rows`` rows (one compiled shape for all tests)."""
    shapes = ((P_LEN, np.int32), (P_LEN, np.float32), (R_LEN, np.int32), (R_LEN, np.float32))
    pt, pm, rt, rm = (np.zeros((max(rows, len(pairs)), w), dtype) for w, dtype in shapes)
    for i, (p, r) in enumerate(pairs):
        p_ids = np.asarray(L.encode(lang, p))
        r_ids = np.asarray(L.encode(lang, r)) if r else np.zeros(0, np.int32)
        pt[i, P_LEN - len(p_ids) :], pm[i, P_LEN - len(p_ids) :] = p_ids, 1
        rt[i, : len(r_ids)], rm[i, : len(r_ids)] = r_ids, 1
    return tuple(map(jnp.asarray, (pt, pm, rt, rm)))


@pytest.fixture(scope="module")
def scored(lang, params) -> dict[tuple[str, str], G.GoldTerms]:
    prompts = ("the old dog", "it walks . the cat")
    keys = [(p, k) for p in prompts for k in EXAMPLES]
    batch = _batch(lang, [(p, EXAMPLES[k]) for p, k in keys])
    terms = jax.jit(G.gold_terms)(lang, *batch, params)
    print("\nthreshold", round(params.ll_threshold, 3), "gold_min", round(float(G.gold_min(params)), 3))
    out = {}
    for i, key in enumerate(keys):
        out[key] = G.GoldTerms(*(float(x[i]) for x in terms))
        print(f"{key[0]!r:22} {key[1]:18} gold {out[key].reward:8.3f}  sentiment {out[key].sentiment:6.3f}  "
              f"ll/token {out[key].ll_per_token:7.3f}")  # fmt: skip
    return out


@pytest.mark.parametrize("prompt", ["the old dog", "it walks . the cat"])
def test_gold_ranks_hand_written_examples(scored, params, prompt):
    g = {k: scored[(prompt, k)].reward for k in EXAMPLES}
    assert g["fluent_positive"] > g["fluent_neutral"] > g["repeated_positive"]
    assert g["fluent_negative"] < g["fluent_neutral"]
    assert g["fluent_positive"] > g["repeated_fluent"]
    assert g["fluent_positive"] > 0 > g["adjective_salad"]
    assert g["empty"] == pytest.approx(float(G.gold_min(params)))
    assert min(g.values()) == g["empty"]
    # fluent text is not penalised, the word salad and the repetition are
    for k in ("fluent_positive", "fluent_neutral"):
        assert scored[(prompt, k)].fluency_penalty < 0.3
    assert scored[(prompt, "repeated_positive")].fluency_penalty > 5
    assert scored[(prompt, "adjective_salad")].fluency_penalty > 1


def test_repetition_does_not_increase_sentiment(lang, params):
    responses = [
        "good",
        "good good good good good good good good",
        "the good dog is good . the good cat is good .",
        "the good dog is happy .",
        "the good dog is happy . the happy cat is good .",
        "the bad dog is good .",
    ]
    t = G.gold_terms(lang, *_batch(lang, [("it walks . the", r) for r in responses]), params)
    s = np.asarray(t.sentiment)
    assert s[0] == s[1] == s[2] > 0
    assert s[3] == s[4] > s[0]  # two distinct positive words beat one, repeated or not
    assert s[5] == 0.0
    assert np.all(np.asarray(t.num_positive)[:6] == [1, 1, 1, 2, 2, 1])
    assert s.max() < params.sentiment_weight


@pytest.fixture(scope="module")
def real(lang) -> tuple[jax.Array, ...]:
    """Prompts and their true continuations: sampled sequences split after ``P_LEN`` tokens."""
    full, mask = L.sample(lang, jax.random.key(11), 1024, P_LEN + R_LEN)
    return full[:, :P_LEN], mask[:, :P_LEN], full[:, P_LEN:], mask[:, P_LEN:]


def test_fluency_is_the_conditional_log_likelihood(lang, params, real):
    pt, pm, rt, rm = real
    rm = rm.at[:300, 10:].set(0.0)  # some shorter responses (no EOS)
    t = G.gold_terms(lang, pt, pm, rt, rm, params)
    joint = L.log_prob(lang, jnp.concatenate([pt, rt], 1), jnp.concatenate([pm, rm], 1))
    diff = joint - L.log_prob(lang, pt, pm)
    n = rm.sum(1)
    lp = G.response_log_probs(lang, pt, pm, rt, rm)
    ok = (n > 0) & jnp.all((lp > params.min_token_logp) | (rm == 0), axis=1)  # no floor hit
    assert ok.sum() > 500
    np.testing.assert_allclose(t.ll_per_token[ok], (diff / n)[ok], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(G.oracle_ppl(lang, pt, pm, rt, rm)[ok], jnp.exp(-diff / n)[ok], rtol=1e-3)
    np.testing.assert_allclose(
        t.reward, jnp.where(n > 0, t.sentiment - t.fluency_penalty, G.gold_min(params))
    )


def test_real_continuations_are_rarely_penalised(lang, params, real):
    """Continuations the language itself produces (EOS or not) almost never pay the fluency penalty."""
    pt, pm, rt, rm = real
    t = G.gold_terms(lang, pt, pm, rt, rm, params)
    nonempty = np.asarray(rm.sum(1) > 0)
    no_eos = nonempty & ~np.asarray((rt == L.EOS).any(1))
    assert no_eos.sum() > 100
    assert (np.asarray(t.fluency_penalty)[nonempty] > 0).mean() < 0.05
    assert (np.asarray(t.fluency_penalty)[no_eos] > 0).mean() < 0.05
    assert np.all(np.asarray(t.reward) >= float(G.gold_min(params)))


def test_sentiment_consistency_with_prompt(lang, params):
    """The sentiment is fixed per sequence: a positive response is more likely after a positive prompt."""
    resp = EXAMPLES["fluent_positive"]
    t = G.gold_terms(lang, *_batch(lang, [("the happy dog", resp), ("the sad dog", resp)]), params)
    assert t.ll_per_token[0] > t.ll_per_token[1] + 0.05


def test_possible_degenerate_responses_are_penalised(lang, params):
    """After a determiner, adjective runs are grammatical but unlikely: repetition and word salad
    pay the fluency penalty (with a finite likelihood), a fluent positive continuation does not."""
    responses = [
        "happy child loves the lovely garden . <eos>",
        "good good good good good good good good good good good good",
        "good great happy wonderful lovely kind bright beautiful excellent cheerful",
        "good good good good dog loves the good good good garden .",
    ]
    t = G.gold_terms(lang, *_batch(lang, [("it walks . the", r) for r in responses]), params)
    g, ll = np.asarray(t.reward)[:4], np.asarray(t.ll_per_token)[:4]
    assert np.all(ll > params.min_token_logp + 3)  # possible under the language
    assert g[0] > 0 > max(g[1], g[2]) and g[3] < g[0]
    assert np.all(np.asarray(t.fluency_penalty)[1:4] > 0.3)
    print(
        "\nafter 'it walks . the':",
        dict(zip(("fluent", "repeated", "salad", "mixed"), g.round(3), strict=True)),
    )
