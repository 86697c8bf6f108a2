"""A DPO beta sweep as one compiled program on a pretrained model (default: SmolLM2-135M-Instruct's GGUF):
a demonstration of ``klrl.dpo``, not the beta study (that one trains on the real-LM study's gold-labelled
pairs and sits beside PPO on the gold-vs-sqrt(KL) figure).

    python experiments/dpo_sweep.py --out runs/dpo-sweep [--model PATH] [--betas 0.01,0.03,0.1,0.3,1]
        [--iterations 12] [--lr 1e-4] [--lora-rank 8]

The pairs are written to ``OUT/pairs.jsonl`` from templates (prompt: an instruction about a topic;
chosen: a warm answer; rejected: a dismissive one; seeded): a preference every beta learns, so the
members differ in how far they move from the reference. JAX's compile log is counted: the sweep's
iteration (``dpo_sweep_step``) must compile once for all the members. The last line is JSON: per
member beta, the final training loss and reward accuracy, the held-out accuracy and
``kl/exact_seq_sum`` (nats per sequence), the number of compiles, seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

TOPICS = [
    "the sea",
    "a cat",
    "winter",
    "music",
    "coffee",
    "a forest",
    "the moon",
    "bread",
    "rain",
    "a city",
    "friendship",
    "a garden",
    "mountains",
    "books",
    "the sun",
    "a river",
]
ASKS = [
    "Write one sentence about {}.",
    "Describe {} briefly.",
    "Say something nice about {}.",
    "Tell me about {}.",
]
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def template_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` seeded pairs: a warm chosen answer and a dismissive rejected one to an instruction."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.choice(TOPICS)
        rows.append(
            {
                "prompt": rng.choice(ASKS).format(t),
                "chosen": f"I love {t}: it is wonderful, calm and full of joy.",
                "rejected": f"{t[0].upper() + t[1:]} is boring and I do not care.",
            }
        )
    return rows


class _Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Compiling "):  # "Compiling jit(NAME) with global shapes ..."
            self.names.append(msg.split()[1].removeprefix("jit(").removesuffix(")"))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=SMOLLM2, help="a model path or a `klrl models` name")
    p.add_argument("--betas", default="0.01,0.03,0.1,0.3,1")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--pairs", type=int, default=96)
    ns = p.parse_args(argv)

    import jax

    import klrl
    from klrl.config import DataConfig, LoRAConfig, SamplingConfig

    if not Path(ns.model).exists():  # a name `klrl models` lists
        from klrl.models.catalog import find_models

        hits = [f.path for f in find_models()[0] if f.name == ns.model or f.path.name == ns.model]
        ns.model = str(hits[0]) if hits else ns.model
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = out / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in template_pairs(ns.pairs)))
    jax.config.update("jax_log_compiles", True)
    counter = _Compiles()
    logging.getLogger("jax").addHandler(counter)
    t0 = time.time()
    every = max(ns.iterations // 2, 1)
    cfg = klrl.DPOConfig(
        lr=ns.lr,
        batch_size=8,
        iterations=ns.iterations,
        eval_every=every,
        checkpoint_every=every,
        eval_prompts=8,
    )
    betas = [float(b) for b in ns.betas.split(",")]
    res = klrl.dpo(
        pairs,
        model_path=ns.model,
        cfg=cfg,
        betas=betas,
        lora=LoRAConfig(rank=ns.lora_rank),
        data=DataConfig(prompt_len=32),
        sampling=SamplingConfig(response_len=16),
        run_dir=out / "run",
        log=print,
    )
    members = []
    for j, m in enumerate(res.members):
        last = lambda name: float(res.metric(name, j)[1][-1])
        members.append(
            {
                "beta": m.beta,
                "loss": last("dpo/loss"),
                "accuracy": last("dpo/reward_accuracy"),
                "heldout_accuracy": last("eval/dpo/reward_accuracy"),
                "kl_exact_seq_sum": last("kl/exact_seq_sum"),
            }
        )
    doc = {
        "members": members,
        "compiles_of_dpo_sweep_step": counter.names.count("dpo_sweep_step"),
        "iterations": ns.iterations,
        "seconds": round(time.time() - t0, 1),
        "run": str(out / "run"),
    }
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
