"""klrl.loop.files: a resume's cut back to its checkpoint, a rollback's move of rows, the saved
rollback references, against files written by hand."""

import json

from klrl.config import RunConfig
from klrl.io.resume import Resume
from klrl.loop.files import (
    ROLLED_BACK,
    SAMPLES_ROLLED_BACK,
    cut_to_checkpoint,
    move_rolled_back,
    rollback_bases,
)


def _rows(d, n, extra=b""):
    lines = b"".join(
        json.dumps({"iteration": i, "x": float(i), "alias/x": 0.0}).encode() + b"\n" for i in range(n)
    )
    (d / "metrics.jsonl").write_bytes(lines + extra)
    samples = b"".join(json.dumps({"iteration": i, "text": "t"}).encode() + b"\n" for i in range(n))
    (d / "samples.jsonl").write_bytes(samples)


def test_cut_to_checkpoint_drops_rows_after_it(tmp_path):
    _rows(tmp_path, 5, extra=b'{"iteration": 5, "x"')  # a torn last line
    cfg = RunConfig()
    resume = Resume(dir=tmp_path, step=3, meta={})
    rows, msgs = cut_to_checkpoint(resume, 3, [cfg], [tmp_path], {"alias/x"}, main=True)
    assert rows == [[{"iteration": i, "x": float(i)} for i in range(3)]]
    assert msgs == ["resumed from checkpoint 3 (2 metrics lines after it dropped)"]
    assert not (tmp_path / "events.jsonl").exists()  # (the sink writes the message, once its files open)
    assert [json.loads(x)["iteration"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
        2,
    ]
    assert [json.loads(x)["iteration"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [
        0,
        1,
        2,
    ]
    assert json.loads((tmp_path / "config.json").read_text()) == cfg.to_dict()


def test_cut_on_another_process_writes_nothing(tmp_path):
    _rows(tmp_path, 4)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    resume = Resume(dir=tmp_path, step=2, meta={})
    rows, msgs = cut_to_checkpoint(resume, 2, [RunConfig()], [tmp_path], set(), main=False)
    assert len(rows[0]) == 2 and msgs == []
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and not (tmp_path / "config.json").exists()


def test_move_rolled_back_appends_and_truncates(tmp_path):
    _rows(tmp_path, 5)
    (tmp_path / ROLLED_BACK).write_bytes(b'{"old": 1}\n')
    move_rolled_back([tmp_path], 2, main=True)
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    moved = (tmp_path / ROLLED_BACK).read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in kept] == [0, 1]
    assert moved[0] == '{"old": 1}' and [json.loads(x)["iteration"] for x in moved[1:]] == [2, 3, 4]
    assert not (tmp_path / SAMPLES_ROLLED_BACK).exists()  # the samples' own hook moves those (one owner)


def test_the_samples_hook_moves_the_rolled_back_samples(tmp_path):
    from test_hooks import _cfg, _loop

    from klrl.loop.samples import Samples

    _rows(tmp_path, 5)
    Samples(None).truncate(_loop([_cfg()], dirs=[tmp_path]), 2)  # (also with samples off now)
    kept = (tmp_path / "samples.jsonl").read_text().splitlines()
    samples_moved = (tmp_path / SAMPLES_ROLLED_BACK).read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in kept] == [0, 1]
    assert [json.loads(x)["iteration"] for x in samples_moved] == [2, 3, 4]


def test_rollback_bases_saved_or_first_row():
    traces = [[2.0, 1.0], [], [5.0]]
    assert rollback_bases({"rollback_base": {"metric": "m", "values": [1.5, 2.5]}}, "m", traces) == [
        1.5,
        2.5,
        5.0,
    ]
    assert rollback_bases({"rollback_base": {"metric": "other", "value": 9.0}}, "m", traces) == [
        2.0,
        None,
        5.0,
    ]
    assert rollback_bases({"rollback_base": {"metric": "m", "value": 9.0}}, "m", traces[:1]) == [9.0]
    assert rollback_bases({}, "m", traces) == [2.0, None, 5.0]


def test_rollback_bases_of_the_other_guarded_metrics():
    """A checkpoint of several guards keeps the first metric's references as before and the others' per
    member under ``others``; a metric it did not guard starts from its first row."""
    saved = {"rollback_base": {"metric": "m", "value": 9.0, "others": {"d": [0.5], "p": [None]}}}
    assert rollback_bases(saved, "m", [[1.0]]) == [9.0]
    assert rollback_bases(saved, "d", [[0.7]]) == [0.5]
    assert rollback_bases(saved, "p", [[3.0]]) == [None]  # not a number when saved
    assert rollback_bases(saved, "q", [[4.0]]) == [4.0]
    stacked = {"rollback_base": {"metric": "m", "values": [1.0, 2.0], "others": {"d": [0.5, 0.6]}}}
    assert rollback_bases(stacked, "d", [[0.1], [0.2], [0.3]]) == [0.5, 0.6, 0.3]
