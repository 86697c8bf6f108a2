"""A generated suite of invalid invocations and damaged run directories: every case ends in exit status
2 and exactly one line on stderr (``error: ...`` naming what is wrong), before anything is built or
compiled, and leaves every run directory byte-identical.

The bulk runs in this process (``experiments/run.py``'s ``main(argv)`` and ``klrl.cli.commands.main``,
stderr captured, ``SystemExit`` caught) with the task builders, ``make_train``, the sweep and
``klrl.run`` itself replaced by functions that fail the test if reached: a case that got past the
checks would be caught there. A few cases run as real subprocesses to prove the exit status end to end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from klrl.config import SECTIONS, RunConfig
from klrl.config.schema import ALIASES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "run.py"

_spec = importlib.util.spec_from_file_location("klrl_run_for_invalid_inputs", SCRIPT)
run_py = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_py)

FIELDS = [(s, f) for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
FLOATS = [f"{s}.{f.name}" for s, f in FIELDS if type(f.default) is float]
INTS = [f"{s}.{f.name}" for s, f in FIELDS if type(f.default) is int]
BOOLS = [f"{s}.{f.name}" for s, f in FIELDS if type(f.default) is bool]
FREE_STRINGS = {
    "task.cache_dir",
    "train.out_dir",
    "train.name",
    "train.rollback_metric",
    "train.rollback_guards",  # metric>ratio or metric<ratio (tested in test_bad_rollback_guard)
    "model.path",
    "model.value_path",
    "model.adapter",
    "lora.targets",
    "model.reward_path",
    "model.eval_path",  # (a path: tested in RANGES)
    "train.mesh",  # (three integers: tested in RANGES)
    "data.path",
    "data.field",
    "data.split",
    "data.eval_path",
    "reward.fn",  # (tested below: test_bad_reward_fn)
    "train.hooks",  # module:function specs (tested in test_user_hooks: a bad spec is one line, exit 2)
    "train.metric_fns",
    "reward.weights",
    "log.wandb_project",
    "log.wandb_name",
    "log.wandb_group",
}
CHOICES = [
    f"{s}.{f.name}" for s, f in FIELDS if type(f.default) is str and f"{s}.{f.name}" not in FREE_STRINGS
]


class Reached(AssertionError):
    pass


@pytest.fixture(autouse=True)
def nothing_is_built(monkeypatch, tmp_path):
    """Any case that reaches a task build, a compile or a run fails; caches and runs go to tmp."""
    import klrl
    import klrl.api
    import klrl.loop.build
    import klrl.step.train

    def reached(what):
        def f(*a, **k):
            raise Reached(f"{what} was reached: the input was not rejected before anything was built")

        return f

    for obj, name in ((klrl.loop.build, "build_task"), (klrl.api, "run"), (klrl, "run"),
                      (klrl.step.train, "make_train"), (klrl.api, "make_program"), (klrl.api, "sweep"),
                      (klrl, "sweep")):  # fmt: skip
        monkeypatch.setattr(obj, name, reached(f"{obj.__name__}.{name}"))
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def one_line_exit_2(capsys, fn, argv, *words):
    capsys.readouterr()
    try:
        status = fn(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2, (argv, status, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err[-2000:])
    for w in words:
        assert w in lines[0], (argv, w, lines[0])
    return lines[0]


def legacy(capsys, argv, *words):
    """``experiments/run.py ARGV`` (the working directory is a temporary one: runs go there)."""
    return one_line_exit_2(capsys, run_py.main, argv, *words)


def snapshot(d: Path) -> str:
    """A hash of every entry's name, kind and bytes under ``d``."""
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        h.update(str(p.relative_to(d)).encode() + (b"/" if p.is_dir() else b""))
        if p.is_file():
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


# ---- 1. every float field: nan, inf, -inf -----------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FLOATS)
def test_nonfinite_float(name, value, capsys):
    legacy(capsys, [f"--{name}", value], name, "finite")


# ---- 2. every int field: beyond int32, not an integer -----------------------------------------------
@pytest.mark.parametrize("value", ["2147483648", "99999999999999999999", "1.5", "ten"])
@pytest.mark.parametrize("name", INTS)
def test_bad_int(name, value, capsys):
    legacy(capsys, [f"--{name}", value], name)


# ---- 3. bools and choices ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", BOOLS)
def test_bad_bool(name, capsys):
    legacy(capsys, [f"--{name}", "maybe"], name)


@pytest.mark.parametrize("name", CHOICES)
def test_bad_choice(name, capsys):
    legacy(capsys, [f"--{name}", "bogus"], name, "must be one of")


# ---- 4. ranges, including those that depend on the task -------------------------------------------
RANGES = [
    ("task.seed", "-1"), ("train.seed", "-1"), ("sampling.top_k", "100000"), ("sampling.top_k", "148"),
    ("sampling.top_k", "-1"), ("sampling.temperature", "0"), ("ppo.ent_coef", "-0.1"),
    ("ppo.vf_coef", "-1"), ("optim.eps", "0"), ("optim.weight_decay", "-1"), ("ctrl.kp", "-1"),
    ("kl.beta", "2e6"), ("kl.beta", "-1"), ("train.name", "a/b"), ("train.name", ".."),
    ("train.out_dir", ""), ("kl.ref_mix", "0"), ("ctrl.step_clip", "1"), ("ppo.gamma", "1.01"),
    ("optim.b2", "1"), ("train.rollback_threshold", "1"), ("diag.window", "3"),
    ("train.batch_size", "0"), ("train.devices", "4096"), ("ppo.minibatches", "3"), ("model.d_model", "30"),
    ("model.eval_path", "bogus"), ("train.mesh", "bogus"), ("train.mesh", "2,0,1"), ("train.mesh", "-1,-1,1"),
    ("reward.standardize_samples", "1"), ("reward.standardize_samples", "0"),
]  # fmt: skip


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--reward.fn", "positivity"], ("reward.fn", "task.name=text")),  # the testbed has no text reward
        (["--task.name", "text", "--model.path", __file__, "--reward.fn", "bogus"], ("reward.fn", "bogus")),
        (["--task.name", "text", "--model.path", __file__, "--reward.fn", "positivity,"], ("reward.fn",)),
        *(
            (["--task.name", "text", "--reward.fn", "positivity", "--reward.weights", w], ("reward.weights",))
            for w in ("x", "1,2", "nan")
        ),
    ],
)
def test_bad_reward_fn(argv, words, capsys):
    legacy(capsys, argv, *words)


@pytest.mark.parametrize("name,value", RANGES)
def test_out_of_range(name, value, capsys):
    legacy(capsys, [f"--{name}", value], name)


@pytest.mark.parametrize(
    "value,words",
    [
        ("text/distinct_2", ("expected metric>ratio or metric<ratio, got 'text/distinct_2'",)),
        ("eval/oracle_ppl_floored>0.5", ("'eval/oracle_ppl_floored>0.5': expected a number > 1 after '>'",)),
        ("reward/task>1.5,text/distinct_2<1.2", ("'text/distinct_2<1.2': expected a number in (0, 1)",)),
    ],
)
def test_bad_rollback_guard(value, words, capsys):
    line = legacy(capsys, ["--train.rollback_guards", value], *words)
    assert line.startswith("error: train.rollback_guards: "), line


def test_warmup_beta_outside_the_bounds(capsys):
    legacy(capsys, ["--ctrl.warmup_iters", "2", "--ctrl.warmup_beta", "5", "--ctrl.beta_max", "1"],
           "ctrl.warmup_beta")  # fmt: skip


# ---- 5. unknown flags: typos of every field, TRL/verl names, fields without a section ----------------
def _typo(s: str) -> str:
    i = len(s) // 2
    return s[:i] + s[i + 1 :] if len(s) > 3 else s + "x"


@pytest.mark.parametrize("name", [f"{s}.{f.name}" for s, f in FIELDS])
def test_typo_of_a_field_suggests_it(name, capsys):
    sec, fld = name.split(".")
    line = legacy(capsys, [f"--{sec}.{_typo(fld)}", "1"], f"{sec}.{_typo(fld)}", "unknown field")
    assert "did you mean --" in line or "valid:" in line, line


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_trl_and_verl_names_map_to_klrl(alias, capsys):
    legacy(capsys, [f"--{alias}", "1"], f"--{alias}", f"--{ALIASES[alias][0]}")


@pytest.mark.parametrize("flag", ["--n_layers", "--prompt_len", "--estimator", "--rm_lr"])
def test_field_without_section(flag, capsys):
    legacy(capsys, [flag, "1"], flag, "take their section")


@pytest.mark.parametrize("flag", ["--kll.beta", "--sweep_devices", "--reportt", "-x", "stray"])
def test_other_unknown_arguments(flag, capsys):
    legacy(capsys, [flag, "1"] if flag.startswith("-") else [flag])


def test_the_guard_catches_a_valid_invocation(capsys):
    """The fixture's guard works: a valid run or sweep gets as far as building and is stopped there."""
    for argv in (["--kl.beta", "0.1"], ["--sweep", "kl.beta=0.1,1"], []):
        with pytest.raises(Reached):
            run_py.main(argv)


# ---- 6. conflicting or malformed command-line flags -----------------------------------------------
CONFLICTS = [
    (["--report", "R", "--resume", "R"], "--resume"),
    (["--report", "R", "--sweep", "kl.beta=0.1,1"], "--sweep"),
    (["--report", "R", "--kl.beta", "0.1"], "--kl.beta"),
    (["--report", "R", "--study"], "--study"),
    (["--report", "R", "--config", "c.json"], "--config"),
    (["--report", "R", "--quiet"], "--quiet"),
    (["--resume", "R", "--sweep", "kl.beta=0.1,1"], "--sweep"),
    (["--resume", "R", "--study"], "--study"),
    (["--study", "--sweep", "kl.beta=0.1,1"], "--study"),
    (["--sweep-devices", "2", "--kl.beta", "0.1"], "--sweep-devices"),
    (["--sweep", "kl.beta", "0.1,1"], "expected --sweep section.field=v1,v2"),
    (["--sweep", "kl.beta:0.1,1"], "expected --sweep section.field=v1,v2"),
    (["--sweep", "kl.betta=0.1,1"], "kl.betta"),
    (["--sweep", "kl.beta=x,1"], "kl.beta"),
    (["--sweep", "kl.beta=0.1,nan"], "kl.beta"),
    (["--sweep", "kl.beta=0.1", "--sweep", "kl.beta=1"], "twice"),
    (["--sweep", "model.d_model=32,64"], "model.d_model"),
    (["--sweep", "kl.beta=1", "--sweep-devices", "0"], "--sweep-devices"),
    (["--kl.beta"], "--kl.beta"),
    (["--coordinator", "localhost:notaport"], "--coordinator"),
    (["--coordinator", "localhost"], "--coordinator"),
    (["--coordinator", "h:70000"], "--coordinator"),
    (["--coordinator", ":1234"], "--coordinator"),
    (["--num-processes", "0"], "--num-processes"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id"),
    (["--process-id", "-1"], "--process-id"),
    (["--num-processes", "x"], "--num-processes"),
]  # fmt: skip


@pytest.mark.parametrize("argv,word", CONFLICTS, ids=[" ".join(a) for a, _ in CONFLICTS])
def test_conflicting_or_malformed_flags(argv, word, capsys):
    legacy(capsys, argv, word)


# ---- 6b. flags a study or sweep would ignore, model paths a task would not read (issue 30, 7 and 10) ----
GGUF = str(ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf")
IGNORED = [
    ("--study --kl.beta 0.5 --ctrl.kind pi", "--kl.beta: set per member by the study (0.01, 0.1, 1)"),
    ("--study --ctrl.kind pi", "--ctrl.kind: set per member by the study (fixed, proportional)"),
    ("--study --ctrl.target 2", "--ctrl.target: set per member by the study"),
    ("--study --ctrl.kp 0.3", "--ctrl.kp: read by no member of the study (ctrl.kind fixed, proportional"),
    ("--study --ctrl.warmup_iters 5",
     "the study: members 0 and 1 would be the same run: their maths does not read kl.beta"),
    ("--sweep train.name=a,b", "--sweep train.name: per-run bookkeeping, one value for the whole sweep"),
    ("--sweep train.out_dir=a,b", "--sweep train.out_dir: per-run bookkeeping"),
    ("--sweep train.quiet=true,false", "--sweep train.quiet: per-run bookkeeping"),
    ("--sweep diag.window=5,10", "--sweep diag.window: per-run bookkeeping"),
    ("--sweep kl.beta=0.1,0.1", "--sweep kl.beta: value 0.1 given twice"),
    ("--sweep ctrl.kp=0.1,0.2", "--sweep ctrl.kp: two members would be the same run (ctrl.kp=0.1 and 0.2): "
                                "their maths does not read ctrl.kp with ctrl.kind=fixed"),
    ("--sweep kl.beta=0.1,1 --ctrl.warmup_iters 3", "--sweep kl.beta: two members would be the same"),
    ("--sweep kl.beta=0.1,1 --kl.beta 0.5", "--kl.beta: set per member by --sweep (0.1, 1)"),
    ("--sweep kl.beta=0.1,1 --ctrl.horizon 50", "--ctrl.horizon: read by no member of --sweep"),
    ("--sweep ctrl.kind=fixed,pi --ctrl.horizon 50", "--ctrl.horizon: read by no member"),
    ("--task.name testbed --model.path GGUF --train.iterations 2", "model.path: task testbed does not read"),
    ("--task.name wordclass --model.eval_path GGUF", "model.eval_path: task wordclass does not read it"),
    ("--model.path GGUF --model.reward_path GGUF --reward.fn positivity",
     "model.reward_path: not read when reward.fn is given"),
    ("--model.path GGUF --model.value_model head --model.value_path GGUF",
     "model.value_path: read only with model.value_model=sep"),
    ("--sweep kl.beta=0.1,1 --model.path GGUF --model.value_model separate --model.value_path GGUF",
     "model.value_path: a sweep's members draw a fresh value model each"),
    # a single run, as the study and sweeps (issue 41): a field another field makes irrelevant
    ("--lora.alpha 32", "lora.alpha=32.0 has no effect without lora.rank > 0"),
    ("--model.lora.targets qkv", "lora.targets='qkv' has no effect without lora.rank > 0"),
    ("--lora.rank 4 --model.value_model head --model.lora.critic_rank 2",
     "lora.critic_rank=2 has no effect with model.value_model=head"),
    ("--ctrl.kp 0.3", "ctrl.kp=0.3 has no effect with ctrl.kind=fixed"),
    ("--ctrl.kind band --ctrl.horizon 50", "ctrl.horizon=50.0 has no effect with ctrl.kind=band"),
    ("--kl.loss_coef 0.1", "kl.loss_coef=0.1 has no effect with kl.placement=reward"),
    ("--sweep kl.beta=0.1,1 --lora.alpha 8", "lora.alpha=8.0 has no effect without lora.rank > 0"),
    ("--lora.rank 1000000 --model.d_model 32 --model.n_heads 2",
     "lora.rank: 1000000 exceeds the width of the adapted layer h0/"),
]  # fmt: skip


@pytest.mark.parametrize("argv,words", IGNORED, ids=[a for a, _ in IGNORED])
def test_a_flag_the_run_would_ignore_is_refused(argv, words, capsys):
    legacy(capsys, [GGUF if w == "GGUF" else w for w in argv.split()], words)


def test_study_and_sweep_flags_that_are_used_pass(capsys):
    """What the members do read gets through to the build: a ctrl knob of the study's proportional member, a
    seed for every member, a knob of a swept controller kind."""
    for argv in (
        ["--study", "--ctrl.clip", "0.1", "--train.seed", "3"],
        ["--sweep", "ctrl.kind=fixed,proportional", "--ctrl.horizon", "50"],
        ["--sweep", "ctrl.kp=0.1,0.2", "--ctrl.kind", "pi"],
        ["--sweep", "ctrl.kind=fixed,pi", "--ctrl.kp", "0.3"],
        ["--lora.rank", "32", "--lora.alpha", "8", "--model.d_model", "32", "--model.n_heads", "2"],
    ):
        with pytest.raises(Reached):
            run_py.main(argv)


# ---- 7. paths the run would write -------------------------------------------------------------------
def test_paths(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    cases = [
        (["--train.out_dir", str(f)], "train.out_dir"),
        (["--train.out_dir", str(f / "sub")], "train.out_dir"),
        (["--task.cache_dir", str(f)], "task.cache_dir"),
        (["--task.cache_dir", str(f / "sub")], "task.cache_dir"),
    ]
    for argv, word in cases:
        one_line_exit_2(capsys, run_py.main, ["--kl.beta", "0.1", *argv], word)
        assert f.read_text() == "x"


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """Make directories read-only: ``chattr +i`` (stops root too) where it works, else ``os.access``."""
    made = []

    def make(d: Path) -> Path:
        r = subprocess.run(["chattr", "+i", str(d)], capture_output=True)
        if r.returncode == 0:
            made.append(d)
        else:
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, m, **k: False if Path(p) == d else real(p, m, **k))
        return d

    yield make
    for d in made:
        subprocess.run(["chattr", "-i", str(d)], check=True)


def _valid_run(d: Path, rows: int = 3) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(RunConfig().to_dict(), indent=1))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "kl/seq_sum": 0.5}) + "\n"
                                             for i in range(rows)))  # fmt: skip
    return d


def test_read_only_directories(tmp_path, read_only, capsys):
    ro = read_only(tmp_path.joinpath("ro").mkdir() or tmp_path / "ro")
    one_line_exit_2(capsys, run_py.main, ["--kl.beta", "0.1", "--train.out_dir", str(ro)], "not writable")
    one_line_exit_2(capsys, run_py.main, ["--kl.beta", "0.1", "--train.out_dir", str(ro / "new")],
                    "not writable")  # fmt: skip
    one_line_exit_2(capsys, run_py.main, ["--kl.beta", "0.1", "--task.cache_dir", str(ro / "c")],
                    "not writable")  # fmt: skip
    run = _valid_run(tmp_path / "run")
    before = snapshot(run)
    read_only(run)
    one_line_exit_2(capsys, run_py.main, ["--resume", str(run)], "resume: ", "not writable")
    one_line_exit_2(capsys, run_py.main, ["--report", str(run)], "--report", "not writable")
    assert snapshot(run) == before


# ---- 8. damaged run directories, read by --report, --resume, klrl.load_run and --config ----------------
NESTED = "[" * 100_000 + "]" * 100_000
GOOD_ROW = json.dumps({"iteration": 0, "kl/seq_sum": 0.5}) + "\n"
DAMAGE = {
    # name -> (file, content: str | bytes | None for a directory)
    "config_list": ("config.json", "[]"),
    "config_null": ("config.json", "null"),
    "config_number": ("config.json", "3"),
    "config_string": ("config.json", '"kl"'),
    "config_nested": ("config.json", NESTED),
    "config_nested_value": ("config.json", '{"kl": {"beta": 1, "clamp": ' + NESTED + "}}"),
    "config_garbage": ("config.json", "{not json"),
    "config_binary": ("config.json", bytes(range(256))),
    "config_empty": ("config.json", ""),
    "config_dir": ("config.json", None),
    "config_section_list": ("config.json", json.dumps({"kl": [1, 2]})),
    "config_unknown_section": ("config.json", json.dumps({"kll": {}})),
    "config_unknown_field": ("config.json", json.dumps({"kl": {"betta": 1}})),
    "config_bad_value": ("config.json", json.dumps({"kl": {"beta": -1}})),
    "config_nan_value": ("config.json", '{"kl": {"beta": NaN}}'),
    "config_wrong_type": ("config.json", json.dumps({"kl": {"beta": "0.1"}})),
    "config_bool_for_int": ("config.json", json.dumps({"train": {"iterations": True}})),
    "metrics_garbage_first": ("metrics.jsonl", "garbage\n" + GOOD_ROW),
    "metrics_binary_first": ("metrics.jsonl", b"\xff\xfe\x00\x01\n" + GOOD_ROW.encode()),
    "metrics_dir": ("metrics.jsonl", None),
    "metrics_array_row": ("metrics.jsonl", GOOD_ROW + "[1, 2]\n" + GOOD_ROW),
    "metrics_string_value": ("metrics.jsonl", GOOD_ROW + '{"iteration": 1, "kl/seq_sum": "x"}\n'),
    "metrics_no_iteration": ("metrics.jsonl", json.dumps({"kl/seq_sum": 1.0}) + "\n"),
    "metrics_nested_line": ("metrics.jsonl", NESTED + "\n" + GOOD_ROW),
    "metrics_blank_line": ("metrics.jsonl", GOOD_ROW + "\n" + GOOD_ROW),
}  # fmt: skip


def damaged(tmp_path: Path, name: str) -> Path:
    d = _valid_run(tmp_path / "run")
    file, content = DAMAGE[name]
    p = d / file
    p.unlink()
    if content is None:
        p.mkdir()
        (p / "inside").write_text("{}")
    elif isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    return d


@pytest.mark.parametrize("name", sorted(DAMAGE))
@pytest.mark.parametrize("reader", ["report", "resume", "klrl report", "klrl resume"])
def test_damaged_run_directory_cli(reader, name, tmp_path, capsys):
    from klrl.cli.commands import main as klrl_main

    d = damaged(tmp_path, name)
    before = snapshot(d)
    if reader in ("report", "resume"):
        one_line_exit_2(capsys, run_py.main, [f"--{reader}", str(d)], f"--{reader}")
    else:
        one_line_exit_2(capsys, klrl_main, [reader.split()[1], str(d)], str(d))
    assert snapshot(d) == before


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damaged_run_directory_load_run(name, tmp_path):
    import klrl
    from klrl.io.readers import RunDirError

    d = damaged(tmp_path, name)
    before = snapshot(d)
    with pytest.raises(RunDirError) as e:
        klrl.load_run(d)
    assert len(str(e.value).splitlines()) == 1 and str(d) in str(e.value)
    assert snapshot(d) == before


@pytest.mark.parametrize("name", sorted(n for n in DAMAGE if n.startswith("config_")))
def test_damaged_config_file(name, tmp_path, capsys):
    d = damaged(tmp_path, name)
    before = snapshot(d)
    one_line_exit_2(capsys, run_py.main, ["--config", str(d / "config.json")], "--config")
    assert snapshot(d) == before


def test_damaged_sweep_index(tmp_path, capsys):
    for doc in ("[]", '{"members": "member-00"}', '{"members": ["../../etc"]}', "{", '{"members": [1]}'):
        d = tmp_path / f"sweep-{abs(hash(doc))}"
        _valid_run(d / "member-00")
        (d / "sweep.json").write_text(doc)
        before = snapshot(d)
        one_line_exit_2(capsys, run_py.main, ["--report", str(d)], "sweep.json")
        assert snapshot(d) == before


# ---- 9. the klrl command ----------------------------------------------------------------------------
KLRL = [
    ([], "expected a command"), (["trian"], "did you mean klrl train"), (["sweep"], "no axis"),
    (["sweep", "kl.beta"], "expected --sweep"), (["sweep", "kl.beta", "0.1,1"], "expected --sweep"),
    (["resume"], "RUN_DIR"), (["report"], "RUN_DIR"), (["report", "nowhere"], "nowhere"),
    (["resume", "nowhere"], "not a klrl run directory"), (["train", "--kl_coef", "0.1"], "--kl.beta"),
    (["train", "--ppo.ent_coef", "nan"], "ppo.ent_coef"), (["report", "R", "--kl.beta", "1"], "--kl.beta"),
    (["train", "--sweep", "kl.beta=1"], "--sweep"), (["study", "--kl.beta", "inf"], "kl.beta"),
    (["train", "--config", "missing.yaml"], "missing.yaml"), (["sweep", "kl.beta=1", "--sweep-devices", "0"],
                                                               "--sweep-devices"),
]  # fmt: skip


@pytest.mark.parametrize("argv,word", KLRL, ids=[" ".join(a) or "none" for a, _ in KLRL])
def test_klrl_command(argv, word, capsys):
    from klrl.cli.commands import main as klrl_main

    one_line_exit_2(capsys, klrl_main, argv, word)


def test_yaml_config_errors(tmp_path, capsys):
    for i, text in enumerate(["kl: [1", "kl:\n  betta: 1\n", "- 1\n- 2\n", "kl:\n  beta: .nan\n"]):
        p = tmp_path / f"c{i}.yaml"
        p.write_text(text)
        one_line_exit_2(capsys, run_py.main, ["--config", str(p)], "--config")


# ---- 10. end to end: real processes -----------------------------------------------------------------
SUBPROCESS = [
    [str(SCRIPT), "--ppo.ent_coef", "nan"],
    [str(SCRIPT), "--sampling.top_k", "100000"],
    [str(SCRIPT), "--train.seed", "99999999999999999999"],
    [str(SCRIPT), "--kl_coef", "0.1"],
    [str(SCRIPT), "--sweep", "kl.beta", "0.1,1"],
    [str(SCRIPT), "--coordinator", "localhost:notaport"],
    [str(SCRIPT), "--report", "DAMAGED"],
    [str(SCRIPT), "--resume", "DAMAGED"],
    ["-m", "klrl", "train", "--optim.eps", "inf"],
    ["-m", "klrl", "report", "DAMAGED"],
]


def test_real_processes_exit_2_with_one_line(tmp_path):
    d = damaged(tmp_path, "config_list")
    before = snapshot(d)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), KLRL_CACHE=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen([sys.executable, *[str(d) if a == "DAMAGED" else a for a in args],
                          "--train.out_dir", str(tmp_path / "runs")] if "--report" not in args
                         and "report" not in args else
                         [sys.executable, *[str(d) if a == "DAMAGED" else a for a in args]],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in SUBPROCESS
    ]  # fmt: skip
    for args, p in zip(SUBPROCESS, procs, strict=True):
        _, err = p.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert p.returncode == 2, (args, p.returncode, err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, err[-2000:])
    assert snapshot(d) == before
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()
