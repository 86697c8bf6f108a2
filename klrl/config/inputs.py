"""The config sections of a text task's inputs: its prompts (``data``, klrl.data.prompts) and its
host-side text rewards (``reward``, klrl.rewards); re-exported by :mod:`klrl.config.run`."""

from __future__ import annotations

import math

from klrl.config.fields import Help, _check, _choice, _f
from klrl.config.schema import section
from klrl.registry import REWARDS  # the built-in rewards' names, for reward.fn's help

__all__ = ["COMPLETIONS", "FORMATS", "TRUNCATE", "DataConfig", "RewardConfig"]

COMPLETIONS = ("auto", "text", "messages")


@section("reward")
class RewardConfig:
    """Task text: host-side text rewards instead of the reward model (klrl.rewards); every task: the
    missing-EOS penalty."""

    fn: str = _f(
        "", Help(lambda: f"comma-separated text rewards: built-in names ({', '.join(REWARDS.names())}), "
                 "module:function or file.py:function ('' = the reward model of model.reward_path)"),
    )  # fmt: skip
    weights: str = _f("", "comma-separated weights of reward.fn ('' = all 1)")
    completions: str = _f(
        "auto",
        "the form of reward.fn's completions: auto (TRL's rule: a message list "
        "[{'role': 'assistant', 'content': text}] where the row's prompt is a conversation, the text "
        "otherwise), text (always the text) or messages (always a message list)",
    )
    missing_eos_penalty: float = _f(
        0.0,
        "subtracted from the task reward of a response without a stop token (TRL missing_eos_penalty)",
    )
    standardize: bool = _f(
        False,
        "standardise the task reward (the reward model's score) to mean 0, std 1 over responses of "
        "the reference policy, once at the start (gain and bias in task.json; klrl.rewards.standardize)",
    )
    standardize_samples: int = _f(256, "reference responses sampled for reward.standardize's mean and std")
    timeout: float = _f(
        600.0,
        "seconds one call of a reward.fn function (one batch) may take; a call that has not returned "
        "by then ends the run as a failing function does: one line, last good state saved, exit 2 (0 = no "
        "limit)",
    )

    def __post_init__(self) -> None:
        _check(math.isfinite(self.missing_eos_penalty), "reward.missing_eos_penalty", "must be finite")
        _choice(self.completions, "reward.completions", COMPLETIONS)
        _check(self.standardize_samples >= 2, "reward.standardize_samples", "must be >= 2 (a std needs two)")
        _check(
            math.isfinite(self.timeout) and self.timeout >= 0,
            "reward.timeout",
            "must be a number of seconds >= 0 (0 = no limit)",
        )
        fns = [f.strip() for f in self.fn.split(",")] if self.fn.strip() else []
        _check(all(fns), "reward.fn", f"an empty entry in {self.fn!r} (comma-separated functions)")
        _check(bool(fns) or self.completions == "auto", "reward.completions", "given without reward.fn")
        if self.weights.strip():
            _check(bool(fns), "reward.weights", "given without reward.fn")
            try:
                ws = [float(w) for w in self.weights.split(",")]
            except ValueError:
                ws = None
            _check(
                ws is not None and all(map(math.isfinite, ws)),
                "reward.weights",
                f"must be comma-separated finite numbers (got {self.weights!r})",
            )
            _check(
                len(ws) == len(fns),
                "reward.weights",
                f"{len(ws)} weights for {len(fns)} functions in reward.fn",
            )


FORMATS = ("auto", "jsonl", "json", "csv", "parquet", "text", "disk")
TRUNCATE = ("left", "error")


@section("data")
class DataConfig:
    """Where the prompts of a text task come from and how they become a token pool (klrl.data.prompts)."""

    path: str = _f(
        "klrl:instructions",
        "prompt file (.jsonl/.json/.csv/.parquet/.txt), a saved "
        "datasets directory, or klrl:<name> for a shipped file",
    )
    format: str = _f("auto", "file format: auto (from the suffix), jsonl, json, csv, parquet, text, disk")
    field: str = _f("prompt", "column holding the prompt: a string or a list of {role, content} messages")
    split: str = _f("train", "split to read from a saved datasets.DatasetDict")
    chat_template: bool = _f(
        True,
        "wrap each prompt in the tokenizer's chat template (a string: one user turn) with the "
        "generation prompt, as TRL does; false: raw prompts, encoded as they are. A prompt that already "
        "carries the template is not wrapped again",
    )
    prompt_len: int = _f(64, "prompt budget P in tokens (left padding)")
    truncate: str = _f(
        "left",
        "a prompt longer than P: 'left' (cut the first tokens of its user content; the chat template "
        "and generation prompt kept) or 'error'",
    )
    eval_path: str = _f("", "separate file of evaluation prompts (same format rules)")
    eval_fraction: float = _f(0.0, "fraction of the prompts held out for evaluation (if no eval_path)")
    seed: int = _f(0, "seed of the held-out split")
    limit: int = _f(0, "use the first `limit` prompts of the file (0: all)")
    eval_every: int = _f(
        10,
        "score the held-out prompts (data.eval_path or data.eval_fraction) with the policy at "
        "temperature 0 every this many iterations, also at the first and last; logged as eval/heldout/* "
        "(0 = off)",
    )

    def __post_init__(self) -> None:
        _check(bool(self.path), "data.path", "must name a prompt file")
        _choice(self.format, "data.format", FORMATS)
        _check(bool(self.field), "data.field", "must name a column")
        _check(self.prompt_len >= 1, "data.prompt_len", f"must be >= 1 (got {self.prompt_len})")
        _choice(self.truncate, "data.truncate", TRUNCATE)
        _check(
            0.0 <= self.eval_fraction < 1.0,
            "data.eval_fraction",
            f"must be in [0, 1) (got {self.eval_fraction})",
        )
        _check(
            not (self.eval_path and self.eval_fraction > 0),
            "data.eval_fraction",
            "must be 0 when data.eval_path is given",
        )
        _check(self.limit >= 0, "data.limit", f"must be >= 0 (got {self.limit})")
        _check(self.eval_every >= 0, "data.eval_every", f"must be >= 0 (got {self.eval_every})")
