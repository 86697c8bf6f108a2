"""User hooks (``every=N``) and metric functions (``user/<name>`` in metrics.jsonl), from Python and
the command line."""

from __future__ import annotations

import json
import sys

import pytest

import klrl
from klrl.config.sweep import grid
from klrl.loop.user import every


def _rows(d):
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def test_every_n_hook_and_metric_fn_from_python(tiny_cfg, tiny_task, tmp_path):
    seen = []
    cfg = tiny_cfg.replace(train={"iterations": 5, "out_dir": str(tmp_path), "name": "r", "quiet": True})

    def mean_kl(row, samples):
        return {"twice_beta": 2 * row["ctrl/beta"]}

    r = klrl.run(
        cfg, task=tiny_task, hooks=[every(2, lambda loop, row: seen.append(row.it))], metrics=[mean_kl]
    )
    assert seen == [0, 2, 4]
    rows = _rows(r.dir)
    assert [x["user/twice_beta"] for x in rows] == pytest.approx([2 * x["ctrl/beta"] for x in rows])


def test_a_metric_fn_in_a_sweep_sees_each_members_row(tiny_cfg, tiny_task, tmp_path):
    base = tiny_cfg.replace(train={"iterations": 3, "quiet": True})
    members = grid(base, {"kl.beta": [0.05, 0.2]})
    seen = []

    def beta_and_samples(row, samples):
        seen.append(row["ctrl/beta"])
        return {"beta_copy": row["ctrl/beta"], "tenfold": 10 * row["ctrl/beta"]}

    res = klrl.sweep(members, task=tiny_task, out_dir=tmp_path / "sweep", metrics=[beta_and_samples])
    assert len(seen) == 3 * 2  # each iteration, each member
    for r, beta in zip(res, [0.05, 0.2], strict=True):
        rows = _rows(r.dir)
        assert [x["user/beta_copy"] for x in rows] == pytest.approx([beta] * 3)
        assert [x["user/tenfold"] for x in rows] == pytest.approx([10 * beta] * 3)


def test_metric_fn_from_the_cli_and_a_bad_spec(tiny_cfg, tmp_path, monkeypatch, capsys):
    from klrl.cli.commands import main

    (tmp_path / "mymod.py").write_text("def fn(row, samples):\n    return {'one': 1.0}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mymod", None)
    flags = ["--model.n_layers", "1", "--model.d_model", "32", "--model.n_heads", "2",
             "--task.cache_dir", tiny_cfg.task.cache_dir, "--task.pretrain_steps", "100",
             "--task.pretrain_batch", "32", "--task.pretrain_len", "16", "--task.prompt_len", "6",
             "--task.prompt_pool", "256", "--sampling.response_len", "8",
             "--train.batch_size", str(tiny_cfg.train.batch_size), "--train.iterations", "2",
             "--train.out_dir", str(tmp_path), "--train.quiet", "true"]  # fmt: skip
    assert main(["train", *flags, "--train.name", "ok", "--train.metric_fns", "mymod:fn"]) == 0
    assert [x["user/one"] for x in _rows(tmp_path / "ok")] == [1.0, 1.0]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", *flags, "--train.name", "bad", "--train.metric_fns", "mymod:nope"])
    code = e.value.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: train.metric_fns:"), err


def test_a_hook_from_the_cli_and_check_refuses_a_bad_one(tiny_cfg, tmp_path, monkeypatch, capsys):
    from klrl.cli.commands import main

    log = tmp_path / "calls.txt"
    (tmp_path / "myhooks.py").write_text(
        "def note(loop, row):\n"
        f"    open({str(log)!r}, 'a').write(f'{{row.it}} {{row.members[0][\"ctrl/beta\"]:.4g}}\\n')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myhooks", None)
    flags = ["--model.n_layers", "1", "--model.d_model", "32", "--model.n_heads", "2",
             "--task.cache_dir", tiny_cfg.task.cache_dir, "--task.pretrain_steps", "100",
             "--task.pretrain_batch", "32", "--task.pretrain_len", "16", "--task.prompt_len", "6",
             "--task.prompt_pool", "256", "--sampling.response_len", "8", "--kl.beta", "0.3",
             "--train.batch_size", str(tiny_cfg.train.batch_size), "--train.iterations", "3",
             "--train.out_dir", str(tmp_path), "--train.quiet", "true"]  # fmt: skip
    assert main(["train", *flags, "--train.name", "ok", "--train.hooks", "myhooks:note"]) == 0
    assert log.read_text().splitlines() == ["0 0.3", "1 0.3", "2 0.3"]  # after every row
    for bad, why in [
        ("myhooks:nope", "myhooks has no function 'nope'"),
        ("nosuch_mod_x:f", "does not import"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["train", *flags, "--check", "--train.name", "bad", "--train.hooks", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: train.hooks:"), err
        assert why in err, err
        assert not (tmp_path / "bad").exists()  # --check builds and writes nothing


def test_the_docs_metric_function_example_runs(tiny_cfg, tiny_task, tmp_path, monkeypatch):
    """docs/python.md's metric-function example (issue 48: the page never mentioned ``metrics=`` or
    ``train.metric_fns``): its code block, run as written but with ``klrl.run`` caught, hands
    ``klrl.run`` a function that, on the tiny task, logs ``user/beta_x100`` every iteration and
    ``user/completion_chars`` (the samples' mean completion length) on the iterations with samples."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "python.md").read_text()
    section = text.split("## Hooks and metric functions", 1)[1].split("\n## ", 1)[0]
    assert "--train.metric_fns" in section and "klrl.hook(" in section
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    caught = {}
    monkeypatch.setattr(klrl, "run", lambda cfg, **kw: caught.update(cfg=cfg, **kw) or _Result())
    exec(block, {})
    (fn,) = caught["metrics"]
    cfg = tiny_cfg.replace(
        train={"iterations": 3, "samples_every": 2, "out_dir": str(tmp_path), "name": "r", "quiet": True}
    )
    monkeypatch.undo()
    rows = _rows(klrl.run(cfg, task=tiny_task, metrics=[fn]).dir)
    assert [x["user/beta_x100"] for x in rows] == pytest.approx([100 * x["ctrl/beta"] for x in rows])
    samples = [json.loads(x) for x in (tmp_path / "r" / "samples.jsonl").read_text().splitlines()]
    with_samples = sorted({s["iteration"] for s in samples})
    assert [x["iteration"] for x in rows if "user/completion_chars" in x] == with_samples == [0, 2]
    for it in with_samples:
        mine = [len(s["completion"]) for s in samples if s["iteration"] == it]
        assert rows[it]["user/completion_chars"] == pytest.approx(sum(mine) / len(mine))


class _Result:
    metrics = {"user/beta_x100": []}
