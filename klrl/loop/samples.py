"""The step's samples on the host: decoded, written, and the hook that does it each row.

The step returns the first ``train.samples`` rows of each iteration's rollout as ``_samples/*``
outputs (:func:`klrl.step.samples.sample_rows`); here:

* :func:`pop_samples`: the driver takes them out of the step's metrics before a row is recorded, so
  they never reach ``metrics.jsonl`` (they ride on the row, :attr:`klrl.loop.hooks.Row.samples`);
* :class:`Samples`, the hook (:class:`SampleLog` does the work): every ``train.samples_every``
  iterations (and at the first and the last, :func:`klrl.loop.hooks.due`) the rows are decoded with
  the task's tokenizer (the testbed's word vocabulary too, :func:`decode_rows`) and written to
  ``RUN_DIR/samples.jsonl`` (:class:`klrl.io.samples.SamplesWriter`) and to TensorBoard as text
  (``samples/text``, a markdown table: :func:`markdown`);
* reading them back (``samples.jsonl``, the report's section, ``klrl.samples(result_or_run_dir)``):
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

import numpy as np

from klrl.io.samples import SamplesWriter, table_cell, trim_samples
from klrl.loop.files import SAMPLES_ROLLED_BACK
from klrl.loop.hooks import Hook, Loop, Note, Row, due
from klrl.step.samples import PREFIX

NUMBERS = ("reward", "kl_seq_sum", "kl_exact_seq_sum", "ref_logprob", "length")


def pop_samples(metrics: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the ``_samples/*`` entries of a metrics dict (keys without the prefix)."""
    return {k[len(PREFIX) :]: metrics.pop(k) for k in [k for k in metrics if k.startswith(PREFIX)]}


def decode_rows(
    tokenizer: Any, rows: dict[str, np.ndarray], prompt_texts: Sequence[str] | None = None
) -> dict[str, list[Any]]:
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
        prompts.append(
            prompt_texts[j] if prompt_texts is not None and 0 <= j < len(prompt_texts) else text(p, pm, False)
        )
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
    """Writes decoded samples for each member directory."""

    def __init__(self, tokenizer: Any, dirs: list[Path], every: int, iterations: int,
                 prompt_texts: Sequence[str] | None = None):  # fmt: skip
        self.tokenizer, self.every, self.iterations = tokenizer, every, iterations
        self.prompt_texts = prompt_texts
        self.files = [SamplesWriter(d) for d in dirs]
        self.last: tuple[int, list[dict[str, list[Any]]]] | None = None  # the newest (iteration, decoded)

    def write(self, iteration: int, rows: dict[str, np.ndarray], stacked: bool) -> list[str]:
        """Each member's rows decoded and written to its ``samples.jsonl`` when ``iteration`` is due;
        returns each member's markdown table (for TensorBoard; [] when not due)."""
        if not rows or not due(iteration, self.every, self.iterations):
            return []
        self.last, tables = (iteration, []), []
        for j, f in enumerate(self.files):
            member = {k: np.asarray(v)[j] for k, v in rows.items()} if stacked else rows
            dec = decode_rows(self.tokenizer, member, self.prompt_texts)
            self.last[1].append(dec)
            extra = {k: v for k, v in dec.items() if k not in ("prompt", "completion", "reward")}
            f.write(iteration, dec["prompt"], dec["completion"], dec["reward"], **extra)
            tables.append(markdown(dec))
        return tables

    def close(self) -> None:
        for f in self.files:
            f.close()


class Samples(Hook):
    """The step's samples, decoded and written every ``train.samples_every`` iterations (None: off); their
    TensorBoard text a :class:`~klrl.loop.hooks.Note` to the sink, the event files' owner. The owner of
    ``samples.jsonl`` and ``samples.rolled_back.jsonl`` (a rollback's :meth:`truncate`)."""

    def __init__(self, log: SampleLog | None):
        self.log = log

    @classmethod
    def of(cls, loop: Loop) -> Samples:
        """For a writing process 0 whose task has a tokenizer and ``train.samples_every > 0``."""
        prog, tc = loop.prog, loop.configs[0].train
        if not loop.writers or prog.tokenizer is None or tc.samples_every <= 0:
            return cls(None)
        return cls(SampleLog(prog.tokenizer, loop.dirs, tc.samples_every, tc.iterations, prog.prompt_texts))

    def on_row(self, loop: Loop, row: Row) -> list[Note]:
        if self.log is None:
            return []
        tables = self.log.write(row.it, row.samples, loop.stacked)
        return [Note(j, row.it, "samples", t, tag="samples/text") for j, t in enumerate(tables)]

    def truncate(self, loop: Loop, step: int) -> None:
        """A rollback to ``step``: the samples of the iterations from ``step`` on move to
        ``samples.rolled_back.jsonl`` (process 0; also with ``train.samples_every`` off now)."""
        if not loop.main:
            return
        for d in loop.dirs:
            if d is not None:
                trim_samples(d / "samples.jsonl", step, d / SAMPLES_ROLLED_BACK)

    def on_stop(self, loop: Loop) -> None:
        if self.log is not None:
            self.log.close()
