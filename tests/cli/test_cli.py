"""The command line: bad input ends in one line naming the field and exit status 2, before any
task is built or anything compiles. Every case is a real ``python experiments/run.py``
subprocess; they are started together (module fixture) so the module costs about one start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_line_error, xla_flags

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "run.py"
TIMEOUT = 120  # generous for a loaded machine; a bad config must never get as far as pretraining

# name -> (arguments, field the error line must name, extra environment)
BAD = {
    "batch_size_zero": (["--train.batch_size", "0"], "train.batch_size", {}),
    "batch_not_divisible_by_devices": (
        ["--train.batch_size", "6", "--ppo.minibatches", "2"],
        "train.batch_size",
        {"XLA_FLAGS": xla_flags(4)},
    ),
    "minibatches_not_dividing": (
        ["--train.batch_size", "16", "--ppo.minibatches", "3"],
        "ppo.minibatches",
        {},
    ),
    "response_len_zero": (["--sampling.response_len", "0"], "sampling.response_len", {}),
    "negative_beta": (["--kl.beta", "-0.1"], "kl.beta", {}),
    "target_zero": (["--ctrl.target", "0"], "ctrl.target", {}),
    "horizon_zero": (["--ctrl.horizon", "0"], "ctrl.horizon", {}),
    "unknown_field": (["--kl.betta", "0.1"], "kl.betta", {}),
    "unparsable_float": (["--kl.beta", "abc"], "kl.beta", {}),
    "unparsable_bool": (["--sampling.use_eos", "maybe"], "sampling.use_eos", {}),
}


def _start(args: list[str], cache: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()  # the session's code generation, no forced devices
    env.update({"KLRL_CACHE": str(cache), "JAX_PLATFORMS": "cpu", **extra_env})
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "--train.out_dir", str(cache / "runs")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Start every case at once, then collect ``name -> (status, stdout, stderr, cache)``."""
    procs = {}
    for name, (args, _, extra) in BAD.items():
        cache = tmp_path_factory.mktemp(f"cli-{name}")
        procs[name] = (_start(args, cache, extra), cache)
    cache = tmp_path_factory.mktemp("cli-help")
    procs["help"] = (_start(["--help"], cache, {}), cache)
    out = {}
    for name, (p, cache) in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            pytest.fail(
                f"{name}: still running after {TIMEOUT}s (did it start pretraining?)\n{stderr[-2000:]}"
            )
        out[name] = (p.returncode, stdout, stderr, cache)
    return out


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exits_2_with_one_line(results, name: str) -> None:
    status, stdout, stderr, cache = results[name]
    field = BAD[name][1]
    assert status == 2, (status, stderr[-2000:])
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert field in lines[0], lines[0]
    assert lines[0].startswith("error: ")
    # nothing was built: no cache entry, no run directory
    assert not any(cache.iterdir()), list(cache.iterdir())


def test_device_count_checked_before_the_task_is_built(results) -> None:
    status, _, stderr, cache = results["batch_not_divisible_by_devices"]
    assert status == 2
    assert "device" in stderr and "6 % 4" in stderr, stderr
    assert not any(cache.iterdir())


def test_help_lists_fields(results) -> None:
    status, stdout, stderr, _ = results["help"]
    assert status == 0, stderr
    for flag in ("--kl.beta", "--train.iterations", "--ctrl.target", "--ppo.minibatches", "--sampling.top_k"):
        assert flag in stdout, flag
    assert "initial KL coefficient" in stdout  # field help text is shown


# ---- in process: the flags, --config, the klrl command, the teaching errors -----------------------
def _klrl_run_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("klrl_run_for_test_cli", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def modes(monkeypatch):
    """Replace the executor: record ``(mode, config, sweep specs)`` instead of running."""
    import klrl.cli.commands as C

    seen = []

    def fake(mode, ns):
        cfg = None
        if mode in ("train", "study", "sweep"):
            cfg = C.config_from_args(ns)
        seen.append((mode, cfg, list(getattr(ns, "sweep", []) or [])))
        return 0

    monkeypatch.setattr(C, "execute", fake)
    return seen


@pytest.mark.parametrize(
    "argv,mode",
    [
        ([], "study"),
        (["--study", "--kl.beta", "0.2"], "study"),
        (["--kl.beta", "0.2"], "train"),
        (["--sweep", "kl.beta=0.1,1"], "sweep"),
        (["--resume", "R"], "resume"),
        (["--report", "R"], "report"),
    ],
)
def test_legacy_flags_choose_the_mode(argv, mode, modes) -> None:
    assert _klrl_run_module().main(argv) == 0
    assert modes[-1][0] == mode


@pytest.mark.parametrize(
    "argv,command",
    [
        ([], ["study"]),
        (["--study", "--kl.beta", "0.2"], ["study", "--kl.beta", "0.2"]),
        (["--kl.beta", "0.2", "--quiet"], ["train", "--kl.beta", "0.2", "--quiet"]),
        (["--config", "c.json"], ["train", "--config", "c.json"]),
        (["--kl.beta", "-inf", "--sweep-devices", "1"], ["train", "--kl.beta", "-inf"]),
        (["--sweep", "kl.beta=0.1,1", "--sweep-devices=2", "--train.seed", "3"],
         ["sweep", "--sweep", "kl.beta=0.1,1", "--sweep-devices=2", "--train.seed", "3"]),
        (["--train.iterations", "9", "--resume", "R"], ["resume", "R", "--train.iterations", "9"]),
        (["--resume=R", "--distributed"], ["resume", "R", "--distributed"]),
        (["--report", "R"], ["report", "R"]),
    ],
)  # fmt: skip
def test_legacy_flags_translate_to_a_klrl_command(argv, command) -> None:
    from klrl.cli.legacy import legacy_argv

    assert legacy_argv(argv) == command


def test_klrl_subcommands(modes, tmp_path) -> None:
    from klrl.cli.commands import main

    assert main(["train", "--kl.beta", "0.3"]) == 0 and modes[-1][0] == "train"
    assert modes[-1][1].kl.beta == 0.3
    assert main(["sweep", "kl.beta=0.1,1", "train.seed=0,1", "--train.iterations", "5"]) == 0
    assert modes[-1][0] == "sweep" and modes[-1][2] == ["kl.beta=0.1,1", "train.seed=0,1"]
    assert modes[-1][1].train.iterations == 5
    assert main(["sweep", "--sweep", "kl.beta=0.1,1"]) == 0 and modes[-1][2] == ["kl.beta=0.1,1"]
    for cmd in ("resume", "report"):
        assert main([cmd, str(tmp_path)]) == 0 and modes[-1][0] == cmd


def test_help_of_the_klrl_command(capsys) -> None:
    from klrl.cli.commands import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"klrl {c}" in out for c in ("train", "sweep", "study", "resume", "report"))
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    assert "--kl.beta" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_file_and_flags_override_it(suffix, tmp_path, modes) -> None:
    import json

    import yaml

    from klrl.config import RunConfig

    cfg = RunConfig().replace(kl={"beta": 0.3, "estimator": "k3"}, train={"iterations": 7, "name": "x"},
                              sampling={"use_eos": False, "temperature": 2})  # fmt: skip
    path = tmp_path / f"c{suffix}"
    d = cfg.to_dict()
    path.write_text(json.dumps(d, indent=1) if suffix == ".json" else yaml.safe_dump(d))
    from klrl.cli.commands import main

    assert main(["train", "--config", str(path)]) == 0
    assert modes[-1][1] == cfg  # a run directory's config.json is re-runnable as it is
    assert main(["train", "--config", str(path), "--kl.beta", "0.5"]) == 0
    assert modes[-1][1] == cfg.replace(kl={"beta": 0.5})
    part = tmp_path / f"part{suffix}"
    part.write_text('{"kl": {"beta": 1}}' if suffix == ".json" else "kl:\n  beta: 1\n")
    assert main(["train", "--config", str(part)]) == 0
    assert modes[-1][1] == RunConfig().replace(kl={"beta": 1.0})  # missing fields take defaults


@pytest.mark.parametrize(
    "argv,want",
    [
        (["--kl.betta", "1"], "kl.betta: unknown field; did you mean --kl.beta?"),
        (["--ctrl.targte", "1"], "did you mean --ctrl.target?"),
        (["--model.lora.rnak", "8"], "lora.rnak: unknown field; did you mean --lora.rank?"),
        (["--lora.rnak", "8"], "lora.rnak: unknown field; did you mean --lora.rank?"),
        (["--model.lora_rank", "8"], "did you mean --lora.rank?"),
        (["--model.lora.zzz", "8"], "lora.zzz: unknown field (valid: rank, alpha, targets, critic_"),
        (["--rnak", "8"], "--rnak: unknown flag; did you mean --lora.rank?"),
        (["--kl_coef", "0.1"], "--kl_coef: not a klrl flag; klrl's is --kl.beta"),
        (["--init_kl_coef", "0.1"], "klrl's is --kl.beta"),
        (["--target_kl", "6"], "klrl's is --ctrl.target"),
        (["--beta", "0.1"], "klrl's is --kl.beta"),
        (["--target", "6"], "klrl's is --ctrl.target"),
        (["--horizon", "10000"], "klrl's is --ctrl.horizon"),
        (["--adap_kl_ctrl", "true"], "klrl's is --ctrl.kind"),
        (["--learning_rate", "1e-5"], "klrl's is --optim.lr"),
        (["--num_ppo_epochs", "4"], "klrl's is --ppo.epochs"),
        (["--cliprange", "0.2"], "klrl's is --ppo.clip"),
        (["--sweep", "kl.beta", "0.1,1"], "expected --sweep section.field=v1,v2"),
        (["--estimator", "k3"], "--kl.estimator or --ctrl.estimator"),
        (["--sweep-device", "2"], "did you mean --sweep-devices?"),
        (["--distributed-timeout", "5"], "--distributed-timeout: needs --distributed"),
        (["--model_name_or_path", "m"], "--model_name_or_path: not a klrl flag; klrl's is --model.path"),
        (["--model-name-or-path=m"], "klrl's is --model.path"),
        (["--reward_model_path", "m"], "klrl's is --model.reward_path"),
        (["--actor_rollout_ref.model.path", "m"], "klrl's is --model.path"),
        (["--actor_rollout_ref.actor.kl_loss_coef", "0.1"], "klrl's is --kl.loss_coef"),
        (["--lr_warmup_ratio", "0.1"], "klrl's is --optim.warmup_steps (a fraction of all steps (see warmup"),
        (["--distributed", "--distributed-timeout", "0"], "must be a number of seconds > 0 (got 0.0)"),
    ],
)
def test_errors_that_teach(argv, want, capsys) -> None:
    line = one_line_error(capsys, _klrl_run_module().main, argv)
    assert want in line, line


def test_negative_and_nonfinite_values_reach_the_field(capsys) -> None:
    # argparse would take '-inf' for a flag; the value reaches the field and its rule
    line = one_line_error(capsys, _klrl_run_module().main, ["--ppo.ent_coef", "-inf"])
    assert line == "error: ppo.ent_coef: must be a finite number (got -inf)"
    line = one_line_error(capsys, _klrl_run_module().main, ["--kl.beta", "-1e-3"])
    assert line.startswith("error: kl.beta: must be >= 0")


def test_config_is_read_up_to_its_cap(tmp_path, monkeypatch, capsys) -> None:
    """A shell's pipe (``--config <(...)``: ``/dev/fd/N``) has no size in ``stat``: it is read up to the
    cap and one byte more, and refused there; under the cap it is read like a file."""
    import threading

    import klrl.io.readers as readers

    monkeypatch.setattr(readers, "MAX_JSON_BYTES", 100)

    def feed(data: bytes) -> tuple[str, threading.Thread]:
        r, w = os.pipe()

        def write() -> None:
            try:
                with open(w, "wb") as f:
                    f.write(data)
            except BrokenPipeError:  # the reader stopped at the cap
                pass

        t = threading.Thread(target=write, daemon=True)
        t.start()
        return f"/dev/fd/{r}", t

    from klrl.cli.commands import main

    path, t = feed(b" " * 10_000 + b"{}")
    line = one_line_error(capsys, main, ["train", "--config", path])
    assert line == f"error: --config: {path}: more than 100 bytes, too large for a klrl file"
    t.join(5)
    path, t = feed(b'{"kl": {"beta": 0.5}}')
    from klrl.cli.args import load_config_file

    assert load_config_file(path).kl.beta == 0.5
    t.join(5)


class _Hung(Exception):
    pass


def _special(kind: str, path: Path) -> Path:
    """``path`` made a named pipe with no writer, or a listening Unix socket."""
    if kind == "fifo":
        os.mkfifo(path)
    else:
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        _special.keep = s  # (open for the test's life)
    return path


@pytest.mark.parametrize(
    "argv,what",
    [
        (["train", "--config", "{p}"], "--config: {p}: not a regular file (a {k})"),
        (["train", "--config", "{p}.yaml"], "--config: {p}.yaml: not a regular file (a {k})"),
        (["train", "--model.path", "{p}"], "model.path: {p}: not a regular file or directory (a {k})"),
        (["train", "--data.path", "{p}", "--task.name", "text"],
         "data.path: {p}: not a regular file or directory (a {k})"),
        (["train", "--reward.fn", "{p}:score", "--task.name", "text"],
         "reward.fn: {p}: not a regular file or directory (a {k})"),
        (["resume", "{p}"], "RUN_DIR: {p}: not a regular file or directory (a {k})"),
        (["report", "{p}"], "RUN_DIR: {p}: not a regular file or directory (a {k})"),
        (["export", "{p}", "{p}-out"], "RUN_DIR: {p}: not a regular file or directory (a {k})"),
    ],
    ids=["config", "config-yaml", "model.path", "data.path", "reward.fn", "resume", "report", "export"],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_fifos_and_sockets_are_refused_before_opening(argv, what, kind, tmp_path, capsys) -> None:
    """A named pipe with no writer waited for ever (``--config FIFO``); a socket or a FIFO is refused
    before anything opens it, one line and exit 2 (the alarm turns a hang into a failure)."""
    import signal

    from klrl.cli.commands import main

    p = _special(kind, tmp_path / ("c.yaml" if "{p}.yaml" in argv else "c"))
    p = p.with_suffix("") if p.suffix == ".yaml" else p
    argv = [a.format(p=p) for a in argv]
    k = "named pipe (FIFO)" if kind == "fifo" else "socket"

    def hung(*_):
        raise _Hung(f"{argv} waited on the {kind}")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        line = one_line_error(capsys, main, argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert line == "error: " + what.format(p=p, k=k)


# ---- pretrained models: Hub names from the local Hugging Face cache, klrl models ---------------------
@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """$HF_HUB_CACHE holding Org/Tiny-Llama (tests/data/tiny_llama), $KLRL_CACHE empty; the run
    itself replaced: the config it would get is recorded."""
    from test_catalog import fake_hub_repo, tiny_hf_files

    import klrl.cli.commands as C

    hub = tmp_path / "hub"
    snap = fake_hub_repo(hub, "Org/Tiny-Llama", tiny_hf_files())
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "klrl"))
    runs = []
    monkeypatch.setattr(C, "run_one", lambda cfg, resume, report=None: runs.append(cfg) or 0)
    return hub, snap, runs


def test_a_hub_name_is_read_from_the_local_cache(fake_hub, tmp_path, capsys, monkeypatch) -> None:
    from klrl.cli.commands import main

    hub, snap, runs = fake_hub
    out_dir = str(tmp_path / "runs")
    fits = ["--data.prompt_len", "16"]  # the tiny model's context is 64 tokens (checked before the run)
    assert main(["train", "--model.path", "Org/Tiny-Llama", "--train.out_dir", out_dir, *fits]) == 0
    assert runs[-1].model.path == str(snap) and runs[-1].task.name == "text"  # config.json records it
    assert f"model.path: Org/Tiny-Llama is {snap}" in capsys.readouterr().out
    line = one_line_error(capsys, main, ["train", "--model.path", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert line.startswith(
        "error: model.path: HuggingFaceTB/SmolLM2-135M-Instruct: no such file or directory"
    )
    assert (
        str(hub / "models--HuggingFaceTB--SmolLM2-135M-Instruct") in line and "klrl fetches nothing" in line
    )
    import klrl.cli.commands as C

    swept = []  # every member of a sweep resolved, the line printed once
    monkeypatch.setattr(C, "run_sweep", lambda members, *a, **k: swept.append(members) or 0)
    assert (
        main(["sweep", "kl.beta=0.1,1", "--model.path", "Org/Tiny-Llama", "--train.out_dir", out_dir, *fits])
        == 0
    )
    assert [m.model.path for m in swept[-1]] == [str(snap)] * 2
    assert capsys.readouterr().out.count("model.path: Org/Tiny-Llama is") == 1
    line = one_line_error(
        capsys, main, ["train", "--model.path", "Org/Tiny-Llama", "--model.reward_path", "Org/Nope"]
    )
    assert line.startswith("error: model.reward_path: Org/Nope: no such file or directory")


def test_klrl_models_lists_what_it_sees(fake_hub, tmp_path, capsys) -> None:
    import shutil

    from klrl.cli.commands import main

    hub, snap, _ = fake_hub
    (tmp_path / "klrl" / "gguf").mkdir(parents=True)
    shutil.copyfile(ROOT / "tests/data/tiny_gguf/tiny.gguf", tmp_path / "klrl" / "gguf" / "tiny.gguf")
    capsys.readouterr()
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "Org/Tiny-Llama: llama safetensors, " in out and f"    {snap}\n" in out
    assert "tiny.gguf: llama GGUF, 35K parameters (klrl cache)" in out  # 34,976: the tiny GGUF's tensors
    assert f"Hugging Face cache {hub}" in out and f"klrl cache {tmp_path / 'klrl'}" in out
    assert "klrl models" in main.__globals__["_usage"]()
    line = one_line_error(capsys, main, ["models", "--model.path", "x"])
    assert line == "error: --model.path: klrl models takes no flags or arguments"


@pytest.mark.parametrize(
    "argv,env,want",
    [
        # a device has no size to trust: read unbounded it was a MemoryError
        (["--config", "/dev/zero"], {}, "error: --config: /dev/zero: not a regular file"),
        # root may write anywhere by the permission bits, but not into /proc: tried, not inferred
        ([], {"KLRL_CACHE": "/proc/klrl-nope"},
         "error: the task cache ($KLRL_CACHE): /proc/klrl-nope cannot be created: /proc is not writable"),
        (["--task.cache_dir", "/proc/klrl-nope"], {}, "error: task.cache_dir: /proc/klrl-nope cannot be"),
        (["--train.out_dir", "/proc/klrl-nope"], {}, "error: train.out_dir: /proc/klrl-nope cannot be"),
    ],
)  # fmt: skip
def test_unusable_files_and_directories_before_anything_is_built(
    argv, env, want, tmp_path, monkeypatch, capsys
):
    import klrl.cli.commands as C

    def reached(*a, **k):
        raise AssertionError("the run was reached: the input was not refused before anything was built")

    monkeypatch.setattr(C, "run_one", reached)
    monkeypatch.setattr(C, "run_sweep", reached)
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = [] if "--train.out_dir" in argv else ["--train.out_dir", str(tmp_path / "runs")]
    line = one_line_error(capsys, C.main, ["train", *argv, *out])
    assert line.startswith(want), line
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing created


def test_help_per_command_and_the_gpt_fields_apart() -> None:
    """``klrl report --help`` is its own (no training flag), ``klrl resume --help`` lists only what a
    resume may change, and ``train``'s model section opens with fields every model reads: the built-in
    GPT's own (n_layers, ...) sit under their own heading."""
    from klrl.cli.commands import _command_parser

    report = _command_parser("report").format_help()
    assert len(report.splitlines()) < 15 and "--kl.beta" not in report and "RUN_DIR" in report
    resume = _command_parser("resume").format_help()
    assert "--train.iterations" in resume and "--log.wandb" in resume and "--kl.beta" not in resume
    train = _command_parser("train").format_help()
    model = train.split("\nmodel:\n", 1)[1].split("\n\n")[1]  # the flags after the section's description
    assert model.lstrip().startswith("--model.value_model") and "--model.n_layers" not in model
    gpt = train.split("\nmodel (klrl's built-in GPT only):\n", 1)[1].split("\n\n")[1]
    assert gpt.lstrip().startswith("--model.n_layers") and "--model.tie_embeddings" in gpt
    # hidden flags still parse (a report's own message names them; a resume checks them against the run)
    ns = _command_parser("report").parse_args(["RUN", "--kl.beta", "1"])
    assert getattr(ns, "kl.beta") == "1"


# ---- the front door: --help without jax, --check, one parse of experiments/run.py's flags ---------------
_NO_JAX = (
    "import sys\n"
    "from klrl.cli import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit as e:\n"
    "    assert e.code in (0, None), e.code\n"
    "heavy = sorted(m for m in ('jax', 'jaxlib', 'flax', 'optax', 'orbax') if m in sys.modules)\n"
    "assert not heavy, heavy\n"
)


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["sweep", "--help"], ["study", "--help"], ["resume", "--help"],
     ["report", "--help"], ["models", "--help"], ["export", "--help"], ["generate", "--help"],
     ["eval", "--help"], ["reward-model", "--help"], ["dpo", "--help"]],
)  # fmt: skip
def test_help_does_not_import_jax(argv) -> None:
    """``klrl --help`` and the training commands' ``--help`` import neither jax nor the training stack
    (a lazy ``klrl/__init__``, the command line's imports inside its functions, the registries' built-in
    names declared in klrl.registry): they answer in a fraction of a second."""
    p = subprocess.run([sys.executable, "-c", _NO_JAX, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=TIMEOUT)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage" in p.stdout


def test_the_help_names_the_distributed_timeout_default() -> None:
    from klrl import distributed
    from klrl.cli.commands import DISTRIBUTED_TIMEOUT_S

    assert DISTRIBUTED_TIMEOUT_S == distributed.DEFAULT_TIMEOUT_S


@pytest.mark.parametrize(
    "argv,members",
    [(["train"], 1), (["study"], 4), (["sweep", "kl.beta=0.1,1", "train.seed=0,1"], 4),
     (["train", "--kl.beta", "0.3", "--ctrl.kind", "fixed"], 1)],
)  # fmt: skip
def test_check_runs_the_preflight_alone(argv, members, tmp_path, monkeypatch, capsys) -> None:
    """``--check``: every check that needs no compiled code, then one line and exit 0; nothing is run,
    built or written (no run directory, no task cache)."""
    import klrl.cli.commands as C

    def reached(*a, **k):
        raise AssertionError("--check reached the run")

    monkeypatch.setattr(C, "run_one", reached)
    monkeypatch.setattr(C, "run_sweep", reached)
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    assert C.main([*argv, "--check", "--train.out_dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr()
    assert out.out.strip().splitlines()[-1] == f"check: ok ({members} member{'s' if members > 1 else ''})"
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv,want",
    [(["train", "--sampling.top_k", "100000"], "error: sampling.top_k: must be <= the task's vocabulary"),
     (["train", "--model.path", "/no/such/model"], "error: model.path: /no/such/model: no such file"),
     (["train", "--model.reward_path", "/no/rm"], "error: model.reward_path: task testbed does not read"),
     (["study", "--lora.rank", "10000"], "error: lora.rank"),
     (["sweep", "kl.beta=0.1,1", "--sweep-devices", "4"], "error: sweep: 2 members do not split over 4")],
)  # fmt: skip
def test_check_fails_as_the_run_would(argv, want, tmp_path, monkeypatch, capsys) -> None:
    """``--check`` refuses what the command would refuse, with its one line and exit status 2."""
    import klrl.cli.commands as C

    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    line = one_line_error(capsys, C.main, [*argv, "--check", "--train.out_dir", str(tmp_path / "runs")])
    assert line.startswith(want), line
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_the_script_parses_its_flags_once(monkeypatch, tmp_path, capsys) -> None:
    """``python experiments/run.py`` is ``klrl study`` (and its siblings, by its flags) with one parser:
    the command's own parser is never built, and ``--check`` answers as the command's does."""
    import klrl.cli.commands as C
    from klrl.cli import legacy_main

    def second(*a, **k):
        raise AssertionError("a second parser was built")

    monkeypatch.setattr(C, "_command_parser", second)
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # (train.out_dir: runs/ here)
    capsys.readouterr()
    assert legacy_main(["--check"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "check: ok (4 members)"  # the study
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())
    out = ["--train.out_dir", str(tmp_path / "runs")]
    assert legacy_main(["--check", "--kl.beta", "0.2", *out]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "check: ok (1 member)"  # a run
    assert legacy_main(["--check", "--sweep", "kl.beta=0.1,1", *out]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "check: ok (2 members)"


def test_the_preflight_runs_once(monkeypatch, tmp_path) -> None:
    """The command line runs :func:`klrl.checks.preflight` once and tells the API (``checked=True``),
    which then does not run it again."""
    import klrl.api
    import klrl.checks
    import klrl.cli.commands as C

    calls, seen = [], {}
    real = klrl.checks.preflight

    def counting(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    def fake_run(cfg, **k):
        seen.update(k)
        raise KeyboardInterrupt  # (launch.guarded: "interrupted", exit 130)

    monkeypatch.setattr(klrl.checks, "preflight", counting)
    monkeypatch.setattr(klrl.api, "run", fake_run)
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    assert C.main(["train", "--train.out_dir", str(tmp_path / "runs")]) == 130
    assert calls == ["run"] and seen["checked"] is True
