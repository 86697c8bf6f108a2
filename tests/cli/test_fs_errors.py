"""Every command, every filesystem error, one line (issue 52, item 2): each command that writes or reads
a path (``train``, ``sweep``, ``study``, ``resume``, ``report``, ``export``, ``generate``, ``eval``,
``reward-model``, ``dpo``) meets each of a name too long, a symbolic link loop, a file where a directory
is expected, a read-only filesystem, a full disk and a directory without permission, at the path it
writes (a run's ``train.out_dir``, export's ``OUT_DIR``, generate's and eval's ``--out``,
reward-model's ``--out``) or at the run directory it works in (resume, report): exit 2, one line naming
the path and the cause, before anything is built, and nothing left behind.

The read-only and full disks are tmpfs mounts (skipped where this sandbox cannot mount); no
permission is a directory of mode 0500, and for root (whom permission bits do not refuse) the refusal
is injected where the checks meet it (``tempfile.mkdtemp`` and ``os.access`` under that directory)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from klrl.cli.commands import main as klrl_main

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
CAUSE = {  # the words of the cause in the line
    "too_long": "File name too long",
    "loop": "Too many levels of symbolic links",
    "file": "not a directory",
    "read_only": "ead-only",  # 'Read-only file system' or 'read-only or no permission'
    "no_space": "No space left on device",
    "permission": "ermission",
}
WRITERS = ("train", "sweep", "study", "export", "generate", "eval", "reward-model", "dpo")
READERS = ("resume", "report")


class Reached(AssertionError):
    pass


def _mount(d: Path, size: str) -> None:
    d.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")


def _fill(d: Path) -> None:
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def _refuse_writes_under(base: Path, monkeypatch) -> None:
    """As root: creating anything under ``base`` fails with EACCES, as it would for another user
    (``tempfile.mkdtemp``, what the write check tries first; ``os.access`` as well)."""
    import errno
    import tempfile

    real_mkdtemp, real_access = tempfile.mkdtemp, os.access

    def mkdtemp(*a, dir=None, **k):
        if dir is not None and Path(dir).absolute().is_relative_to(base):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real_mkdtemp(*a, dir=dir, **k)

    def access(path, mode, *a, **k):
        if mode & os.W_OK and Path(path).absolute().is_relative_to(base):
            return False
        return real_access(path, mode, *a, **k)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(os, "access", access)


@pytest.fixture
def place(tmp_path, tiny_gguf_run, request):
    """``place(condition, run=False)``: a path under that condition (``run``: the tiny run copied there,
    for resume and report); the mounts are undone at the end."""
    mounts = []

    def make(condition: str, run: bool = False) -> Path:
        base = tmp_path / condition
        if condition == "too_long":
            base.mkdir()
            return base / ("n" * 300)
        if condition == "loop":
            base.mkdir()
            (base / "a").symlink_to(base / "b")
            (base / "b").symlink_to(base / "a")
            return base / "a" / "sub" if not run else base / "a"
        if condition == "file":
            base.mkdir()
            (base / "afile").write_text("x")
            return base / "afile" / "sub"
        if condition == "permission":
            base.mkdir()
            target = base / "sub"
            if run:
                shutil.copytree(tiny_gguf_run.dir, target)
                target.chmod(0o500)
            base.chmod(0o500)
            request.addfinalizer(lambda: (base.chmod(0o700), target.exists() and target.chmod(0o700)))
            if os.geteuid() == 0:  # root is not refused by permission bits: the refusal is injected
                _refuse_writes_under(base, request.getfixturevalue("monkeypatch"))
            return target
        _mount(base, "8m" if condition == "read_only" else "4m")
        mounts.append(base)
        target = base / "sub"
        if run:
            shutil.copytree(tiny_gguf_run.dir, target)
        if condition == "read_only":
            subprocess.run(["mount", "-o", "remount,ro", str(base)], check=True)
        else:
            _fill(base)
        return target

    yield make
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], check=False)


@pytest.fixture(autouse=True)
def _nothing_runs(monkeypatch, tmp_path):
    import klrl.cli.commands as C

    def reached(*a, **k):
        raise Reached("the run was started: the path was not refused first")

    monkeypatch.setattr(C, "run_one", reached)
    monkeypatch.setattr(C, "run_sweep", reached)
    monkeypatch.setenv("KLRL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "inputs").mkdir()
    monkeypatch.chdir(tmp_path / "inputs")


def _argv(cmd: str, target: Path, run_dir: Path, tmp_path: Path) -> list[str]:
    inputs = tmp_path / "inputs"
    (inputs / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (inputs / "pairs.jsonl").write_text('{"chosen": "a", "rejected": "b"}\n' * 4)
    return {
        "train": ["train", "--train.out_dir", str(target)],
        "sweep": ["sweep", "kl.beta=0.1,1", "--train.out_dir", str(target)],
        "study": ["study", "--train.out_dir", str(target)],
        "export": ["export", str(run_dir), str(target)],
        "generate": ["generate", str(run_dir), "--prompt", "hi", "--out", str(target)],
        "eval": ["eval", str(run_dir), "--prompts", str(inputs / "p.jsonl"), "--out", str(target)],
        "reward-model": ["reward-model", "--model.path", str(GGUF), "--pairs", str(inputs / "pairs.jsonl"),
                         "--out", str(target)],
        "dpo": ["dpo", "--model.path", str(GGUF), "--pairs", str(inputs / "pairs.jsonl"),
                "--out", str(target)],
        "resume": ["resume", str(target)],
        "report": ["report", str(target)],
    }[cmd]  # fmt: skip


def _tree(d: Path) -> list[str]:
    out = []
    for root, dirs, files in os.walk(d, followlinks=False):
        out += [os.path.join(root, n) for n in sorted(dirs + files)]
    return sorted(out)


@pytest.mark.parametrize("condition", list(CAUSE))
@pytest.mark.parametrize("cmd", WRITERS + READERS)
def test_a_filesystem_error_is_one_line(cmd, condition, place, tiny_gguf_run, tmp_path, capsys):
    target = place(condition, run=cmd in READERS)
    argv = _argv(cmd, target, tiny_gguf_run.dir, tmp_path)
    before = _tree(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        klrl_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (cmd, condition, err)
    line = err[0]
    named = str(target)[:60] if condition != "loop" else str(target.parent)
    assert named in line or named.replace(str(tmp_path) + "/", "") in line, (cmd, condition, line)
    assert CAUSE[condition].lower() in line.lower(), (cmd, condition, line)
    assert _tree(tmp_path) == before  # nothing half-written, no empty directory left behind
