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
user turn (unless it already carries the template, below) and the conversation is rendered by the
tokenizer's chat template with the generation prompt, then encoded without added special tokens
(the template writes them, as transformers does). With it off, a string is encoded with
``add_special_tokens=True`` (a BOS where the tokenizer adds one) and a conversation is an error.

**Prompts that already carry the template** (the output of ``apply_chat_template``, e.g. a string
starting ``<|im_start|>system``): a string that contains a special token the tokenizer's chat
template writes (:func:`chat_format`: its markers, e.g. ``<|im_start|>``, ``<|im_end|>``; found by
rendering a probe conversation) is encoded as it is, never wrapped a second time;
``PromptPool.templated`` marks them (counted as ``data/prompts_templated`` by the text task).

**Truncation** to the prompt budget ``P = prompt_len`` (``truncate='left'``, the default) keeps the
template: a prompt longer than ``P`` tokens loses the *first* tokens of its user content (the end of
the request, usually the question, survives), while the system turn, the user header, the end of
turn and the generation prompt (``<|im_start|>assistant\\n``) stay whole; its row is then exactly
``P`` tokens. The pieces are encoded separately (template text, user content), the content's tokens
cut from the left, and concatenated. In a conversation the user messages are shortened in order,
the earliest first (an emptied one keeps its header); system messages and assistant turns are never
cut. A string that already carries the template is cut the same way inside its user turns (the
text between the template's user header and the next marker); with ``chat_template`` off a plain
string loses its first tokens after the BOS the tokenizer adds. Where the template alone (every
piece but the user content) takes ``P`` tokens or more, or the user content cannot be found, it is
a :class:`PromptDataError` naming ``data.prompt_len``; ``truncate='error'`` makes any long prompt
one. ``PromptPool.truncated`` marks the cut prompts (``data/prompts_truncated``); the caller logs
the counts (:func:`counts_line`), no Python warning is emitted.

Tokens are left-padded to ``P`` (``mask`` 1 on prompt tokens, 0 on pads), so every prompt ends at
column ``P - 1`` and the response starts at column ``P``. Held-out prompts: a separate file
(``eval_path``) or a deterministic fraction (``eval_fraction``: a ``seed``-ed permutation picks
``round(fraction * N)`` rows, at least one; both pools keep file order).

A ``data`` field that is set but has no effect is an error naming it (:func:`check_fields`):
``split`` without a saved ``datasets.DatasetDict`` directory to read it from (a JSONL, JSON, CSV,
Parquet or text file has no splits), ``seed`` without ``eval_fraction``, ``eval_every`` without
held-out prompts; and any of them on a task that generates its own prompts (:func:`check_unused`).

Every user mistake raises :class:`PromptDataError` with one line naming the file (and row or
column); a bad configuration value raises :class:`klrl.config.run.ConfigError` naming the field.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from klrl.config import ConfigError, DataConfig
from klrl.data.chat import PromptDataError, chat_format, one_line, render, shorten
from klrl.data.tokenizer import Tokenizer

FILES = Path(__file__).resolve().parent / "files"
_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


class PromptTruncationWarning(UserWarning):
    """No longer emitted (truncation is counted and logged, see the module docstring); kept so that
    warning filters naming it still resolve."""


@dataclass(frozen=True)
class PromptPool:
    """``N`` prompts, left-padded: ``tokens [N, P] int32``, ``mask [N, P] float32`` (1 on prompt tokens).

    ``prompts`` are the field's values as read (strings or message lists), ``texts`` the strings
    that were encoded (after the chat template, before truncation), ``columns`` every other
    column (name -> list of N values; ``None`` where a row lacks it), ``rows`` each prompt's row
    in its file (0-based), ``truncated [N] bool`` which prompts were cut to the budget (inside
    their user content), ``templated [N] bool`` which already carried the chat template.
    """

    tokens: np.ndarray
    mask: np.ndarray
    prompts: list[Any]
    texts: list[str]
    columns: dict[str, list[Any]]
    rows: np.ndarray
    truncated: np.ndarray
    source: str
    templated: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.templated is None:
            object.__setattr__(self, "templated", np.zeros(len(self.truncated), dtype=bool))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_truncated(self) -> int:
        return int(self.truncated.sum())

    @property
    def n_templated(self) -> int:
        return int(self.templated.sum())

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
            templated=self.templated[idx],
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
    if p.is_char_device() or p.is_block_device() or p.is_socket() or p.is_fifo():  # (a FIFO: may never end)
        raise PromptDataError(f"{p}: not a regular file (a device, named pipe or socket)")
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


def build_pool(
    records: list[dict],
    tokenizer: Tokenizer,
    cfg: DataConfig,
    *,
    source: str = "<records>",
    where: list[str] | None = None,
    rows: np.ndarray | None = None,
) -> PromptPool:
    """Encode ``records`` into a left-padded pool (chat template, truncation, padding as configured;
    a string that already carries the template is not wrapped again)."""
    if not records:
        raise PromptDataError(f"{source}: no prompts")
    where = where or [f"row {i}" for i in range(len(records))]
    missing = [w for r, w in zip(records, where, strict=True) if cfg.field not in r]
    if missing:
        cols = ", ".join(list(records[0])[:10])
        hint = " messages" if "messages" in records[0] else ""  # TRL's conversational column
        raise PromptDataError(
            f"{source}: no column {cfg.field!r} ({missing[0]}; columns: {cols}); set data.field{hint}"
        )
    n, P = len(records), cfg.prompt_len
    fmt = chat_format(tokenizer)
    tokens = np.full((n, P), tokenizer.pad_id, dtype=np.int32)
    mask = np.zeros((n, P), dtype=np.float32)
    texts, truncated, templated = [], np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    for i, (rec, w) in enumerate(zip(records, where, strict=True)):
        label, value = f"{source} {w}", rec[cfg.field]
        templated[i] = fmt is not None and isinstance(value, str) and fmt.carries(value)
        text = value if templated[i] else render(value, tokenizer, cfg.chat_template, label)
        ids = list(tokenizer.encode(text, add_special_tokens=not cfg.chat_template))
        if not ids:
            raise PromptDataError(f"{label}: the prompt encodes to no tokens")
        if len(ids) > P:
            ids = shorten(value, text, bool(templated[i]), tokenizer, cfg, fmt, label, len(ids))
            truncated[i] = True
        tokens[i, P - len(ids) :] = ids
        mask[i, P - len(ids) :] = 1.0
        texts.append(text)
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
        templated=templated,
    )


def counts_line(pool: PromptPool, cfg: DataConfig, what: str = "prompts") -> str | None:
    """One log line on the prompts of ``pool`` that already carried the chat template and those cut
    to the budget; None when there are none."""
    n, parts = len(pool), []
    if pool.n_templated:
        parts.append(f"{pool.n_templated} of {n} already carry the chat template (not wrapped again)")
    if pool.n_truncated:
        parts.append(
            f"{pool.n_truncated} of {n} longer than data.prompt_len = {cfg.prompt_len} tokens were cut to it "
            "inside the user content (its first tokens dropped; the chat template kept)"
        )
    return f"{what} {pool.source}: " + "; ".join(parts) if parts else None


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataConfig)}


def _changed(cfg: DataConfig) -> list[str]:
    """The ``data`` fields ``cfg`` sets to something other than their default, in field order."""
    return [k for k, v in _DEFAULTS.items() if getattr(cfg, k) != v]


def _kind(path: str, fmt: str) -> str | None:
    """What a prompt source is, for the data.split message ("a .jsonl file"); None when it reads
    ``data.split`` (a saved ``DatasetDict``) or does not exist (read_records reports it)."""
    try:
        p = resolve_path(path)
    except PromptDataError:
        return None
    if not p.exists():
        return None
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():  # what DatasetDict.save_to_disk writes
            return None
        return "a saved single dataset (no splits)"
    name = fmt if fmt not in ("auto", "disk") else (p.suffix or "suffix-less")
    return f"a {name} file"


def check_fields(cfg: DataConfig) -> None:
    """A ``data`` field that is set but has no effect on these prompt sources is a
    :class:`ConfigError` naming it: ``split`` when no source is a saved ``datasets.DatasetDict``
    directory (the only source with splits), ``seed`` without ``eval_fraction`` (it seeds that
    split only), ``eval_every`` (> 0) without held-out prompts (``eval_path`` or ``eval_fraction``)."""
    changed = set(_changed(cfg))
    if "split" in changed:
        sources = [cfg.path] + ([cfg.eval_path] if cfg.eval_path else [])
        kinds = [_kind(s, cfg.format) for s in sources]
        if all(k is not None for k in kinds):
            what = "; ".join(f"{s} is {k}" for s, k in zip(sources, kinds, strict=True))
            raise ConfigError(
                f"data.split: {cfg.split!r} is read only from a saved datasets.DatasetDict directory; "
                f"{what}, which has no splits"
            )
    if "seed" in changed and cfg.eval_fraction <= 0:
        raise ConfigError(
            f"data.seed: {cfg.seed} seeds only the held-out split of data.eval_fraction, which is 0 here; "
            "set data.eval_fraction or drop data.seed"
        )
    if "eval_every" in changed and cfg.eval_every > 0 and not (cfg.eval_path or cfg.eval_fraction > 0):
        raise ConfigError(
            f"data.eval_every: {cfg.eval_every}, but there are no held-out prompts to score; "
            "set data.eval_path or data.eval_fraction"
        )


def check_unused(cfg: DataConfig, task: str) -> None:
    """The ``data`` section is for prompt files (``task.name=text``): on a task that generates its own
    prompts, any field set is a :class:`ConfigError` naming the fields."""
    changed = _changed(cfg)
    if changed:
        hint = " (its prompt length is task.prompt_len)" if "prompt_len" in changed else ""
        raise ConfigError(
            f"{', '.join('data.' + k for k in changed)}: the {task} task generates its prompts{hint}; "
            "data.* applies to --task.name text"
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
    """The training pool and the evaluation pool (None without ``eval_path`` or ``eval_fraction``);
    first :func:`check_fields`."""
    check_fields(cfg)
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
