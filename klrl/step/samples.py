"""Samples you can read: a few rows of each iteration's rollout, decoded on the host.

* In the step (:func:`sample_rows`, traced; ``make_train(..., samples=n)``): the first ``n`` rows of
  the global batch as token ids and per-sample numbers, under metric names starting with
  ``_samples/`` (``[n, P]``/``[n, R]`` int32 and ``[n]`` float32; a sweep adds the member axis).
  The loop pops them before a row is recorded, so they never reach ``metrics.jsonl``.
* On the host (:class:`SampleLog`): every ``train.samples_every`` iterations (and at the first and
  the last) the rows are decoded with the task's tokenizer (the testbed's word vocabulary too) and
  written to ``RUN_DIR/samples.jsonl`` (:class:`klrl.io.samples.SamplesWriter`) and to TensorBoard as
  text (``samples/text``, a markdown table).
* Reading them back (``samples.jsonl``, the report's section, ``klrl.samples(result_or_run_dir)``):
  :mod:`klrl.io.samples`, which the analysis layer may import.

Per sample: ``prompt`` (the dataset's text where the task has it, else the decoded prompt tokens),
``completion`` (decoded, special tokens and the final stop token dropped), ``reward`` (the task
reward, after ``reward.missing_eos_penalty``), ``kl_seq_sum`` (the sample's summed k1 KL, nats per
sequence: the per-sample term of the metric ``kl/k1_seq_sum``), ``kl_exact_seq_sum`` (of
``kl/exact_seq_sum``), ``ref_logprob`` (the reference model's summed log-probability of the
response, nats), ``length`` (response tokens) and ``prompt_idx`` (the row of the prompt pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.algo import kl as kl_lib
from klrl.io.samples import SamplesWriter, table_cell
from klrl.step.parallel import gather

PREFIX = "_samples/"
NUMBERS = ("reward", "kl_seq_sum", "kl_exact_seq_sum", "ref_logprob", "length")


def sample_rows(n: int, ro: Any, task_reward: jax.Array, k1: jax.Array, exact: jax.Array | None,
                ref_logp: jax.Array) -> dict[str, jax.Array]:  # fmt: skip
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


def pop_samples(metrics: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the ``_samples/*`` entries of a metrics dict (keys without the prefix)."""
    return {k[len(PREFIX) :]: metrics.pop(k) for k in [k for k in metrics if k.startswith(PREFIX)]}


def due(iteration: int, every: int, iterations: int) -> bool:
    """Samples are written at iteration 0, every ``every`` iterations and at the last one."""
    return every > 0 and (iteration % every == 0 or iteration == iterations - 1)


def decode_rows(tokenizer: Any, rows: dict[str, np.ndarray], prompt_texts: Sequence[str] | None = None
                ) -> dict[str, list[Any]]:  # fmt: skip
    """Host-side: the text and numbers of one member's sample rows (see the module docstring)."""
    stops = {int(s) for s in tokenizer.stop_ids}

    def text(ids, mask, drop_stop):
        kept = [int(t) for t, v in zip(ids, mask, strict=True) if v > 0]
        if drop_stop and kept and kept[-1] in stops:
            kept = kept[:-1]
        return tokenizer.decode(kept, skip_special_tokens=True)

    idx = np.asarray(rows["prompt_idx"]).reshape(-1)
    prompts = []
    for i, (p, pm) in enumerate(zip(rows["prompt"], rows["prompt_mask"], strict=True)):
        j = int(idx[i])
        prompts.append(prompt_texts[j] if prompt_texts is not None and 0 <= j < len(prompt_texts) else
                       text(p, pm, False))  # fmt: skip
    out: dict[str, list[Any]] = {
        "prompt": prompts,
        "completion": [text(r, m, True) for r, m in zip(rows["response"], rows["mask"], strict=True)],
    }
    for k in NUMBERS:
        out[k] = [float(x) for x in np.asarray(rows[k]).reshape(-1)]
    out["length"] = [int(x) for x in out["length"]]
    out["prompt_idx"] = [int(x) for x in idx]
    return out


def markdown(decoded: dict[str, list[Any]]) -> str:
    """One markdown table of decoded samples (TensorBoard's text plugin renders markdown)."""
    lines = [
        "| prompt | completion | reward | KL k1 (nats/seq) | ref log-prob (nats) |",
        "|---|---|---|---|---|",
    ]
    for i in range(len(decoded["completion"])):
        lines.append(
            f"| {table_cell(decoded['prompt'][i])} | {table_cell(decoded['completion'][i])} | "
            f"{decoded['reward'][i]:.4g} | {decoded['kl_seq_sum'][i]:.4g} | {decoded['ref_logprob'][i]:.4g} |"
        )
    return "\n".join(lines)


class SampleLog:
    """Writes decoded samples for each member directory (``writers``: the loop's MetricsWriters)."""

    def __init__(self, tokenizer: Any, dirs: list[Path], writers: list[Any], every: int, iterations: int,
                 prompt_texts: Sequence[str] | None = None):  # fmt: skip
        self.tokenizer, self.every, self.iterations = tokenizer, every, iterations
        self.prompt_texts = prompt_texts
        self.writers = writers
        self.files = [SamplesWriter(d) for d in dirs]
        self.last: tuple[int, list[dict[str, list[Any]]]] | None = None  # the newest (iteration, decoded)

    def write(self, iteration: int, rows: dict[str, np.ndarray], stacked: bool) -> None:
        if not rows or not due(iteration, self.every, self.iterations):
            return
        self.last = (iteration, [])
        for j, f in enumerate(self.files):
            member = {k: np.asarray(v)[j] for k, v in rows.items()} if stacked else rows
            dec = decode_rows(self.tokenizer, member, self.prompt_texts)
            self.last[1].append(dec)
            extra = {k: v for k, v in dec.items() if k not in ("prompt", "completion", "reward")}
            f.write(iteration, dec["prompt"], dec["completion"], dec["reward"], **extra)
            tb = getattr(self.writers[j], "_tb", None) if j < len(self.writers) else None
            if tb is not None:
                tb.add_text("samples/text", markdown(dec), int(iteration))

    def close(self) -> None:
        for f in self.files:
            f.close()
