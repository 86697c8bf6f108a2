"""``klrl reward-model``: a Bradley-Terry reward model from preference pairs, as TRL's ``RewardTrainer``.

::

    klrl reward-model --model.path BASE --pairs FILE --out DIR [--epochs N] [--lr X] [--batch-size B]
        [--max-len T] [--eval-fraction F] [--seed S] [--chat-template true|false]
        [--center-rewards-coef C] [--weight-decay W] [--lora.rank R --lora.alpha A --lora.targets RE]
        [--head-only]

``BASE`` is any causal LM klrl loads (an HF directory or a ``.gguf``, with its tokenizer); ``FILE`` a
JSONL or Parquet file of ``prompt`` (optional) / ``chosen`` / ``rejected`` rows
(:mod:`klrl.rewards.pairs`). The trunk is trained in full, or with ``--lora.rank R > 0`` through LoRA
adapters merged into it at the end, or not at all with ``--head-only`` (a linear probe of the frozen
trunk's last hidden state), with a fresh bias-free score head (:mod:`klrl.rewards.train`).
One line per epoch: the training loss and the held-out accuracy on ``--eval-fraction`` of the pairs.

``DIR`` (new or empty) gets an HF ``*ForSequenceClassification`` directory: ``--model.reward_path DIR``
loads it (:func:`klrl.tasks.text.reward_model`), so does ``transformers``; and ``reward_model.json``
with the run's numbers (held-out accuracy, losses per epoch, pair counts, settings, seconds).

Bad input (a pairs file that is missing, empty, not JSONL/Parquet, lacks a column or holds a non-text
or empty value; a model path that does not load; a setting out of range) is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from klrl.cli.args import fail
from klrl.models import lora as lora_lib
from klrl.models.hf import CheckpointFormatError
from klrl.models.pretrained import from_pretrained
from klrl.rewards.pairs import PairsError, encode_pairs, read_pairs, split
from klrl.rewards.train import TrainSettings, save_reward_model, train

RESULT = "reward_model.json"


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {s!r}")


def parser() -> argparse.ArgumentParser:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one line, exit 2
            fail(f"klrl reward-model: {message}")

    what = "train a Bradley-Terry reward model (trunk + score head) on preference pairs"
    p = Parser(prog="klrl reward-model", allow_abbrev=False, description=what,
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    a = p.add_argument
    a("--model.path", dest="model_path", required=True, metavar="PATH", help="the base causal LM")
    a("--pairs", required=True, metavar="FILE", help="JSONL or Parquet: prompt (optional), chosen, rejected")
    a("--out", required=True, metavar="DIR", help="a new (or empty) directory to write")
    a("--epochs", type=int, default=2, help="passes over the training pairs")
    a("--lr", type=float, default=1e-4, help="AdamW learning rate")
    a("--batch-size", type=int, default=8, help="pairs per update")
    a("--max-len", type=int, default=256, help="tokens per sequence (prompt + response + end token)")
    a("--eval-fraction", type=float, default=0.1, help="fraction of the pairs held out for the accuracy")
    a("--seed", type=int, default=0, help="the held-out split, the head's init, the shuffling")
    a("--chat-template", type=_bool, default=False,
      help="a string prompt as a user message in the chat template (a conversation always is)")  # fmt: skip
    a("--center-rewards-coef", type=float, default=0.0, help="TRL's center_rewards_coefficient")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("--lora.rank", "--model.lora.rank", dest="lora_rank", type=int, default=0,
      help="LoRA adapter rank (0: full fine-tuning)")  # fmt: skip
    a("--lora.alpha", "--model.lora.alpha", dest="lora_alpha", type=float, default=16.0,
      help="LoRA scale numerator: (alpha / rank) A B")  # fmt: skip
    a("--lora.targets", "--model.lora.targets", dest="lora_targets", default="",
      help="regex of the adapted modules ('' = the family's defaults)")  # fmt: skip
    a(
        "--head-only",
        action="store_true",
        help="train the score head alone on the frozen trunk (a linear probe)",
    )
    return p


def _check(ns: argparse.Namespace) -> None:
    rules = [
        (ns.epochs >= 1, "--epochs", "must be >= 1"),
        (ns.lr > 0, "--lr", "must be > 0"),
        (ns.batch_size >= 1, "--batch-size", "must be >= 1"),
        (ns.max_len >= 2, "--max-len", "must be >= 2"),
        (0 < ns.eval_fraction < 1, "--eval-fraction", "must be in (0, 1)"),
        (ns.center_rewards_coef >= 0, "--center-rewards-coef", "must be >= 0"),
        (ns.weight_decay >= 0, "--weight-decay", "must be >= 0"),
        (ns.lora_rank >= 0, "--lora.rank", "must be >= 0 (0 = full fine-tuning)"),
        (ns.lora_alpha > 0, "--lora.alpha", "must be > 0"),
        (not (ns.head_only and ns.lora_rank > 0), "--lora.rank", "must be 0 with --head-only (no adapters)"),
    ]
    for ok, flag, rule in rules:
        if not ok:
            fail(f"{flag}: {rule} (got {getattr(ns, flag.lstrip('-').replace('.', '_').replace('-', '_'))})")
    out = Path(ns.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--out: {out}: exists and is not an empty directory (nothing is overwritten)")
    if not Path(ns.model_path).exists():
        fail(f"--model.path: {ns.model_path}: no such file or directory")


def _load(ns: argparse.Namespace):
    try:
        model, base, tok = from_pretrained(ns.model_path)
    except (CheckpointFormatError, OSError, ValueError) as e:
        fail(f"--model.path: {e}")
    if tok is None:
        fail(f"--model.path: {ns.model_path}: no tokenizer (an HF directory needs tokenizer.json)")
    lora = None
    if ns.lora_rank > 0:
        try:
            lora = lora_lib.LoRA(model, ns.lora_rank, ns.lora_alpha, lora_lib.parse_targets(ns.lora_targets))
            lora_lib.check(lora, base)
        except ValueError as e:
            fail(str(e).replace("model.lora.", "--lora."))
    return model, base, tok, lora


def run(ns: argparse.Namespace) -> dict:
    """Train and write ``ns.out`` (module docstring); returns ``reward_model.json``'s dict."""
    t0 = time.time()
    _check(ns)
    try:
        records = read_pairs(ns.pairs)
        tr, ev = split(len(records), ns.eval_fraction, ns.seed)
    except PairsError as e:
        fail(f"--pairs: {e}" if not str(e).startswith("--") else str(e))
    model, base, tok, lora = _load(ns)
    try:
        pairs = encode_pairs(records, tok, ns.max_len, chat_template=ns.chat_template, source=str(ns.pairs))
    except PairsError as e:
        fail(f"--pairs: {e}")
    s = TrainSettings(ns.epochs, ns.lr, ns.batch_size, ns.weight_decay, ns.center_rewards_coef, ns.seed)
    how = (
        "the score head alone"
        if ns.head_only
        else f"LoRA rank {ns.lora_rank}"
        if lora
        else "full fine-tuning"
    )
    print(f"{len(records)} pairs ({len(tr)} training, {len(ev)} held out; {pairs.truncated} cut to "
          f"--max-len {ns.max_len}); {how} of {ns.model_path}")  # fmt: skip
    trunk, score, history = train(model, base, pairs.take(tr), pairs.take(ev), s, lora, print, ns.head_only)
    save_reward_model(model, trunk, score, tok, ns.out)
    last = history[-1]
    doc = {
        "heldout_accuracy": last["eval_accuracy"],
        "heldout_loss": last["eval_loss"],
        "train_loss": last["loss"],
        "pairs": {"total": len(records), "train": len(tr), "heldout": len(ev), "truncated": pairs.truncated},
        "history": history,
        "settings": {**{k: v for k, v in vars(ns).items()}, "lora": how},
        "loss": "Bradley-Terry: -log sigmoid(r_chosen - r_rejected) + center_rewards_coef * (r_c + r_r)^2",
        "seconds": round(time.time() - t0, 2),
    }
    (Path(ns.out) / RESULT).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"held-out accuracy {last['eval_accuracy']:.3f}; wrote {ns.out} (--model.reward_path {ns.out})")
    return doc


def main(argv: list[str]) -> int:
    """``klrl reward-model [flags]``."""
    ns = parser().parse_args(argv)
    try:
        run(ns)
    except OSError as e:
        fail(f"{e.filename or ''}: {e.strerror}".lstrip(": "))
    return 0
