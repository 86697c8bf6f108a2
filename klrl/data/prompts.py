"""Prompt datasets: a file of prompts -> a left-padded token pool ``[N, P]`` with its texts and columns.

Sources (``DataConfig.path``; the format comes from the suffix unless ``format`` names it):

- ``.jsonl``: one JSON object per line (blank lines skipped); ``.json``: a list of objects;
- ``.csv``: a header row, one prompt per row (every value is a string, as ``csv.DictReader`` reads it);
- ``.parquet``: read with pyarrow (optional; a one-line error when it is not installed);
- ``.txt``: one prompt per non-empty line, in a column named ``field``;
- a directory written by ``datasets.Dataset.save_to_disk`` (``datasets`` optional; of a
  ``DatasetDict`` the split ``split`` is read);
- ``klrl:<name>``: a file shipped with klrl (``klrl:instructions``, ``klrl:arithmetic``).

The prompt column ``field`` (default ``prompt``, TRL's convention) holds a string or a
conversation: a list of ``{"role", "content"}`` dicts (TRL's conversational format, e.g. a
``messages`` column with ``field="messages"``). With ``chat_template`` on, a string becomes one
user turn and the conversation is rendered by the tokenizer's chat template with the generation
prompt, then encoded without added special tokens (the template writes them, as transformers
does). With it off, a string is encoded with ``add_special_tokens=True`` (a BOS where the tokenizer
adds one) and a conversation is an error.

Tokens are left-padded to the prompt budget ``P = prompt_len`` (``mask`` 1 on prompt tokens, 0 on
pads), so every prompt ends at column ``P - 1`` and the response starts at column ``P``. A prompt
longer than ``P`` keeps its last ``P`` tokens (``truncate='left'``: the generation prompt survives;
one warning counts them, and ``PromptPool.n_truncated`` holds the count) or is an error
(``truncate='error'``). Held-out prompts: a separate file (``eval_path``) or a deterministic
fraction (``eval_fraction``: a ``seed``-ed permutation picks ``round(fraction * N)`` rows, at least
one; both pools keep file order).

Every user mistake raises :class:`PromptDataError` with one line naming the file (and row or
column); a bad configuration value raises :class:`klrl.config.run.ConfigError` naming the field.
"""

from __future__ import annotations

import csv
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from klrl.config import ConfigError, DataConfig
from klrl.data.tokenizer import Tokenizer


def one_line(e: BaseException) -> str:
    """``Type: message`` on one line (a multi-line message joined with " / ")."""
    return f"{type(e).__name__}: {' / '.join(x.strip() for x in str(e).splitlines() if x.strip())}"


FILES = Path(__file__).resolve().parent / "files"
_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


class PromptDataError(ValueError):
    """A prompt file or its content is unusable. The message names the file (and row or column)."""


class PromptTruncationWarning(UserWarning):
    """Some prompts were longer than the prompt budget and lost their first tokens."""


@dataclass(frozen=True)
class PromptPool:
    """``N`` prompts, left-padded: ``tokens [N, P] int32``, ``mask [N, P] float32`` (1 on prompt tokens).

    ``prompts`` are the field's values as read (strings or message lists), ``texts`` the strings
    that were encoded (after the chat template, before truncation), ``columns`` every other
    column (name -> list of N values; ``None`` where a row lacks it), ``rows`` each prompt's row
    in its file (0-based), ``truncated [N] bool`` which prompts lost tokens on the left.
    """

    tokens: np.ndarray
    mask: np.ndarray
    prompts: list[Any]
    texts: list[str]
    columns: dict[str, list[Any]]
    rows: np.ndarray
    truncated: np.ndarray
    source: str

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_truncated(self) -> int:
        return int(self.truncated.sum())

    def take(self, idx: np.ndarray) -> PromptPool:
        """The prompts at positions ``idx`` (in that order)."""
        idx = np.asarray(idx, dtype=np.int64)
        pick = lambda xs: [xs[i] for i in idx]
        return PromptPool(
            tokens=self.tokens[idx],
            mask=self.mask[idx],
            prompts=pick(self.prompts),
            texts=pick(self.texts),
            columns={k: pick(v) for k, v in self.columns.items()},
            rows=self.rows[idx],
            truncated=self.truncated[idx],
            source=self.source,
        )


class PromptSplits(NamedTuple):
    train: PromptPool
    eval: PromptPool | None


def resolve_path(path: str) -> Path:
    """``klrl:<name>`` -> the shipped ``klrl/data/files/<name>.jsonl``; anything else as a path."""
    if path.startswith("klrl:"):
        name = path[len("klrl:") :]
        shipped = FILES / f"{name}.jsonl"
        if not shipped.is_file():
            names = ", ".join(sorted("klrl:" + p.stem for p in FILES.glob("*.jsonl")))
            raise PromptDataError(f"{path}: no such shipped prompt file (shipped: {names})")
        return shipped
    return Path(path).expanduser()


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "disk"
    if path.suffix.lower() not in _SUFFIX:
        raise PromptDataError(
            f"{path}: unknown prompt file type {path.suffix!r} (use .jsonl, .json, .csv, .parquet, .txt "
            "or a saved datasets directory, or set data.format)"
        )
    return _SUFFIX[path.suffix.lower()]


def _read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    records, where = [], []
    with path.open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptDataError(f"{path} line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PromptDataError(f"{path} line {n}: expected a JSON object, got {type(rec).__name__}")
            records.append(rec)
            where.append(f"line {n}")
    return records, where


def _read_json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise PromptDataError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise PromptDataError(f"{path}: expected a JSON list of objects")
    return data


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise PromptDataError(f"{path}: not a readable Parquet file ({one_line(e)})") from None


def _read_disk(path: Path, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise PromptDataError(
            f"{path}: reading a saved dataset needs `datasets` (pip install datasets)"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # FileNotFoundError or datasets' own errors for a foreign directory
        raise PromptDataError(f"{path}: not a saved datasets directory ({one_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise PromptDataError(f"{path}: no split {split!r} (splits: {', '.join(ds)}); set data.split")
        ds = ds[split]
    return ds.to_list()


def read_records(
    path: str | Path, *, format: str = "auto", field: str = "prompt", split: str = "train"
) -> tuple[list[dict], list[str]]:
    """The rows of a prompt file as dicts, with a label for each (``line 7`` or ``row 3``) for errors.

    Raises :class:`PromptDataError` for a missing, empty or malformed file.
    """
    p = resolve_path(str(path))
    if not p.exists():
        raise PromptDataError(f"{p}: prompt file not found")
    fmt = _format_of(p, format)
    where: list[str] | None = None
    try:
        if fmt == "jsonl":
            records, where = _read_jsonl(p)
        elif fmt == "json":
            records = _read_json(p)
        elif fmt == "csv":
            with p.open(encoding="utf-8-sig", newline="") as f:
                records = [dict(r) for r in csv.DictReader(f)]
            where = [f"row {i + 2}" for i in range(len(records))]  # the header is row 1
        elif fmt == "parquet":
            records = _read_parquet(p)
        elif fmt == "text":
            lines = p.read_text(encoding="utf-8-sig").splitlines()
            keep = [(n, s) for n, s in enumerate(lines, 1) if s.strip()]
            records, where = [{field: s} for _, s in keep], [f"line {n}" for n, _ in keep]
        else:
            records = _read_disk(p, split)
    except (OSError, UnicodeDecodeError) as e:
        raise PromptDataError(f"{p}: cannot read ({one_line(e)})") from None
    if not records:
        raise PromptDataError(f"{p}: no prompts in the file")
    return records, where or [f"row {i}" for i in range(len(records))]


def _messages(value: Any, label: str) -> list[dict[str, str]] | None:
    """``value`` as a conversation, None for a string; a malformed one is an error."""
    if isinstance(value, str):
        return None
    if (
        isinstance(value, list | tuple)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise PromptDataError(
        f"{label}: expected a string or a list of {{role, content}} messages, got {type(value).__name__}"
    )


def render(value: Any, tokenizer: Tokenizer, chat_template: bool, label: str) -> str:
    """The text to encode for one prompt value (see the module docstring)."""
    msgs = _messages(value, label)
    if not chat_template:
        if msgs is not None:
            raise PromptDataError(f"{label}: a conversation needs data.chat_template true")
        return value
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptDataError(f"{label}: the tokenizer has no chat template; set data.chat_template false")
    try:
        return tokenizer.apply_chat_template(
            msgs if msgs is not None else [{"role": "user", "content": value}], add_generation_prompt=True
        )
    except Exception as e:  # jinja2's TemplateError, or whatever the template raises
        raise PromptDataError(f"{label}: the chat template failed ({one_line(e)})") from None


def build_pool(
    records: list[dict],
    tokenizer: Tokenizer,
    cfg: DataConfig,
    *,
    source: str = "<records>",
    where: list[str] | None = None,
    rows: np.ndarray | None = None,
) -> PromptPool:
    """Encode ``records`` into a left-padded pool (chat template, truncation, padding as configured)."""
    if not records:
        raise PromptDataError(f"{source}: no prompts")
    where = where or [f"row {i}" for i in range(len(records))]
    missing = [w for r, w in zip(records, where, strict=True) if cfg.field not in r]
    if missing:
        cols = ", ".join(list(records[0])[:10])
        raise PromptDataError(
            f"{source}: no column {cfg.field!r} ({missing[0]}; columns: {cols}); set data.field"
        )
    n, P = len(records), cfg.prompt_len
    tokens = np.full((n, P), tokenizer.pad_id, dtype=np.int32)
    mask = np.zeros((n, P), dtype=np.float32)
    texts, truncated = [], np.zeros(n, dtype=bool)
    for i, (rec, w) in enumerate(zip(records, where, strict=True)):
        label = f"{source} {w}"
        text = render(rec[cfg.field], tokenizer, cfg.chat_template, label)
        ids = list(tokenizer.encode(text, add_special_tokens=not cfg.chat_template))
        if not ids:
            raise PromptDataError(f"{label}: the prompt encodes to no tokens")
        if len(ids) > P:
            if cfg.truncate == "error":
                raise PromptDataError(
                    f"{label}: prompt has {len(ids)} tokens, more than data.prompt_len "
                    f"= {P} (data.truncate = 'error')"
                )
            ids, truncated[i] = ids[-P:], True
        tokens[i, P - len(ids) :] = ids
        mask[i, P - len(ids) :] = 1.0
        texts.append(text)
    if truncated.any():
        warnings.warn(
            f"{source}: {truncated.sum()} of {n} prompts longer than data.prompt_len = {P} tokens "
            "were truncated from the left",
            PromptTruncationWarning,
            stacklevel=2,
        )
    names: dict[str, None] = {}
    for r in records:
        names.update(dict.fromkeys(k for k in r if k != cfg.field))
    columns = {k: [r.get(k) for r in records] for k in names}
    return PromptPool(
        tokens=tokens,
        mask=mask,
        prompts=[r[cfg.field] for r in records],
        texts=texts,
        columns=columns,
        rows=np.arange(n) if rows is None else np.asarray(rows),
        truncated=truncated,
        source=source,
    )


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)`` row indices, each ascending: ``round(fraction * n)`` rows (>= 1 if
    ``fraction > 0``) picked by a ``seed``-ed permutation, never all ``n``."""
    if fraction <= 0:
        return np.arange(n), np.arange(0)
    k = min(max(1, round(fraction * n)), n - 1)
    if k < 1:
        raise ConfigError(f"data.eval_fraction: {n} prompt(s) cannot be split into train and eval")
    held = np.sort(np.random.default_rng(seed).permutation(n)[:k])
    return np.setdiff1d(np.arange(n), held), held


def load_prompts(cfg: DataConfig, tokenizer: Tokenizer) -> PromptSplits:
    """The training pool and the evaluation pool (None without ``eval_path`` or ``eval_fraction``)."""
    src = str(resolve_path(cfg.path))
    records, where = read_records(cfg.path, format=cfg.format, field=cfg.field, split=cfg.split)
    if cfg.limit:
        records, where = records[: cfg.limit], where[: cfg.limit]
    if cfg.eval_path:
        train = build_pool(records, tokenizer, cfg, source=src, where=where)
        erec, ewhere = read_records(cfg.eval_path, format=cfg.format, field=cfg.field, split=cfg.split)
        return PromptSplits(
            train, build_pool(erec, tokenizer, cfg, source=str(resolve_path(cfg.eval_path)), where=ewhere)
        )
    tr, ev = split_indices(len(records), cfg.eval_fraction, cfg.seed)
    sub = lambda idx: dict(records=[records[i] for i in idx], where=[where[i] for i in idx], rows=idx)
    train = build_pool(tokenizer=tokenizer, cfg=cfg, source=src, **sub(tr))
    return PromptSplits(
        train, build_pool(tokenizer=tokenizer, cfg=cfg, source=src, **sub(ev)) if len(ev) else None
    )
