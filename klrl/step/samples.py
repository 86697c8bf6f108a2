"""Samples you can read, the step's side: :func:`sample_rows` (traced; ``make_train(..., samples=n)``)
returns the first ``n`` rows of the global batch as token ids and per-sample numbers, under metric
names starting with :data:`PREFIX` (``_samples/``; ``[n, P]``/``[n, R]`` int32 and ``[n]`` float32, a
sweep adds the member axis): ``prompt``, ``prompt_mask``, ``response``, ``mask``, ``prompt_idx``,
``reward``, ``kl_seq_sum``, ``kl_exact_seq_sum``, ``ref_logprob`` and ``length``.

The host's side (taking them out of the metrics, decoding, writing ``samples.jsonl`` and
TensorBoard's text, the hook that does it) is :mod:`klrl.loop.samples`; reading them back is
:mod:`klrl.io.samples`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from klrl.algo import kl as kl_lib
from klrl.step.parallel import gather

PREFIX = "_samples/"


def sample_rows(
    n: int, ro: Any, task_reward: jax.Array, k1: jax.Array, exact: jax.Array | None, ref_logp: jax.Array
) -> dict[str, jax.Array]:
    """The first ``n`` rows of the global batch (gathered over ``'data'``) as ``_samples/*`` outputs
    (``exact`` None, with ``kl.exact_metric`` off: ``kl_exact_seq_sum`` is NaN)."""
    m = ro.mask
    rows = {
        "prompt": ro.prompt.astype(jnp.int32),
        "prompt_mask": ro.prompt_mask.astype(jnp.float32),
        "response": ro.response.astype(jnp.int32),
        "mask": m.astype(jnp.float32),
        "prompt_idx": (ro.prompt_idx if ro.prompt_idx is not None else jnp.full(m.shape[:1], -1)).astype(
            jnp.int32
        ),
        "reward": task_reward.astype(jnp.float32),
        "kl_seq_sum": kl_lib.seq_sum(k1, m),
        "kl_exact_seq_sum": kl_lib.seq_sum(exact, m) if exact is not None else jnp.full(m.shape[:1], jnp.nan),
        "ref_logprob": jnp.sum(ref_logp * m, axis=-1),
        "length": jnp.sum(m, axis=-1),
    }
    return {PREFIX + k: v[:n] for k, v in gather(rows).items()}
