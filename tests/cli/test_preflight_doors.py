"""One preflight for every door (issue 50, item 2): the same bad config refused by ``klrl train`` (and
``klrl sweep``) and by :func:`klrl.run` (and :func:`klrl.sweep`) with the same one line, before anything
is built. ``klrl dpo`` and
:func:`klrl.dpo` likewise (:func:`klrl.checks.preflight_dpo`; stopped where the DPO driver would start).
The cases are the checks that only the command line made before (the paths a run writes, a
named pipe given as a file, the reward functions, the device count) and some it shared (model fields, a
built-in task's lengths, the user's hooks, the rollback on its own). A run that got past the checks is
stopped where the program would be built (:func:`klrl.loop.build.make_program`, patched to raise
:class:`Reached`), so a check missing at one door fails here instead of training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import klrl
import klrl.api
from klrl.cli.args import build_parser, config_from_args, parse
from klrl.cli.commands import main as klrl_main
from klrl.config import ConfigError, DataConfig, SamplingConfig


class Reached(Exception):
    """The program was about to be built: every check passed."""


@pytest.fixture(autouse=True)
def _stop_before_the_build(monkeypatch, tmp_path):
    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(klrl.api, "make_program", reached)
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def _cli(capsys, argv: list[str]) -> str:
    """The one error line of ``klrl ARGV`` (exit 2), without its ``error: ``."""
    capsys.readouterr()
    try:
        status = klrl_main(argv)
    except Reached:
        return "reached"
    except SystemExit as e:
        status = e.code
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("warning: ")]
    assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (argv, status, err)
    return err[0].removeprefix("error: ")


def _api(call) -> str:
    """The :class:`ConfigError` of ``call()`` as the command line prints it (one line)."""
    try:
        call()
    except Reached:
        return "reached"
    except ConfigError as e:
        return " ".join(str(e).split())
    raise AssertionError("neither refused nor reached")


def _config(flags: list[str]):
    """The config ``klrl train FLAGS`` builds (flags to fields as the command line reads them)."""
    ns = parse(build_parser(), flags)
    return config_from_args(ns)


HOOKS = "nowhere_module_xyz:fn"
GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
CASES = [  # (flags, a word of the expected line): each refused by both doors alike
    (["--train.out_dir", "FILE"], "train.out_dir: "),  # a file where the runs' directory goes
    (["--task.cache_dir", "FILE/c"], "task.cache_dir: "),
    (["--train.out_dir", "TMP", "--train.name", "file"], "train.name: "),  # a file where the run goes
    (["--data.path", "FIFO"], "data.path: "),  # a named pipe would block the read forever
    (["TEXT", "--reward.fn", "nowhere_module_xyz:score"], "reward.fn: "),  # on the tiny GGUF model
    (["--train.devices", "64"], "train.devices: asked for 64 devices"),
    (["--model.path", "m.gguf", "--task.name", "testbed"], "model.path: task testbed does not read it"),
    (["TEXT", "--sampling.response_len", "49"], "sampling.response_len: "),  # 16 + 49 > the context 64
    (["--train.hooks", HOOKS], "train.hooks: "),
    (["--sampling.top_k", "100000"], "sampling.top_k: "),
]


def _subs(tmp_path, flags: list[str]) -> list[str]:
    (tmp_path / "file").write_text("x")
    fifo = tmp_path / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    subs = {"FILE": str(tmp_path / "file"), "FILE/c": str(tmp_path / "file" / "c"),
            "TMP": str(tmp_path), "FIFO": str(fifo)}  # fmt: skip
    text = {"--model.path": str(GGUF), "--data.prompt_len": "16", "--data.limit": "8",
            "--sampling.response_len": "4", "--train.batch_size": "4", "--ppo.minibatches": "2"}  # fmt: skip
    if flags[:1] != ["TEXT"]:
        return [subs.get(f, f) for f in flags]
    text.update(zip(flags[1::2], [subs.get(f, f) for f in flags[2::2]], strict=True))
    return [t for kv in text.items() for t in kv]


@pytest.mark.parametrize("flags,word", CASES, ids=[" ".join(f) for f, _ in CASES])
def test_the_same_line_through_the_cli_and_the_api(flags, word, tmp_path, capsys):
    flags = [*_subs(tmp_path, flags), "--train.iterations", "1", "--train.quiet", "true"]
    cli = _cli(capsys, ["train", *flags])
    api = _api(lambda: klrl.run(_config(flags)))
    assert word in cli, (cli, word)
    assert cli == api, ("cli:", cli, "api:", api)


SWEEP_CASES = [c for c in CASES if "train.devices" not in c[0][0]]  # (a sweep's devices: its groups)


@pytest.mark.parametrize("flags,word", SWEEP_CASES, ids=[" ".join(f) for f, _ in SWEEP_CASES])
def test_the_same_line_through_klrl_sweep_and_the_api(flags, word, tmp_path, capsys):
    flags = [*_subs(tmp_path, flags), "--train.iterations", "1", "--train.quiet", "true"]
    cli = _cli(capsys, ["sweep", "kl.beta=0.1,1", *flags])
    cfg = _config(flags)
    api = _api(lambda: klrl.sweep([cfg.replace(kl={"beta": b}) for b in (0.1, 1.0)]))
    assert word in cli, (cli, word)
    assert cli == api, ("cli:", cli, "api:", api)


def test_a_valid_config_passes_both_doors(tmp_path, capsys):
    flags = ["--train.iterations", "1", "--train.quiet", "true", "--train.out_dir", str(tmp_path / "runs")]
    assert _cli(capsys, ["train", *flags]) == "reached"
    assert _api(lambda: klrl.run(_config(flags))) == "reached"


def test_write_false_checks_no_output_path(tmp_path):
    """``write=False`` writes no run directory: an unwritable ``train.out_dir`` is not its concern."""
    (tmp_path / "file").write_text("x")
    cfg = _config(["--train.out_dir", str(tmp_path / "file"), "--train.iterations", "1"])
    assert _api(lambda: klrl.run(cfg, write=False)) == "reached"
    assert _api(lambda: klrl.run(cfg)).startswith("train.out_dir: ")


# ---- DPO: ``klrl dpo`` and klrl.dpo through klrl.checks.preflight_dpo ----------------------------------
DPO_CASES = [  # (klrl.dpo's arguments over a valid call, a word of the expected line)
    ({"pairs": "FIFO"}, "pairs: "),  # a named pipe would block the read forever
    ({"run_dir": "FILE"}, "run_dir: "),  # a file where the run directory goes
    ({"run_dir": "FILE/c"}, "run_dir: "),
    ({"run_dir": "TMP"}, "run_dir: "),  # not empty: nothing is overwritten
    ({"run_dir": "FIFO"}, "run_dir: "),
    ({"run_dir": "EMPTY", "resume": True}, "resume: "),  # no config.json there
    ({"model_path": "none.gguf"}, "model.path: "),
    ({"betas": [0.1, 0.0]}, "dpo.beta: must be > 0"),
]
DPO_FLAGS = {"pairs": "--pairs", "model_path": "--model.path", "betas": "--dpo.betas"}


def _dpo_call(tmp_path, given: dict) -> tuple[list[str], dict]:
    """``(klrl dpo's argv, klrl.dpo's keyword arguments)`` for ``given`` over a valid call."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a b", "chosen": "c", "rejected": "d"}\n' * 40)
    (tmp_path / "empty").mkdir(exist_ok=True)
    names = ["FILE", "FILE/c", "TMP", "FIFO"]
    subs = {**dict(zip(names, _subs(tmp_path, names), strict=True)), "EMPTY": str(tmp_path / "empty")}
    kw = {"pairs": str(pairs), "model_path": str(GGUF), "run_dir": str(tmp_path / "new"), "resume": False}
    kw |= {k: subs.get(v, v) if isinstance(v, str) else v for k, v in given.items()}
    argv = ["dpo", "--data.prompt_len", "16", "--sampling.response_len", "4"]
    for k, flag in DPO_FLAGS.items():
        if k in kw:
            argv += [flag, ",".join(map(str, kw[k])) if k == "betas" else kw[k]]
    argv += ["--resume" if kw["resume"] else "--out", kw["run_dir"]]
    if kw["resume"]:  # a resume's settings are the run's: only the pairs are given
        argv = ["dpo", "--pairs", kw["pairs"], "--resume", kw["run_dir"]]
    return argv, kw


@pytest.mark.parametrize("given,word", DPO_CASES, ids=[str(g) for g, _ in DPO_CASES])
def test_dpo_the_same_line_through_the_cli_and_the_api(given, word, tmp_path, capsys, monkeypatch):
    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(klrl.api, "drive_dpo", reached)
    argv, kw = _dpo_call(tmp_path, given)
    cli = _cli(capsys, argv)
    data, sampling = DataConfig(prompt_len=16), SamplingConfig(response_len=4)
    api = _api(lambda: klrl.dpo(data=data, sampling=sampling, **kw))
    assert word in cli, (cli, word)
    assert cli == api, ("cli:", cli, "api:", api)


def test_dpo_a_valid_call_passes_both_doors(tmp_path, capsys, monkeypatch):
    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(klrl.api, "drive_dpo", reached)
    argv, kw = _dpo_call(tmp_path, {})
    assert _cli(capsys, argv) == "reached"
    data, sampling = DataConfig(prompt_len=16), SamplingConfig(response_len=4)
    assert _api(lambda: klrl.dpo(data=data, sampling=sampling, **kw)) == "reached"
