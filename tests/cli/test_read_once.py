"""Nothing read twice, nothing misnamed (issue 52, items 1 and 6): a key given twice in a YAML or JSON
config, a flag given twice on the command line, and a regular file where a run directory is expected
are each refused in one line naming what is wrong, exit status 2, before anything is built."""

from __future__ import annotations

import json

import pytest

from klrl.cli.commands import main as klrl_main


def one_line_exit_2(capsys, argv: list[str], *words: str) -> str:
    capsys.readouterr()
    try:
        status = klrl_main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2, (argv, status, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err[-2000:])
    for w in words:
        assert w in lines[0], (argv, w, lines[0])
    return lines[0]


@pytest.fixture(autouse=True)
def _tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


# ---- duplicate keys -------------------------------------------------------------------------------
YAML = [  # (text, the words of the error)
    ("kl: {beta: 0.1}\nkl: {estimator: k1}\n", ("duplicate key 'kl'", "line 2", "first at line 1")),
    ("kl:\n  beta: 0.1\n  beta: 0.2\n", ("duplicate key 'beta'", "line 3", "first at line 2")),
    ("kl: {beta: 0.1, beta: 0.2}\n", ("duplicate key 'beta'", "line 1")),
    ("train:\n  iterations: 2\nkl:\n  beta: 0.1\ntrain:\n  seed: 3\n", ("duplicate key 'train'", "line 5")),
]
JSON = [
    ('{"kl": {"beta": 0.1, "beta": 0.2}}', "'kl.beta'"),
    ('{"kl": {"beta": 0.1}, "kl": {"estimator": "k1"}}', "'kl'"),
    ('{"train": {"iterations": 2}, "kl": {"estimator": "k1", "estimator": "k2"}}', "'kl.estimator'"),
]


@pytest.mark.parametrize("text,words", YAML, ids=range(len(YAML)))
def test_a_yaml_key_given_twice_is_refused(text, words, tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    one_line_exit_2(capsys, ["train", "--check", "--config", str(p)], "--config", str(p), *words)


@pytest.mark.parametrize("text,where", JSON, ids=range(len(JSON)))
def test_a_json_key_given_twice_is_refused(text, where, tmp_path, capsys):
    p = tmp_path / "c.json"
    p.write_text(text)
    one_line_exit_2(capsys, ["train", "--check", "--config", str(p)], str(p), "duplicate key", where)


def test_a_json_key_given_twice_in_a_run_directory_is_refused(tmp_path, capsys):
    from klrl.config import RunConfig
    from klrl.io.readers import RunDirError, read_config

    p = tmp_path / "config.json"
    text = json.dumps(RunConfig().to_dict())
    p.write_text(text.replace('"beta": 0.05', '"beta": 0.05, "beta": 0.5', 1))
    with pytest.raises(RunDirError, match=r"duplicate key 'kl\.beta'"):
        read_config(p)


def test_what_is_allowed_still_reads(tmp_path, capsys):
    """A YAML merge key overriding a merged value, the same key in two sections, a key once: accepted."""
    merged = tmp_path / "m.yaml"
    merged.write_text("kl:\n  <<: {beta: 0.1, estimator: k1}\n  beta: 0.2\nctrl:\n  beta: 0.0\n")
    from klrl.cli.args import load_config_file

    with pytest.raises(SystemExit):  # ctrl.beta is not a field: the usual error, not a duplicate
        load_config_file(str(merged))
    assert "duplicate" not in capsys.readouterr().err
    merged.write_text("kl:\n  <<: {beta: 0.1, estimator: k1}\n  beta: 0.2\ntrain:\n  seed: 0\n")
    cfg = load_config_file(str(merged))
    assert (cfg.kl.beta, cfg.kl.estimator) == (0.2, "k1")
    p = tmp_path / "c.json"
    p.write_text('{"kl": {"beta": 0.3}, "ppo": {"epochs": 2}}')
    assert load_config_file(str(p)).kl.beta == 0.3


# ---- a flag given twice ----------------------------------------------------------------------------
FLAGS = [
    (["train", "--check", "--kl.beta", "0.1", "--kl.beta", "0.2"],
     ("--kl.beta", "given twice", "'0.1'", "'0.2'")),
    (["train", "--check", "--kl.beta=0.1", "--kl.beta", "0.1"], ("--kl.beta", "given twice")),
    (["train", "--check", "--lora.rank", "4", "--model.lora.rank", "8"],
     ("--model.lora.rank", "--lora.rank")),
    (["sweep", "--check", "kl.beta=0.1,1", "--train.seed", "1", "--train.seed", "2"], ("--train.seed",)),
    (["resume", "R", "--train.iterations", "3", "--train.iterations", "4"], ("--train.iterations",)),
    (["export", "R", "OUT", "--step", "1", "--step", "2"], ("klrl export", "--step", "given twice")),
    (["generate", "R", "--n", "1", "--n", "2"], ("klrl generate", "--n", "given twice")),
    (["eval", "R", "--prompts", "a", "--prompts", "b"], ("klrl eval", "--prompts", "given twice")),
    (["reward-model", "--pairs", "p", "--out", "o", "--rm.epochs", "1", "--epochs", "2"],
     ("--epochs (the same as --rm.epochs)",)),
]  # fmt: skip


@pytest.mark.parametrize("argv,words", FLAGS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in FLAGS])
def test_a_flag_given_twice_is_refused(argv, words, capsys):
    one_line_exit_2(capsys, argv, *words)


def test_flags_meant_to_repeat_still_do(capsys):
    """``--sweep`` and ``--prompt`` append; a flag's value that looks like a flag is a value."""
    from klrl.cli.args import build_parser, repeated_flag
    from klrl.cli.commands import sweep_args
    from klrl.cli.flags import generate_parser

    p = build_parser(extra=sweep_args)
    argv = ["--sweep", "kl.beta=1,2", "--sweep", "train.seed=0,1", "--kl.estimator", "k1"]
    assert repeated_flag(p, argv) is None
    assert repeated_flag(p, ["--train.name", "--kl.beta", "--kl.beta", "1"]) is None  # the first is a value
    assert repeated_flag(generate_parser("generate"), ["x", "--prompt", "a", "--prompt", "b"]) is None
    assert klrl_main(["sweep", "--check", "--sweep", "kl.beta=0.1,1", "--sweep", "train.seed=0,1"]) == 0
    assert "check: ok (4 members)" in capsys.readouterr().out


# ---- a file where a run directory is expected --------------------------------------------------------
@pytest.mark.parametrize("cmd", ["resume", "report", "export"])
def test_a_file_given_as_the_run_directory_is_called_a_file(cmd, tmp_path, capsys):
    f = tmp_path / "metrics.jsonl"
    f.write_text("{}\n")
    argv = [cmd, str(f)] + ([str(tmp_path / "out")] if cmd == "export" else [])
    line = one_line_exit_2(capsys, argv, str(f), "a file, not a directory")
    assert "no such" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
