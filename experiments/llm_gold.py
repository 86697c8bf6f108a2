"""The gold that reads the prompt (issue 47, item 1), checked on stored responses before any new run.

``python experiments/llm_gold.py [--draws 4] [--results experiments/results/llm_gold]``

Scores, with :mod:`klrl.eval.gold` and the independent judge (Gemma 3 270M, raw text: it has no chat
template), responses the third study (``experiments/results/llm_turn``) stored:

* ``reference``: the reference's responses to the 64 held-out prompts, draws ``0 .. draws-1`` (the
  gold's two medians, ``nll_free`` and ``pmi_free``, are calibrated on these);
* ``early``: the turn arm's training responses of iterations 0-3 (all three seeds);
* ``collapsed``: the same arm's training responses of iterations 32-39, which were 98% / 91% / 9%
  cross-prompt near-duplicates (seeds 0 / 1 / 2);
* ``generic``: seed 0's most frequent collapsed response given as the answer to every held-out prompt
  (a prompt-independent answer by construction).

Writes ``gold_check.json`` (the medians, each set's gold quantiles and its share below the reference
median, old gold beside new) and ``scored.jsonl.gz`` (every scored response with its parts).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if not __package__:
    sys.path.insert(0, str(HERE.parent))

TURN = HERE / "results" / "llm_turn"


def _rows(name: str) -> list[dict]:
    with gzip.open(TURN / name, "rt") as f:
        return [json.loads(x) for x in f]


def sets(draws: int, train_texts: list[str], held_texts: list[str]) -> dict[str, list[dict]]:
    """The four sets of the module docstring: rows with ``prompt`` and ``completion``."""
    pool = [r for r in _rows("pool_heldout.jsonl.gz") if r["draw"] < draws]
    turn = _rows("turn_samples.jsonl.gz")
    late = [r for r in turn if r["iteration"] >= 32]
    modal = collections.Counter(r["completion"] for r in late if r["member"] == 0).most_common(1)[0][0]
    out = {
        "reference": [{**r, "prompt": held_texts[r["prompt_idx"]]} for r in pool],
        "early": [{**r, "prompt": train_texts[r["prompt_idx"]]} for r in turn if r["iteration"] < 4],
        "collapsed": [{**r, "prompt": train_texts[r["prompt_idx"]]} for r in late],
        "generic": [{"prompt_idx": i, "prompt": p, "completion": modal} for i, p in enumerate(held_texts)],
    }
    return out


def summary(values: np.ndarray, median: float) -> dict[str, float]:
    q = np.quantile(values, [0.1, 0.25, 0.5, 0.75, 0.9])
    return {"n": int(len(values)), "mean": float(values.mean()), "q10": q[0], "q25": q[1], "median": q[2],
            "q75": q[3], "q90": q[4], "below_ref_median": float(np.mean(values < median))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from experiments.llm_turn import PRESETS, base_config, default_judge
    from klrl.api import build_task
    from klrl.eval import gold
    from klrl.eval.score import Judge

    p = argparse.ArgumentParser()
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--results", default=str(HERE / "results" / "llm_gold"))
    p.add_argument("--model-path", default="")
    ns = p.parse_args(argv)
    from experiments.llm_beta import default_gguf

    ns.model_path = ns.model_path or default_gguf()
    ns.remat, ns.out = "none", "/tmp/llm_gold_unused"
    task = build_task(base_config(ns, PRESETS["cpu"]), None)
    data = sets(ns.draws, list(task.prompt_texts), list(task.heldout.texts))
    judge = Judge.load(default_judge())
    print(f"judge {judge.path}: prompts in {judge.format}", flush=True)
    t0, scored = time.time(), {}
    for name, rows in data.items():
        prompts = sorted({r["prompt"] for r in rows})
        idx = [prompts.index(r["prompt"]) for r in rows]
        texts = [r["completion"] for r in rows]
        scored[name] = judge.relevance(texts, prompts, idx, batch=16)
        print(f"{name}: {len(rows)} responses scored ({time.time() - t0:.0f} s)", flush=True)
    n = scored["reference"]["tokens"]
    free = gold.calibrate(scored["reference"]["nll_text"] / np.maximum(n, 1), scored["reference"]["pmi"])
    out, lines = {"free": free, "draws": ns.draws, "judge": judge.path, "format": judge.format}, []
    for name, rows in data.items():
        s = scored[name]
        per = s["nll_text"] / np.maximum(s["tokens"], 1)
        parts = gold.score([r["completion"] for r in rows], per, s["pmi"], free)
        for r, pt in zip(rows, parts, strict=True):
            lines.append({"set": name, **{k: r[k] for k in ("prompt_idx", "prompt", "completion") if k in r},
                          **{k: r[k] for k in ("member", "iteration", "draw") if k in r},
                          "old_gold": r.get("gold"), **pt})  # fmt: skip
        out[name] = {"new": np.array([pt["gold"] for pt in parts]), "pmi": s["pmi"]}
        if rows[0].get("gold") is not None:
            out[name]["old"] = np.array([r["gold"] for r in rows])
    med_new, med_old = np.median(out["reference"]["new"]), np.median(out["reference"]["old"])
    res = {k: out[k] for k in ("free", "draws", "judge", "format")}
    for name in data:
        res[name] = {"gold_new": summary(out[name]["new"], med_new),
                     "relevance_pmi": summary(np.nan_to_num(out[name]["pmi"]), free["pmi_free"])}  # fmt: skip
        if "old" in out[name]:
            res[name]["gold_old"] = summary(out[name]["old"], med_old)
    res["seconds"] = round(time.time() - t0, 1)
    dest = Path(ns.results)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "gold_check.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    with gzip.open(dest / "scored.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(x, default=float) + "\n" for x in lines)
    print(json.dumps(res, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
