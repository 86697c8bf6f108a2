"""A trained reward model from Python in one call: :func:`load_reward_model` (``klrl.load_reward_model``).

``load_reward_model(DIR)`` reads a directory ``klrl reward-model`` wrote (an HF
``*ForSequenceClassification`` directory with its tokenizer; any such directory with one label works)
and returns a :class:`RewardModel` whose ``score(prompts, responses)`` gives one float per pair: the
score head at the last real token, ``r = score . h_last``, of the text laid out exactly as PPO shows it
to ``--model.reward_path`` (:func:`klrl.rewards.pairs.encode_as_ppo`: the chat template, the stop
token, the truncation), in the text format recorded in the directory's ``reward_model.json`` (the one it
was trained on; the PPO defaults where there is none). ``prompts`` are strings or conversations
(lists of ``{role, content}``), ``responses`` strings.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from klrl.config import ConfigError, DataConfig, SamplingConfig
from klrl.data.hf_tokenizer import TokenizerFormatError, load_tokenizer_dir
from klrl.models.hf import CheckpointFormatError, load_hf
from klrl.rewards.pairs import PairsError, check_pairs, encode_as_ppo
from klrl.rewards.train import last_hidden

RESULT = "reward_model.json"


def recorded_format(path: str | Path) -> tuple[DataConfig, SamplingConfig]:
    """The ``data`` and ``sampling`` fields of the text format ``reward_model.json`` records (PPO's
    defaults for what it does not record, or without the file)."""
    f = Path(path) / RESULT
    fmt = json.loads(f.read_text()).get("text_format", {}) if f.is_file() else {}
    data = {k: fmt[k] for k in ("chat_template", "prompt_len", "truncate") if k in fmt}
    sampling = {k: fmt[k] for k in ("response_len", "use_eos") if k in fmt}
    try:
        return DataConfig(**data), SamplingConfig(**sampling)
    except ConfigError as e:
        raise CheckpointFormatError(f"{f}: text_format: {e}") from None


@dataclasses.dataclass(frozen=True)
class RewardModel:
    """A frozen reward model: the trunk (``model``, ``params``), its score vector ``score [D]``, the
    tokenizer and the text format (``data``, ``sampling``: the fields of PPO's config it reads)."""

    model: Any
    params: Any
    score_head: np.ndarray
    tokenizer: Any
    data: DataConfig
    sampling: SamplingConfig
    path: str = ""

    def encode(self, prompts: Sequence[Any], responses: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, mask)`` ``[N, prompt_len + response_len]``, right-padded: the token ids PPO's
        reward model reads for each ``(prompt, response)``."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        rows = [{"prompt": p, "chosen": r, "rejected": r} for p, r in zip(prompts, responses, strict=True)]
        try:
            # text responses need no check: an empty one stopped at once, and PPO's reward model reads
            # the prompt and its end token (a pairs file refuses an empty response; scoring does not)
            if not all(isinstance(r, str) for r in responses):
                check_pairs(rows, [f"pair {i}" for i in range(len(rows))])
            pairs = encode_as_ppo(rows, self.tokenizer, self.data, self.sampling, source=self.path)
        except PairsError as e:
            raise ValueError(str(e).replace("chosen", "response")) from None
        return pairs.chosen, pairs.chosen_mask

    def score(self, prompts: Sequence[Any], responses: Sequence[str], batch_size: int = 16) -> np.ndarray:
        """``[N]`` float32 rewards of the pairs (module docstring)."""
        if not len(prompts):
            return np.zeros((0,), np.float32)
        tokens, mask = self.encode(prompts, responses)
        hidden = last_hidden(self.model, self.params, tokens, mask, chunk=batch_size)
        return np.asarray(hidden @ jnp.asarray(self.score_head, jnp.float32), np.float32)


def load_reward_model(path: str | Path, *, dtype: Any = jnp.float32) -> RewardModel:
    """The reward model in ``path`` (module docstring). A directory that is not a one-label sequence
    classifier with a tokenizer is a :class:`klrl.models.hf.CheckpointFormatError` (one line)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise CheckpointFormatError(
            f"{p}: no config.json (a reward model is a directory klrl reward-model wrote)"
        )
    model, params, score = load_hf(p, dtype=dtype, score=True, put=jnp.asarray)
    score = np.asarray(score, np.float32)
    if score.shape[0] != 1:
        raise CheckpointFormatError(
            f"{p}: a reward model has one label (num_labels=1), this score head has {score.shape[0]}"
        )
    if not (p / "tokenizer.json").is_file():
        raise CheckpointFormatError(f"{p}: no tokenizer.json (the reward model's tokenizer)")
    try:
        tok = load_tokenizer_dir(p)
    except TokenizerFormatError as e:
        raise CheckpointFormatError(str(e)) from None
    data, sampling = recorded_format(p)
    return RewardModel(model, params, score[0], tok, data, sampling, str(p))


# the text-format fields reward_model.json records -> their config section
_SECTION = {"chat_template": "data", "prompt_len": "data", "truncate": "data", "response_len": "sampling",
            "use_eos": "sampling"}  # fmt: skip


def format_mismatch(path: str | Path, data: DataConfig, sampling: SamplingConfig) -> str | None:
    """One line when the reward model in ``path`` was trained (``reward_model.json``'s ``text_format``)
    on another text format than a PPO run with ``data`` and ``sampling`` shows it; None when they agree
    or nothing is recorded (a directory klrl reward-model did not write)."""
    fmt = _recorded(path)
    if fmt is None:
        return None
    run = {**dataclasses.asdict(data), **dataclasses.asdict(sampling)}
    differ = [
        f"{sec}.{k} {fmt[k]!r} (this run: {run[k]!r})"
        for k, sec in _SECTION.items()
        if k in fmt and fmt[k] != run[k]
    ]
    if not differ:
        return None
    return (
        f"warning: model.reward_path {path} was trained on another text format than this run shows it: "
        + ", ".join(differ)
        + "; retrain it with these flags (or --config of this run), or set them here (docs/reward-model.md)"
    )


def _recorded(path: str | Path) -> dict | None:
    """``reward_model.json``'s ``text_format`` in ``path``; None when there is none (or it is unreadable)."""
    f = Path(path) / RESULT
    try:
        fmt = json.loads(f.read_text()).get("text_format") if f.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return fmt if isinstance(fmt, dict) else None


def format_note(path: str | Path, data: DataConfig, sampling: SamplingConfig) -> str:
    """The line a PPO run with ``model.reward_path`` logs about the text format: the warning of
    :func:`format_mismatch`; else, when ``reward_model.json`` records a format, that it matches (the
    fields compared, with their values); else that none is recorded (a directory klrl reward-model
    did not write: nothing to compare)."""
    mismatch = format_mismatch(path, data, sampling)
    if mismatch is not None:
        return mismatch
    fmt = _recorded(path)
    if fmt is None:
        return (
            f"model.reward_path {path}: no text format recorded (no {RESULT} from klrl reward-model), "
            "so it is not compared with this run's"
        )
    shown = ", ".join(f"{_SECTION[k]}.{k} {fmt[k]!r}" for k in _SECTION if k in fmt)
    return f"model.reward_path {path}: text format matches the one it was trained on ({shown})"
