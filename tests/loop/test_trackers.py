"""The W&B tracker (klrl.loop.trackers, ``log.wandb``) and the user hooks of ``klrl.run(cfg, hooks=...)``.

The W&B run is written offline (no network) and read back from its ``.wandb`` file: the transaction
log wandb writes (LevelDB's log format: 32 KiB blocks of records with a 7-byte header, after a 7-byte
``:W&B`` file header; each record a ``wandb_internal_pb2.Record``), parsed here by hand, independently
of klrl, with wandb's own protobuf classes."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from klrl.config import ConfigError, RunConfig

wandb = pytest.importorskip("wandb")


def _records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data, out, pos, buf = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def _read_run(run_dir: Path) -> tuple[dict, list[dict], dict]:
    """(config, history rows, summary) of one offline W&B run directory."""
    (path,) = run_dir.glob("run-*.wandb")
    config, history, summary = {}, [], {}
    items = lambda xs: {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in xs}
    for r in _records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            history.append(items(r.history.item))
        elif kind == "summary":
            summary.update(items(r.summary.update))
    return config, history, summary


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.stopped = 0

    def on_step(self, loop: Any, row: Any) -> None:
        self.rows.append((row.it, dict(row.members[0])))

    def on_stop(self, loop: Any) -> None:
        self.stopped += 1


def test_wandb_offline_logs_config_rows_samples_and_summary(tiny_cfg, tiny_task, tmp_path, monkeypatch):
    """A 3-iteration run with ``log.wandb``: one offline W&B run whose config is config.json, whose
    history has every metrics.jsonl row at its iteration, whose samples table holds the samples.jsonl
    rows of their iteration, and whose summary has summary.json's start and end; a user hook sees the
    same rows and the stop."""
    import klrl

    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: auto is offline
    cfg = tiny_cfg.replace(
        train={"iterations": 3, "samples_every": 2, "samples_n": 3, "out_dir": str(tmp_path), "name": "w"},
        log={"wandb": True, "wandb_project": "klrl-test"},
    )
    rec = _Recorder()
    r = klrl.run(cfg, task=tiny_task, hooks=[rec])
    (wdir,) = (r.dir / "wandb").glob("offline-run-*")  # offline (no key), under the run directory
    config, history, summary = _read_run(wdir)
    assert {k: v for k, v in config.items() if not k.startswith("_")} == json.loads(
        (r.dir / "config.json").read_text()
    )
    rows = [json.loads(line) for line in (r.dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history] == [0, 1, 2]
    for h, row in zip(history, rows, strict=True):
        for k, v in row.items():
            want = float(v)  # (a non-finite value is "nan" in metrics.jsonl)
            assert h[k] == pytest.approx(want, rel=1e-6, abs=1e-12, nan_ok=True), k
    assert [it for it, _ in rec.rows] == [0, 1, 2] and rec.stopped == 1
    assert rec.rows[1][1]["reward/task"] == rows[1]["reward/task"]
    tables = {h["iteration"]: h["samples/path"] for h in history if "samples/path" in h}
    assert sorted(tables) == [0, 2]  # samples_every=2 and the last iteration
    table = json.loads((wdir / "files" / tables[2]).read_text())
    samples = [json.loads(s) for s in (r.dir / "samples.jsonl").read_text().splitlines()]
    want = [s for s in samples if s["iteration"] == 2]
    cols = table["columns"]
    assert cols[:4] == ["iteration", "prompt", "completion", "reward"] and "kl_seq_sum" in cols
    got = [dict(zip(cols, d, strict=True)) for d in table["data"]]
    assert [g["completion"] for g in got] == [s["completion"] for s in want]
    assert [g["kl_seq_sum"] for g in got] == pytest.approx([s["kl_seq_sum"] for s in want])
    for k, se in json.loads((r.dir / "summary.json").read_text()).items():
        assert summary[f"{k}/start"] == pytest.approx(se["start"])
        assert summary[f"{k}/end"] == pytest.approx(se["end"])
    assert summary["iterations_done"] == 3
    assert (r.dir / "wandb_id").read_text().strip() == wdir.name.rsplit("-", 1)[1]  # a resume continues it


def test_wandb_missing_is_one_config_error(monkeypatch):
    """``log.wandb`` without the wandb package: a ConfigError naming the field and the extra, raised by
    the entry checks (before anything is built)."""
    from klrl.checks import check_config

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = RunConfig().replace(log={"wandb": True})
    with pytest.raises(ConfigError, match=r"^log\.wandb: .*klrl\[wandb\]"):
        check_config([cfg], stacked=False)
    check_config([RunConfig()], stacked=False)  # off: nothing asked of wandb


def test_wandb_mode_auto(monkeypatch, tmp_path):
    """auto: $WANDB_MODE, else online with a key (env or netrc), else offline."""
    from klrl.loop.trackers import wandb_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    assert wandb_mode("auto") == "offline" and wandb_mode("online") == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    with pytest.raises(ConfigError, match=r"^log\.wandb_mode"):
        RunConfig().replace(log={"wandb_mode": "cloud"})


def test_log_fields_are_one_value_per_sweep():
    """``log.*`` is per-run bookkeeping: a sweep's members share it (one W&B setting for all of them)."""
    from klrl.config.sweep import check_members

    a = RunConfig().replace(log={"wandb": True})
    check_members([a, a.replace(kl={"beta": 1.0})])
    with pytest.raises(ConfigError, match=r"^log\.wandb_project: .*per-run bookkeeping"):
        check_members([a, a.replace(log={"wandb_project": "other"})])
