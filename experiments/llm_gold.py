"""The gold that reads the prompt (issue 47, item 1), checked on stored responses before any new run.

``python experiments/llm_gold.py [--draws 4] [--results experiments/results/llm_gold] [--replay]``

Scores, with :mod:`klrl.eval.gold` and the independent judge (Gemma 3 270M, raw text: it has no chat
template), responses the third study (``experiments/results/llm_turn``) stored:

* ``reference``: the reference's responses to the 64 held-out prompts, draws ``0 .. draws-1`` (the
  gold's two medians, ``nll_free`` and ``pmi_free``, are calibrated on these);
* ``early``: the turn arm's training responses of iterations 0-3 (all three seeds);
* ``collapsed``: the same arm's training responses of iterations 32-39, which were 98% / 91% / 9%
  cross-prompt near-duplicates (seeds 0 / 1 / 2);
* ``generic``: seed 0's most frequent collapsed response given as the answer to every held-out prompt
  (a prompt-independent answer by construction).

Writes ``judged.jsonl.gz`` (every response with the judge's NLL per token and relevance) and
``gold_check.json`` (the medians, each set's gold quantiles and share below the reference median, old
gold beside new), which ``--replay`` recomputes from ``judged.jsonl.gz`` alone.
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
    values = values[np.isfinite(values)]  # an empty response has no relevance
    q = np.quantile(values, [0.1, 0.25, 0.5, 0.75, 0.9])
    return {"n": int(len(values)), "mean": float(values.mean()), "q10": q[0], "q25": q[1], "median": q[2],
            "q75": q[3], "q90": q[4], "below_ref_median": float(np.mean(values < median))}  # fmt: skip


def judge_sets(ns: argparse.Namespace) -> list[dict]:
    """Every response of the four sets with the judge's numbers: ``nll`` per token (alone), ``pmi``."""
    from experiments.llm_beta import default_gguf
    from experiments.llm_turn import PRESETS, base_config, default_judge
    from klrl.api import build_task
    from klrl.eval.score import Judge

    ns.model_path, ns.remat, ns.out = default_gguf(), "none", "/tmp/llm_gold_unused"
    task = build_task(base_config(ns, PRESETS["cpu"]), None)
    data = sets(ns.draws, list(task.prompt_texts), list(task.heldout.texts))
    judge = Judge.load(default_judge())
    print(f"judge {judge.path}: prompts in {judge.format}", flush=True)
    t0, lines = time.time(), []
    for name, rows in data.items():
        prompts = sorted({r["prompt"] for r in rows})
        rel = judge.relevance(
            [r["completion"] for r in rows], prompts, [prompts.index(r["prompt"]) for r in rows]
        )
        for m, r in enumerate(rows):
            n = int(rel["tokens"][m])
            keep = {
                k: r[k]
                for k in ("prompt_idx", "prompt", "completion", "member", "iteration", "draw")
                if k in r
            }
            lines.append({"set": name, **keep, "old_gold": r.get("gold"), "judge_tokens": n,
                          "nll": float(rel["nll_text"][m] / n) if n else None,
                          "pmi": float(rel["pmi"][m]) if n else None})  # fmt: skip
        print(f"{name}: {len(rows)} responses judged ({time.time() - t0:.0f} s)", flush=True)
    print(f"judge: {time.time() - t0:.0f} s", flush=True)
    return lines


def finish(lines: list[dict], draws: int) -> dict:
    """The gold of every stored response and each set's summary (from the stored judge numbers alone)."""
    from klrl.eval import gold

    nan = lambda v: float("nan") if v is None else v
    ref = [r for r in lines if r["set"] == "reference"]
    free = gold.calibrate([nan(r["nll"]) for r in ref], [nan(r["pmi"]) for r in ref])
    res: dict = {"free": free, "draws": draws, "coefs": {"rep": gold.REP_COEF, "nll": gold.NLL_COEF,
                                                         "rel": gold.REL_COEF}}  # fmt: skip
    for r in lines:
        r.update(gold.gold_parts(r["completion"], nan(r["nll"]), nan(r["pmi"]), free))
    by = {}
    for r in lines:
        by.setdefault(r["set"], []).append(r)
    med_new = float(np.median([r["gold"] for r in by["reference"]]))
    med_old = float(np.median([r["old_gold"] for r in by["reference"]]))
    for name, rows in by.items():
        pmi = np.array([nan(r["pmi"]) for r in rows])
        res[name] = {"gold_new": summary(np.array([r["gold"] for r in rows]), med_new),
                     "relevance_pmi": summary(pmi, free["pmi_free"])}  # fmt: skip
        if rows[0]["old_gold"] is not None:
            res[name]["gold_old"] = summary(np.array([r["old_gold"] for r in rows]), med_old)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--results", default=str(HERE / "results" / "llm_gold"))
    p.add_argument("--replay", action="store_true", help="the gold and summaries from the stored judged rows")
    ns = p.parse_args(argv)
    dest = Path(ns.results)
    judged = dest / "judged.jsonl.gz"
    if ns.replay:
        with gzip.open(judged, "rt") as f:
            lines = [json.loads(x) for x in f]
    else:
        lines = judge_sets(ns)
        dest.mkdir(parents=True, exist_ok=True)
        with gzip.GzipFile(judged, "wb", mtime=0) as f:
            f.write("".join(json.dumps(x) + "\n" for x in lines).encode())
    res = finish(lines, ns.draws)
    (dest / "gold_check.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    print(json.dumps(res, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
