"""Time to the first iteration (issue 48): the persistent compilation cache keyed by machine, the phase
lines, XLA's compile banners moved to the run's ``xla.log``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from klrl.loop import compile as C

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

CPU = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon X\nflags\t\t: fpu sse avx2 avx512f\n"


def test_machine_key_follows_the_cpu_features():
    """The key is a function of the CPU's model and flags (their order aside): a host with other
    features (no AVX-512 here) gets another directory, so its executables are never read back."""
    key = C.machine_key(CPU)
    assert len(key) == 16 and int(key, 16) >= 0
    assert C.machine_key(CPU.replace("sse avx2 avx512f", "avx512f sse avx2")) == key
    assert C.machine_key(CPU.replace(" avx512f", "")) != key
    assert C.machine_key(CPU.replace("Xeon X", "EPYC Y")) != key
    assert C.machine_key(CPU + "processor\t: 1\nflags\t\t: fpu\n") == key  # the first CPU's fields


ENABLE = """
import json, os, sys, jax
from klrl.loop import compile as C
out = C.enable_cache(sys.argv[1])
f = jax.jit(lambda x: (x @ x.T).sum() * 3)
snap = C.CacheStats.snapshot()
f(jax.numpy.ones((64, 64))).block_until_ready()
print(json.dumps({"dir": None if out is None else str(out), "key": C.machine_key(),
                  "jax_dir": jax.config.jax_compilation_cache_dir, **C.CacheStats.since(snap)}))
"""


def _no_jax_cache() -> dict[str, str]:
    """The environment without the test session's own JAX cache (conftest's ``JAX_COMPILATION_CACHE_DIR``
    and threshold), which klrl would leave as the user's."""
    drop = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "KLRL_COMPILE_CACHE")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _enable(root: Path, **env: str) -> dict:
    e = {**_no_jax_cache(), "PYTHONPATH": str(ROOT), **env}
    r = subprocess.run([sys.executable, "-c", ENABLE, str(root)], env=e, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_the_cache_is_private_keyed_and_read_by_the_next_process(tmp_path):
    """In ``ROOT/xla/<machine key>`` with mode 0700; the first process writes the program, a second
    process reads it instead of compiling (one hit, no write); ``KLRL_COMPILE_CACHE=0`` and a cache
    directory the user gave JAX are left alone."""
    first = _enable(tmp_path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # (the user's: kept)
    d = Path(first["dir"])
    assert d == tmp_path / "xla" / first["key"] and first["jax_dir"] == str(d)
    for p in (d, d.parent):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, oct(p.stat().st_mode)
    assert first["hits"] == 0 and first["misses"] >= 1, first
    second = _enable(tmp_path)
    assert second["hits"] >= 1 and second["misses"] == 0, second
    assert _enable(tmp_path / "off", KLRL_COMPILE_CACHE="0")["dir"] is None
    assert not (tmp_path / "off").exists()
    own = _enable(tmp_path / "mine", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jaxown"))
    assert own["dir"] is None and own["jax_dir"] == str(tmp_path / "jaxown")


BANNER = """E1207 19:02:03.123456   4242 slow_operation_alarm.cc:73]
********************************
[Compiling module jit_step] Very slow compile? If you want to file a bug, run with envvar XLA_FLAGS=...
********************************
"""
FOLDING = """E1207 19:02:09.000001   4242 slow_operation_alarm.cc:140] The operation took 1.5s
Constant folding an instruction is taking > 1s:

  %reduce.7 = f32[64]{0} reduce(f32[64,128]{1,0} %x, f32[] %c), dimensions={1}

This isn't necessarily a bug; constant-folding is inherently a trade-off between compilation time and speed.
If you'd like to file a bug, run with envvar XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.
"""


def test_split_banners_keeps_xla_messages_apart():
    text = "a python line\n" + BANNER + "checkpoints: every 10\n" + FOLDING + "[1/2] R 0\n"
    xla, rest = C.split_banners(text)
    assert xla == BANNER + FOLDING
    assert rest == "a python line\ncheckpoints: every 10\n[1/2] R 0\n"


def test_xla_banners_go_to_the_run_directory(tmp_path, capfd):
    """What C++ writes to descriptor 2 in the block (XLA's banners) is appended to ``xla.log``, with one
    line naming it; other writes reach stderr as they were."""
    said = []
    with C.xla_banners(tmp_path, said.append):
        os.write(2, BANNER.encode())
        print("a warning of python", file=sys.stderr, flush=True)
        os.write(2, FOLDING.encode())
    err = capfd.readouterr().err
    assert err == "a warning of python\n"
    assert (tmp_path / C.XLA_LOG).read_text() == BANNER + FOLDING
    assert said == [f"XLA's compile messages (2) are in {tmp_path / C.XLA_LOG}"]
    with C.xla_banners(None):  # no run directory: nothing moves
        os.write(2, BANNER.encode())
    assert capfd.readouterr().err == BANNER


def test_phase_lines_on_a_terminal_or_when_asked(monkeypatch, capsys):
    monkeypatch.delenv(C.PROGRESS_ENV, raising=False)
    assert C.phase_log(quiet=False) is None  # (pytest's stderr is no terminal)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    say = C.phase_log(quiet=False)
    say("compiling the train step ...")
    assert capsys.readouterr().err == "klrl: compiling the train step ...\n"
    assert C.phase_log(quiet=True) is None
    monkeypatch.setenv(C.PROGRESS_ENV, "0")
    assert C.phase_log(quiet=False) is None


RUN = """
import sys
sys.path.insert(0, {tests!r})
from conftest import tiny_config
import klrl
cfg = tiny_config({cache!r}).replace(train={{"iterations": 1, "out_dir": {out!r}, "name": sys.argv[1],
                                             "quiet": False}})
klrl.run(cfg)
"""


@pytest.mark.slow
def test_a_second_run_reads_the_train_step_from_the_cache(tmp_path):
    """Two processes run the same tiny config: each says what it does before the first iteration
    (task, compile, with seconds); the first compiles the train step and writes it, the second reads it
    (``persistent cache: N read, 0 written``) in much less time than XLA took to compile it."""
    script = RUN.format(tests=str(TESTS), cache=str(tmp_path / "cache"), out=str(tmp_path / "runs"))
    env = {
        **_no_jax_cache(),
        "PYTHONPATH": str(ROOT),
        "KLRL_PROGRESS": "1",
        "KLRL_CACHE": str(tmp_path / "cache"),
    }
    lines = []
    for name in ("first", "second"):
        r = subprocess.run([sys.executable, "-c", script, name], env=env, capture_output=True, text=True,
                           timeout=900)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        lines.append([ln for ln in r.stderr.splitlines() if ln.startswith("klrl: ")])
    for ls in lines:
        assert ls[0].startswith("klrl: building the task wordclass (model load, reference) ...")
        assert any(ln.startswith("klrl: task ready in ") for ln in ls)
        assert "klrl: compiling the train step ..." in ls
    compiled = [next(ln for ln in ls if ln.startswith("klrl: compiled the train step in ")) for ls in lines]
    assert "0 read" in compiled[0] and "written" in compiled[0] and " 0 written" not in compiled[0], compiled
    assert " 0 read" not in compiled[1] and "0 written" in compiled[1], compiled
    xla = [float(c.split(", XLA ")[1].split(" s")[0]) for c in compiled]  # XLA's compile, or its cache read
    assert xla[1] < 0.5 * xla[0], compiled
