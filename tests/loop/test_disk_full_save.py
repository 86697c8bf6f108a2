"""A disk that fills during an asynchronous checkpoint save (issue 52, item 3): one line, exit 2, the
last committed checkpoint intact, the partial save's temporary directory removed, and nothing from
orbax or asyncio on the terminal (orbax writes each array in an asyncio task; when the disk fills, the
errors of the tasks no one awaited were logged by asyncio at garbage collection, 241 lines in the
issue)."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "tests" / "data" / "tiny_gguf" / "tiny.gguf"


def _unretrieved(exc: BaseException) -> None:
    """A task that failed with ``exc`` and was never awaited, collected: asyncio logs it."""

    async def write():
        raise exc

    async def main():
        t = asyncio.ensure_future(write())
        await asyncio.sleep(0.01)
        del t

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    gc.collect()


def test_a_failed_writes_unretrieved_errors_are_not_logged(caplog):
    import klrl.io.checkpoint  # noqa: F401  (installs the filter)

    caplog.set_level(logging.ERROR, logger="asyncio")
    _unretrieved(OSError(errno.ENOSPC, "No space left on device"))
    _unretrieved(ValueError("RESOURCE_EXHAUSTED: Error writing local file"))
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    _unretrieved(ValueError("a bug elsewhere"))  # anything else is still logged
    assert [r for r in caplog.records if r.name == "asyncio"], "the filter drops too much"


def test_remove_partial_leaves_the_checkpoints(tmp_path):
    from klrl.io.checkpoint import directory, remove_partial

    d = directory(tmp_path)
    for name in ("1", "2.orbax-checkpoint-tmp-1234", "3.orbax-checkpoint-tmp", "4.incomplete"):
        (d / name).mkdir(parents=True)
        (d / name / "f").write_text("x")
    assert remove_partial(tmp_path) == ["2.orbax-checkpoint-tmp-1234", "3.orbax-checkpoint-tmp"]
    assert sorted(p.name for p in d.iterdir()) == ["1", "4.incomplete"]


@pytest.fixture
def disk(tmp_path):
    """A 1200 KiB tmpfs: the tiny model's first checkpoint (about 790 KiB) fits, the second does not."""
    d = tmp_path / "disk"
    d.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(d)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_disk_that_fills_during_a_save_is_one_line(disk, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), KLRL_CACHE=str(tmp_path / "cache"))
    argv = [sys.executable, "-m", "klrl", "train", "--model.path", str(GGUF), "--data.prompt_len", "16",
            "--data.limit", "8", "--sampling.response_len", "4", "--ppo.epochs", "1",
            "--ppo.minibatches", "2", "--train.batch_size", "4", "--train.iterations", "6",
            "--train.checkpoint_every", "1",
            "--train.out_dir", str(disk), "--train.name", "r", "--train.quiet", "true"]  # fmt: skip
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, (p.returncode, p.stderr[-3000:])
    run = disk / "r"
    assert err[0].startswith(f"error: {run}: disk full (no space left on device)"), err
    ckpts = sorted(q.name for q in (run / "checkpoints").iterdir())
    assert ckpts and all(n.isdigit() for n in ckpts), ckpts  # the partial save's directory is gone
    assert f"the last complete checkpoint, {max(ckpts, key=int)}, is intact" in err[0], err
