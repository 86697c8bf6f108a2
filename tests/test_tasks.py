"""A task in parts (klrl.tasks.base): the boundary checks name the part that is wrong; the built-in
tasks are registered by name; make_train trains any CausalLM, whatever its family."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import ConfigError, RunConfig
from klrl.data.tokenizer import Tokenizer
from klrl.data.vocab import WordTokenizer
from klrl.models.base import CausalLM, LMOutput
from klrl.models.gpt import GPT
from klrl.registry import TASKS
from klrl.step.train import make_train
from klrl.tasks.base import HostReward, JaxReward, Task, TokenPool

V, P, R = 11, 8, 4


def _cfg(value_model: str = "head") -> RunConfig:
    return RunConfig().replace(
        model={"n_layers": 1, "d_model": 16, "n_heads": 2, "value_model": value_model},
        sampling={"response_len": R},
        train={"batch_size": 8, "devices": 1, "iterations": 2},
        ppo={"minibatches": 2, "epochs": 1},
        task={"prompt_len": P},
    )


def _reward(env, ro):
    return jnp.mean(ro.mask, axis=-1)


def _task(cfg: RunConfig, width: int = P, vocab: int = V, policy: CausalLM | None = None, **kw) -> Task:
    policy = policy or GPT(cfg.model, V, P + R + 4)
    prompts = jax.random.randint(jax.random.PRNGKey(0), (16, width), 2, V)
    parts = dict(
        name="toy",
        tokenizer=WordTokenizer(tuple(f"w{i}" for i in range(vocab)), pad_id=0, stop_ids=(1,)),
        prompts=TokenPool(prompts, jnp.ones((16, width), jnp.float32)),
        prompt_len=P,
        reward=JaxReward(_reward),
        policy=policy,
        policy_params=policy.init(jax.random.PRNGKey(1)),
    )
    return Task(**{**parts, **kw})


def test_prompt_source_wider_than_prompt_len_is_an_error():
    cfg = _cfg()
    with pytest.raises(
        ConfigError, match=r"prompts: the prompt source is 12 tokens wide, the task's prompt_len is 8"
    ):
        make_train(cfg, _task(cfg, width=12))
    with pytest.raises(ConfigError, match="prompts: the prompt source is 5 tokens wide"):
        make_train(cfg, _task(cfg, width=5))
    bad_mask = dataclasses.replace(
        _task(cfg), prompts=TokenPool(jnp.zeros((16, P), jnp.int32), jnp.ones((16, 3)))
    )
    with pytest.raises(
        ConfigError, match=r"prompts: expected prompts \[N, P\] and prompt_mask of the same shape"
    ):
        make_train(cfg, bad_mask)
    floats = dataclasses.replace(_task(cfg), prompts=TokenPool(jnp.zeros((16, P)), jnp.ones((16, P))))
    with pytest.raises(ConfigError, match="prompts: token ids must be integers"):
        make_train(cfg, floats)


@pytest.mark.parametrize(
    "fn,got",
    [
        (lambda env, ro: jnp.mean(ro.mask, axis=-1, keepdims=True), r"\(8, 1\) float32"),
        (lambda env, ro: jnp.sum(ro.response, axis=-1), r"\(8,\) int32"),
        (lambda env, ro: jnp.mean(ro.mask), r"\(\) float32"),
    ],
)
def test_reward_of_the_wrong_shape_or_dtype_is_an_error(fn, got):
    cfg = _cfg()
    with pytest.raises(
        ConfigError, match=rf"reward: must return \[B\] = \(8,\) float32 per batch, got {got}"
    ):
        make_train(cfg, _task(cfg, reward=JaxReward(fn)))


def test_vocabulary_mismatch_is_an_error():
    cfg = _cfg()
    with pytest.raises(ConfigError, match=r"tokenizer: 40 token ids, the policy's vocabulary has only 11"):
        make_train(cfg, _task(cfg, vocab=40))
    stops = dataclasses.replace(
        _task(cfg), tokenizer=WordTokenizer(tuple(f"w{i}" for i in range(V)), pad_id=0, stop_ids=(1, 10))
    )
    make_train(cfg, stops)  # in range: fine
    with pytest.raises(ConfigError, match="policy: 10 positions"):
        make_train(cfg, _task(cfg, policy=GPT(cfg.model, V, P + R - 2)))
    with pytest.raises(ConfigError, match="reward: host-side text rewards are not run by the trainer yet"):
        make_train(cfg, _task(cfg, reward=HostReward(lambda prompts, responses: [0.0] * len(prompts))))


def test_word_tokenizer_is_a_tokenizer_with_several_stop_ids():
    tok = WordTokenizer(("<pad>", "<eos>", "<eot>", "a", "b"), pad_id=0, stop_ids=(1, 2))
    assert isinstance(tok, Tokenizer) and tok.stop_ids == (1, 2) and tok.vocab_size == 5
    assert tok.encode("a b a") == [3, 4, 3] and tok.decode([3, 4, 2, 0]) == "a b"
    assert tok.decode([3, 2], skip_special_tokens=False) == "a <eot>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        WordTokenizer(("a",), pad_id=0, stop_ids=(3,))


def test_built_in_tasks_are_registered():
    assert {"testbed", "wordclass", "peer", "text"} <= set(TASKS.names())
    with pytest.raises(
        ConfigError, match=r"task.name: must be one of peer, wordclass, testbed, text \(got .nope.\)"
    ):
        RunConfig().replace(task={"name": "nope"})


@dataclass(frozen=True)
class Bigram:
    """A CausalLM that is not klrl's GPT: logits depend on the current token only (no attention)."""

    vocab_size: int
    hidden_size: int
    max_len: int

    def init(self, key):
        k1, k2 = jax.random.split(key)
        d, v = self.hidden_size, self.vocab_size
        return {"emb": 0.1 * jax.random.normal(k1, (v, d)), "out": 0.1 * jax.random.normal(k2, (d, v))}

    def apply(self, params, tokens, positions, mask, cache=None, index=None, *, logits=True):
        hidden = jnp.tanh(params["emb"][tokens])
        return LMOutput(hidden @ params["out"] if logits else None, hidden, cache)

    def init_cache(self, batch, length):
        return jnp.zeros((batch,), jnp.float32)

    def partition_rules(self):
        return ()


@pytest.mark.parametrize("value_model", ["head", "separate"])
def test_make_train_takes_any_causal_lm(value_model):
    cfg = _cfg(value_model)
    bigram = Bigram(V, 6, 64)
    assert isinstance(bigram, CausalLM)
    task = _task(cfg)  # a GPT task: the policy passed in replaces it
    params = bigram.init(jax.random.PRNGKey(5))
    kw = {}
    if value_model == "separate":
        from klrl.models.heads import ValueHead, attach

        trunk = Bigram(V, 3, 64)
        value_params = attach(trunk.init(jax.random.PRNGKey(6)), ValueHead(3).init(jax.random.PRNGKey(7)))
        kw = {"value": trunk, "value_params": value_params}
    train = make_train(cfg, task, policy=bigram, policy_params=params, stop_ids=(1, 2), **kw)
    state = train.init(0)
    state, m = train.step(state, task.env)
    assert all(np.isfinite(float(v)) for v in m.values())
    assert float(m["guard/skipped"]) == 0.0
    pol = state.params["policy"]
    assert not np.array_equal(np.asarray(pol["emb"]), np.asarray(params["emb"]))  # it trained
    assert ("v_head" in pol) is (value_model == "head")
    np.testing.assert_array_equal(np.asarray(state.ref_params["emb"]), np.asarray(params["emb"]))
