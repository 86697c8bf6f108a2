"""A task in parts (klrl.tasks.base): the built-in tasks are registered by name; make_train trains any
CausalLM, whatever its family. (The boundary checks of a task's parts: tests/config/test_checks.py.)"""

from __future__ import annotations

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
from klrl.tasks.base import JaxReward, Task, TokenPool

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


@pytest.mark.parametrize("name", ["wordclass", "peer"])
def test_tasks_that_generate_their_prompts_refuse_data_fields_first(name, monkeypatch):
    """A ``data`` field set is a ConfigError naming it, raised before anything is built (the
    language, the pretrained reference or the peer's models: building them here fails the test)."""
    from klrl.tasks import peer, wordclass

    def built(*a, **k):
        raise AssertionError("built before the check")

    monkeypatch.setattr(wordclass.L, "make_language", built)
    monkeypatch.setattr(peer, "make_peer_task", built)
    cfg = _cfg().replace(task={"name": name}, data={"split": "nosuch", "eval_fraction": 0.5})
    want = f"data.split, data.eval_fraction: the {name} task generates its prompts; data.* applies to "
    want += "--task.name text"
    with pytest.raises(ConfigError) as e:
        TASKS.get(name)(cfg)
    assert str(e.value) == want


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
