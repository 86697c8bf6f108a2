"""experiments/llm_beta.py at its smallest: a tiny random Llama GGUF (tests/data), one fixed beta and
a PI controller (a mixed fixed/adaptive sweep), 2 iterations. Checks the files it writes and that the
completions its recording reward kept are split per member correctly: their positivity, recomputed
here from the stored text with the lexicon rule written out independently, equals each member's
logged reward."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf"
POS = {"good", "great", "happy", "wonderful", "lovely", "calm", "nice"}


def _positivity_subset(text: str) -> float | None:
    """Positivity for texts whose only lexicon words are in POS and have no negator (else None)."""
    import re

    from klrl.rewards.text import NEGATIVE, NEGATORS, POSITIVE

    ws = re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower())
    if any(w in NEGATIVE or w in NEGATORS or (w in POSITIVE and w not in POS) for w in ws):
        return None
    return sum(w in POS for w in ws) / math.sqrt(max(len(ws), 1))


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_smallest_study_runs_and_records_each_members_samples(tmp_path):
    from experiments import llm_beta

    argv = [
        "--model.path", str(GGUF), "--data.limit", "8", "--data.prompt_len", "16",
        "--sampling.response_len", "4", "--train.batch_size", "4", "--ppo.minibatches", "2",
        "--ppo.epochs", "1", "--optim.lr", "1e-3", "--iterations", "2", "--betas", "0.1",
        "--target", "2", "--eval-prompts", "2", "--train.out_dir", str(tmp_path), "--train.name", "s",
        "--train.quiet", "true",
    ]  # fmt: skip
    assert llm_beta.main(argv) == 0
    out = tmp_path / "s"
    for f in ("table.md", "table.json", "samples.md", "eval.json", "iterations.json", "llm_beta.png"):
        assert (out / f).is_file(), f
    assert not (out / "checkpoints").exists()
    table = json.loads((out / "table.json").read_text())
    # one call per iteration (2), and the check call before compiling (klrl.checks.check_reward)
    assert len(table["rows"]) == 2 and table["timing"]["reward_calls"] == 3
    it = json.loads((out / "iterations.json").read_text())
    assert it["members"][1].startswith("pi target=2")
    rows = [json.loads(x) for x in gzip.open(out / "samples.jsonl.gz", "rt")]
    assert len(rows) == 2 * 2 and all(len(r["completions"]) == 4 for r in rows)
    sweep = json.loads((out / "sweep.json").read_text())["members"]
    checked = 0
    for j, name in enumerate(it["members"]):
        logged = (
            [json.loads(x)["reward/task"] for x in gzip.open(out / sweep[j] / "metrics.jsonl.gz", "rt")]
            if (out / sweep[j] / "metrics.jsonl.gz").is_file()
            else [json.loads(x)["reward/task"] for x in (out / sweep[j] / "metrics.jsonl").open()]
        )
        for r in (r for r in rows if r["member"] == name):
            mine = [_positivity_subset(t) for t in r["completions"]]
            if all(v is not None for v in mine):
                np.testing.assert_allclose(np.mean(mine), logged[r["iteration"]], atol=1e-5)
                checked += 1
            assert it["per_iteration"][j]["positivity"][r["iteration"]] == pytest.approx(
                logged[r["iteration"]], abs=1e-5
            )
    assert checked > 0
    ev = json.loads((out / "eval.json").read_text())
    assert ev["start"]["sampled"]["stats"]["kl_mc_seq_sum"] == pytest.approx(0.0, abs=1e-4)  # pi = ref
    assert set(ev["end"]) == set(it["members"])
