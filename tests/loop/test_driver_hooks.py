"""The driver calls every hook the same way (issue 50, item 1): no hook is named in
``klrl/loop/driver.py``; a hook's requests (a :class:`Note`, a :class:`Stop`, a :class:`Restore`) are
done alike whichever hook asks, the user's included (``klrl.hook(fn, every=N)``, ``klrl.every``);
and every file a run writes has exactly one owner in the table of :mod:`klrl.loop.hooks`' docstring."""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

import klrl
import klrl.loop.hooks as H
from klrl.io import checkpoint as ckpt
from klrl.loop.hooks import Hook, Note, Restore, Stop

ROOT = Path(__file__).resolve().parents[2]


def _rows(d: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (d / name).read_text().splitlines()]


def _hook_classes() -> set[str]:
    """Every hook class klrl defines (the subclasses of Hook in klrl.loop's modules)."""
    names = set()
    for mod in ("hooks", "samples", "trackers", "user", "wiring"):
        m = importlib.import_module(f"klrl.loop.{mod}")
        names |= {
            n for n, c in vars(m).items() if inspect.isclass(c) and issubclass(c, Hook) and c is not Hook
        }
    return names


def test_the_driver_names_no_hook():
    """The driver calls hooks through the Hook interface only: no hook class, and none of the methods that
    only one hook has, appear in its source (the list of hooks is klrl.loop.wiring's)."""
    src = (ROOT / "klrl" / "loop" / "driver.py").read_text()
    classes = _hook_classes()
    assert {"Checkpoints", "QualityRollback", "HeldOut", "RewardFailure", "MetricsSink", "Samples"} <= classes
    named = [n for n in sorted(classes) if re.search(rf"\b{n}\b", src)]
    assert named == [], named
    own = {"save", "roll_back", "crossed", "heldout_error", "heldout_stop", "restart_clock", "where_saved",
           "take", "rejected", "drop_after"}  # fmt: skip
    called = sorted(m for m in own if re.search(rf"\.{m}\(", src))  # a method only one hook has, called
    called += [a for a in ("received", "ckpts", "sink", "signals") if re.search(rf"\.{a}\b", src)]
    assert called == [], called


class _Rewind(Hook):
    """A user hook that keeps the state after step 2 (``on_sync``) and, at row 3, asks the driver to roll
    the run back to it (once), with a note for the event file; at row ``stop_at``, asks it to stop."""

    def __init__(self, stop_at: int | None = None):
        self.kept, self.done, self.stop_at, self.truncated = None, False, stop_at, []

    def on_sync(self, loop, step):
        if step == 2:
            self.kept = ckpt.host_copy(loop.state)

    def on_row(self, loop, row):
        if row.it == 3 and not self.done:
            self.done = True
            return [Note(0, row.it, "user_rollback", "back to 2"), Restore(2, self.kept)]
        if row.it == self.stop_at:
            return Stop("enough")
        return None

    def truncate(self, loop, step):
        self.truncated.append(step)


def _table() -> list[tuple[list[str], str]]:
    """The owners table of klrl.loop.hooks' docstring: (file patterns, owner) per row."""
    doc = H.__doc__
    block = doc.split("=" * 29 + "  ", 3)[2].split("\n", 1)[1].rsplit("\n=", 1)[0]  # the table's body
    out: list[tuple[list[str], str]] = []
    for line in block.splitlines():
        files, owner = line[:31].strip(), line[31:].strip()
        if files:
            out.append((re.findall(r"``([^`]+)``", files), owner))
        elif out:  # a continued owner
            out[-1] = (out[-1][0], out[-1][1] + " " + owner)
    return out


def _resolves(owner: str) -> bool:
    """The owner's first reference (``:class:`X``` / ``:func:`X```) names an object that exists."""
    ref = re.search(r":(?:class|func):`~?([\w.]+)`", owner).group(1)
    if "." not in ref:
        return hasattr(H, ref)
    module, _, name = ref.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:  # a class's method: module.Class.name
        module, _, cls = module.rpartition(".")
        return hasattr(getattr(importlib.import_module(module), cls), name)


def test_every_file_a_run_writes_has_one_owner_in_the_table(tiny_cfg, tiny_task, tmp_path):
    table = _table()
    assert len(table) >= 15 and all(_resolves(owner) for _, owner in table), table
    cfg = tiny_cfg.replace(train={"iterations": 5, "checkpoint_every": 1, "samples_every": 1, "samples_n": 2,
                                  "out_dir": str(tmp_path), "name": "r"})  # fmt: skip
    user = _Rewind()
    r = klrl.run(cfg, task=tiny_task, hooks=[user])
    files = sorted(str(p.relative_to(r.dir)) for p in r.dir.rglob("*") if p.is_file())
    want = {"config.json", "task.json", "metrics.jsonl", "metrics.rolled_back.jsonl", "timing.jsonl",
            "events.jsonl", "samples.jsonl", "samples.rolled_back.jsonl", "summary.json"}  # fmt: skip
    assert want <= set(files), files
    assert any(f.startswith("checkpoints/") for f in files) and any(f.startswith("tb/") for f in files)
    for f in files:
        owners = [owner for patterns, owner in table if any(fnmatch.fnmatch(f, p) for p in patterns)]
        assert len(owners) == 1, (f, owners)
    # the rollback the user's hook asked for: every owner cut its output back to step 2
    assert [x["iteration"] for x in _rows(r.dir)] == [0, 1, 2, 3, 4]
    assert [x["iteration"] for x in _rows(r.dir, "metrics.rolled_back.jsonl")] == [2, 3]
    assert [x["iteration"] for x in _rows(r.dir, "samples.rolled_back.jsonl")] == [2, 2, 3, 3]  # 2 a row
    assert sorted({x["iteration"] for x in _rows(r.dir, "samples.jsonl")}) == [0, 1, 2, 3, 4]
    assert _rows(r.dir, "events.jsonl")[0] == {
        "iteration": 3,
        "event": "user_rollback",
        "message": "back to 2",
    }
    assert user.truncated == [2] and r.info["rollbacks"] == 1 and r.info["iteration"] == 5
    assert ckpt.steps(ckpt.manager(r.dir, keep=10)) == [3, 4, 5]  # (train.keep_checkpoints 3)


def test_a_user_hooks_stop_ends_the_run_with_its_line(tiny_cfg, tiny_task):
    cfg = tiny_cfg.replace(train={"iterations": 6})
    with pytest.raises(klrl.loop.reliability.RunStopped, match="^stopped: enough$") as e:
        klrl.run(cfg, task=tiny_task, write=False, hooks=[_Rewind(stop_at=1)])
    assert len(e.value.result.metrics["ctrl/beta"]) == 2 and e.value.result.info["iteration"] == 2


def test_klrl_hook_and_every():
    """``klrl.hook(fn, every=N)`` and ``klrl.every(N)`` (a decorator too) are the same hook: ``fn`` on the
    rows whose iteration is a multiple of N."""
    seen = []
    fn = lambda loop, row: seen.append(row.it)  # noqa: E731
    hooks = [klrl.hook(fn, every=3), klrl.every(3, fn), klrl.every(3)(fn)]
    assert all(isinstance(h, Hook) and h.every == 3 for h in hooks)
    assert klrl.hook(fn).every == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every: n must be an int >= 1"):
            klrl.hook(fn, every=bad)
    with pytest.raises(TypeError, match="hook: fn must be a function"):
        klrl.hook(3)
    assert "every" in klrl.__all__ and "hook" in klrl.__all__


def test_the_driver_calls_on_row_every_n_rows(tiny_cfg, tiny_task):
    seen, old = [], []

    class OldStyle:  # an object with the older method name, on_step
        def on_step(self, loop, row):
            old.append(row.it)

    cfg = tiny_cfg.replace(train={"iterations": 5})
    klrl.run(cfg, task=tiny_task, write=False,
             hooks=[klrl.hook(lambda loop, row: seen.append(row.it), every=2), OldStyle()])  # fmt: skip
    assert seen == [0, 2, 4] and old == [0, 1, 2, 3, 4]


def test_a_hook_answering_something_else_is_a_type_error(tiny_cfg, tiny_task):
    with pytest.raises(TypeError, match="a hook returned int, not a Note, Stop or Restore"):
        klrl.run(tiny_cfg, task=tiny_task, write=False, hooks=[klrl.hook(lambda loop, row: 3)])


def test_the_metrics_sink_opens_and_closes_its_own_writers(tiny_cfg, tiny_task, tmp_path):
    """``metrics.jsonl``'s owner is the sink from end to end: :meth:`MetricsSink.open` makes the loop's
    writers (one per member, into its directory) when the hooks are made, its ``on_stop`` closes them;
    klrl.loop.files makes none and closes none."""
    assert "MetricsWriter" not in (ROOT / "klrl" / "loop" / "files.py").read_text()
    cfg = tiny_cfg.replace(train={"iterations": 2, "out_dir": str(tmp_path), "name": "r"})
    seen = []
    r = klrl.run(cfg, task=tiny_task, hooks=[klrl.hook(lambda loop, row: seen.append(list(loop.writers)))])
    assert len(seen) == 2 and seen[0] == seen[1] and len(seen[0]) == 1
    w = seen[0][0]
    assert Path(w.run_dir) == r.dir and w._f.closed
    assert [x["iteration"] for x in _rows(r.dir)] == [0, 1]
