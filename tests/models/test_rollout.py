"""Tests of klrl.models.rollout on the pretrained tiny reference (which really does emit EOS):
KV-cache log-probs, values and logits vs a teacher-forced forward, EOS masking, top-k,
and per-example keys."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from klrl.algo.logprobs import token_logprobs
from klrl.config import SamplingConfig
from klrl.models.base import forward
from klrl.models.heads import ValueHead, attach, detach
from klrl.models.rollout import generate, is_stop, response_slice, sequence

N = 64  # examples per rollout
R_LEN = 8
BASE = SamplingConfig(response_len=R_LEN, temperature=1.3)


class Setup:
    """The policy (pretrained trunk + a fresh value head), prompts, keys and compiled functions."""

    def __init__(self, cfg, task) -> None:
        self.task = task
        self.policy = task.policy
        self.head = ValueHead(self.policy.hidden_size)
        self.params = attach(task.ref_params, self.head.init(jax.random.PRNGKey(3)))
        self.prompt = task.env["prompts"][:N]
        self.prompt_mask = task.env["prompt_mask"][:N]
        self.keys = jax.random.split(jax.random.PRNGKey(42), N)
        self._gen: dict[SamplingConfig, object] = {}

        def fwd(p, t, m):
            trunk, head = detach(p)
            out = forward(self.policy, trunk, t, m)
            return out.logits, self.head.apply(head, out.hidden)

        self.forward = jax.jit(fwd)
        self._rollouts: dict[SamplingConfig, object] = {}

    def generate(self, scfg: SamplingConfig, prompt=None, prompt_mask=None, keys=None):
        if scfg not in self._gen:
            t = self.task
            self._gen[scfg] = jax.jit(
                lambda p, pr, pm, k: generate(
                    self.policy, p, pr, pm, k, scfg, t.stop_ids, t.pad_id, True, value_head=self.head
                )
            )
        if prompt is None:
            if scfg not in self._rollouts:
                self._rollouts[scfg] = self._gen[scfg](self.params, self.prompt, self.prompt_mask, self.keys)
            return self._rollouts[scfg]
        return self._gen[scfg](self.params, prompt, prompt_mask, keys)

    def teacher_forced(self, ro, temperature: float):
        """Tempered logits, log-probs of the sampled tokens and values from one full forward."""
        tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
        out_logits, out_value = self.forward(self.params, tokens, key_mask)
        p = ro.prompt.shape[1]
        logits = response_slice(out_logits, p, R_LEN) / temperature
        return logits, token_logprobs(logits, ro.response), response_slice(out_value, p, R_LEN)


@pytest.fixture(scope="module")
def setup(tiny_cfg, tiny_task) -> Setup:
    return Setup(tiny_cfg, tiny_task)


def _np(x):
    return np.asarray(x)


def _check_parity(setup: Setup, ro, temperature: float) -> None:
    logits, logp, value = setup.teacher_forced(ro, temperature)
    m = _np(ro.mask) > 0
    np.testing.assert_allclose(_np(ro.logp)[m], _np(logp)[m], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_np(ro.value)[m], _np(value)[m], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_np(ro.logits)[m], _np(logits)[m], atol=1e-5, rtol=1e-5)
    # masked positions carry zeros, not stale numbers
    assert np.all(_np(ro.logp)[~m] == 0) and np.all(_np(ro.value)[~m] == 0)


def test_logp_and_values_match_teacher_forcing(setup: Setup) -> None:
    ro = setup.generate(BASE)
    assert ro.response.shape == ro.mask.shape == ro.logp.shape == ro.value.shape == (N, R_LEN)
    assert ro.logits.shape == (N, R_LEN, setup.task.vocab_size)
    lengths = _np(ro.mask).sum(-1)
    # the parity check must cover responses cut short by EOS as well as full-length ones
    assert np.any(lengths < R_LEN - 1), lengths
    assert np.any(lengths == R_LEN), lengths
    _check_parity(setup, ro, BASE.temperature)


def test_eos_masking(setup: Setup) -> None:
    ro = setup.generate(BASE)
    resp, mask = _np(ro.response), _np(ro.mask)
    eos, pad = setup.task.eos_id, setup.task.pad_id
    n_early = 0
    for b in range(N):
        hits = np.flatnonzero(resp[b] == eos)
        if hits.size == 0:
            assert np.all(mask[b] == 1), (resp[b], mask[b])
            continue
        e = hits[0]
        n_early += e < R_LEN - 1
        assert np.all(mask[b, : e + 1] == 1), (resp[b], mask[b])  # EOS itself is kept
        assert np.all(mask[b, e + 1 :] == 0), (resp[b], mask[b])
        assert np.all(resp[b, e + 1 :] == pad), resp[b]
    assert n_early > 0
    # mask is contiguous from the start: it never switches back on
    assert np.all(np.diff(mask, axis=1) <= 0)


def test_no_eos_gives_full_masks(setup: Setup) -> None:
    scfg = dataclasses.replace(BASE, use_eos=False)
    ro = setup.generate(scfg)
    assert np.all(_np(ro.mask) == 1)
    # same keys as BASE: identical tokens up to each row's first EOS, and EOS really was sampled
    base = setup.generate(BASE)
    resp, base_resp, base_mask = _np(ro.response), _np(base.response), _np(base.mask) > 0
    np.testing.assert_array_equal(resp[base_mask], base_resp[base_mask])
    assert np.any(resp[:, :-1] == setup.task.eos_id)
    _check_parity(setup, ro, scfg.temperature)


def test_top_k_never_draws_outside_top_k(setup: Setup) -> None:
    k = 3
    scfg = dataclasses.replace(BASE, top_k=k, temperature=2.0)
    ro = setup.generate(scfg)
    logits, resp, m = _np(ro.logits), _np(ro.response), _np(ro.mask) > 0
    chosen = np.take_along_axis(logits, resp[..., None], axis=-1)[..., 0]
    rank = (logits > chosen[..., None]).sum(-1)  # number of strictly better tokens
    assert np.all(rank[m] < k), rank[m].max()
    # with temperature 2 the 2nd and 3rd choices are drawn too, not just the argmax
    assert np.any(rank[m] > 0)
    # the recorded log-prob is that of the full (untruncated) tempered policy
    _check_parity(setup, ro, scfg.temperature)


def test_rollout_does_not_depend_on_batch_split(setup: Setup) -> None:
    base = setup.generate(BASE)
    sl = slice(4, 8)
    part = setup.generate(BASE, setup.prompt[sl], setup.prompt_mask[sl], setup.keys[sl])
    np.testing.assert_array_equal(_np(part.response), _np(base.response)[sl])
    np.testing.assert_array_equal(_np(part.mask), _np(base.mask)[sl])
    np.testing.assert_allclose(_np(part.logp), _np(base.logp)[sl], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_np(part.value), _np(base.value)[sl], atol=1e-5, rtol=1e-5)
    # and a different key does change the sample
    other = setup.generate(BASE, setup.prompt[sl], setup.prompt_mask[sl], setup.keys[sl][::-1])
    assert not np.array_equal(_np(other.response), _np(base.response)[sl])


def test_rollout_without_value_head(setup: Setup) -> None:
    """A policy without a trunk value head records no values (separate critic / critic-free)."""
    plain = setup.policy
    t = setup.task
    ro = jax.jit(
        lambda p: generate(plain, p, setup.prompt[:4], setup.prompt_mask[:4], setup.keys[:4], BASE, t.eos_id)
    )(t.ref_params)
    assert ro.value is None and ro.logits is None
    np.testing.assert_array_equal(_np(ro.response), _np(setup.generate(BASE).response)[:4])


def test_gumbel_argmax_draws_what_jax_random_categorical_draws() -> None:
    """The sampler's max/min-index form of Gumbel-max gives ``jax.random.categorical``'s exact draws,
    including rows restricted to their top k (``-inf`` elsewhere) and rows with tied logits."""
    import jax.numpy as jnp

    from klrl.models.rollout import gumbel_argmax

    b, v = 512, 97
    logits = 3.0 * jax.random.normal(jax.random.PRNGKey(0), (b, v))
    kth = jax.lax.top_k(logits, 5)[0][:, -1:]
    top5 = jnp.where(logits >= kth, logits, -jnp.inf)
    tied = jnp.zeros((b, v))  # every token equally likely: the draw is decided by the noise alone
    keys = jax.random.split(jax.random.PRNGKey(1), b)
    draws = {}
    for name, lg in (("plain", logits), ("top5", top5), ("tied", tied)):
        draws[name] = jax.jit(gumbel_argmax)(keys, lg)
        want = jax.jit(jax.vmap(jax.random.categorical))(keys, lg)
        assert draws[name].dtype == jnp.int32
        np.testing.assert_array_equal(_np(draws[name]), _np(want), err_msg=name)
    # top-5 rows never leave their top 5; tied rows spread over the vocabulary
    assert bool(jnp.all(jnp.isfinite(jnp.take_along_axis(top5, draws["top5"][:, None], axis=-1))))
    assert len(np.unique(_np(draws["tied"]))) > v // 2
    # a NaN row (a diverged policy) still draws a token id in range; the guard skips the iteration
    nan_rows = logits.at[:4, 3].set(jnp.nan)
    drawn = _np(jax.jit(gumbel_argmax)(keys, nan_rows))
    assert np.all((drawn >= 0) & (drawn < v))
    np.testing.assert_array_equal(drawn[4:], _np(draws["plain"])[4:])


def test_several_stop_ids_each_end_a_response(setup: Setup) -> None:
    """With a set of stop ids, the first token of the set ends the response (kept, mask 1)."""
    t = setup.task
    base = setup.generate(BASE)
    resp = _np(base.response)
    first = int(resp[0, 0])  # a token the policy samples first for row 0: make it a stop token too
    stops = (t.eos_id, first)
    ro = jax.jit(
        lambda p: generate(
            setup.policy, p, setup.prompt, setup.prompt_mask, setup.keys, BASE, stops, t.pad_id
        )
    )(t.ref_params)
    r, m = _np(ro.response), _np(ro.mask)
    np.testing.assert_array_equal(r[:, 0], resp[:, 0])  # the same draws until a stop
    for b in range(N):
        hits = np.flatnonzero(np.isin(resp[b], stops) & (_np(base.mask)[b] > 0))
        n = hits[0] + 1 if len(hits) else R_LEN
        assert m[b].sum() == n and np.all(m[b, :n] == 1), b
        np.testing.assert_array_equal(r[b, :n], resp[b, :n])
        assert np.all(r[b, n:] == t.pad_id)
    assert m[0].sum() == 1  # row 0 ends at once
    import jax.numpy as jnp

    np.testing.assert_array_equal(_np(is_stop(jnp.array([0, 1, 5, 7]), (1, 7))), [False, True, False, True])
