"""Experiment trackers beside ``metrics.jsonl`` and TensorBoard: Weights & Biases (``log.wandb``).

:class:`WandbTracker` is a hook of the run loop (:mod:`klrl.loop.hooks`) on process 0. It logs what a
TRL user finds in W&B: the run's resolved config (``RunConfig.to_dict()``, as ``config.json``), every
metrics row under the names ``metrics.jsonl`` has (``train.metric_aliases`` included) with its
``iteration`` as the x axis, the decoded samples as a ``wandb.Table`` (``samples``: iteration,
prompt, completion, reward, per-sample k1 and exact KL in nats/sequence, reference log-prob,
length; every ``train.samples_every`` iterations, text tasks) and at the end the run's
``summary.json`` (``run.summary``: ``<metric>/start``, ``<metric>/end``) with how it ended.

A sweep is one W&B run per member, named after the member's directory and grouped under the sweep
directory's name (W&B's group view then compares the members as it compares seeds); ``log.wandb_name``
and ``log.wandb_group`` override. ``log.wandb_mode=auto`` is ``$WANDB_MODE`` when set, else online
with an API key (``WANDB_API_KEY`` or a ``wandb login`` in ``~/.netrc``), else offline: the run is
written under the run directory's ``wandb/`` (``$WANDB_DIR`` when set) and ``wandb sync`` uploads it
later. wandb is imported here only, when a run asks for it (``pip install 'klrl[wandb]'``).
"""

from __future__ import annotations

import netrc
import os
import secrets
import string
import sys
from pathlib import Path
from typing import Any

from klrl.io.results import RunResult, columns
from klrl.loop.hooks import Hook, Loop, Row
from klrl.loop.metrics import with_aliases
from klrl.loop.samples import Samples

TABLE_COLUMNS = ("iteration", "prompt", "completion", "reward", "kl_seq_sum", "kl_exact_seq_sum",
                 "ref_logprob", "length")  # fmt: skip


def has_api_key() -> bool:
    """Whether W&B would find a key without asking: ``WANDB_API_KEY`` or ``wandb login``'s netrc entry."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(mode: str) -> str:
    """``log.wandb_mode`` resolved (see the module docstring)."""
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")


class WandbTracker(Hook):
    """One W&B run per member (see the module docstring); ``samples``: the loop's :class:`Samples` hook,
    whose decoded rows become the table."""

    def __init__(self, loop: Loop, samples: Samples, aliases: dict[str, str], log: Any):
        import wandb  # the optional dependency (klrl.checks.check_config said so if it is missing)

        self.wandb, self.samples, self.aliases = wandb, samples, aliases
        cfg = loop.configs[0].log
        mode = wandb_mode(cfg.wandb_mode)
        where = None if os.environ.get("WANDB_DIR") or loop.root is None else str(loop.root)
        group = cfg.wandb_group or (loop.root.name if loop.stacked and loop.root is not None else None)
        self.runs = []
        for j, c in enumerate(loop.configs):
            d = loop.dirs[j]
            name = cfg.wandb_name or (d.name if d is not None else None)
            if cfg.wandb_name and loop.stacked and d is not None:
                name = f"{cfg.wandb_name}/{d.name}"
            # silent: wandb's own lines (a history and summary per run) left out; ours says where they are
            run = wandb.init(project=cfg.wandb_project, name=name, group=group, mode=mode, dir=where,
                             config=c.to_dict(), reinit="create_new", resume="allow", id=_run_id(d),
                             settings=wandb.Settings(silent=True))  # fmt: skip
            run.define_metric("*", step_metric="iteration")  # rows, iteration as the x axis
            self.runs.append(run)
        if mode != "disabled":
            log(_where(self.runs, mode))

    def on_row(self, loop: Loop, row: Row) -> None:
        decoded = getattr(self.samples.log, "last", None)
        for j, run in enumerate(self.runs):
            mj = with_aliases(row.members[j], self.aliases) if self.aliases else row.members[j]
            data: dict[str, Any] = {"iteration": row.it, **{k: float(v) for k, v in mj.items()}}
            if decoded is not None and decoded[0] == row.it:
                data["samples"] = self._table(row.it, decoded[1][j])
            run.log(data)

    def _table(self, it: int, dec: dict[str, list[Any]]) -> Any:
        cols = [c for c in TABLE_COLUMNS if c == "iteration" or c in dec]
        n = len(dec["prompt"])
        rows = [[it if c == "iteration" else dec[c][i] for c in cols] for i in range(n)]
        return self.wandb.Table(columns=cols, data=rows)

    def on_stop(self, loop: Loop) -> None:
        failed = sys.exc_info()[0] is not None or loop.reward_stop is not None
        for j, run in enumerate(self.runs):
            summary = RunResult(loop.configs[j], loop.dirs[j], columns(loop.rows[j]), None, {}).summary()
            run.summary.update({f"{k}/{e}": v for k, se in summary.items() for e, v in se.items()})
            run.summary.update({"iterations_done": loop.recorded, "stopped": loop.stopped or "",
                                "stop_error": loop.stop_error or loop.reward_stop or ""})  # fmt: skip
            run.finish(exit_code=1 if failed or loop.stop_error else 0)
        self.runs = []


def _where(runs: list[Any], mode: str) -> str:
    """The log line: where the W&B runs are (offline: the command that uploads them)."""
    if mode != "offline":
        return f"W&B: {', '.join(str(r.url) for r in runs)}"
    dirs = [str(getattr(r.settings, "sync_dir", "")) for r in runs]
    where = dirs[0] if len(dirs) == 1 else str(Path(dirs[0]).parent / "offline-run-*")
    n = f"{len(runs)} offline runs" if len(runs) > 1 else "offline run"
    return f"W&B: {n} in {where}; `wandb sync {where}` uploads"


def _run_id(d: Path | None) -> str | None:
    """The W&B run id of member directory ``d``, kept in ``d/wandb_id`` so a resume continues the same
    W&B run (None: no directory, W&B draws one)."""
    if d is None:
        return None
    path = d / "wandb_id"
    if path.exists():
        return path.read_text().strip() or None
    rid = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as W&B's
    path.write_text(rid + "\n")
    return rid
