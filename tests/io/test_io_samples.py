"""samples.jsonl: one readable JSON line per sample, appended, torn last line skipped."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from klrl.io.samples import (
    SamplesWriter,
    read_samples,
    report_lines,
    samples,
    side_by_side,
    table_cell,
    trim_samples,
)


def test_write_and_read(tmp_path) -> None:
    with SamplesWriter(tmp_path) as w:
        n = w.write(
            3,
            ["Say hi.", [{"role": "user", "content": "Hi?"}]],
            ["Hello — friend", "Hi"],
            np.array([0.5, -1.0], np.float32),
            kl_seq_sum=[0.25, math.nan],
            ref_logprob=np.array([-3.0, -4.5]),
            answer=[42, None],
        )
        assert n == 2
    with SamplesWriter(tmp_path, max_per_iteration=1) as w:  # appends, capped
        assert w.write(4, ["a", "b"], ["x", "y"], [1.0, 2.0]) == 1
    raw = (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(raw) == 3 and "Hello — friend" in raw[0]  # readable, not \u-escaped
    assert json.loads(raw[0]) == {
        "iteration": 3,
        "prompt": "Say hi.",
        "completion": "Hello — friend",
        "reward": 0.5,
        "kl_seq_sum": 0.25,
        "ref_logprob": -3.0,
        "answer": 42,
    }
    rows = read_samples(tmp_path / "samples.jsonl")
    assert rows[1]["kl_seq_sum"] == "nan" and rows[1]["prompt"] == [{"role": "user", "content": "Hi?"}]
    assert rows[1]["answer"] is None
    assert [r["completion"] for r in read_samples(tmp_path / "samples.jsonl", iteration=4)] == ["x"]
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"iteration": 5, "prompt": "tor')  # a crash mid-write
    assert len(read_samples(tmp_path / "samples.jsonl")) == 3


def test_length_mismatch_names_the_field(tmp_path) -> None:
    with SamplesWriter(tmp_path) as w, pytest.raises(ValueError, match="samples: reward has 1 values for 2"):
        w.write(0, ["a", "b"], ["x", "y"], [1.0])


def test_trim_keeps_earlier_iterations_and_moves_the_rest(tmp_path) -> None:
    """The rollback's cut: rows of iterations >= 2 move (in order) to the side file, a torn last line
    is dropped, and a writer still open on the file appends at the new end."""
    path, side = tmp_path / "samples.jsonl", tmp_path / "samples.rolled_back.jsonl"
    w = SamplesWriter(tmp_path)
    for it in range(4):
        w.write(it, [f"p{it}a", f"p{it}b"], [f"c{it}a", f"c{it}b"], [float(it), -float(it)])
    lines = path.read_bytes().splitlines(keepends=True)
    with open(path, "a") as f:
        f.write('{"iteration": 4, "prompt": "tor')  # a crash mid-write
    assert trim_samples(path, 2, side) == 4
    assert path.read_bytes() == b"".join(lines[:4])
    assert side.read_bytes() == b"".join(lines[4:])
    w.write(2, ["again"], ["c"], [9.0])  # the iteration replayed after the rollback
    w.close()
    assert [(r["iteration"], r["prompt"]) for r in read_samples(path)] == [
        (0, "p0a"), (0, "p0b"), (1, "p1a"), (1, "p1b"), (2, "again")
    ]  # fmt: skip
    assert trim_samples(path, 0) == 5 and path.read_bytes() == b""  # back to the initial state
    assert trim_samples(tmp_path / "none.jsonl", 0) == 0


# ---- klrl.samples: rows out of the step, decoded on the host -------------------------------------


def _word_tok():
    from klrl.data.vocab import WordTokenizer

    return WordTokenizer(("<pad>", "<eos>", "good", "bad", "day", "cat"), pad_id=0, stop_ids=(1,))


def test_decode_rows_hand_values() -> None:
    from klrl.loop.samples import decode_rows

    rows = {
        "prompt": np.array([[0, 5, 4], [0, 0, 3]]),
        "prompt_mask": np.array([[0, 1, 1], [0, 0, 1]], np.float32),
        "response": np.array([[2, 2, 1, 0], [3, 4, 5, 2]]),
        "mask": np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32),
        "prompt_idx": np.array([1, 7]),
        "reward": np.array([0.5, -1.0], np.float32),
        "kl_seq_sum": np.array([0.25, 2.0], np.float32),
        "kl_exact_seq_sum": np.array([0.5, 1.0], np.float32),
        "ref_logprob": np.array([-3.0, -9.0], np.float32),
        "length": np.array([3.0, 4.0], np.float32),
    }
    got = decode_rows(_word_tok(), rows, prompt_texts=["p0", "Tell me about cats."])
    # row 0: prompt text of pool row 1; the stop token dropped. Row 1: index 7 is outside the pool
    # texts, so its valid prompt tokens are decoded
    assert got["prompt"] == ["Tell me about cats.", "bad"]
    assert got["completion"] == ["good good", "bad day cat good"]
    assert got["reward"] == [0.5, -1.0] and got["kl_seq_sum"] == [0.25, 2.0]
    assert got["ref_logprob"] == [-3.0, -9.0] and got["length"] == [3, 4] and got["prompt_idx"] == [1, 7]
    assert decode_rows(_word_tok(), rows)["prompt"] == ["cat day", "bad"]


def test_due_first_every_and_last() -> None:
    from klrl.loop.hooks import due

    assert [i for i in range(25) if due(i, 10, 25)] == [0, 10, 20, 24]
    assert [i for i in range(3) if due(i, 10, 3)] == [0, 2]
    assert not any(due(i, 0, 5) for i in range(5))


def test_side_by_side_pairs_first_and_last_iteration() -> None:
    rows = [
        {"iteration": it, "prompt": f"p{it}{i}", "completion": f"c{it}{i}", "reward": it, "kl_seq_sum": 0.5}
        for it in (0, 5, 9)
        for i in range(2)
    ]
    lines = side_by_side(rows)
    assert lines[0] == "| # | iteration 0 | iteration 9 |"
    assert "**p00** → c00 (reward 0, KL 0.5)" in lines[2] and "**p90** → c90 (reward 9, KL 0.5)" in lines[2]
    assert "p51" not in "\n".join(lines) and side_by_side([]) == []


def test_run_writes_samples_consistent_with_its_metrics(tiny_cfg, tiny_task, tmp_path) -> None:
    """With ``train.samples_n`` = the batch, the samples' means are the logged batch means
    (reward/task, kl/k1_seq_sum, response/length) and their reference log-probs give eval/ref_ppl:
    the rows are the batch's, each number in its named unit."""
    import klrl

    b = tiny_cfg.train.batch_size
    cfg = tiny_cfg.replace(
        train={"iterations": 4, "samples_every": 2, "samples_n": b, "out_dir": str(tmp_path), "name": "s"}
    )
    r = klrl.run(cfg, task=tiny_task)
    rows = read_samples(r.dir / "samples.jsonl")
    assert sorted({x["iteration"] for x in rows}) == [0, 2, 3] and len(rows) == 3 * b
    words = set(tiny_task.tokenizer.words)
    for it in (0, 2, 3):
        got = [x for x in rows if x["iteration"] == it]
        assert all(set(x["completion"].split()) <= words for x in got)  # the testbed's own vocabulary
        assert all(len(x["completion"].split()) <= x["length"] for x in got)
        np.testing.assert_allclose(
            np.mean([x["reward"] for x in got]), r.metrics["reward/task"][it], rtol=1e-5
        )
        np.testing.assert_allclose(
            np.mean([x["kl_seq_sum"] for x in got]), r.metrics["kl/k1_seq_sum"][it], rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(np.mean([x["length"] for x in got]), r.metrics["response/length"][it])
        ppl = math.exp(-sum(x["ref_logprob"] for x in got) / sum(x["length"] for x in got))
        np.testing.assert_allclose(ppl, r.metrics["eval/ref_ppl"][it], rtol=1e-4)
    assert not any(k.startswith("_samples") for k in r.metrics)  # never a logged metric
    assert b"samples/text" in b"".join(p.read_bytes() for p in (r.dir / "tb").rglob("events.*"))
    frame = klrl.samples(r)
    assert len(frame) == 3 * b and {"member", "iteration", "prompt", "completion", "kl_seq_sum"} <= set(frame)
    assert klrl.samples(r.dir, iteration=3, frame=False) == [
        {"member": "s", **x} for x in rows if x["iteration"] == 3
    ]
    report = klrl.write_report(r.dir, plots=False).read_text()
    assert "## Samples" in report and "| # | iteration 0 | iteration 3 |" in report


def test_sweep_writes_samples_per_member(tiny_cfg, tiny_task, tmp_path) -> None:
    """Samples per member; with reward.standardize (klrl.rewards.standardize) every member's reward is
    gain * raw + bias with the sweep's one gain and bias (task.json), raw = wordclass's positive
    words / length of the sample's own tokens, and the members' iteration-0 samples are the same."""
    import klrl

    base = tiny_cfg.replace(
        train={"iterations": 2, "samples_n": 6, "out_dir": str(tmp_path), "name": "sw"},
        reward={"standardize": True, "standardize_samples": 64},
    )
    members = [base.replace(kl={"beta": b}) for b in (0.01, 1.0)]
    res = klrl.sweep(members, task=tiny_task)
    root = res[0].dir.parent
    frame = klrl.samples(root)
    assert sorted(set(frame["member"])) == sorted(r.dir.name for r in res)
    assert len(frame) == 2 * 2 * 6  # members x iterations (first, last) x samples_n
    norm = json.loads((root / "task.json").read_text())["reward_norm"]
    gain, bias = np.float32(norm["gain"]), np.float32(norm["bias"])
    assert norm["samples"] == 64 and np.isfinite(gain) and gain > 0
    k = (frame["reward"].to_numpy(np.float64) - bias) / gain * frame["length"].to_numpy(np.float64)
    np.testing.assert_allclose(k, np.round(k), atol=2e-3)  # an integer count of positive words...
    assert (np.round(k) >= 0).all() and (np.round(k) <= frame["length"]).all() and np.round(k).max() > 0
    first = [frame[(frame["member"] == r.dir.name) & (frame["iteration"] == 0)] for r in res]
    assert first[0]["completion"].tolist() == first[1]["completion"].tolist()
    assert first[0]["reward"].tolist() == first[1]["reward"].tolist()  # one env: the same reward
    report = klrl.write_report(root, plots=False).read_text()
    assert report.count("Samples:") == 2


def test_table_cell_one_line_escaped_and_cut() -> None:
    assert table_cell("a |b\n c") == "a \\|b c"
    assert table_cell("x" * 10, 4) == "xxx…" and table_cell("xxxx", 4) == "xxxx"


def test_report_lines_and_samples_read_a_run_and_a_sweep(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert report_lines(run) == [] and report_lines(None) == []
    with SamplesWriter(run) as w:
        w.write(0, ["p"], ["c0"], [1.0], kl_seq_sum=[0.5])
        w.write(3, ["q"], ["c3"], [2.0], kl_seq_sum=[0.25])
    lines = report_lines(run, title="## S")
    assert lines[:3] == ["## S", "", "| # | iteration 0 | iteration 3 |"] and lines[-1] == ""
    got = samples(run, frame=False)
    assert [(r["member"], r["iteration"], r["completion"]) for r in got] == [
        ("run", 0, "c0"),
        ("run", 3, "c3"),
    ]
    assert [r["completion"] for r in samples(run, 3, frame=False)] == ["c3"]
    sweep = tmp_path / "sweep"
    for name in ("00", "01"):
        (sweep / name).mkdir(parents=True)
        with SamplesWriter(sweep / name) as w:
            w.write(1, ["p"], [f"c{name}"], [0.0])
    (sweep / "sweep.json").write_text(json.dumps({"members": ["00", "01"]}))
    assert [(r["member"], r["completion"]) for r in samples(sweep, frame=False)] == [
        ("00", "c00"),
        ("01", "c01"),
    ]
    with pytest.raises(ValueError, match="no run directory"):
        samples(type("R", (), {"dir": None})())


def test_samples_without_pandas_says_it_is_a_list(tmp_path, monkeypatch) -> None:
    """No pandas: klrl.samples warns (naming the extra) and returns the list; frame=False: no warning."""
    import sys
    import warnings

    import klrl

    w = SamplesWriter(tmp_path)
    w.write(0, ["p"], ["c"], [1.0], kl_seq_sum=[0.5])
    w.close()
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.warns(UserWarning, match=r"pandas is not installed \(pip install 'klrl\[viz\]'\)"):
        rows = klrl.samples(tmp_path)
    assert [(r["prompt"], r["completion"]) for r in rows] == [("p", "c")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert klrl.samples(tmp_path, frame=False) == rows
