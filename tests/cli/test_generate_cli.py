"""``klrl generate`` and ``klrl eval`` (klrl.cli.generate): on the tiny GGUF run, greedy output equals
klrl's Python ``generate_text`` of the run's saved policy, a seed fixes the samples; the exact KL of a
model against itself is 0 and, on a hand-built case, equals NumPy's full-vocabulary KL summed over the
response; bad input is one line with exit status 2. In-process, tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_line_error

from klrl.cli import main as klrl_main
from klrl.models.base import forward
from klrl.models.generate import generate_text
from klrl.models.pretrained import from_pretrained

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
PROMPTS = ["ab cd", "ef", "gh ij kl"]


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "answer": k}) + "\n" for k, p in enumerate(PROMPTS)))
    return f


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_generate_on_a_run_is_python_generate_when_greedy_and_seeded_otherwise(
    tiny_gguf_run, prompt_file, tmp_path, capsys
):
    """``klrl generate RUN --temperature 0``: the completions ``generate_text`` (a separate decoder) gives
    for the run's final policy (``RUN/policy``, written by the run) with the prompts as chat messages; the
    same from the checkpoint directory. At temperature 1 the same seed gives the same rows, another seed
    other rows."""
    run = tiny_gguf_run.dir
    base = ["--prompts", str(prompt_file), "--max-new-tokens", "4"]
    out = {k: tmp_path / f"{k}.jsonl" for k in ("greedy", "ckpt", "s3", "s3b", "s4")}
    assert klrl_main(["generate", str(run), *base, "--temperature", "0", "--out", str(out["greedy"])]) == 0
    assert "iteration 2" in capsys.readouterr().out
    model, params, tok = from_pretrained(run / "policy")
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    want = generate_text(model, params, tok, msgs, 4, 0.0)
    rows = _rows(out["greedy"])
    assert [r["completion"] for r in rows] == want and [r["prompt"] for r in rows] == PROMPTS
    ckpt = run / "checkpoints" / "2"
    argv = [
        "generate",
        str(ckpt),
        *base,
        "--temperature",
        "0",
        "--batch-size",
        "2",
        "--out",
        str(out["ckpt"]),
    ]
    assert klrl_main(argv) == 0 and _rows(out["ckpt"]) == rows
    for k, seed in (("s3", 3), ("s3b", 3), ("s4", 4)):
        argv = ["generate", str(run), *base, "--n", "2", "--seed", str(seed), "--out", str(out[k])]
        assert klrl_main(argv) == 0
    s3, s4 = _rows(out["s3"]), _rows(out["s4"])
    assert s3 == _rows(out["s3b"]) and len(s3) == 6 and [r["sample"] for r in s3] == [0, 1] * 3
    assert [r["completion"] for r in s3] != [r["completion"] for r in s4]


def test_eval_kl_of_the_reference_against_itself_is_zero(prompt_file, tmp_path, capsys):
    out = tmp_path / "e.jsonl"
    argv = ["eval", str(GGUF), "--prompts", str(prompt_file), "--ref", str(GGUF), "--max-new-tokens", "4",
            "--reward.fn", "arithmetic", "--judge", str(GGUF), "--out", str(out)]  # fmt: skip
    assert klrl_main(argv) == 0
    rows, summary = _rows(out), json.loads(out.with_suffix(".summary.json").read_text())
    assert [r["kl_exact_seq_sum"] for r in rows] == [0.0] * 3 and summary["eval/kl_exact_seq_sum"] == 0.0
    assert all(r["reward"] in (0.0, 1.0) for r in rows)  # the answer column is passed by name
    nll = [r["judge_nll_token_mean"] for r in rows]
    assert all(x is None or x > 0 for x in nll) and summary["eval/judge_ppl"] > 1
    assert "mean exact KL 0 nats/seq" in capsys.readouterr().out


def test_exact_kl_matches_numpy_on_a_hand_built_case():
    """Three sequences, hand-chosen prompt and response ids (left-padded prompts, a response that stopped
    after 2 tokens), a policy that is the tiny GGUF with perturbed weights: per sequence
    ``sum_t m_t sum_v p_v (log p_v - log q_v)`` in NumPy (float64) from the two models' logits at the
    positions that predict the response tokens; chunks of 2 (the last one filled up)."""
    from klrl.config import DataConfig, SamplingConfig
    from klrl.data.prompts import PromptPool
    from klrl.eval.policy import Source
    from klrl.eval.score import exact_kl

    model, base, tok = from_pretrained(GGUF)
    noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), base)
    prompt = np.array([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13]], np.int32)
    pmask = (np.arange(4) >= np.array([[2], [0], [1]])).astype(np.float32)
    response = np.array([[20, 21, 22], [23, 24, 0], [25, 26, 27]], np.int32)
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], np.float32)
    pool = PromptPool(prompt, pmask, [""] * 3, [""] * 3, {}, np.arange(3), np.zeros(3, bool), "hand")
    src = Source(model, noisy, tok, DataConfig(), SamplingConfig(), "base", "")
    got = exact_kl(src.model, src.params, (model, base), pool, np.arange(3), response, mask, batch=2)
    want = []
    for b in range(3):
        real = np.concatenate([prompt[b][pmask[b] > 0], response[b][mask[b] > 0]])[None]
        n_p = int(pmask[b].sum())
        logits = [np.asarray(forward(model, p, jnp.asarray(real), jnp.ones_like(real)).logits[0], np.float64)
                  for p in (noisy, base)]  # fmt: skip
        logp, logq = (x - x.max(-1, keepdims=True) for x in logits)
        logp, logq = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (logp, logq))
        rows = np.arange(n_p - 1, n_p - 1 + int(mask[b].sum()))  # the positions predicting the response
        want.append(np.sum(np.exp(logp[rows]) * (logp[rows] - logq[rows])))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert min(want) > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "nope/none.gguf", "--prompt", "x"], ["SOURCE", "nope/none.gguf"]),
        (["generate", str(GGUF)], ["--prompts FILE or --prompt TEXT"]),
        (["generate", str(GGUF), "--prompt", "x", "--n", "0"], ["--n", ">= 1"]),
        (["generate", str(GGUF), "--prompt", "x", "--temperature", "-1"], ["--temperature", ">= 0"]),
        (["generate", str(GGUF), "--prompt", "x", "--step", "3"], ["--step", "not a run directory"]),
        (
            ["generate", str(GGUF), "--prompt", "x", "--max-new-token", "3"],
            ["did you mean --max-new-tokens?"],
        ),
        (["generate", str(GGUF), "--prompts", "none.jsonl"], ["--prompts", "not found"]),
        (["eval", str(GGUF), "--prompts", "P", "--reward.fn", "nonesuch"], ["--reward.fn", "nonesuch"]),
        (["eval", str(GGUF), "--prompts", "P", "--ref", "nope/x.gguf"], ["--ref", "nope/x.gguf"]),
        (["eval", str(GGUF), "--prompts", "P", "--reward-model", str(GGUF)], ["--reward-model"]),
        (["eval", str(GGUF), "--prompts", "P", "--judge", "nope/x.gguf"], ["--judge", "nope/x.gguf"]),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, words, prompt_file, capsys):
    argv = [str(prompt_file) if a == "P" else a for a in argv]
    line = one_line_error(capsys, klrl_main, argv)
    for w in words:
        assert w in line, (w, line)


def test_generate_ids_are_the_tokens_of_each_completion(prompt_file, tmp_path):
    """``--ids``: each row's token ids, as many as its ``tokens`` count, decoding (stop token dropped) to
    its completion."""
    out = tmp_path / "g.jsonl"
    argv = ["generate", str(GGUF), "--prompts", str(prompt_file), "--max-new-tokens", "5", "--n", "2",
            "--ids", "--out", str(out)]  # fmt: skip
    assert klrl_main(argv) == 0
    _, _, tok = from_pretrained(GGUF)
    rows = _rows(out)
    assert len(rows) == 6
    for r in rows:
        assert len(r["ids"]) == r["tokens"] and all(isinstance(i, int) for i in r["ids"])
        stops = set(tok.stop_ids)
        assert tok.decode([i for i in r["ids"] if i not in stops]) == r["completion"]


def test_eval_judge_reads_prompts_in_its_own_format_not_the_policys(
    prompt_file, tmp_path, capsys, monkeypatch
):
    """A judge without a chat template scores a chat policy's completions out of the box (raw text), the
    policy's prompts still wrapped in its template; ``--judge.chat_template true`` on it is one line."""
    import dataclasses

    from klrl.eval import score

    model, params, tok = from_pretrained(GGUF)
    bare = dataclasses.replace(tok, chat_template=None)
    real = score.from_pretrained
    monkeypatch.setattr(score, "from_pretrained", lambda p: (model, params, bare) if "bare" in p else real(p))
    monkeypatch.setattr(score, "resolve_model_path", lambda p, field: p)
    out = tmp_path / "e.jsonl"
    argv = ["eval", str(GGUF), "--prompts", str(prompt_file), "--max-new-tokens", "4", "--judge", "bare",
            "--out", str(out)]  # fmt: skip
    assert klrl_main(argv) == 0
    text = capsys.readouterr().out
    assert "prompts in raw text" in text and "relevance" in text
    rows = _rows(out)
    assert all(r["judge_relevance_pmi_token_mean"] is None or np.isfinite(r["judge_relevance_pmi_token_mean"])
               for r in rows)  # fmt: skip
    line = one_line_error(capsys, klrl_main, [*argv[:-2], "--judge.chat_template", "true"])
    assert "--judge.chat_template true" in line and "no chat template" in line
