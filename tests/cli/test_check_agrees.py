"""``klrl train --check`` refuses exactly what the run refuses before it compiles, with the same line
(issue 52, item 4). Each case runs twice in this process: with ``--check`` (exit 0 and ``check: ok``, or
exit 2 and one line), and as the run itself, stopped where the compile would start (the reward
normalisation after ``make_train``, patched to raise :class:`Reached`): a run that reaches it accepted
the config; one that did not exited 2 with one line. The two must agree, line for line.

The cases: every float field set to NaN and every int field to a fraction (the schema's invalid
values), and a table of valid-but-refused configs on the tiny GGUF model (lengths against the model's
context, top_k against its vocabulary, LoRA ranks against its layers, model fields, reward functions,
prompts), with valid neighbours that both must accept."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from klrl.cli.commands import main as klrl_main
from klrl.config import SECTIONS

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
FIELDS = [(s, f) for s, c in SECTIONS.items() for f in dataclasses.fields(c)]


class Reached(Exception):
    """The run got to the compile: every check before it passed."""


@pytest.fixture(autouse=True)
def _stop_at_the_compile(monkeypatch, tmp_path):
    import klrl.loop.build

    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(klrl.loop.build, "reward_norm_env", reached)
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def _outcome(capsys, argv: list[str]) -> tuple[str, str]:
    """``("ok", "")``, ``("reached", "")`` or ``("refused", the one error line)``."""
    capsys.readouterr()
    try:
        status = klrl_main(argv)
    except Reached:
        return "reached", ""
    except SystemExit as e:
        status = e.code
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("warning: ")]
    if status == 0:
        return "ok", ""
    assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (argv, status, err)
    return "refused", err[0]


def agree(capsys, argv: list[str]) -> tuple[str, str]:
    checked = _outcome(capsys, ["train", "--check", *argv])
    ran = _outcome(capsys, ["train", *argv])
    assert checked[0] in ("ok", "refused") and ran[0] in ("reached", "refused"), (checked, ran)
    assert (checked[0] == "ok") == (ran[0] == "reached"), (argv, "check:", checked, "run:", ran)
    assert checked[1] == ran[1], (argv, checked[1], ran[1])
    return checked


@pytest.mark.parametrize("name", [f"{s}.{f.name}" for s, f in FIELDS if type(f.default) is float])
def test_a_nan_is_refused_by_both_alike(name, capsys):
    assert agree(capsys, [f"--{name}", "nan"])[0] == "refused"


@pytest.mark.parametrize("name", [f"{s}.{f.name}" for s, f in FIELDS if type(f.default) is int])
def test_a_fraction_is_refused_by_both_alike(name, capsys):
    assert agree(capsys, [f"--{name}", "1.5"])[0] == "refused"


def _text(*extra: str) -> list[str]:
    flags = {"--model.path": str(GGUF), "--data.prompt_len": "16", "--data.limit": "8",
             "--sampling.response_len": "4", "--train.batch_size": "4", "--ppo.minibatches": "2",
             "--train.iterations": "1", "--train.quiet": "true"}  # fmt: skip
    flags.update(zip(extra[::2], extra[1::2], strict=True))
    return [t for kv in flags.items() for t in kv]


REWARDS = """
def ok(completions, **kwargs):
    return [1.0] * len(completions)

def conversational(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]

def short(completions, **kwargs):
    return [0.0]
"""
CASES = [  # (argv, refused?) on the tiny GGUF model: context 64, vocabulary 256, width 64
    ([], False),
    (["--sampling.response_len", "8", "--data.prompt_len", "64"], True),  # the case
    (["--sampling.response_len", "8", "--data.prompt_len", "64", "--lora.rank", "4"], True),
    (["--sampling.response_len", "48", "--data.prompt_len", "16"], False),  # 64 = the context
    (["--sampling.response_len", "49", "--data.prompt_len", "16"], True),
    (["--sampling.top_k", "256"], False),
    (["--sampling.top_k", "257"], True),
    (["--lora.rank", "8"], False),
    (["--lora.rank", "65"], True),
    (["--lora.rank", "4", "--lora.targets", "nothing_matches"], True),
    (["--model.reward_path", str(GGUF), "--reward.fn", "REWARDS:ok"], True),
    (["--reward.fn", "REWARDS:ok"], False),
    (["--reward.fn", "REWARDS:conversational"], True),
    (["--reward.fn", "REWARDS:short"], True),
    (["--reward.fn", "REWARDS:missing"], True),
    (["--data.path", "PROMPTS_EMPTY"], True),
    (["--data.path", "PROMPTS_NO_FIELD"], True),
    (["--data.path", "PROMPTS_OK"], False),
    (["--train.batch_size", "6"], False),
    (["--train.batch_size", "5"], True),  # 5 rows do not split into 2 minibatches
    (["--ppo.advantage", "grpo", "--ppo.group_size", "3"], True),
    (["--train.devices", "2"], True),  # one CPU device
    (["--model.value_model", "lora", "--lora.rank", "4", "--lora.critic_rank", "65"], True),
    (["--data.eval_fraction", "0.5", "--reward.fn", "REWARDS:ok"], False),
    (["--data.field", "messages"], True),
    (["--data.chat_template", "true"], False),
]


@pytest.mark.filterwarnings("ignore::klrl.data.prompts.PromptTruncationWarning")
@pytest.mark.parametrize("extra,refused", CASES, ids=[" ".join(a) or "valid" for a, _ in CASES])
def test_check_and_run_agree_on_the_tiny_model(extra, refused, tmp_path, capsys):
    (tmp_path / "rw.py").write_text(REWARDS)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"text": "hello"}\n' * 8)
    (tmp_path / "ok.jsonl").write_text("".join(f'{{"prompt": "say {i}"}}\n' for i in range(8)))
    subs = {"PROMPTS_EMPTY": "empty.jsonl", "PROMPTS_NO_FIELD": "nofield.jsonl", "PROMPTS_OK": "ok.jsonl"}
    extra = [subs.get(a, a.replace("REWARDS:", f"{tmp_path / 'rw.py'}:")) for a in extra]
    outcome, line = agree(capsys, _text(*extra))
    assert (outcome == "refused") == refused, (extra, outcome, line)
