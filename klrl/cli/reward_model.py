"""``klrl reward-model``: a Bradley-Terry reward model from preference pairs, as TRL's ``RewardTrainer``.

::

    klrl reward-model --model.path BASE --pairs FILE --out DIR [--config PPO_CONFIG]
        [--data.chat_template B] [--data.prompt_len P] [--data.truncate left|error]
        [--sampling.response_len R] [--sampling.use_eos B]
        [--rm.epochs N] [--rm.lr X] [--rm.batch_size B] [--rm.eval_fraction F] [--rm.seed S]
        [--rm.center_rewards_coef C] [--rm.weight_decay W] [--rm.head_only true]
        [--lora.rank R --lora.alpha A --lora.targets RE]

``BASE`` is any causal LM klrl loads (an HF directory, a ``.gguf`` or a Hub name in the local cache,
with its tokenizer); ``FILE`` a JSONL or Parquet file of ``prompt`` (optional) / ``chosen`` /
``rejected`` rows (:mod:`klrl.rewards.pairs`). The trunk is trained in full, or with ``--lora.rank R
> 0`` through LoRA adapters merged into it at the end, or not at all with ``--rm.head_only true`` (a
linear probe of the frozen trunk's last hidden state), with a fresh bias-free score head
(:mod:`klrl.rewards.train`). One line per epoch: the training loss and the held-out accuracy on
``--rm.eval_fraction`` of the pairs.

**The text it trains on is the text PPO shows it** (:func:`klrl.rewards.pairs.encode_as_ppo`): the
``data`` and ``sampling`` fields are PPO's, with PPO's defaults (the chat template on, prompts cut to
``data.prompt_len`` inside their user content, responses ended by the end token and cut to
``sampling.response_len``); ``--config FILE`` (the PPO run's config, JSON or YAML, e.g. its
``config.json``) takes them, and ``model.path``, from it; a flag overrides. One line says which format
it is, and ``reward_model.json`` records it (``text_format``), so :func:`klrl.load_reward_model` scores
in it.

The flags of the run's own settings are ``--rm.FIELD``; the earlier spellings (``--epochs``,
``--lr``, ``--batch-size``, ``--eval-fraction``, ``--seed``, ``--center-rewards-coef``,
``--weight-decay``, ``--head-only``, ``--chat-template``) still work and print a deprecation line;
``--max-len`` is refused (one line naming ``--data.prompt_len`` and ``--sampling.response_len``).

``DIR`` (new or empty) gets an HF ``*ForSequenceClassification`` directory: ``--model.reward_path DIR``
loads it (:func:`klrl.tasks.text.reward_model`), so do :func:`klrl.load_reward_model` and
``transformers``; and ``reward_model.json`` with the run's numbers (held-out accuracy, losses per
epoch, pair counts, settings, the text format, seconds).

Bad input (a pairs file that is missing, empty, not JSONL/Parquet, lacks a column or holds a non-text
or empty value; a model path that does not load; a setting out of range; an unknown flag, with a
did-you-mean) is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from klrl.cli.args import check_new_path, check_special, fail, load_config_file
from klrl.cli.flags import DEPRECATED, reward_model_parser
from klrl.config import ConfigError, DataConfig, SamplingConfig
from klrl.config.schema import closest
from klrl.models import lora as lora_lib
from klrl.models.catalog import resolve_model_path
from klrl.models.pretrained import text_model
from klrl.rewards.pairs import PairsError, encode_as_ppo, format_line, read_pairs, split, text_format
from klrl.rewards.train import TrainSettings, heldout_warning, save_reward_model, train

RESULT = "reward_model.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with a did-you-mean for an unknown one; ``ns.deprecated`` lists the old spellings used."""
    p = reward_model_parser()
    ns, rest = p.parse_known_args(argv)
    if rest:
        flags = [s for act in p._actions for s in act.option_strings if s.startswith("--")]
        name = rest[0].split("=", 1)[0]
        near = closest(name, [f for f in flags if f not in DEPRECATED and f != "--max-len"])
        what = "unknown flag" if name.startswith("-") else "unexpected argument"
        fail(f"klrl reward-model: {name}: {what}" + (f"; did you mean {near}?" if near else ""))
    if ns.max_len is not None:
        fail(
            "--max-len: replaced by PPO's lengths: --data.prompt_len (prompt tokens) and "
            "--sampling.response_len (response tokens), the fields the PPO run reads"
        )
    used = [t.split("=", 1)[0] for t in argv if t.startswith("--")]
    ns.deprecated = [f for f in dict.fromkeys(used) if f in DEPRECATED]
    return ns


def text_configs(ns: argparse.Namespace) -> tuple[DataConfig, SamplingConfig]:
    """PPO's ``data`` and ``sampling`` sections: ``--config``'s (or the defaults), the flags over them;
    ``ns.model_path`` from ``--config`` when not given."""
    base = None
    if ns.config:
        base = load_config_file(ns.config)
        if ns.model_path is None and base.model.path:
            ns.model_path = base.model.path
    data = base.data if base else DataConfig()
    sampling = base.sampling if base else SamplingConfig()
    try:
        given = lambda sec, names: {
            f: getattr(ns, f"{sec}_{f}") for f in names if getattr(ns, f"{sec}_{f}") is not None
        }
        data = dataclasses.replace(data, **given("data", ("chat_template", "prompt_len", "truncate")))
        sampling = dataclasses.replace(sampling, **given("sampling", ("response_len", "use_eos")))
    except ConfigError as e:
        fail(f"--{e}")
    if ns.model_path is None:
        fail("--model.path: required (the base causal LM), or a --config that names one")
    return data, sampling


def _check(ns: argparse.Namespace) -> None:
    rules = [
        (ns.epochs >= 1, "--rm.epochs", "epochs", "must be >= 1"),
        (ns.lr > 0, "--rm.lr", "lr", "must be > 0"),
        (ns.batch_size >= 1, "--rm.batch_size", "batch_size", "must be >= 1"),
        (0 < ns.eval_fraction < 1, "--rm.eval_fraction", "eval_fraction", "must be in (0, 1)"),
        (ns.center_rewards_coef >= 0, "--rm.center_rewards_coef", "center_rewards_coef", "must be >= 0"),
        (ns.weight_decay >= 0, "--rm.weight_decay", "weight_decay", "must be >= 0"),
        (ns.lora_rank >= 0, "--lora.rank", "lora_rank", "must be >= 0 (0 = full fine-tuning)"),
        (ns.lora_alpha > 0, "--lora.alpha", "lora_alpha", "must be > 0"),
        (not (ns.head_only and ns.lora_rank > 0), "--lora.rank", "lora_rank",
         "must be 0 with --rm.head_only (no adapters)"),
    ]  # fmt: skip
    for ok, flag, dest, rule in rules:
        if not ok:
            fail(f"{flag}: {rule} (got {getattr(ns, dest)})")
    for flag, path in (("--pairs", ns.pairs), ("--out", ns.out), ("--model.path", ns.model_path)):
        check_special(path, flag)  # before anything opens it (a FIFO would wait forever)
    check_new_path(ns.out, "--out", directory=True)  # also a name too long, a loop, read-only, a full disk
    try:
        ns.model_path = resolve_model_path(ns.model_path)
    except ConfigError as e:
        fail(f"--{e}")
    if not Path(ns.model_path).exists():
        fail(f"--model.path: {ns.model_path}: no such file or directory")


def _load(ns: argparse.Namespace):
    try:
        model, base, tok = text_model(ns.model_path)
    except ValueError as e:
        fail(f"--model.path: {e}")
    lora = None
    if ns.lora_rank > 0:
        try:
            lora = lora_lib.LoRA(model, ns.lora_rank, ns.lora_alpha, lora_lib.parse_targets(ns.lora_targets))
            lora_lib.check(lora, base)
        except ValueError as e:
            fail(str(e).replace("lora.", "--lora.", 1) if str(e).startswith("lora.") else str(e))
    return model, base, tok, lora


def run(ns: argparse.Namespace) -> dict:
    """Train and write ``ns.out`` (module docstring); returns ``reward_model.json``'s dict."""
    t0 = time.time()
    data, sampling = text_configs(ns)
    _check(ns)
    try:
        records = read_pairs(ns.pairs)
        tr, ev = split(len(records), ns.eval_fraction, ns.seed)
    except PairsError as e:
        fail(
            f"--pairs: {e}"
            if not str(e).startswith("--")
            else str(e).replace("--eval-fraction", "--rm.eval_fraction")
        )
    model, base, tok, lora = _load(ns)
    try:
        pairs = encode_as_ppo(records, tok, data, sampling, source=str(ns.pairs))
    except PairsError as e:
        fail(f"--pairs: {e}")
    for old in ns.deprecated:  # after every check: an error is the only line on stderr
        print(f"warning: {old} is deprecated; use {DEPRECATED[old]}", file=sys.stderr)
    fmt = text_format(tok, data, sampling)
    print(format_line(fmt))
    s = TrainSettings(ns.epochs, ns.lr, ns.batch_size, ns.weight_decay, ns.center_rewards_coef, ns.seed)
    how = (
        "the score head alone"
        if ns.head_only
        else f"LoRA rank {ns.lora_rank}"
        if lora
        else "full fine-tuning"
    )
    print(
        f"{len(records)} pairs ({len(tr)} training, {len(ev)} held out; {pairs.truncated} cut to "
        f"data.prompt_len / sampling.response_len); {how} of {ns.model_path}"
    )
    trunk, score, history = train(model, base, pairs.take(tr), pairs.take(ev), s, lora, print, ns.head_only)
    save_reward_model(model, trunk, score, tok, ns.out)
    last = history[-1]
    settings = {k: v for k, v in vars(ns).items() if k not in ("deprecated", "max_len")}
    doc = {
        "heldout_accuracy": last["eval_accuracy"],
        "heldout_loss": last["eval_loss"],
        "train_loss": last["loss"],
        "pairs": {"total": len(records), "train": len(tr), "heldout": len(ev), "truncated": pairs.truncated},
        "history": history,
        "settings": {**settings, "lora": how},
        "text_format": fmt,
        "loss": "Bradley-Terry: -log sigmoid(r_chosen - r_rejected) + center_rewards_coef * (r_c + r_r)^2",
        "seconds": round(time.time() - t0, 2),
    }
    (Path(ns.out) / RESULT).write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"held-out accuracy {last['eval_accuracy']:.3f}; wrote {ns.out} (--model.reward_path {ns.out}; "
        f"Python: klrl.load_reward_model({str(ns.out)!r}).score(prompts, responses))"
    )
    warning = heldout_warning(last["eval_accuracy"], len(ev))
    if warning:
        print(warning, file=sys.stderr)
    return doc


def main(argv: list[str]) -> int:
    """``klrl reward-model [flags]``."""
    ns = parse_args(argv)
    try:
        run(ns)
    except OSError as e:
        fail(f"{e.filename or ''}: {e.strerror}".lstrip(": "))
    return 0
