"""The Python API end to end on a tiny config: ``klrl.run`` and ``klrl.sweep`` write metrics.jsonl and
TensorBoard event files that TensorBoard's own reader reads back (scalars and hparams), ``load_run`` /
``load_sweep`` return what the run returned, every ``klrl.analysis.plots`` figure renders for them, and
``write_report`` (and ``run.py --report``) covers a run and a sweep."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import klrl
from klrl.config.sweep import grid
from klrl.io.readers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("beta_kl", "frontier", "overoptimization", "perplexity_diversity", "controller_comparison")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("api")


@pytest.fixture(scope="module")
def run_result(tiny_cfg, tiny_task, out):
    cfg = tiny_cfg.replace(train={"out_dir": str(out), "name": "run"})
    return klrl.run(cfg, task=tiny_task)


@pytest.fixture(scope="module")
def sweep_results(tiny_cfg, tiny_task, out):
    base = tiny_cfg.replace(train={"name": "sweep"})
    members = grid(base, {"kl.beta": [0.01, 0.1]})
    members.append(base.replace(ctrl={"kind": "proportional", "target": 1.0}))
    return klrl.sweep(members, task=tiny_task, out_dir=out / "sweep")


def events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every event
    ea.Reload()
    return ea


def hparams_of_events(path: Path) -> tuple[dict, list[str]]:
    """The hparams (name -> value) and metric tags TensorBoard's hparams plugin sees in ``path``."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = events(path).PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    hp = {}
    for k, v in start.session_start_info.hparams.items():
        hp[k] = getattr(v, v.WhichOneof("kind"))
    return hp, [m.name.tag for m in exp.experiment.metric_infos]


def assert_same_metrics(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_public_names():
    import klrl.analysis.plots
    import klrl.api

    assert callable(klrl.sweep) and klrl.sweep is klrl.api.sweep and klrl.run is klrl.api.run
    assert "klrl.sweep" not in sys.modules  # the function; its module is klrl.api
    assert klrl.plots.__name__ == "klrl.analysis.plots" and callable(klrl.plots.fit_gao)
    for name in ("plots", "load_sweep", "write_report", "sweep", "run", "load_run"):
        assert name in klrl.__all__ and getattr(klrl, name) is not None


def test_one_make_train_per_program_and_each_members_own_init(tiny_cfg, tiny_task, monkeypatch):
    """A sweep builds one Train; each member's initial state is, leaf for leaf and bit for bit, the one
    its own ``make_train(member).init(seed)`` gives (with its learning rate set), as before the merge."""
    import jax

    import klrl.loop.build
    from klrl.distributed import to_host
    from klrl.step.optim import set_learning_rate
    from klrl.step.train import make_train

    calls = []

    def counting(*a, **k):
        calls.append(a[0])
        return make_train(*a, **k)

    monkeypatch.setattr(klrl.loop.build, "make_train", counting)
    base = tiny_cfg
    members = [
        base,
        base.replace(kl={"beta": 0.3}, train={"seed": 5}, optim={"lr": 3e-4}),
        base.replace(ctrl={"kind": "proportional", "target": 2.0, "horizon": 50.0}, kl={"beta": 0.02}),
    ]
    prog, _ = klrl.loop.build.make_program(members, tiny_task, stacked=True, write=False)
    assert len(calls) == 1 and prog.stacked and prog.configs == members
    stacked = to_host(prog.init())
    for i, m in enumerate(members):
        own = make_train(m, tiny_task, log_target=True)  # the per-member Train of the old sweep
        want = to_host(own.init(m.train.seed))
        want = want._replace(opt_state=set_learning_rate(want.opt_state, m.optim.lr))
        # the frozen reference is one copy for all members (no members' axis)
        got = jax.tree.map(lambda x, i=i: x[i], stacked._replace(ref_params=None))
        got = got._replace(ref_params=stacked.ref_params)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == np.asarray(b).dtype and np.array_equal(a, np.asarray(b)), m
    calls.clear()
    prog, _ = klrl.loop.build.make_program([base], tiny_task, stacked=False, write=False)
    assert len(calls) == 1 and not prog.stacked and prog.shardings is not None


def test_run_metrics_match_metrics_jsonl(run_result, tiny_cfg):
    n = tiny_cfg.train.iterations
    assert {"ctrl/beta", "kl/k1_seq_sum", "reward/task"} <= set(run_result.metrics)
    assert all(v.shape == (n,) for v in run_result.metrics.values())
    rows = read_jsonl(run_result.dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(n))
    for k, v in run_result.metrics.items():
        np.testing.assert_array_equal(v, [float(r[k]) for r in rows], err_msg=k)


def test_tensorboard_scalars_and_hparams(run_result, tiny_cfg):
    n = tiny_cfg.train.iterations
    ea = events(run_result.dir / "tb")
    assert {"ctrl/beta", "kl/k1_seq_sum", "kl/exact_seq_sum", "reward/task"} <= set(ea.Tags()["scalars"])
    for tag in ("ctrl/beta", "kl/k1_seq_sum"):
        ev = ea.Scalars(tag)
        assert [e.step for e in ev] == list(range(n))
        np.testing.assert_allclose([e.value for e in ev], run_result.metrics[tag], rtol=1e-6)
    hp, metric_tags = hparams_of_events(run_result.dir / "tb")  # the same run as the time series
    assert hp["kl/beta"] == pytest.approx(tiny_cfg.kl.beta)
    assert hp["ctrl/kind"] == tiny_cfg.ctrl.kind and hp["ppo/advantage"] == tiny_cfg.ppo.advantage
    assert {"final/ctrl/beta", "final/kl/k1_seq_sum"} <= set(metric_tags)
    final = ea.Scalars("final/kl/k1_seq_sum")  # the trailing-window (diag.window >= n) mean
    assert final[0].value == pytest.approx(np.mean(run_result.metrics["kl/k1_seq_sum"]), rel=1e-5)


def test_load_run_reads_the_run_back(run_result):
    back = klrl.load_run(run_result.dir)
    assert back.config == run_result.config and back.dir == run_result.dir and back.state is None
    assert_same_metrics(back.metrics, run_result.metrics)


def test_sweep_members_written_and_loaded_back(sweep_results, out, tmp_path):
    root = out / "sweep"
    names = ["ctrl.kind=fixed,kl.beta=0.01", "ctrl.kind=fixed,kl.beta=0.1",  # (a fixed beta reads no target)
             "ctrl.kind=proportional,ctrl.target=1.0,kl.beta=0.05"]  # fmt: skip
    index = json.loads((root / "sweep.json").read_text())
    assert index["members"] == names and index["axes"]["ctrl.kind"] == ["fixed", "proportional"]
    back = klrl.load_sweep(root)
    assert [r.config for r in back] == [r.config for r in sweep_results]
    for a, b in zip(back, sweep_results, strict=True):
        assert_same_metrics(a.metrics, b.metrics)
    hp, _ = hparams_of_events(root / names[1] / "tb")
    assert hp["kl/beta"] == pytest.approx(0.1) and hp["ctrl/kind"] == "fixed"
    hp, _ = hparams_of_events(root / names[2] / "tb")
    assert hp["ctrl/kind"] == "proportional"
    beta = [e.value for e in events(root / names[0] / "tb").Scalars("ctrl/beta")]
    np.testing.assert_allclose(beta, sweep_results[0].metrics["ctrl/beta"], rtol=1e-6)
    # an old sweep.json (only "members") and old member-XX directories are read as before
    copy = shutil.copytree(root, tmp_path / "copy", ignore=shutil.ignore_patterns("tb", "sweep.json"))
    for j, n in enumerate(names):
        (copy / n).rename(copy / f"member-{j:02d}")
    (copy / "sweep.json").write_text(json.dumps({"members": [f"member-{j:02d}" for j in range(3)]}))
    assert [r.config for r in klrl.load_sweep(copy)] == [r.config for r in sweep_results]
    (copy / "sweep.json").unlink()  # without sweep.json the member-XX directories are read in order
    assert [r.config for r in klrl.load_sweep(copy)] == [r.config for r in sweep_results]
    with pytest.raises(FileNotFoundError, match="not a klrl sweep directory"):
        klrl.load_sweep(tmp_path)


@pytest.mark.parametrize("name", PLOTS)
def test_figures_of_a_real_run_and_sweep(name, run_result, sweep_results, tmp_path):
    for i, results in enumerate((run_result, sweep_results)):
        path = tmp_path / f"{i}.png"
        getattr(klrl.plots, name)(results).savefig(path, dpi=40)
        assert path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_report_of_a_run(run_result):
    path = klrl.write_report(run_result.dir)
    assert path == run_result.dir / "report.md"
    text = path.read_text()
    for section in ("## Summary", "## Diagnosis timeline", "## Plots", "## Config"):
        assert section in text
    assert "| kl/k1_seq_sum |" in text and "| ctrl/beta |" in text
    links = [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert "report-beta_kl.png" in links and "report-frontier.png" in links
    for link in links:
        assert (run_result.dir / link).read_bytes()[:8] == PNG_MAGIC
    block = text.split("```json\n")[1].split("```")[0]
    assert klrl.RunConfig.from_dict(json.loads(block)) == run_result.config
    assert klrl.write_report(run_result) == path  # a RunResult works too


def test_report_of_a_sweep(sweep_results, out):
    root = out / "sweep"
    path = klrl.write_report(root)
    assert path == root / "report.md"
    text = path.read_text()
    members = [line for line in text.splitlines() if line.startswith("| ctrl.kind=")]
    assert len(members) == 3  # one row per member
    assert "kl.beta" in text and "ctrl.kind" in text  # the fields that differ are columns
    assert "### ctrl.kind=proportional,ctrl.target=1.0,kl.beta=0.05: proportional target=1" in text
    assert (root / "report-controller_comparison.png").read_bytes()[:8] == PNG_MAGIC
    assert klrl.write_report(sweep_results) == path  # the list klrl.sweep returned works too


def test_maybe_write_report_never_raises(run_result, tmp_path):
    from klrl.analysis.report import maybe_write_report

    assert maybe_write_report(run_result) == run_result.dir / "report.md"
    in_memory = klrl.RunResult(run_result.config, None, run_result.metrics)
    assert maybe_write_report(in_memory) is None
    logged = []
    (tmp_path / "file").write_text("")
    broken = klrl.RunResult(run_result.config, tmp_path / "file", run_result.metrics)  # dir is a file
    assert maybe_write_report(broken, logged.append) is None
    assert len(logged) == 1 and logged[0].startswith("report: not written")


def _run_py():
    spec = importlib.util.spec_from_file_location("klrl_run_script", ROOT / "experiments" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_report(run_result, tmp_path, capsys):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "--report", str(run_result.dir)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    n, where = len(run_result.metrics["ctrl/beta"]), run_result.dir / "metrics.jsonl"
    assert out == [f"read {n} rows of 1 run from {where}", str(run_result.dir / "report.md")]
    main = _run_py().main
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    for d, why in ((tmp_path / "missing", "no such run directory"), (tmp_path, "not a klrl run"),
                   (bad, "unreadable klrl run")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(["--report", str(d)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err and err.startswith("error: --report:")


def test_a_model_path_the_task_does_not_train_is_refused_before_anything_is_built(
    tiny_cfg, tiny_task, tmp_path, monkeypatch
):
    """``model.path`` on a task that trains klrl's own GPT used to train, then crash in ``save_policy``
    after the last iteration, leaving a partial ``policy/``: refused at the entry (a built-in task, before
    it is built) or once the task is built (a task given to klrl.run), before anything compiles."""
    import klrl.loop.build
    from klrl.config import ConfigError

    def reached(*a, **k):
        raise AssertionError("reached: the combination was not refused first")

    gguf = str(ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf")
    cfg = tiny_cfg.replace(model={"path": gguf}, train={"out_dir": str(tmp_path), "name": "r"})
    monkeypatch.setattr(klrl.loop.build, "make_train", reached)
    monkeypatch.setattr(klrl.loop.build, "build_task", reached)
    for name in ("testbed", "wordclass"):
        with pytest.raises(ConfigError, match=rf"^model\.path: task {name} does not read it"):
            klrl.run(cfg.replace(task={"name": name}))
    with pytest.raises(ConfigError, match=r"^model\.path: task wordclass trains a GPT policy, not the model"):
        klrl.run(cfg.replace(task={"name": "text"}), task=tiny_task)  # its GPT: not model.path
    assert list(tmp_path.iterdir()) == []


def _hub_snapshot(tmp_path, monkeypatch):
    """A local Hugging Face cache (``HF_HUB_CACHE``) holding one snapshot of ``Org/Tiny``; its path."""
    cache = tmp_path / "hub"
    snap = cache / "models--Org--Tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--Org--Tiny" / "refs").mkdir()
    (cache / "models--Org--Tiny" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return snap


def test_a_hub_name_is_read_from_the_local_cache_from_python(tiny_cfg, tmp_path, monkeypatch):
    """``klrl.run`` resolves a Hub name as the CLI does: the run is built from the cached snapshot (the
    config ``build_task`` sees names it); one not cached is one line saying where klrl looked."""
    import klrl.loop.build
    from klrl.config import ConfigError

    snap = _hub_snapshot(tmp_path, monkeypatch)
    seen = []

    def stop(cfg, log=None):
        seen.append(cfg.model.path)
        raise RuntimeError("built")

    monkeypatch.setattr(klrl.loop.build, "build_task", stop)
    # klrl's defaults (tiny_cfg sizes klrl's own GPT: model.n_layers has no effect on a text task)
    cfg = klrl.RunConfig().replace(task={"name": "text"}, train={"out_dir": str(tmp_path / "runs")})
    with pytest.raises(ConfigError, match=r"^model\.path: Org/Missing: .*not in the local Hugging Face"):
        klrl.run(cfg.replace(model={"path": "Org/Missing"}), write=False)
    with pytest.raises(RuntimeError, match="built"):
        klrl.run(cfg.replace(model={"path": "Org/Tiny"}), write=False)
    assert seen == [str(snap)]


def test_a_run_on_a_hub_name_saves_its_policy_with_the_snapshot_it_trained(tmp_path, monkeypatch):
    """``klrl.run`` on a Hub name writes ``policy/`` with the config the run trained (the snapshot's path,
    from which the adapter config records the Hub id and revision), not the name it was given (which
    would be taken as a path under the working directory). The training itself stubbed."""
    from klrl.analysis.results import RunResult

    snap = _hub_snapshot(tmp_path, monkeypatch)
    seen = []

    def drive(prog, **k):
        (m,) = prog
        seen.append(m.model.path)
        return [RunResult(m, tmp_path / "run", {}, "state")], None

    monkeypatch.setattr(klrl.api, "make_program", lambda members, *a, **k: (members, "the task"))
    monkeypatch.setattr(klrl.api, "drive", drive)
    saved = []
    monkeypatch.setattr(klrl.api, "save_policy", lambda task, s, out, c: saved.append((task, s, out, c)))
    cfg = klrl.RunConfig().replace(task={"name": "text"}, model={"path": "Org/Tiny"})
    klrl.run(cfg, run_dir=tmp_path / "run")
    assert seen == [str(snap)]
    want = [("the task", "state", tmp_path / "run" / "policy", str(snap))]
    assert [(t, s, o, c.model.path) for t, s, o, c in saved] == want


def test_each_sweep_member_on_a_model_path_saves_its_policy(tmp_path, monkeypatch):
    """klrl.sweep writes ``policy/`` into every member's directory on a pretrained model.path, as
    klrl.run does (the training itself stubbed: the members' results as the loop returns them)."""
    from klrl.analysis.results import RunResult

    cfg = klrl.RunConfig().replace(model={"path": str(tmp_path / "m.gguf")}, task={"name": "text"})
    members = [cfg.replace(kl={"beta": b}) for b in (0.1, 1.0)]
    dirs = [tmp_path / f"kl.beta={b}" for b in (0.1, 1.0)]
    results = [RunResult(m, d, {}, f"state{j}") for j, (m, d) in enumerate(zip(members, dirs, strict=True))]
    monkeypatch.setattr(klrl.api, "_checked", lambda ms, *a: (ms, None))
    monkeypatch.setattr(klrl.api, "make_program", lambda *a, **k: ("the program", "the task"))
    monkeypatch.setattr(klrl.api, "drive", lambda prog, **k: (results, None))
    saved = []
    monkeypatch.setattr(klrl.api, "save_policy", lambda task, s, out, c: saved.append((task, s, out, c)))
    klrl.sweep(members, out_dir=tmp_path)
    assert [(t, s, o) for t, s, o, _ in saved] == [("the task", "state0", dirs[0] / "policy"),
                                                   ("the task", "state1", dirs[1] / "policy")]  # fmt: skip
    assert [c.kl.beta for *_, c in saved] == [0.1, 1.0]
