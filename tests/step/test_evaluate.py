"""The held-out evaluation (klrl.step.evaluate): the held-out prompts answered greedily by the policy
every data.eval_every iterations, scored with the held-out rows' reward, logged as eval/heldout/*."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from klrl.config import RunConfig

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"

RECORDER = """
import json, os

def record(prompts, completions, topic):
    with open(os.environ["KLRL_TEST_RECORD"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "topic": topic}) + "\\n")
    return [float(len(c)) for c in completions]
"""


def _greedy_reference(model, params, tokens, mask, n_new, stops):
    """Greedy decoding by a Python loop of full forward passes (no KV cache), one prompt at a time."""
    from klrl.models.base import forward

    toks, m = list(tokens), list(mask)
    out = []
    for _ in range(n_new):
        logits = forward(model, params, jnp.asarray([toks]), jnp.asarray([m], jnp.float32)).logits
        t = int(jnp.argmax(logits[0, -1]))
        out.append(t)
        toks.append(t)
        m.append(1.0)
        if t in stops:
            break
    return out


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_heldout_is_greedy_scored_by_its_rows_reward_and_logged(tmp_path, monkeypatch):
    import klrl
    from klrl.data.prompts import load_prompts
    from klrl.models import from_pretrained

    rec = tmp_path / "record.jsonl"
    monkeypatch.setenv("KLRL_TEST_RECORD", str(rec))
    (tmp_path / "rew.py").write_text(RECORDER)
    cfg = RunConfig.from_dict(
        {"model": {"path": str(GGUF)}, "task": {"name": "text"},
         "data": {"prompt_len": 16, "limit": 8, "eval_fraction": 0.25, "eval_every": 2},
         "sampling": {"response_len": 6}, "ppo": {"epochs": 1, "minibatches": 2}, "optim": {"lr": 1e-3},
         "reward": {"fn": f"{tmp_path / 'rew.py'}:record"},
         "train": {"iterations": 4, "batch_size": 4, "quiet": True, "samples_every": 0}}
    )  # fmt: skip
    m = klrl.run(cfg, write=False).metrics
    names = ("reward", "kl_k1_seq_sum", "ref_ppl", "length", "distinct_1", "distinct_2", "rep_4")
    for k in names:
        v = m[f"eval/heldout/{k}"]
        assert np.isfinite(v[[0, 2, 3]]).all() and np.isnan(v[1]), (k, v)  # iterations 0, 2 and the last
    assert abs(m["eval/heldout/kl_k1_seq_sum"][0]) < 1e-3  # the policy is the reference at iteration 0

    calls = [json.loads(x) for x in rec.read_text().splitlines()]
    model, params, tok = from_pretrained(GGUF)
    held = load_prompts(cfg.data, tok).eval
    assert len(held) == 2
    # training calls score batch_size = 4 rows; the first 2-row call is the check before compiling, on the
    # held-out prompts' own text (klrl.checks.check_text_reward)
    evals = [c for c in calls if len(c["completions"]) == 2][1:]
    assert len(evals) == 3
    first = evals[0]
    assert first["prompts"] == list(held.prompts) and first["topic"] == held.columns["topic"]
    want = []
    for i in range(2):
        ids = _greedy_reference(model, params, held.tokens[i], held.mask[i], 6, set(tok.stop_ids))
        if ids and ids[-1] in tok.stop_ids:
            ids = ids[:-1]
        want.append(tok.decode(ids, skip_special_tokens=True))
    assert first["completions"] == want
    np.testing.assert_allclose(m["eval/heldout/reward"][0], np.mean([len(c) for c in want]))
