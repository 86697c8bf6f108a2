"""Teacher-forced pretraining of a small LM on samples of the synthetic language,
cached on disk with orbax, keyed by a hash of everything that determines it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from klrl.algo.logprobs import token_logprobs
from klrl.config import ModelConfig
from klrl.models.base import CausalLM, forward

Array = jax.Array
CACHE_VERSION = 1


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("KLRL_CACHE", "") or Path.home() / ".cache" / "klrl")


def lm_loss(model: CausalLM, params: Any, tokens: Array, mask: Array) -> Array:
    """Mean next-token cross-entropy (nats/token) over positions 1.. whose target is real."""
    out = forward(model, params, tokens, mask)
    logp = token_logprobs(out.logits[:, :-1], tokens[:, 1:])
    m = mask[:, 1:] * mask[:, :-1]
    return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1.0)


def pretrain(
    model: CausalLM,
    sample_fn: Callable[[Array, int], tuple[Array, Array]],
    *,
    key: Array,
    steps: int,
    batch: int,
    lr: float,
    seq_len: int,
    chunk: int = 100,
    log: Callable[[str], None] | None = None,
) -> tuple[Any, dict[str, float]]:
    """Train ``model`` on fresh samples ``sample_fn(key, batch) -> (tokens, mask)`` each step.

    AdamW with a cosine decay; the inner loop is a jitted ``lax.scan`` of ``chunk`` steps.
    Returns the parameters and ``{'loss': final train loss, 'eval_loss': held-out loss}``.
    """
    k_init, k_data, k_eval = jax.random.split(key, 3)
    params = model.init(k_init)  # (``seq_len``: the length of the samples; parameters do not depend on it)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 10 + 1), max(steps, 2)), 0.01
        ),
    )
    opt_state = opt.init(params)

    @jax.jit
    def run(params, opt_state, keys):
        def one(carry, k):
            params, opt_state = carry
            tokens, mask = sample_fn(k, batch)
            loss, grads = jax.value_and_grad(lambda p: lm_loss(model, p, tokens, mask))(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return jax.lax.scan(one, (params, opt_state), keys)

    keys = jax.random.split(k_data, max(steps, 1))
    loss = float("nan")
    t0 = time.time()
    for start in range(0, steps, chunk):
        (params, opt_state), losses = run(params, opt_state, keys[start : start + chunk])
        loss = float(jnp.mean(losses[-10:]))
        if log:
            log(f"pretrain {min(start + chunk, steps)}/{steps} loss {loss:.4f} ({time.time() - t0:.1f}s)")
    tokens, mask = sample_fn(k_eval, 4 * batch)
    eval_loss = float(jax.jit(lambda p: lm_loss(model, p, tokens, mask))(params))
    return params, {"loss": loss, "eval_loss": eval_loss}


def cache_key(payload: dict[str, Any]) -> str:
    blob = json.dumps({"v": CACHE_VERSION, **payload}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _restore_host(path: Path) -> Any:
    """The cached parameters as host NumPy arrays, whatever devices or processes wrote them.

    Restoring with the saved sharding fails when it names a device this process cannot address
    (every process but 0 of a multi-process run, or another device count).
    """
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    return ckptr.restore(path, jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree))


def cached(
    name: str,
    payload: dict[str, Any],
    build: Callable[[], tuple[Any, dict]],
    cache_dir: str = "",
    log: Callable[[str], None] | None = None,
) -> tuple[Any, dict]:
    """Load ``name-<hash(payload)>`` from the cache, or ``build()`` it and save it.

    The parameters are written with orbax to a temporary directory that is renamed
    into place only when complete, so a half-written entry is never loaded.
    """
    root = cache_root(cache_dir)
    path = root / f"{name}-{cache_key(payload)}"
    info_file = path / "info.json"
    if info_file.exists():
        try:
            info = json.loads(info_file.read_text())
            params = _restore_host((path / "params").absolute())
            if log:
                log(f"loaded cached {name} from {path}")
            return params, info
        except Exception as e:  # a corrupt cache entry is rebuilt, never trusted
            if log:
                log(f"cache entry {path} unreadable ({type(e).__name__}); rebuilding")
    params, info = build()
    info = {**info, "payload": payload}
    tmp = root / f".tmp-{path.name}-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((tmp / "params").absolute(), params)
    ckpt.wait_until_finished()
    (tmp / "info.json").write_text(json.dumps(info, indent=1, default=str))
    try:
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except OSError:
        pass  # another process won the race; its entry is equivalent
    return params, info


def fingerprint(tree: Any) -> str:
    """A short hash of every array in ``tree``: cache keys change when the data-generating process does."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def model_payload(cfg: ModelConfig, vocab: int, max_len: int) -> dict[str, Any]:
    return {"model": {k: getattr(cfg, k) for k in ("n_layers", "n_heads", "d_model", "mlp_ratio",
                                                   "tie_embeddings", "dtype")},
            "vocab": vocab, "max_len": max_len}  # fmt: skip
