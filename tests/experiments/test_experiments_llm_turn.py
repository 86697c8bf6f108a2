"""experiments/llm_turn.py: the gold by hand, the proxies' pairs against their rate, best-of-n against
brute force over subsets, and every preset's arms as valid sweeps."""

from __future__ import annotations

import math
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from experiments import llm_turn

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf"


def test_gold_by_hand():
    g = llm_turn.gold_parts("A great day", judge_nll=2.0, free=3.0)  # below free: no fluency cost
    assert g == pytest.approx({"gold": 1 / math.sqrt(3), "sentiment": 1 / math.sqrt(3), "repeated": 0.0,
                               "judge_nll": 2.0})  # fmt: skip
    g = llm_turn.gold_parts("not great great", judge_nll=7.0, free=3.0)
    assert g["gold"] == pytest.approx(-2 / math.sqrt(3) - 1 / 3 - llm_turn.NLL_COEF * 4.0)


def test_pairs_take_the_higher_gold_and_flip_at_the_noise_rate():
    samples = [{"gold": float(i % 2), "i": i} for i in range(400)]
    clean = llm_turn.label_pairs(samples, 500, 0.0, 0)
    assert len(clean) == 500
    assert all(p["chosen"]["gold"] == 1.0 and p["rejected"]["gold"] == 0.0 for p in clean)
    noisy = llm_turn.label_pairs(samples, 2000, 0.3, 1)
    rate = np.mean([not p["gold_chosen"] for p in noisy])
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 2000)
    assert all(p["gold_chosen"] == (p["chosen"]["gold"] == 1.0) for p in noisy)


def test_best_of_n_is_the_mean_over_subsets_of_the_proxys_pick():
    rng = np.random.default_rng(0)
    k, prompts = 4, 3
    held = [{"prompt_idx": p, "draw": d, "gold": float(rng.normal()), "judge_nll": float(rng.normal())}
            for d in range(k) for p in range(prompts)]  # fmt: skip
    proxy = rng.normal(size=len(held))
    out = llm_turn.best_of_n(held, {"s": proxy}, k)
    assert out["n"] == [1, 2, 4] and out["prompts"] == prompts
    assert out["kl"] == pytest.approx([0.0, math.log(2) - 0.5, math.log(4) - 0.75])
    for i, n in enumerate(out["n"]):
        per = []
        for p in range(prompts):
            idx = [j for j, s in enumerate(held) if s["prompt_idx"] == p]
            per.append(np.mean([held[max(c, key=lambda j: proxy[j])]["gold"] for c in combinations(idx, n)]))
        assert out["s/gold"][i] == pytest.approx(np.mean(per))


@pytest.mark.parametrize("preset", sorted(llm_turn.PRESETS))
def test_every_preset_makes_arms_that_validate_as_sweeps(preset, tmp_path):
    from klrl.config.relevance import check_relevance
    from klrl.config.sweep import check_members

    ns = llm_turn.parse(["--preset", preset, "--model-path", str(GGUF), "--out", str(tmp_path)])
    p = llm_turn.preset_of(ns)
    arms = llm_turn.arms(llm_turn.base_config(ns, p), p)
    expect = {"turn"} if p["turn_iterations"] else set()
    expect |= {"frozen"} if p["frozen_iterations"] else set()
    expect |= {"ctrl"} if p["ctrl_iterations"] and p["ctrl_settle"] > 0 else set()
    expect |= ({"grid"} if p["grid_iterations"] else set()) | (
        {"recipe"} if p["recipe_iterations"] else set()
    )
    assert set(arms) == expect and expect
    assert {"cpu": {"turn", "frozen"}, "cpu-ctrl": {"ctrl"}, "cpu-recipe": {"grid", "recipe"}}.get(
        preset, expect
    ) == expect
    for members in arms.values():
        check_members(members)
        for m in members:  # no knob its controller does not read (ctrl.kp on proportional was ignored)
            check_relevance([m])
    assert all(m.lora.rank == 8 and m.data.eval_fraction > 0 for ms in arms.values() for m in ms)
    if "frozen" in arms:  # the large betas and their control at the frozen arm's (smaller) lr
        assert {m.optim.lr for m in arms["frozen"]} == {p["frozen_lr"]} and p["frozen_lr"] < p["turn_lr"]
    if "ctrl" in arms:  # the fixed settle beta, and each controller from 10x below and 10x above it
        betas = sorted({m.kl.beta for m in arms["ctrl"]})
        assert betas == pytest.approx([p["ctrl_settle"] / 10, p["ctrl_settle"], p["ctrl_settle"] * 10])
    for m in arms.get("recipe", []):  # warm-up at the grid's beta, then PI, rolled back on the judge's NLL
        assert m.ctrl.kind == "pi" and m.ctrl.warmup_iters == p["recipe_warmup"] > 0
        assert m.train.rollback_metric == llm_turn.JUDGE_KEY and m.train.rollback_factor == 2.0


def test_the_stored_results_replay_to_the_committed_claims(tmp_path):
    """``--replay`` rebuilds claims.md and claims.json of the stored study from its files alone."""
    import shutil

    res = ROOT / "experiments" / "results" / "llm_turn"
    shutil.copytree(res, tmp_path / "r")
    assert llm_turn.main(["--replay", str(tmp_path / "r")]) == 0
    for name in ("claims.md", "claims.json"):
        assert (tmp_path / "r" / name).read_text() == (res / name).read_text(), name


def test_a_second_arm_reuses_the_pools_and_proxies_of_the_first(tmp_path):
    """``--reuse``: the frozen arm trains against the turn arm's stored pools and proxies (nothing sampled or
    trained again: the pool files are byte for byte the first run's) and is added to its study.json."""
    import json

    common = ["--preset", "tiny", "--model-path", str(GGUF), "--judge", str(GGUF),
              "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]  # fmt: skip
    assert llm_turn.main([*common, "--arms", "turn"]) == 0
    res = tmp_path / "res"
    pools = {p.name: p.read_bytes() for p in res.glob("pool_*.jsonl.gz")}
    first = json.loads((res / "study.json").read_text())
    assert llm_turn.main([*common, "--arms", "frozen", "--reuse"]) == 0
    study = json.loads((res / "study.json").read_text())
    assert {p.name: p.read_bytes() for p in res.glob("pool_*.jsonl.gz")} == pools
    assert study["proxies"] == first["proxies"] and study["timing"]["turn"] == first["timing"]["turn"]
    assert study["timing"]["frozen"]["members"] == 2 and "--reuse" in study["timing"]["frozen"]["command"]
    assert (res / "frozen_metrics.json.gz").is_file() and (res / "turn_metrics.json.gz").is_file()
    claims = (res / "claims.md").read_text()
    assert "(control, same lr)" not in claims and "beta=10: gold flat" in claims  # tiny: no control beta


def test_best_of_n_extended_holds_the_pool_sampled_at_once(tmp_path, monkeypatch):
    """``--reuse --bon-k``: a held-out pool of 4 draws extended to 8 is byte for byte the pool sampled with 8
    draws at once (the new draws continue the stored keys), and so is best-of-n over it."""
    import json

    monkeypatch.setattr(llm_turn, "POOL_CHUNK", 4)  # tiny: 4 held-out prompts, one chunk per draw
    common = ["--preset", "tiny", "--model-path", str(GGUF), "--judge", str(GGUF), "--arms", "",
              "--out", str(tmp_path / "runs")]  # fmt: skip
    assert llm_turn.main([*common, "--results", str(tmp_path / "once"), "--set", "bon_k=8"]) == 0
    assert llm_turn.main([*common, "--results", str(tmp_path / "ext")]) == 0
    assert json.loads((tmp_path / "ext" / "bon.json").read_text())["n"] == [1, 2, 4]
    assert llm_turn.main([*common, "--results", str(tmp_path / "ext"), "--reuse", "--bon-k", "8"]) == 0
    from experiments.llm_overopt import load_gz

    once, ext = (load_gz(tmp_path / d / "pool_heldout.jsonl.gz", lines=True) for d in ("once", "ext"))
    same = lambda v: v if isinstance(v, (str, list)) else pytest.approx(v, rel=1e-4, abs=1e-5)
    for a, b in zip(once, ext, strict=True):  # the same responses; their scores to float-level noise
        assert b == {k: same(v) for k, v in a.items()}  # (batches padded to another width)
    bon_once, bon_ext = (json.loads((tmp_path / d / "bon.json").read_text()) for d in ("once", "ext"))
    assert bon_ext["n"] == [1, 2, 4, 8] and set(bon_ext) == set(bon_once)
    for k, v in bon_once.items():
        assert bon_ext[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    study = json.loads((tmp_path / "ext" / "study.json").read_text())
    assert study["sizes"]["bon_k"] == 8 and study["timing"]["bon_extend"]["new_responses"] == 16


def test_the_recipe_picks_from_the_grid_and_runs_with_the_judge_in_the_step(tmp_path):
    """``--arms grid,recipe --reuse``: the grid's beta = 1 beside the stored turn arm's 0.01 (the same lr),
    the choice by the stated rule from their held-out evaluations, then warm-up + PI with the training batch's
    judge NLL logged by the compiled step (the rollback's metric) and claims against the fixed beta."""
    import json

    common = ["--preset", "tiny", "--model-path", str(GGUF), "--judge", str(GGUF),
              "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]  # fmt: skip
    assert llm_turn.main([*common, "--arms", "turn"]) == 0
    assert llm_turn.main([*common, "--arms", "grid,recipe", "--reuse"]) == 0
    res = tmp_path / "res"
    study = json.loads((res / "study.json").read_text())
    ch = study["timing"]["recipe"]["choice"]
    assert set(ch["grid"]) == {"0.01", "1.0"} and ch["grid"]["0.01"]["arm"] == "turn"
    ok = {b: r for b, r in ch["grid"].items() if np.mean(r["judge_ratio"]) <= 1.1}
    best = max(ok, key=lambda b: np.mean(ok[b]["gold_gain"]))
    assert ch["beta"] == float(best) and ch["target"] == pytest.approx(np.mean(ok[best]["kl"]), abs=0.01)
    from experiments.llm_overopt import load_gz

    runs = load_gz(res / "recipe_metrics.json.gz")["runs"]
    assert len(runs) == 2 and all(r["kind"] == "pi" and r["beta0"] == ch["beta"] for r in runs)
    for r in runs:  # the judge's NLL per token of real text: a few nats, every iteration
        nll = r["metrics"][llm_turn.JUDGE_KEY]
        assert len(nll) == 3 and all(0.5 < x < 20 for x in nll)
        assert r["metrics"]["ctrl/beta"][0] == pytest.approx(ch["beta"])  # the warm-up's beta
    claims = (res / "claims.md").read_text()
    assert "recipe: the grid's choice" in claims and "recipe: rollbacks on a judge-NLL breach" in claims
