"""experiments/llm_overopt.py: the gold by hand, the noisy pair labels against their rate, the report's
claims on synthetic stored results whose numbers are known (and ``--replay``), and the whole study at its
smallest on the tiny random Llama GGUF (every response of every member kept, the proxy's held-out accuracy
recorded)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments import llm_overopt

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf"


def test_gold_by_hand():
    from klrl.rewards.text import NEGATORS, POSITIVE

    assert "great" in POSITIVE and "good" in POSITIVE and "not" in NEGATORS and "day" not in POSITIVE
    g = llm_overopt.gold_parts("A great day", ref_logprob=-6.0, length=3)  # nll 2 < 4: no fluency cost
    assert g == pytest.approx({"gold": 1 / math.sqrt(3), "sentiment": 1 / math.sqrt(3), "repeated": 0.0,
                               "nll": 2.0})  # fmt: skip
    # both "great"s follow "not" within two words: -2/sqrt(3); 1 of 3 words repeats; nll 10 -> 0.5 * 6
    g = llm_overopt.gold_parts("not great great", ref_logprob=-30.0, length=3)
    assert g["sentiment"] == pytest.approx(-2 / math.sqrt(3))
    assert g["repeated"] == pytest.approx(1 / 3)
    assert g["gold"] == pytest.approx(-2 / math.sqrt(3) - 1 / 3 - 3.0)


def _sample(i: int, draw: int, text: str) -> dict:
    return {
        "prompt_idx": i,
        "draw": draw,
        "ids": [1, 2],
        "completion": text,
        "ref_logprob": -2.0,
        "length": 2,
    }


def test_pairs_take_the_higher_gold_and_flip_at_the_noise_rate():
    samples = [_sample(i, 0, "great" if i % 2 else "awful") for i in range(2000)]
    clean = llm_overopt.label_pairs(samples, 0.0, 0, per_sample=2)
    assert 1000 < len(clean) < 3000  # about half the draws pair "great" with "awful"; ties are dropped
    assert all(p["chosen"]["completion"] == "great" and p["rejected"]["completion"] == "awful" for p in clean)
    assert all(p["chosen"] is not p["rejected"] for p in clean)
    flipped = llm_overopt.label_pairs(samples, 1.0, 0)
    assert all(p["chosen"]["completion"] == "awful" and not p["gold_chosen"] for p in flipped)
    noisy = llm_overopt.label_pairs(samples, 0.3, 1)
    rate = np.mean([p["chosen"]["completion"] == "awful" for p in noisy])
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / len(noisy))
    assert all(p["gold_chosen"] == (p["chosen"]["completion"] == "great") for p in noisy)


# ---- the report on synthetic results -------------------------------------------------------------------
N, B, SEEDS = 12, 4, (0, 1, 2)


def _logprob_for(gold: float) -> float:
    """ref_logprob of a 2-token "good day" (sentiment 1/sqrt(2)) whose gold is ``gold`` (below it)."""
    excess = (1 / math.sqrt(2) - gold) / llm_overopt.NLL_COEF
    return -2 * (llm_overopt.NLL_FREE + excess)


def _write_results(res: Path) -> dict:
    """Two fixed betas and a PI controller, 3 seeds: beta=10 stays put; beta=0.01's KL grows, its proxy
    rises and its gold rises to iteration 4 then falls; the controller's KL sits at 3 +- 0.3."""
    runs, samples, it = [], [], np.arange(N)
    top = 1 / math.sqrt(2)
    for lab, kind, beta in (
        ("beta=0.01", "fixed", 0.01),
        ("beta=10", "fixed", 10.0),
        ("PI target=3", "pi", 1.0),
    ):
        for s in SEEDS:
            j = len(runs)
            if beta == 0.01:
                kl, proxy = 2.0 * it + 0.1 * s, 0.1 * it + 0.01 * s
                gold = top - 0.1 * np.abs(it - 4) - 0.01 * s
            elif beta == 10.0:
                kl, proxy, gold = 0.05 + 0.0 * it, 0.01 * (s - 1) + 0 * it, top - 0.02 * s + 0 * it
            else:
                kl, proxy, gold = 3.0 + 0.3 * np.sin(it + s), 0.05 * it, top - 0.01 * it
            ppl = 10 + it * (beta < 1)
            met = {"reward/task": proxy.tolist(), "kl/exact_seq_sum": kl.tolist(),
                   "ctrl/beta": (beta * (1 + 0.01 * it)).tolist(), "eval/ref_ppl": ppl.tolist(),
                   "ctrl/kl_observed_seq_sum": kl.tolist()}  # fmt: skip
            runs.append({"label": lab, "seed": s, "beta0": beta, "kind": kind, "dir": "", "metrics": met})
            for i in it:
                samples += [{"member": j, "iteration": int(i), "prompt_idx": k, "completion": "good day",
                             "reward": float(proxy[i]), "ref_logprob": _logprob_for(gold[i]), "length": 2}
                            for k in range(B)]  # fmt: skip
    configs = [{"ctrl": {"kind": r["kind"], "target": 3.0}} for r in runs]
    study = {
        "proxy": {"heldout_accuracy_vs_gold": 0.7, "pairs": {"heldout": 80}},
        "timing": {},
        "configs": configs,
    }
    (res / "study.json").write_text(json.dumps(study))
    with gzip.open(res / "metrics.json.gz", "wt") as f:
        json.dump(runs, f)
    with gzip.open(res / "samples.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(x) + "\n" for x in samples)
    return {"runs": runs}


def _by_claim(res: Path) -> dict:
    return {c["claim"]: c for c in json.loads((res / "claims.json").read_text())}


def test_report_claims_on_known_numbers_and_replay(tmp_path, capsys):
    _write_results(tmp_path)
    assert llm_overopt.main(["--replay", str(tmp_path)]) == 0
    for name in ("claims.md", "claims.json", "table.md", "samples.md", "llm_overopt.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    c = _by_claim(tmp_path)
    end = slice(N - 3, N)  # max(3, 12 // 6) = 3 iterations
    t2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom
    kl = np.array([np.mean((2.0 * np.arange(N) + 0.1 * s)[end]) for s in SEEDS])
    x = c["beta=0.01: KL at the end"]
    assert x["mean"] == pytest.approx(kl.mean())
    assert x["hi"] - x["mean"] == pytest.approx(t2 * kl.std(ddof=1) / math.sqrt(3))
    assert x["verdict"] == "holds"
    order = c["KL at the end: beta=10 - beta=0.01"]
    assert order["mean"] == pytest.approx(0.05 - kl.mean()) and order["verdict"] == "holds"
    # proxy +0.1/iteration: end window mean 10 * 0.1 = 1.0 above iteration 0, for every seed
    assert c["beta=0.01: proxy end - start"]["mean"] == pytest.approx(1.0)
    assert c["beta=0.01: proxy end - start"]["verdict"] == "holds"
    # gold: peak at iteration 4, 0.1 below it per iteration away; the end window (9..11) is 0.6 below
    peak = c["beta=0.01: gold at its peak (iteration 4) - gold at the end"]
    assert peak["mean"] == pytest.approx(0.6 - 0.2 / 3)  # peak window 3..5: 0.2/3 below the top
    assert peak["verdict"] == "holds"
    assert c["beta=0.01: gold end - start"]["mean"] == pytest.approx(
        -0.6 + 0.4
    )  # -0.2: 0.4 below peak at start
    assert c["beta=10: proxy end - start"]["verdict"] == "holds"  # exactly flat
    assert c["beta=10: gold end - start"]["verdict"] == "holds"
    assert c["beta=0.01: ref. perplexity end - start"]["mean"] == pytest.approx(10.0)
    gap = c["gold at the end: beta=0.01 - beta=10 (the best fixed beta)"]
    assert gap["mean"] == pytest.approx(np.mean([-0.6 - 0.01 * s + 0.02 * s for s in SEEDS]))
    assert gap["verdict"] == "holds"
    within = c["PI target=3: second-half KL mean within +-25%"]
    assert within["verdict"] == "holds"
    share = c["PI target=3: share of second-half iterations within +-25%"]
    assert share["mean"] == pytest.approx(1.0)
    assert "| beta=0.01 |" in (tmp_path / "table.md").read_text()


# ---- the whole study at its smallest -------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
def test_smallest_study_runs_end_to_end(tmp_path):
    res = tmp_path / "res"
    argv = ["--preset", "pilot", "--model-path", str(GGUF), "--out", str(tmp_path / "runs"),
            "--results", str(res),
            "--iterations", "2", "--seeds", "0,1", "--betas", "0.1", "--batch", "4", "--response-len", "8",
            "--prompt-len", "16", "--rm-prompts", "24"]  # fmt: skip
    assert llm_overopt.main(argv) == 0
    study = json.loads((res / "study.json").read_text())
    assert study["timing"]["members"] == 4 and len(study["configs"]) == 4  # (beta 0.1, PI) x 2 seeds
    p = study["proxy"]
    assert 0.0 <= p["heldout_accuracy_vs_gold"] <= 1.0 and p["n_samples"] == 48 and len(p["score"]) > 0
    with gzip.open(res / "metrics.json.gz", "rt") as f:
        runs = json.load(f)
    with gzip.open(res / "samples.jsonl.gz", "rt") as f:
        samples = [json.loads(x) for x in f]
    assert [r["label"] for r in runs] == ["beta=0.1", "beta=0.1", "PI target=3", "PI target=3"]
    for j, r in enumerate(runs):
        for i in range(2):
            rows = [s for s in samples if s["member"] == j and s["iteration"] == i]
            assert len(rows) == 4  # every response of the batch is kept
            assert np.mean([s["reward"] for s in rows]) == pytest.approx(
                r["metrics"]["reward/task"][i], abs=1e-4
            )
    assert (res / "claims.md").is_file() and (res / "llm_overopt.png").is_file()
    assert not list((tmp_path / "runs").rglob("checkpoints"))


@pytest.mark.parametrize("preset", sorted(llm_overopt.PRESETS))
def test_every_preset_makes_valid_members(preset):
    """Each preset's members validate as one sweep (the GPU preset included, which this machine cannot run):
    its fixed betas and the controller, once per seed, differing only in sweepable fields."""
    from klrl.config.sweep import check_members

    ns = llm_overopt.parse(["--preset", preset, "--model-path", str(GGUF)])
    p = llm_overopt.PRESETS[preset]
    members = llm_overopt.members_of(ns, llm_overopt.base_config(ns, p), p)
    seeds, betas = p["seeds"].split(","), p["betas"].split(",")
    assert len(members) == (len(betas) + 1) * len(seeds)
    assert [m.ctrl.kind for m in members[:: len(seeds)]] == ["fixed"] * len(betas) + ["pi"]
    assert all(m.train.batch_size % m.ppo.group_size == 0 for m in members)
    check_members(members)
