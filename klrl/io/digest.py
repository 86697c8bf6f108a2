"""Digests of arrays that do not depend on how the arrays are sharded (checkpoint integrity).

Why this digest and not a SHA-256 per array: SHA-256 is sequential over the bytes, so it needs the
whole array in one place (a gather to one host: memory and time that grow with the model), and a
SHA-256 per saved shard cannot be checked after a restore onto another mesh (the new shards cut the
array elsewhere). The digest is a sum over elements, so it does not depend on how the array is cut:
each device sums its own shard, XLA adds the partial sums (one all-reduce of 4 words per array), and
the same value comes out for any mesh, any number of processes, or a host NumPy array. It detects
bit rot, truncation and misplaced shards (each element's term depends on its global index), not a
deliberate forgery (it is not a cryptographic hash; nothing here defends against an adversary who
can write the checkpoint).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl import distributed

DIGEST = "klrl-lanesum-v1"  # the scheme recorded in the meta, in case it ever changes
_SEEDS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)  # 4 lanes x 32 bits (digits of pi)
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3's fmix32 constants


# leaves up to this size that one process holds whole are digested on the host with NumPy (no
# compile: a run's state of small arrays costs nothing to digest); larger or multi-process ones
# on their devices (one compiled program per set of devices)
HOST_MAX_BYTES = 1 << 20


def _fmix(h, xp=jnp):
    """MurmurHash3's 32-bit finaliser (a bijection of uint32): ``h ^= h >> 16; h *= M1; h ^= h >> 13;
    h *= M2; h ^= h >> 16`` (Appleby, MurmurHash3, ``fmix32``)."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(_M1)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(_M2)
    return h ^ (h >> xp.uint32(16))


def _words(x):
    """The elements' bit patterns as uint32 (8/16-bit types zero-extended; 64-bit types as two words,
    low word first, on a trailing axis of 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size in (1, 2, 4):
        small = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
        return jax.lax.bitcast_convert_type(x, small).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    raise TypeError(f"cannot digest an array of dtype {x.dtype}")


def _words_np(x: np.ndarray) -> np.ndarray:
    """:func:`_words` on the host (little-endian bit patterns)."""
    x = np.asarray(x, order="C")  # (not ascontiguousarray: it makes a 0-d array 1-d)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    size = x.dtype.itemsize
    flat = x.reshape(-1).view(x.dtype.newbyteorder("<") if x.dtype.byteorder == ">" else x.dtype)
    if size in (1, 2, 4):
        return flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32).reshape(x.shape)
    if size == 8:
        return flat.view(np.uint32).reshape(*x.shape, 2)
    raise TypeError(f"cannot digest an array of dtype {x.dtype}")


def _digest(x):
    """``uint32[4]``: lane ``l`` is ``sum_e fmix(fmix(p_e ^ w_e) + s_l) mod 2**32`` over the elements
    ``e``, with ``w_e`` the element's bits and ``p_e = fmix(...fmix(fmix(s_0 ^ i_0) ^ i_1)... ^ i_k)``
    from its global index ``(i_0, ..., i_k)``. A sum mod 2**32 is exact and order-free, so the value
    does not depend on the sharding; for a fixed ``p_e`` each term is a bijection of ``w_e``, so a
    change of any single element changes every lane."""
    w = _words(x)
    p = jnp.full(w.shape, _SEEDS[0], jnp.uint32)
    for d in range(w.ndim):
        p = _fmix(p ^ jax.lax.broadcasted_iota(jnp.uint32, w.shape, d))
    h = _fmix(p ^ w)
    return jnp.stack([jnp.sum(_fmix(h + jnp.uint32(s)), dtype=jnp.uint32) for s in _SEEDS])


def _digest_np(x: np.ndarray) -> np.ndarray:
    """:func:`_digest` with NumPy (uint32 arithmetic wraps mod 2**32 as XLA's does)."""
    w = _words_np(x)
    p = np.full(w.shape, _SEEDS[0], np.uint32)
    for d, n in enumerate(w.shape):
        p = _fmix(p ^ np.arange(n, dtype=np.uint32).reshape([n if e == d else 1 for e in range(w.ndim)]), np)
    h = _fmix((p ^ w).reshape(-1), np)  # (1-d: NumPy scalars would warn on the wrap-around)
    return np.array([np.sum(_fmix(h + np.uint32(s), np), dtype=np.uint32) for s in _SEEDS], np.uint32)


# one program per leaf shape (and sharding), run leaf after leaf: a single program over all leaves
# let XLA keep every leaf's uint32 intermediates alive at once (34 GB for a 4-member SmolLM2 sweep's
# 8.6 GB state); one leaf at a time holds one leaf's
_digest_one = jax.jit(_digest)


def _on_host(x: Any) -> bool:
    return not isinstance(x, jax.Array) or (x.is_fully_addressable and x.nbytes <= HOST_MAX_BYTES)


def leaf_name(path: tuple) -> str:
    """A leaf's path as ``'params/policy/wte/embedding'``: the same for a NamedTuple's field and a
    dict's key (orbax restores a NamedTuple state without a target as a dict)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def digests(state: Any) -> dict[str, list]:
    """``{leaf name: [dtype, shape, 32 hex digits]}`` (:func:`leaf_name`) for every array of ``state`` (see
    :func:`_digest`): small arrays this process holds whole with NumPy, the others on the devices
    that hold them (sharded ones: each device its shard, then one all-reduce; every process must
    call it, as for a save). The same value for any sharding, process count or path."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = [x if isinstance(x, jax.Array) else np.asarray(x) for _, x in flat]
    words: list = [None] * len(leaves)
    groups: dict[Any, list[int]] = {}  # one program per set of devices
    for i, x in enumerate(leaves):
        if _on_host(x):
            words[i] = _digest_np(np.asarray(x))
        else:
            groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    for idx in groups.values():
        for i in idx:  # blocking, leaf after leaf: never two leaves' intermediates at once
            words[i] = distributed.to_host(_digest_one(leaves[i]))
    return {
        leaf_name(path): [
            np.dtype(x.dtype).name,
            [int(n) for n in x.shape],
            "".join(f"{int(v):08x}" for v in np.asarray(w, np.uint32)),
        ]
        for (path, _), x, w in zip(flat, leaves, words, strict=True)
    }
