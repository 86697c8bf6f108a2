"""Checkpoints of sharded state (issue 16, item 4) and the sharding-invariant array digest.

A tiny Llama's parameters and Adam state, sharded by the family's partition rules on a
(sweep 1, data 2, fsdp 2, tensor 2) mesh of 8 fake CPU devices, are saved, then restored onto the
same mesh, onto (1, 1, 4, 1) over 4 devices and onto 1 device: identical values (bytes), the
requested shardings, and a byte flipped in one shard's data file is refused. The digest is checked
against a pure-Python reference of its formula, and its device (sharded) and host paths agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).parents[1].joinpath("sharded_ckpt_driver.py")


def _driver(case: str, d: Path, jax_cache: Path) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(8),
        JAX_COMPILATION_CACHE_DIR=str(jax_cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    p = subprocess.run(
        [sys.executable, str(DRIVER), case, str(d)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, jax_cache):
    """One subprocess: saved from 8 devices, then restored (and digested) in every way checked below."""
    d = tmp_path_factory.mktemp("sharded") / "run"
    out = _driver("all", d, jax_cache)
    return d, out


def test_saved_from_eight_devices(sharded):
    assert sharded[1]["save"] == {"devices": 8, "embed_shard": [32, 16]}  # 64 x 32 over tensor 2 x fsdp 2


def test_sharded_state_restores_onto_other_meshes(sharded):
    out = sharded[1]["restore"]
    for name, shards, n in [("same", [[32, 16]], 8), ("four", [[64, 8]], 4), ("one", [[64, 32]], 1)]:
        assert out[name]["equal"], name  # every leaf's bytes, dtypes included
        assert out[name]["shardings"], name  # every leaf has the sharding asked for
        assert out[name]["embed_shards"] == shards and out[name]["n_devices"] == n, (name, out[name])
    assert out["struct_target"]  # ShapeDtypeStructs that carry their sharding (ckpt.target)
    assert out["host"]  # no sharding: host NumPy arrays


def test_digest_device_and_host_paths_agree_on_any_mesh(sharded):
    assert sharded[1]["paths"] == {"eight": True, "four": True, "one": True}


def test_loop_resumes_sharded_state_exactly_and_onto_another_mesh(sharded):
    """klrl.loop.driver.drive with Program.shardings: 2 iterations + resume to 4 on the same 8-device mesh
    equals 4 straight (metrics.jsonl bytes, every leaf of the state); resumed onto 4 devices, the
    run continues on them (the same values up to fp32 reduction order)."""
    out = sharded[1]["loop"]
    assert out["same_rows"] and out["same_state"], out
    assert out["other_rows"] == 4 and out["other_close"] and out["other_state_close"], out
    assert out["other_devices"] == 4


def test_restore_refuses_other_shapes_before_reading(sharded):
    err = sharded[1]["wrong_shape"]["error"]
    assert err is not None and "does not match this model's state" in err, err


def test_damaged_shard_is_refused_on_another_mesh(sharded, tmp_path, jax_cache):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(sharded[0], d)
    err = _driver("damaged", d, jax_cache)["error"]
    assert err is not None and "\n" not in err, err
    assert "checkpoint 2" in err and "is damaged: the digest of 1 array(s)" in err, err
    assert "(params/params/embed_tokens/embedding)" in err, err


# ---- the digest's formula, against a pure-Python reference --------------------------------------

M32 = 0xFFFFFFFF


def _fmix_ref(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _digest_ref(x: np.ndarray) -> str:
    """MurmurHash3 fmix32 over (global index, bits), summed per lane mod 2**32, one element at a time."""
    seeds = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    lanes = [0, 0, 0, 0]
    bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
    for index in np.ndindex(x.shape):
        p = seeds[0]
        for i in index:
            p = _fmix_ref(p ^ i)
        h = _fmix_ref(p ^ int(bits[index]))
        for lane, s in enumerate(seeds):
            lanes[lane] = (lanes[lane] + _fmix_ref((h + s) & M32)) & M32
    return "".join(f"{v:08x}" for v in lanes)


def test_digest_matches_reference_and_catches_any_change():
    import jax.numpy as jnp

    from klrl.io import digest

    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 4)).astype(np.float32)
    state = {
        "a": a,
        "b": np.arange(5, dtype=np.int32),
        "c": np.asarray(a[0], jnp.bfloat16),
        "d": np.int32(-3),
    }
    ref = {k: _digest_ref(np.asarray(v)) for k, v in state.items()}
    host = digest.digests(state)
    dev = {k: digest._digest(jnp.asarray(v)) for k, v in state.items()}  # the device code, unsharded
    for k, v in state.items():
        key = k  # (leaf names: the path's keys joined by '/')
        assert host[key] == [np.dtype(np.asarray(v).dtype).name, list(np.shape(v)), ref[k]], k
        assert "".join(f"{int(w):08x}" for w in np.asarray(dev[k])) == ref[k], k
    flipped = a.copy()
    flipped.view(np.uint8).reshape(-1)[7] ^= 1
    swapped = a.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values in other places (e.g. shards written out of order)
    for bad in (flipped, swapped, a.T.copy().reshape(3, 4)):
        assert digest.digests({"a": bad})["a"][2] != host["a"][2]


def test_check_arrays_names_the_damaged_leaf():
    from klrl.io import checkpoint as ckpt
    from klrl.io import digest

    state = {"a": np.ones((2, 3), np.float32), "b": np.zeros(4, np.int32)}
    rec = digest.digests(state)
    ckpt.check_arrays(state, rec, "here")  # unchanged: no error
    bad = {**state, "b": np.array([0, 0, 1, 0], np.int32)}
    with pytest.raises(
        ckpt.CheckpointError, match=r"checkpoint 3 in X is damaged: the digest of 1 array\(s\) \(b\)"
    ):
        ckpt.check_arrays(bad, rec, "checkpoint 3 in X")
    with pytest.raises(ckpt.CheckpointError, match="other leaves"):
        ckpt.check_arrays({"a": state["a"]}, rec, "here")


def test_checkpoints_of_earlier_versions_are_verified_by_their_sha256(tmp_path):
    """A meta record with the per-array SHA-256 (``checksum``) and no digests: still verified."""
    import json

    from klrl.io import checkpoint as ckpt

    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int32(4)}
    mgr = ckpt.manager(tmp_path, async_save=False)
    ckpt.save(mgr, 1, state, {"config": {}, "version": ckpt.version(), "iteration": 1, "metrics_lines": 0})
    ckpt.finish(mgr)
    path = tmp_path / "checkpoints" / "1" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    assert meta.pop("digest") and meta.pop("arrays")
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in state.items()}
    for checksum, ok in [(ckpt.checksums(state), True), (ckpt.checksums({**state, "n": np.int32(5)}), False)]:
        path.write_text(json.dumps({**meta, "checksum": checksum}))
        mgr = ckpt.manager(tmp_path, read_only=True)
        try:
            if ok:
                got, _ = ckpt.restore(mgr, abstract)
                assert got["w"].tobytes() == state["w"].tobytes() and int(got["n"]) == 4
            else:
                with pytest.raises(ckpt.CheckpointError, match=r"is damaged: the SHA-256 of 1 array"):
                    ckpt.restore(mgr, abstract)
        finally:
            mgr.close()
