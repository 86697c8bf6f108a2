"""experiments/llm_study.py on the tiny test GGUF (policy and judge): the prepare stage stores every
pool response with its judge numbers and gold parts, the proxies' separation and best-of-n per prompt;
an arm (a PPO sweep, or the DPO arm on the strong proxy's own pairs) stores every held-out response of every
member at every checkpoint, and ``--extend`` adds to it (more iterations, new seeds); every preset's arms
are valid sweeps. experiments/llm_gold.py --replay rebuilds its stored check byte for byte. (The study's
gold-labelled pairs: tests/rewards/test_reward_pairs.py.)"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from experiments import llm_gold, llm_study

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf"


def _rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(x) for x in f]


@pytest.mark.parametrize("preset", sorted(llm_study.PRESETS))
def test_every_presets_arms_are_valid_sweeps(preset):
    from klrl.config.sweep import check_members

    ns = llm_study.parse(["--preset", preset, "--model-path", str(GGUF)])
    P = llm_study.PRESETS[preset]
    a = llm_study.arms(llm_study.base_config(ns, P), P)
    for members in a.values():
        check_members(members)  # one compiled program each
    seeds = len(P["seeds"].split(","))
    assert len(a["ctrl"]) == 7 * seeds  # fixed, then 3 controllers started 10x high and 10x low
    assert {(m.ctrl.kind, m.kl.beta) for m in a["ctrl"]} == {("fixed", P["ctrl_settle"])} | {
        (k, P["ctrl_settle"] * f) for k in ("proportional", "pi", "band") for f in (10.0, 0.1)
    }
    grpo = a["grpo"]
    assert {m.kl.loss_coef for m in grpo} == {0.04, 0.001} and all(m.kl.placement == "loss" for m in grpo)
    import klrl

    for b in llm_study._floats(P["dpo_betas"]):  # the DPO arm's settings are a valid DPOConfig
        klrl.DPOConfig(beta=b, lr=P["dpo_lr"], batch_size=P["dpo_batch"], iterations=P["dpo_iterations"],
                       eval_every=P["dpo_eval_every"], checkpoint_every=P["dpo_eval_every"])  # fmt: skip
    assert P["dpo_iterations"] % P["dpo_eval_every"] == 0  # the last checkpoint is an evaluated one


@pytest.mark.slow
def test_the_tiny_study_stores_every_response(tmp_path):
    res, out = tmp_path / "res", tmp_path / "runs"
    argv = ["--preset", "tiny", "--model-path", str(GGUF), "--judge", str(GGUF), "--out", str(out),
            "--results", str(res), "--stage", "prepare,grpo,dpo"]  # fmt: skip
    assert llm_study.main(argv) == 0
    P, study = llm_study.PRESETS["tiny"], json.loads((res / "study.json").read_text())
    held = _rows(res / "pool_heldout.jsonl.gz")
    assert len(held) == P["heldout"] * P["bon_k"]
    for r in held:
        assert {
            "completion",
            "ids",
            "gold",
            "sentiment",
            "relevance",
            "judge_nll",
            "proxy_strong",
            "proxy_weak",
        } <= set(r)
    assert set(study["separation"]) == {"strong", "weak", "difference"}
    assert study["separation"]["difference"]["n_prompts"] == P["heldout"]
    bon = json.loads(gzip.open(res / "bon.json.gz", "rt").read())
    assert np.shape(bon["strong/gold"]) == (len(bon["n"]), P["heldout"])
    ev = _rows(res / "grpo_eval.jsonl.gz")
    members = len(llm_study.arms(llm_study.base_config(llm_study.parse(argv), P), P)["grpo"])
    steps = P["grpo_iterations"] // P["eval_every"]
    assert len(ev) == P["heldout"] * (1 + members * steps)  # the base once, each member at each checkpoint
    assert {(r["member"], r["step"]) for r in ev} == {(-1, 0)} | {
        (j, s + 1) for j in range(members) for s in range(steps)
    }
    assert all(r["kl"] >= 0 and "gold" in r and "proxy_strong" in r for r in ev)
    assert all(r["kl"] == 0 for r in ev if r["step"] == 0)  # the base against itself
    # the DPO arm: one program of betas x seeds on the strong proxy's pairs, each checkpoint evaluated
    dev = _rows(res / "dpo_eval.jsonl.gz")
    runs = json.loads(gzip.open(res / "dpo_runs.json.gz", "rt").read())["runs"]
    betas, seeds = llm_study._floats(P["dpo_betas"]), [int(s) for s in P["seeds"].split(",")]
    assert [(r["beta"], r["seed"]) for r in runs] == [(b, s) for b in betas for s in seeds] and len(
        betas
    ) == 2
    steps = P["dpo_iterations"] // P["dpo_eval_every"]
    assert len(dev) == P["heldout"] * (1 + len(runs) * steps)
    assert {(r["member"], r["step"]) for r in dev} == {(-1, 0)} | {
        (j, (s + 1) * P["dpo_eval_every"]) for j in range(len(runs)) for s in range(steps)
    }
    assert all(r["kl"] == 0 for r in dev if r["step"] == 0) and any(r["kl"] > 0 for r in dev if r["step"] > 0)
    base = [r for r in ev if r["step"] == 0]  # the same base, prompts and keys as the grpo arm's
    assert [r["completion"] for r in dev if r["step"] == 0] == [r["completion"] for r in base]
    timing = study["timing"]["dpo"]
    assert timing["pairs"] == study["proxies"]["strong"]["pairs"] == runs[0]["config"]["pairs"]["train"]
    train = _rows(res / "pool_train.jsonl.gz")
    strong = llm_study.proxy_pairs(train, study["prompts"]["train"], P, study["seed"])["strong"]
    assert all(p["gold_chosen"] and train[p["rows"][0]]["gold"] > train[p["rows"][1]]["gold"] for p in strong)
    outs = ("claims.md", "claims.json", "llm_study.png")
    first = {f: (res / f).read_bytes() for f in outs}
    assert (
        "GRPO k3 loss 0.04" in first["claims.md"].decode()
        and "| turn arm | - | not run |" in first["claims.md"].decode()
    )
    assert all(f"DPO beta={b:g}: the gold peaks and falls" in first["claims.md"].decode() for b in betas)
    assert llm_study.main(["--replay", str(res)]) == 0
    assert {f: (res / f).read_bytes() for f in outs} == first  # the replay is byte for byte
    # --extend: the grpo sweep continued by one iteration (only its new checkpoint evaluated, the stored rows
    # kept), DPO with a new seed (its members numbered after the stored ones, the reference not repeated)
    more = P["grpo_iterations"] + 1
    assert llm_study.main([*argv[:-1], "grpo", "--extend", "--set", f"grpo_iterations={more}"]) == 0
    assert llm_study.main([*argv[:-1], "dpo", "--extend", "--set", "seeds=1"]) == 0
    ev2 = _rows(res / "grpo_eval.jsonl.gz")
    assert ev2[: len(ev)] == ev and {(r["member"], r["step"]) for r in ev2[len(ev) :]} == {
        (j, more) for j in range(members)
    }
    grpo = json.loads(gzip.open(res / "grpo_runs.json.gz", "rt").read())["runs"]
    assert all(len(r["metrics"]["kl/exact_seq_sum"]) == more for r in grpo)
    dev2, runs2 = (
        _rows(res / "dpo_eval.jsonl.gz"),
        json.loads(gzip.open(res / "dpo_runs.json.gz", "rt").read()),
    )
    assert runs2["runs"][: len(runs)] == runs and [r["seed"] for r in runs2["runs"][len(runs) :]] == [1, 1]
    assert dev2[: len(dev)] == dev and {r["member"] for r in dev2[len(dev) :]} == {2, 3}
    assert "before" in json.loads((res / "study.json").read_text())["timing"]["dpo"]
    with pytest.raises(SystemExit, match="seeds \\[1\\] are stored"):
        llm_study.main([*argv[:-1], "dpo", "--extend", "--set", "seeds=1"])


def test_llm_gold_replay_rebuilds_the_stored_check_byte_for_byte(tmp_path):
    src = ROOT / "experiments" / "results" / "llm_gold"
    shutil.copy(src / "judged.jsonl.gz", tmp_path / "judged.jsonl.gz")
    assert llm_gold.main(["--replay", "--results", str(tmp_path)]) == 0
    assert (tmp_path / "gold_check.json").read_bytes() == (src / "gold_check.json").read_bytes()


def _evals(kl, gold, prompts=8, noise=0.01):
    """Held-out rows from ``kl`` and ``gold`` ``[members, steps]`` (step 0 the shared base), each prompt the
    member's value plus a fixed per-prompt offset and a little noise (so per-prompt SEs are finite)."""
    rng = np.random.default_rng(0)
    kl, gold = np.asarray(kl, float), np.asarray(gold, float)
    rows = [{"member": -1, "step": 0, "prompt_idx": q, "kl": 0.0, "gold": gold[0, 0] + q / 10,
             "proxy_strong": 0.0, "completion": f"b{q}"} for q in range(prompts)]  # fmt: skip
    for j in range(kl.shape[0]):
        for s in range(1, kl.shape[1]):
            for q in range(prompts):
                rows.append({"member": j, "step": s, "prompt_idx": q, "kl": kl[j, s] + noise * rng.normal(),
                             "gold": gold[j, s] + q / 10 + noise * rng.normal(), "proxy_strong": 0.0,
                             "completion": f"m{j}s{s}q{q}"})  # fmt: skip
    return rows


def test_grpo_and_ctrl_claims_read_the_seed_interval_as_an_interval():
    from experiments import llm_study_report as rep

    flat = [
        [0, 1, 2, 2.0, 2.5, 3.0],
        [0, 1, 2, 2.0, 1.5, 1.0],
        [0, 1, 2, 2.0, 2.1, 1.9],
    ]  # slopes +-, mean ~0
    runs = [{"label": "GRPO k3 loss 0.04"}] * 3
    assert rep.grpo_claims(_evals(flat, np.zeros((3, 6))), runs)[0]["verdict"] == "**not shown**"
    up = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4.5, 5.5], [0, 1, 2, 3, 3.9, 5.2]]
    assert rep.grpo_claims(_evals(up, np.zeros((3, 6))), runs)[0]["verdict"] == "**rising**"
    at = [[0, 6, 6.1, 5.9, 6.0, 6.05], [0, 3, 5.9, 6.1, 6.0, 5.95], [0, 9, 6.0, 6.0, 6.1, 5.9]]
    cruns = [{"label": "pi from 1", "config": {"ctrl": {"target": 6.0}}}] * 3
    assert rep.ctrl_claims(_evals(at, np.zeros((3, 6))), cruns)[0]["verdict"] == "**tracks**"
    off = [[0, 6, 9, 9, 9, 9], [0, 6, 9.5, 9.5, 9.5, 9.5], [0, 6, 8.5, 8.5, 8.5, 8.5]]
    assert rep.ctrl_claims(_evals(off, np.zeros((3, 6))), cruns)[0]["verdict"] == "**tracking not shown**"


def test_dpo_claims_find_the_peak_and_its_kl_per_beta():
    from experiments import llm_study_report as rep

    kl = [[0, 1, 4, 9, 16]] * 2 + [[0, 0.1, 0.2, 0.3, 0.4]] * 2  # beta 0.1 x 2 seeds, beta 1 x 2 seeds
    gold = [[0, 1, 2, 1, 0], [0, 1.5, 2, 0.5, -1], [0, 0.1, 0.2, 0.3, 0.4], [0, 0.1, 0.2, 0.3, 0.4]]
    runs = [{"beta": b, "seed": s, "label": f"DPO beta={b:g}"} for b in (0.1, 1.0) for s in (0, 1)]
    ev = _evals(kl, gold)
    assert rep.falls(rep.table(ev, "gold")[2])[1] == [True, True, False, False]
    pk = rep.peak_kl(rep.table(ev, "gold")[2], rep.table(ev, "kl")[2])
    np.testing.assert_allclose(pk, [4, 4, 0.4, 0.4], atol=0.02)
    turn = {"peak_kl": {"value": 20.0, "lo": 15.0, "hi": 25.0}, "turn_kl": {"value": 21.0}}
    rows, curves = rep.dpo_claims(ev, runs, turn)
    assert len(rows) == 2 and curves["beta"] == [0.1, 0.1, 1.0, 1.0]
    assert rows[0]["verdict"].startswith("**peaks and falls on 2 of 2 seeds**; peak KL **below** PPO's")
    assert "peak at step 2, 2" in rows[0]["measured"] and "KL at the peak 4.00" in rows[0]["measured"]
    assert rows[1]["verdict"] == "**not shown**; peak KL not compared (no peak)"
    assert rep.dpo_claims(ev, runs, None)[0][0]["verdict"].endswith("no PPO turn arm to compare")


def test_dpo_against_ppo_at_matched_kl_interpolates_each_ppo_seed_at_dpos_kl():
    from experiments import llm_study_report as rep

    assert rep.at_kl(np.array([0, 2, 6]), np.array([0, 1, 3]), 4.0) == 2.0  # 1 + (4 - 2) / 4 x 2
    assert np.isnan(rep.at_kl(np.array([0, 2, 6]), np.array([0, 1, 3]), 7.0))  # never reached
    turn = _evals([[0, 10, 20], [0, 10, 20]], [[0, 1, 2], [0, 2, 4]], noise=0)  # PPO at KL 5: 0.5 and 1.0
    dpo = _evals([[0, 5], [0, 5], [0, 50], [0, 50]], [[0, 2], [0, 2], [0, 3], [0, 3]], noise=0)
    runs = [{"beta": b, "seed": s} for b in (0.1, 0.01) for s in (0, 1)]
    rows = rep.matched_claims(dpo, runs, turn)
    assert [r["verdict"] for r in rows] == [
        "**DPO higher**",
        "**not compared** (PPO's checkpoints never at this KL)",
    ]
    assert (
        "KL 5.0: DPO +2.350, PPO +1.100; difference +1.250" in rows[0]["measured"]
    )  # (+0.35: the prompts' offset)
    assert "below: linear from the base" in rows[0]["measured"] and "below" not in rows[1]["measured"]
    worse = rep.matched_claims(_evals([[0, 5]] * 2, [[0, 0.2]] * 2), runs[:2], turn)
    assert worse[0]["verdict"] == "**PPO higher**"


def test_the_plan_counts_a_dpo_step_as_two_responses_of_policy_update_and_reference_forward(capsys):
    from experiments.llm_turn import N_PARAMS as N

    P = llm_study.PRESETS["cpu"]
    tok, members = P["prompt_len"] + P["response_len"], 15
    train = members * P["dpo_iterations"] * P["dpo_batch"] * tok * 2 * (6 * N + 2 * N)
    per_response = (2 * N + 2 * 2 * N + 2 * 2 * N + 2 * 2 * 270e6) * tok  # rollout, KL, proxies, judge
    evals = (1 + members * (P["dpo_iterations"] // P["dpo_eval_every"])) * P["heldout"] * per_response
    assert llm_study.plan(P, {"dpo": members})["pflop"]["dpo"] == round((train + evals) / 1e15, 2) > 0
    assert llm_study.main(["--dry-run", "--stage", "dpo", "--model-path", str(GGUF)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["arms"]["dpo"][:2] == ["DPO beta=0.01 seed 0", "DPO beta=0.01 seed 1"]
        and len(out["arms"]["dpo"]) == 15
    )
    assert out["plan"]["pflop"]["dpo"] == round((train + evals) / 1e15, 2) and set(out["arms"]) == {"dpo"}
