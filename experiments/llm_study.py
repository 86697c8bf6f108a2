"""The turn on a real LM, round four (issue 47): a gold that reads the prompt, two proxies checked apart on
the evaluation pool, every held-out response stored, controllers with room, GRPO beside PPO.

``python experiments/llm_study.py --stage prepare|turn|ctrl|grpo|dpo|all [--preset cpu|pilot|tiny|gpu]
[--results DIR] [--out DIR] [--dry-run]``

The design (the library does the work: :mod:`klrl.eval`, :mod:`klrl.rewards`, :mod:`klrl.analysis.overopt`):

1. ``prepare``: the reference (SmolLM2-135M-Instruct, the frozen base of every policy) answers each
   training prompt ``per_prompt`` times (the proxies' data) and each held-out prompt ``bon_k`` times (the
   best-of-n pool and the evaluation pool); the independent judge (Gemma 3 270M, raw text) reads every
   response alone and after its prompt; the gold (:mod:`klrl.eval.gold`: VADER sentiment, repetition,
   fluency and relevance, its medians calibrated on the training pool) scores each. Gold-labelled pairs of
   responses to the same prompt (ties dropped) train two head-only Bradley-Terry proxies on PPO's own text
   (prompt and response; :func:`klrl.rewards.train.train`): ``strong`` on ``pairs_strong`` clean pairs,
   ``weak`` on ``pairs_weak`` pairs with ``weak_noise`` of their labels flipped. Both are scored on the
   held-out pool: pairwise accuracy against the gold on every within-prompt pair and their difference,
   with prompt-bootstrap intervals (:func:`klrl.analysis.overopt.accuracy_difference`). Best-of-n for
   n = 1..``bon_k`` by each proxy, per prompt, so the bootstrap resamples prompts.
2. The arms, each one compiled :func:`klrl.sweep` against the strong proxy (``model.reward_path``), LoRA r8
   on the frozen base, checkpoints every ``eval_every`` iterations, each checkpoint of each member evaluated
   on the held-out prompts with every response stored (:func:`klrl.eval.heldout.evaluate`: text, ids, exact
   KL, judge NLL, relevance, gold parts, both proxies):

   * ``turn``: fixed small beta, ``seeds`` seeds, ``turn_iterations`` at ``turn_lr``;
   * ``ctrl``: proportional, PI and the band rule (x2 / /2 beyond 1.5x / below 1/1.5x the target), each
     started 10x high and 10x low from ``ctrl_settle``, beside fixed ``ctrl_settle``, at ``ctrl_lr``;
   * ``grpo``: group-relative advantages, the KL in the loss (k3 per token, ``kl.loss_coef`` 0.04 and
     0.001), against PPO's per-token shaping in the turn arm (the same proxy, gold, lr and prompts) at
     matched KL;
   * ``dpo`` (:func:`run_dpo`): no proxy, no sampling: sigmoid DPO at each of ``dpo_betas`` x ``seeds``, one
     :func:`klrl.dpo` program, on exactly the strong proxy's clean pairs (rebuilt from the stored pool), its
     checkpoints every ``dpo_eval_every`` iterations evaluated as the PPO arms'.
3. ``llm_study_report.py`` turns the stored files into ``claims.md``, ``claims.json`` and the figure
   (``--replay DIR``: from DIR's files alone).

Everything stored under ``--results`` is per response, so every claim recomputes from it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if not __package__:
    sys.path.insert(0, str(HERE.parent))

# the cpu preset is what ran on the 2-core machine (FINDINGS, fourth round): prepare 43 min; the turn arm's 64
# iterations as 32, then --extend to 64 (64 + 70 min); dpo seed 0, then --extend seeds 1, 2; ctrl, grpo sized
_CPU: dict[str, Any] = {
    "batch": 16, "response_len": 24, "prompt_len": 40, "per_prompt": 6, "heldout": 32, "bon_k": 8,
    "pairs_strong": 8000, "pairs_weak": 400, "weak_noise": 0.3, "seeds": "0,1,2", "rm_epochs": 4,
    "turn_betas": "0.01", "turn_iterations": 64, "turn_lr": 2e-3,
    "ctrl_settle": 0.1, "ctrl_target": 6.0, "ctrl_iterations": 48, "ctrl_lr": 3e-4,
    "grpo_coefs": "0.04,0.001", "grpo_iterations": 100, "group_size": 4,
    "eval_every": 4, "eval_n": 1, "minibatches": 2, "epochs": 1, "advantage": "rloo",
    "dpo_betas": "0.01,0.03,0.1,0.3,1", "dpo_iterations": 24, "dpo_lr": 5e-4, "dpo_batch": 8,
    "dpo_eval_every": 8,
}  # fmt: skip
# the sizes the prepare stage used: an arm runs on a prepared study only if these agree (the arms' own sizes,
# iterations and learning rates, may differ from the preparation's and are stored with each arm)
PREPARE_KEYS = ("response_len", "prompt_len", "per_prompt", "heldout", "bon_k", "pairs_strong", "pairs_weak",
                "weak_noise", "rm_epochs")  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": _CPU,
    # a few iterations of each arm, one seed: the timing and the KL's step, to size the cpu preset
    "pilot": {**_CPU, "per_prompt": 2, "heldout": 16, "bon_k": 4, "pairs_strong": 400, "pairs_weak": 100,
              "seeds": "0", "turn_iterations": 4, "ctrl_iterations": 4, "grpo_iterations": 4,
              "eval_every": 2, "dpo_iterations": 4, "dpo_eval_every": 2},
    # the smallest study, on the tiny test GGUF (tests/experiments/test_experiments_llm_study.py)
    "tiny": {**_CPU, "batch": 4, "response_len": 6, "prompt_len": 12, "per_prompt": 2, "heldout": 4,
             "bon_k": 4, "pairs_strong": 20, "pairs_weak": 8, "seeds": "0", "rm_epochs": 1,
             "turn_iterations": 2, "ctrl_iterations": 2, "grpo_iterations": 2, "eval_every": 1,
             "minibatches": 1, "group_size": 2, "dpo_betas": "0.1,1", "dpo_iterations": 2, "dpo_batch": 4,
             "dpo_eval_every": 1},
    "gpu": {**_CPU, "batch": 64, "response_len": 48, "prompt_len": 64, "per_prompt": 16, "heldout": 64,
            "bon_k": 64, "pairs_strong": 16000, "turn_iterations": 200, "ctrl_iterations": 96,
            "grpo_iterations": 200, "minibatches": 4, "epochs": 2, "dpo_iterations": 100, "dpo_batch": 32,
            "dpo_eval_every": 10},
}  # fmt: skip
CTRL = (  # Ziegler's rule with a one-batch horizon; the PI of round three; the band rule (x2 / /2 past 1.5x)
    ("proportional", {"horizon": 16.0, "clip": 0.2}),
    ("pi", {"kp": 0.3, "ki": 0.05, "integral_max": 2.0}),
    ("band", {"band": 1.5, "factor": 2.0}),
)


# ---- the configs -----------------------------------------------------------------------------------------
def base_config(ns: argparse.Namespace, P: dict[str, Any], reward_path: str = "") -> Any:
    """Every member's shared config: LoRA r8 on the frozen base, the proxy as the reward model, the exact KL
    logged, held-out prompts kept out of training, a checkpoint every ``eval_every`` iterations."""
    import klrl

    return klrl.RunConfig.from_dict({
        "task": {"name": "text"},
        "model": {"path": ns.model_path, "reward_path": reward_path, "remat": ns.remat},
        "lora": {"rank": 8},
        "data": {"prompt_len": P["prompt_len"], "eval_fraction": P["heldout"] / 400, "eval_every": 0},
        "sampling": {"response_len": P["response_len"]},
        "kl": {"beta": 0.1, "exact_metric": True},
        "ctrl": {"estimator": "full"},
        "ppo": {"epochs": P["epochs"], "minibatches": P["minibatches"], "normalize_reward": True,
                "advantage": P["advantage"], "group_size": P["group_size"]},
        "optim": {"lr": P["turn_lr"], "max_grad_norm": 1.0, "critic_max_grad_norm": 1.0},
        "train": {"iterations": 1, "batch_size": P["batch"], "quiet": True, "samples_every": 1,
                  "samples_n": P["batch"], "checkpoint_every": P["eval_every"], "keep_checkpoints": 1000,
                  "name": "llm_study", "out_dir": ns.out},
    })  # fmt: skip


def _floats(v: str) -> list[float]:
    return [float(x) for x in str(v).split(",") if x]


def arms(base: Any, P: dict[str, Any]) -> dict[str, list[Any]]:
    """The members of each arm (module docstring), configuration-major, one per seed."""
    out: dict[str, list[Any]] = {}
    fixed = {"kind": "fixed"}
    t = base.replace(train={"iterations": P["turn_iterations"]}, ctrl=fixed)
    out["turn"] = [t.replace(kl={"beta": b}) for b in _floats(P["turn_betas"])]
    c = base.replace(train={"iterations": P["ctrl_iterations"]}, optim={"lr": P["ctrl_lr"]})
    settle, target = P["ctrl_settle"], P["ctrl_target"]
    out["ctrl"] = [c.replace(kl={"beta": settle}, ctrl=fixed)] + [
        c.replace(kl={"beta": settle * f}, ctrl={"kind": kind, "target": target, "unit": "seq_sum", **gains})
        for kind, gains in CTRL
        for f in (10.0, 0.1)
    ]
    g = base.replace(train={"iterations": P["grpo_iterations"]}, ctrl=fixed,
                     ppo={"advantage": "grpo", "group_size": max(2, P["group_size"])})  # fmt: skip
    # the loss coefficient is the controlled (fixed) coefficient, so it is in the state and can be swept
    loss, unset = {"kind": "fixed", "drives": "loss"}, type(base.kl)().beta  # (no KL in the reward)
    out["grpo"] = [g.replace(kl={"placement": "loss", "loss_estimator": "k3", "loss_coef": k, "beta": unset},
                             ctrl=loss) for k in _floats(P["grpo_coefs"])]  # fmt: skip
    seeds = [int(s) for s in str(P["seeds"]).split(",")]
    return {k: [m.replace(train={"seed": s}) for m in v for s in seeds] for k, v in out.items()}


def label(cfg: Any) -> str:
    if cfg.kl.placement == "loss":
        return f"GRPO k3 loss {cfg.kl.loss_coef:g}"
    if cfg.ctrl.kind == "fixed":
        return f"beta={cfg.kl.beta:g}" + (" (GRPO adv.)" if cfg.ppo.advantage == "grpo" else "")
    return f"{cfg.ctrl.kind} from {cfg.kl.beta:g}"


# ---- stored files ------------------------------------------------------------------------------------------
def dump(path: Path, rows: Any) -> None:  # (read back by llm_study_report.load)
    """JSON lines (a list) or one JSON document, gzipped without a timestamp (same rows, same bytes)."""
    text = (
        "".join(json.dumps(r) + "\n" for r in rows) if isinstance(rows, list) else json.dumps(rows, indent=1)
    )
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write(text.encode())


# ---- prepare: pools, judge, gold, proxies, best-of-n -------------------------------------------------------
def train_proxy(task: Any, feats: np.ndarray, train: list[dict], held: list[dict], P: dict, seed: int) -> Any:
    """A head-only Bradley-Terry proxy (:func:`klrl.rewards.train.train_head`) on ``train`` pairs, from
    ``feats`` (the reference's last hidden state on PPO's text of each pool response, computed once);
    returns its score vector and record (the held-out accuracy on ``held``'s clean labels)."""
    from klrl.rewards.train import TrainSettings, train_head

    side = lambda recs, k, clean: feats[[p["rows"][k ^ (clean and not p["gold_chosen"])] for p in recs]]
    s = TrainSettings(epochs=P["rm_epochs"], lr=3e-3, batch_size=32, seed=seed)
    t0 = time.time()
    score, hist = train_head(task.policy, (side(train, 0, False), side(train, 1, False)),
                             (side(held, 0, True), side(held, 1, True)), s)  # fmt: skip
    rec = {"pairs": len(train), "label_agreement": float(np.mean([r["gold_chosen"] for r in train])),
           "heldout_pairs": len(held), "heldout_accuracy": hist[-1]["eval_accuracy"], "history": hist,
           "seconds": round(time.time() - t0, 1), "score": np.asarray(score).tolist()}  # fmt: skip
    return score, rec


def proxy_pairs(train: list[dict], prompts: list[Any], P: dict, seed: int) -> dict[str, list[dict]]:
    """The proxies' pairs from the training pool: ``strong`` (clean) and ``weak`` (noisy) from the first 80%
    of its prompts, ``val`` (clean, at most 2000) from the rest; the DPO arm trains on ``strong``."""
    from klrl.rewards.pairs import gold_pairs

    cut = int(0.8 * len(prompts))
    fit = [r["prompt_idx"] < cut for r in train]
    out = {
        "val": [p for p in gold_pairs(train, prompts, 10**9, 0.0, seed + 3) if not fit[p["rows"][0]]][:2000]
    }
    for tag, n, noise in (("strong", P["pairs_strong"], 0.0), ("weak", P["pairs_weak"], P["weak_noise"])):
        out[tag] = [p for p in gold_pairs(train, prompts, 10**9, noise, seed + 1) if fit[p["rows"][0]]][:n]
    return out


def fit_proxies(task: Any, base: Any, splits: Any, train: list, held: list, P: dict, seed: int) -> tuple:
    """The strong and the weak proxy (module docstring) from the training pool, held-out accuracy on the
    pairs of its last 20% of prompts; each held-out pool response gets ``proxy_<tag>``."""
    from klrl.rewards.model import RewardModel
    from klrl.rewards.train import last_hidden

    prompts = splits.train.prompts
    rm = lambda score: RewardModel(task.policy, task.policy_params, score, task.tokenizer, base.data,
                                   base.sampling)  # fmt: skip
    tok, mask = rm(None).encode([prompts[r["prompt_idx"]] for r in train], [r["completion"] for r in train])
    feats = np.asarray(last_hidden(task.policy, task.policy_params, tok, mask))  # once per response
    sets = proxy_pairs(train, prompts, P, seed)
    proxies, records = {}, {}
    for tag in ("strong", "weak"):
        tr = sets[tag]
        score, records[tag] = train_proxy(task, feats, tr, sets["val"], P, seed)
        proxies[tag] = rm(score)
        print(f"proxy {tag}: {len(tr)} pairs, held-out accuracy {records[tag]['heldout_accuracy']:.3f}")
    for tag, model in proxies.items():
        scores = model.score(
            [splits.eval.prompts[r["prompt_idx"]] for r in held], [r["completion"] for r in held]
        )
        for r, x in zip(held, scores, strict=True):
            r[f"proxy_{tag}"] = float(x)
    return proxies, records


def prepare(ns: argparse.Namespace, P: dict[str, Any], res: Path) -> dict[str, Any]:
    """Stage 1 (module docstring): every file it writes is per response or per pair."""
    from experiments.llm_study_report import best_of_n
    from experiments.llm_turn import default_judge
    from klrl.analysis.overopt import accuracy_difference, pair_accuracy
    from klrl.api import build_task
    from klrl.data.prompts import load_prompts
    from klrl.eval import gold
    from klrl.eval.heldout import judge_rows, reference_rows
    from klrl.eval.score import Judge
    from klrl.rewards.pairs import text_format
    from klrl.rewards.train import save_reward_model

    base = base_config(ns, P)
    task = build_task(base, None)
    splits = load_prompts(base.data, task.tokenizer)  # the task's own split: the same prompts, same order
    judge = Judge.load(ns.judge or default_judge())
    t0, timing = time.time(), {}
    sample = lambda pool, n, seed: reference_rows(task.policy, task.policy_params, task.tokenizer, pool, n,
                                                  P["response_len"], seed)  # fmt: skip
    train, held = sample(splits.train, P["per_prompt"], ns.seed), sample(splits.eval, P["bon_k"], ns.seed + 7)
    timing["sample_s"] = round(time.time() - t0, 1)
    judge_rows(judge, splits.train.prompts, train)
    judge_rows(judge, splits.eval.prompts, held)
    timing["judge_s"] = round(time.time() - t0 - timing["sample_s"], 1)
    free = gold.calibrate([r["judge_nll"] for r in train], [r["relevance"] for r in train])
    for r in train + held:
        r.update(gold.gold_parts(r["completion"], r["judge_nll"], r["relevance"], free))
    proxies, records = fit_proxies(task, base, splits, train, held, P, ns.seed)
    g, q = np.array([r["gold"] for r in held]), np.array([r["prompt_idx"] for r in held])
    sep = {tag: pair_accuracy([r[f"proxy_{tag}"] for r in held], g, q) for tag in proxies}
    sep["difference"] = accuracy_difference(
        [r["proxy_strong"] for r in held], [r["proxy_weak"] for r in held], g, q
    )
    rm_dir = Path(ns.out) / "llm_study-proxy-strong"
    save_reward_model(task.policy, task.policy_params, proxies["strong"].score_head, task.tokenizer, rm_dir)
    fmt = text_format(task.tokenizer, base.data, base.sampling)
    (rm_dir / "reward_model.json").write_text(json.dumps({"text_format": fmt}) + "\n")
    timing["prepare_s"] = round(time.time() - t0, 1)
    dump(res / "pool_train.jsonl.gz", train)
    dump(res / "pool_heldout.jsonl.gz", held)
    dump(res / "bon.json.gz", best_of_n(held, list(proxies), P["bon_k"]))
    study = {"preset": ns.preset, "sizes": P, "seed": ns.seed, "free": free, "judge": judge.path,
             "judge_format": judge.format,
             "coefs": {"rep": gold.REP_COEF, "nll": gold.NLL_COEF, "rel": gold.REL_COEF},
             "prompts": {"train": list(splits.train.prompts), "heldout": list(splits.eval.prompts)},
             "proxies": records, "separation": sep, "reward_path": str(rm_dir),
             "timing": {"prepare": timing}}  # fmt: skip
    (res / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    print(f"proxies on the held-out pool: strong {sep['strong']['value']:.3f} [{sep['strong']['lo']:.3f}, "
          f"{sep['strong']['hi']:.3f}], weak {sep['weak']['value']:.3f} [{sep['weak']['lo']:.3f}, "
          f"{sep['weak']['hi']:.3f}], separated: {sep['difference']['separated']}", flush=True)  # fmt: skip
    return study


# ---- the arms ----------------------------------------------------------------------------------------------
EVAL_SEED = 99_991  # every evaluation draws with this key: common random numbers across policies


def evaluate_arm(name: str, base: Any, dirs: list[Path], study: dict, P: dict, **only: Any) -> list[dict]:
    """Every member (``dirs``: the run directories of a PPO or a DPO sweep's members, in order) at step 0 (the
    base) and at each checkpoint: ``eval_n`` responses to each held-out prompt, every response stored with
    its KL, judge, gold parts and both proxies (:func:`klrl.eval.heldout.evaluate_runs`; ``only``: its
    ``skip`` and ``reference``, for a continued arm)."""
    from klrl.eval.heldout import evaluate_runs
    from klrl.eval.score import Judge
    from klrl.rewards.model import RewardModel

    fmt, head = (base.data, base.sampling), lambda r: np.asarray(r["score"], np.float32)
    rms = lambda src: {t: RewardModel(src.model, src.ref_params, head(r), src.tok, *fmt).score
                       for t, r in study["proxies"].items()}  # fmt: skip
    msg = "{} eval step {} member {}: kl {kl:.2f} gold {gold:.3f} duplicates {duplicates:.2f}"
    log = lambda j, step, s: print(msg.format(name, step, j, **s), flush=True)
    return evaluate_runs(dirs, Judge.load(study["judge"]), study["free"], base.data, proxies=rms, log=log,
                         max_new=P["response_len"], n=P["eval_n"], seed=EVAL_SEED, **only)  # fmt: skip


def run_arm(name: str, ns: argparse.Namespace, P: dict, study: dict, res: Path) -> dict[str, Any]:
    """One arm: its sweep, its held-out evaluations, its metrics and training samples, stored in ``res``.
    ``--extend``: the arm's sweep in ``--out`` continued to this preset's iterations (bit for bit as one
    longer run), only its new checkpoints evaluated and added to the stored ones."""
    import klrl
    from experiments.llm_study_report import load
    from klrl.io.readers import read_sweep_members

    base = base_config(ns, P, study["reward_path"])
    members = arms(base, P)[name]
    stamps: list[float] = []

    def on_step(i: int, m: dict) -> None:
        stamps.append(time.time())
        kl = np.round(np.asarray(m["kl/exact_seq_sum"]), 2).tolist()
        print(f"{name} iteration {i}: exact KL {kl}", flush=True)

    t0, out = time.time(), Path(ns.out) / f"llm_study-{name}"
    stored = res / f"{name}_eval.jsonl.gz"  # --extend with none stored: a killed first run, continued
    old = load(stored) if ns.extend and stored.is_file() else []
    results = list(klrl.sweep(members, out_dir=out, resume=out if ns.extend else None, on_step=on_step))
    t1 = time.time()
    sweep_dir, done = results[0].dir.parent, tuple(sorted({r["step"] for r in old if r["member"] >= 0}))
    dirs = [sweep_dir / d for d in read_sweep_members(sweep_dir)]
    evals = old + evaluate_arm(name, base, dirs, study, P, skip=done, reference=not old)
    runs = [{"label": label(c), "seed": c.train.seed, "config": c.to_dict(),
             "metrics": {k: np.asarray(v, float).tolist() for k, v in r.metrics.items()}}
            for c, r in zip(members, results, strict=True)]  # fmt: skip
    samples = [{"member": j, **json.loads(x)} for j, r in enumerate(results)
               for x in (r.dir / "samples.jsonl").read_text().splitlines() if x]  # fmt: skip
    dump(res / f"{name}_eval.jsonl.gz", evals)
    dump(res / f"{name}_runs.json.gz", {"runs": runs})
    dump(res / f"{name}_samples.jsonl.gz", samples)
    return {"train_s": round(t1 - t0, 1), "eval_s": round(time.time() - t1, 1), "members": len(members),
            "median_s_per_sweep_iteration": float(np.median(np.diff(stamps))) if len(stamps) > 1 else None,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
            "load_avg_1min_end": os.getloadavg()[0], "sweep_dir": str(sweep_dir)}  # fmt: skip


def run_dpo(ns: argparse.Namespace, P: dict, study: dict, res: Path) -> dict[str, Any]:
    """The DPO arm: sigmoid DPO at each beta of ``dpo_betas`` x ``seeds``, one :func:`klrl.dpo` program,
    LoRA r8 on the same base, on the strong proxy's own pairs (rebuilt from the stored training pool: the same
    :func:`proxy_pairs`, seed and filter), its held-out pairs the proxies' ``val``; every checkpoint of every
    member evaluated as the PPO arms' (:func:`evaluate_arm`)."""
    import klrl
    from experiments.llm_study_report import load
    from klrl.models.pretrained import from_pretrained
    from klrl.rewards.pairs import encode_as_ppo

    base = base_config(ns, P)
    train, seed = load(res / "pool_train.jsonl.gz"), study.get("seed", ns.seed)  # (the preparation's seed)
    sets = proxy_pairs(train, study["prompts"]["train"], P, seed)
    if len(sets["strong"]) != study["proxies"]["strong"]["pairs"]:
        raise SystemExit(f"error: {len(sets['strong'])} pairs rebuilt, the strong proxy had "
                         f"{study['proxies']['strong']['pairs']}: give the preparation's --seed")  # fmt: skip
    recs = lambda ps: [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in ps]
    held = encode_as_ppo(recs(sets["val"]), from_pretrained(ns.model_path)[2], base.data, base.sampling)
    every, seeds = P["dpo_eval_every"], [int(x) for x in str(P["seeds"]).split(",")]
    stored = load(res / "dpo_runs.json.gz")["runs"] if ns.extend else []  # --extend: these seeds added
    if clash := sorted({m["seed"] for m in stored} & set(seeds)):
        raise SystemExit(f"error: --extend: seeds {clash} are stored already; give new seeds")
    cfg = klrl.DPOConfig(
        lr=P["dpo_lr"],
        batch_size=P["dpo_batch"],
        iterations=P["dpo_iterations"],
        eval_every=every,
        checkpoint_every=every,
        eval_prompts=min(16, len(held)),
    )
    names = [Path(ns.out) / ("llm_study-dpo" + (f"-{i}" if i else "")) for i in range(1000)]
    used = [p for p in names if p.exists()]
    # a new run directory (klrl.dpo refuses a used one), or with --resume-dpo the newest, continued
    out = used[-1] if ns.resume_dpo and used else next(p for p in names if not p.exists())
    t0 = time.time()
    r = klrl.dpo(recs(sets["strong"]), model_path=ns.model_path, cfg=cfg, betas=_floats(P["dpo_betas"]),
                 seeds=seeds, lora=base.lora, data=base.data, sampling=base.sampling, heldout=held,
                 run_dir=out, resume=out in used, log=lambda x: print(f"dpo {x}", flush=True))  # fmt: skip
    t1 = time.time()
    new = evaluate_arm("dpo", base, [m.dir for m in r.members], study, P, reference=not stored)
    evals = (load(res / "dpo_eval.jsonl.gz") if stored else []) + [
        {**x, "member": x["member"] + len(stored)} for x in new
    ]  # the new members numbered after the stored ones
    doc = json.loads((out / "config.json").read_text())
    runs = stored + [{"label": f"DPO beta={m.beta:g}", "seed": m.seed, "beta": m.beta, "config": doc,
                      "metrics": m.rows} for m in r.members]  # fmt: skip
    dump(res / "dpo_eval.jsonl.gz", evals)
    dump(res / "dpo_runs.json.gz", {"runs": runs})
    return {"train_s": round(t1 - t0, 1), "eval_s": round(time.time() - t1, 1), "members": len(runs),
            "pairs": len(sets["strong"]), "heldout_pairs": len(held), "run_dir": str(out),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}  # fmt: skip


# ---- the plan ---------------------------------------------------------------------------------------------
def plan(P: dict[str, Any], members: dict[str, int]) -> dict[str, Any]:
    """FLOPs and time of each stage: ``2 N`` per token for a forward (rollout, scoring by policy, reference
    and proxy, the evaluations' sampling, exact KL and proxies), ``6 N epochs`` for the update, the judge's
    two forwards at 270 M parameters; a DPO step ``2`` responses x (the policy's forward and backward
    ``6 N`` + the reference's forward ``2 N``) per token and pair; at the CPU rates measured
    (:data:`experiments.llm_turn.CPU_GFLOPS`) and at an assumed 100 TFLOP/s for one GPU (not measured)."""
    from experiments.llm_turn import CPU_GFLOPS, N_PARAMS

    N, J, tok = N_PARAMS, 270e6, P["prompt_len"] + P["response_len"]
    it = {"rollout": 2 * N, "scoring": 3 * 2 * N, "update": 6 * N * P["epochs"]}
    per_it = {k: P["batch"] * tok * f for k, f in it.items()}
    per_dpo = {"scoring": P["dpo_batch"] * tok * 2 * 2 * N, "update": P["dpo_batch"] * tok * 2 * 6 * N}
    per_resp = {
        "rollout": 2 * N * tok,
        "scoring": (2 * 2 * N + 2 * 2 * N + 2 * 2 * J) * tok,
    }  # KL, proxies, judge
    flop, sec = {}, {}
    pool = P["per_prompt"] * (400 - P["heldout"]) + P["bon_k"] * P["heldout"]
    flop["prepare"] = pool * sum(per_resp.values())
    sec["prepare"] = pool * sum(v / CPU_GFLOPS[k] for k, v in per_resp.items()) / 1e9
    for arm, n in members.items():
        its, step = P[f"{arm}_iterations"], per_dpo if arm == "dpo" else per_it
        evals = (1 + n * (its // P.get(f"{arm}_eval_every", P["eval_every"]))) * P["heldout"]
        flop[arm] = n * its * sum(step.values()) + evals * sum(per_resp.values())
        sec[arm] = (n * its * sum(v / CPU_GFLOPS[k] for k, v in step.items())
                    + evals * sum(v / CPU_GFLOPS[k] for k, v in per_resp.items())) / 1e9  # fmt: skip
    return {"members": members, "pflop": {k: round(v / 1e15, 2) for k, v in flop.items()},
            "cpu_min_estimated": {k: round(v / 60, 1) for k, v in sec.items()},
            "gpu_min_at_100_tflops": {k: round(v / 100e12 / 60, 2) for k, v in flop.items()},
            "rates_gflops": CPU_GFLOPS, "note": "CPU rates measured on SmolLM2 (benchmarks/NOTES.md); "
            "100 TFLOP/s is an assumed sustained H100 rate, not measured"}  # fmt: skip


# ---- the command -----------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    from experiments.llm_beta import default_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", default="all", help="prepare, turn, ctrl, grpo, dpo, or all (comma-separated)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--out", default="runs", help="the sweeps' run directories and the proxy (not committed)")
    p.add_argument("--results", default=str(HERE / "results" / "llm_study"), help="the stored results")
    p.add_argument("--model-path", default=default_gguf())
    p.add_argument("--judge", default="", help="the independent judge (default: the Gemma 3 270M GGUF)")
    p.add_argument("--remat", default="none")
    p.add_argument("--seed", type=int, default=0, help="the pools' samples, the pairs and their labels")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override a preset's sizes")
    p.add_argument("--dry-run", action="store_true", help="print the arms' members and sizes, run nothing")
    p.add_argument("--resume-dpo", action="store_true",
                   help="continue the newest dpo run in --out (a finished one: only evaluated)")  # fmt: skip
    p.add_argument(
        "--extend",
        action="store_true",
        help="continue the stored arm: a PPO arm's sweep to more iterations, DPO with new seeds",
    )
    p.add_argument("--replay", metavar="DIR", default="", help="rebuild the claims and figure from DIR alone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    from experiments.llm_study_report import finish

    if ns.replay:
        return finish(Path(ns.replay))
    P = dict(PRESETS[ns.preset])
    for kv in ns.set:
        k, _, v = kv.partition("=")
        if k not in P:
            raise SystemExit(f"error: --set {k}: not a preset key ({', '.join(sorted(P))})")
        P[k] = v if isinstance(P[k], str) else type(P[k])(v)
    stages = ["prepare", "turn", "ctrl", "grpo", "dpo"] if ns.stage == "all" else ns.stage.split(",")
    if ns.dry_run:
        a = {
            k: [f"{label(m)} seed {m.train.seed}" for m in v] for k, v in arms(base_config(ns, P), P).items()
        }
        a["dpo"] = [
            f"DPO beta={b:g} seed {s}" for b in _floats(P["dpo_betas"]) for s in str(P["seeds"]).split(",")
        ]
        a = {k: v for k, v in a.items() if k in stages}
        print(
            json.dumps({"sizes": P, "plan": plan(P, {k: len(v) for k, v in a.items()}), "arms": a}, indent=1)
        )
        return 0
    res = Path(ns.results)
    res.mkdir(parents=True, exist_ok=True)
    command = "python experiments/llm_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    study = prepare(ns, P, res) if "prepare" in stages else json.loads((res / "study.json").read_text())
    for name in [s for s in stages if s != "prepare"]:
        if bad := [k for k in PREPARE_KEYS if study["sizes"].get(k) != P[k]]:
            raise SystemExit(f"error: {res} was prepared with other {', '.join(bad)}; give the same --set")
        arm = run_dpo(ns, P, study, res) if name == "dpo" else run_arm(name, ns, P, study, res)
        before = study["timing"].get(name) if ns.extend else None  # a continued arm keeps its first part's
        study["timing"][name] = {
            **arm,
            "command": command,
            "sizes": P,
            **({"before": before} if before else {}),
        }
        (res / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    return finish(res)


if __name__ == "__main__":
    raise SystemExit(main())
