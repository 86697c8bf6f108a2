"""The parsers of the commands with flags of their own (``klrl export``, ``generate``, ``eval``,
``reward-model``), apart from the modules that run them: those import jax and the models, these only the
config, so that ``klrl COMMAND --help`` answers at once (:func:`klrl.cli.commands.main` builds the parser
from here for ``--help``; the command's own module parses with the same parser)."""

from __future__ import annotations

import argparse

from klrl.cli.args import _Parser as _ArgsParser
from klrl.cli.args import fail
from klrl.config import DataConfig, SamplingConfig

__all__ = ["BASE", "DEPRECATED", "PARSERS", "PPO_FIELDS", "SETTINGS", "HelpFormatter", "export_parser",
           "dpo_parser", "generate_parser", "reward_model_parser"]  # fmt: skip

BASE = "base"  # a LoRA run's float base (klrl export --base), inside OUT_DIR: BASE/<model name>/


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (None, '', a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", argparse.SUPPRESS) or action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(_ArgsParser):  # a flag given twice refused (klrl.cli.args.repeated_flag)
    def error(self, message: str):  # one line, exit 2
        fail(f"{self.prog}: {message}")


def generate_parser(cmd: str) -> argparse.ArgumentParser:
    """``klrl generate`` (``cmd="generate"``) or ``klrl eval``'s flags (:mod:`klrl.cli.generate`)."""
    what = {"generate": "sample completions of prompts", "eval": "sample and score: rewards, exact KL, judge"}
    p = _Parser(prog=f"klrl {cmd}", allow_abbrev=False, description=what[cmd], formatter_class=HelpFormatter)
    a = p.add_argument
    a(
        "source",
        metavar="SOURCE",
        help="a run directory, a checkpoint, an export, an HF dir, a .gguf or a Hub name",
    )
    a(
        "--prompts",
        metavar="FILE",
        default=None,
        help="a prompt file (.jsonl/.json/.csv/.parquet/.txt, klrl:NAME)",
    )
    if cmd == "generate":
        a("--prompt", metavar="TEXT", action="append", default=None, help="a prompt (repeatable)")
        a("--ids", action="store_true", help="add each completion's token ids (the stop token included)")
    a("--n", type=int, default=1, help="completions per prompt")
    a("--max-new-tokens", "--sampling.response_len", dest="max_new_tokens", type=int, default=None,
      help="tokens per completion at most (default: the run's sampling.response_len, else 64)")  # fmt: skip
    a("--temperature", "--sampling.temperature", dest="temperature", type=float, default=1.0,
      help="sampling temperature (0: greedy)")  # fmt: skip
    a("--seed", type=int, default=0, help="the sampling seed")
    a("--step", type=int, default=None, help="a run's checkpoint (default: the latest)")
    a("--out", metavar="FILE.jsonl", default=None, help="write the rows there (a new file; default: stdout)")
    a("--batch-size", type=int, default=8, help="completions sampled at once")
    a("--data.chat_template", dest="chat_template", default=None, metavar="BOOL",
      help="wrap prompts in the chat template (default: the run's, else true)")  # fmt: skip
    a(
        "--data.prompt_len",
        dest="prompt_len",
        type=int,
        default=None,
        help="prompt budget (default: the run's, else 64)",
    )
    a("--data.field", dest="field", default=None, help="the prompt column (default: the run's, else prompt)")
    if cmd == "eval":
        a("--reward.fn", dest="reward_fn", default=None, help="reward functions (as PPO's reward.fn)")
        a("--reward.weights", dest="reward_weights", default="", help="their weights (as PPO's)")
        a("--reward-model", "--model.reward_path", dest="reward_model", default=None, metavar="DIR",
          help="a reward model directory (klrl reward-model)")  # fmt: skip
        a("--ref", "--model.ref_path", dest="ref", default=None, metavar="MODEL",
          help="the reference of the exact KL (default: a run's model.path)")  # fmt: skip
        a(
            "--judge",
            default=None,
            metavar="MODEL",
            help="a model whose NLL per token of the completions and relevance (PMI) are reported",
        )
        a("--judge.chat_template", dest="judge_chat_template", default=None, metavar="BOOL",
          help="the judge's prompt format: its own chat template or raw text (default: its template if "
          "its tokenizer has one, else raw text; independent of --data.chat_template)")  # fmt: skip
    return p


# ---- klrl reward-model --------------------------------------------------------------------------
# the run's own settings: (field, type, default, help); flag --rm.FIELD (formerly --FIELD-WITH-DASHES)
SETTINGS = (
    ("epochs", int, 2, "passes over the training pairs"),
    ("lr", float, 1e-4, "AdamW learning rate"),
    ("batch_size", int, 8, "pairs per update"),
    ("eval_fraction", float, 0.1, "fraction of the pairs held out for the accuracy"),
    ("seed", int, 0, "the held-out split, the head's init, the shuffling"),
    ("center_rewards_coef", float, 0.0, "TRL's center_rewards_coefficient"),
    ("weight_decay", float, 0.0, "AdamW weight decay"),
)
# PPO's fields the text format reads: (section.field, type)
PPO_FIELDS = (
    ("data.chat_template", "bool"),
    ("data.prompt_len", "int"),
    ("data.truncate", "str"),
    ("sampling.response_len", "int"),
    ("sampling.use_eos", "bool"),
)
DEPRECATED = {
    **{"--" + f.replace("_", "-"): "--rm." + f for f, *_ in SETTINGS},
    "--head-only": "--rm.head_only true",
    "--chat-template": "--data.chat_template",
}


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {s!r}")


def reward_model_parser() -> argparse.ArgumentParser:
    """``klrl reward-model``'s flags (:mod:`klrl.cli.reward_model`)."""
    what = "train a Bradley-Terry reward model (trunk + score head) on preference pairs, on PPO's text"
    p = _Parser(prog="klrl reward-model", allow_abbrev=False, description=what, formatter_class=HelpFormatter)
    a = p.add_argument
    a("--model.path", dest="model_path", default=None, metavar="PATH",
      help="the base causal LM (default: --config's model.path)")  # fmt: skip
    a("--pairs", required=True, metavar="FILE", help="JSONL or Parquet: prompt (optional), chosen, rejected")
    a("--out", required=True, metavar="DIR", help="a new (or empty) directory to write")
    a("--config", metavar="FILE", default=None,
      help="the PPO run's config (JSON or YAML): its data.*, sampling.* and model.path")  # fmt: skip
    g = p.add_argument_group("text format", "PPO's fields (default: --config's, else PPO's defaults)")
    for name, kind in PPO_FIELDS:
        sec, f = name.split(".")
        cls = DataConfig if sec == "data" else SamplingConfig
        default = cls.__dataclass_fields__[f].default
        extra = ("--chat-template",) if name == "data.chat_template" else ()
        if extra:
            g.add_argument(
                *extra, dest=name.replace(".", "_"), default=None, type=_bool, help=argparse.SUPPRESS
            )
        g.add_argument(f"--{name}", dest=name.replace(".", "_"), default=None,
                       type=_bool if kind == "bool" else int if kind == "int" else str,
                       metavar=kind.upper(), help=f"PPO's {name} (default {default!r})")  # fmt: skip
    g = p.add_argument_group("rm", "the reward model's training")
    for f, kind, default, hlp in SETTINGS:
        g.add_argument(
            f"--rm.{f}", dest=f, type=kind, default=default, metavar=kind.__name__.upper(), help=hlp
        )
        g.add_argument("--" + f.replace("_", "-"), dest=f, type=kind, default=default, help=argparse.SUPPRESS)
    g.add_argument("--rm.head_only", dest="head_only", type=_bool, default=False, metavar="BOOL",
                   help="train the score head alone on the frozen trunk (a linear probe)")  # fmt: skip
    g.add_argument("--head-only", dest="head_only", action="store_const", const=True, help=argparse.SUPPRESS)
    g.add_argument("--max-len", dest="max_len", default=None, help=argparse.SUPPRESS)
    a("--lora.rank", dest="lora_rank", type=int, default=0, help="LoRA adapter rank (0: full fine-tuning)")
    a(
        "--lora.alpha",
        dest="lora_alpha",
        type=float,
        default=16.0,
        help="LoRA scale numerator: (alpha / rank) A B",
    )
    a(
        "--lora.targets",
        dest="lora_targets",
        default="",
        help="regex of the adapted modules ('' = the family's defaults)",
    )
    for f, kind in (("rank", int), ("alpha", float), ("targets", str)):  # the older spelling, still read
        a(f"--model.lora.{f}", dest=f"lora_{f}", type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


# ---- klrl export --------------------------------------------------------------------------------
def export_parser() -> argparse.ArgumentParser:
    """``klrl export``'s flags (:mod:`klrl.cli.export`)."""
    p = _Parser(prog="klrl export", description="write a run's policy (a checkpoint) as a model directory")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run (or sweep member) directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) directory to write")
    p.add_argument(
        "--step", type=int, default=None, help="the checkpoint (iteration) to export (default: the latest)"
    )
    p.add_argument(
        "--base",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"a LoRA run: also write the float base as an HF directory in OUT_DIR/{BASE}/NAME/ and record "
        "its absolute path as the adapter's base_model_name_or_path, so that peft's "
        "AutoPeftModelForCausalLM.from_pretrained(OUT_DIR/adapter) loads it (default: yes when model.path "
        "is a .gguf, which peft cannot load; an HF directory is recorded by its absolute path, one in the "
        "Hugging Face cache by its Hub id)",
    )
    return p


# command -> its parser (klrl models' is klrl.cli.commands.models_main's own)
# ---- klrl dpo -----------------------------------------------------------------------------------
def dpo_parser() -> argparse.ArgumentParser:
    """``klrl dpo``'s flags (:mod:`klrl.cli.dpo`): the ``dpo`` section's fields as ``--dpo.FIELD``."""
    import dataclasses

    from klrl.config.dpo import DPOConfig

    what = (
        "direct preference optimisation (DPO, IPO, robust, hinge) on preference pairs, in PPO's text format"
    )
    p = _Parser(prog="klrl dpo", allow_abbrev=False, description=what, formatter_class=HelpFormatter)
    a = p.add_argument
    a(
        "--model.path",
        dest="model_path",
        default=None,
        metavar="PATH",
        help="the base causal LM (an HF directory, a .gguf, a `klrl models` name or a cached Hub name)",
    )
    a("--pairs", required=True, metavar="FILE", help="JSONL or Parquet: prompt (optional), chosen, rejected")
    a("--out", default=None, metavar="DIR", help="the run directory to write (new or empty)")
    a("--resume", default=None, metavar="DIR", help="continue this DPO run (its config.json) bit for bit")
    a(
        "--config",
        metavar="FILE",
        default=None,
        help="a PPO run's config (JSON or YAML): its data.*, sampling.* and model.path",
    )
    g = p.add_argument_group("dpo", "the dpo section (klrl.config.dpo.DPOConfig)")
    kinds = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(DPOConfig):
        g.add_argument(
            f"--dpo.{f.name}",
            dest=f"dpo_{f.name}",
            type=kinds[str(f.type)],
            default=None,
            metavar=str(f.type).upper(),
            help=f"{f.metadata['help']} (default {f.default!r})",
        )
    g.add_argument(
        "--dpo.betas",
        dest="betas",
        default=None,
        metavar="B1,B2,..",
        help="a sweep over beta: one member per value (x --dpo.seeds), one compiled program",
    )
    g.add_argument("--dpo.seeds", dest="seeds", default=None, metavar="S1,S2,..", help="a sweep over seeds")
    g = p.add_argument_group("text format", "PPO's fields (default: --config's, else PPO's defaults)")
    for name, kind in PPO_FIELDS:
        g.add_argument(
            f"--{name}",
            dest=name.replace(".", "_"),
            default=None,
            type=_bool if kind == "bool" else int if kind == "int" else str,
            metavar=kind.upper(),
            help=f"PPO's {name}",
        )
    a(
        "--lora.rank",
        "--model.lora.rank",
        dest="lora_rank",
        type=int,
        default=0,
        help="LoRA adapter rank (0: full fine-tuning); the reference is the base with the adapters off",
    )
    a(
        "--lora.alpha",
        "--model.lora.alpha",
        dest="lora_alpha",
        type=float,
        default=16.0,
        help="LoRA scale numerator: (alpha / rank) A B",
    )
    a(
        "--lora.targets",
        "--model.lora.targets",
        dest="lora_targets",
        default="",
        help="regex of the adapted modules ('' = the family's defaults)",
    )
    return p


PARSERS = {
    "export": export_parser,
    "generate": lambda: generate_parser("generate"),
    "eval": lambda: generate_parser("eval"),
    "reward-model": reward_model_parser,
    "dpo": dpo_parser,
}
