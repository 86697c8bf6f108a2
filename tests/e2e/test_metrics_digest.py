"""The testbed's metrics after 5 iterations are those recorded (``tests/data/digest.json``, see
``tests/digest_run.py`` for its history): single runs (three training modes), a sweep of 4, on 1
device and on 4 (forced host) devices, also as 2 sweep groups x 2 data devices.

Tolerance: ``rtol = 1e-3``, ``atol = 1e-4`` per value. Running the same program on 1 and on 4 devices
(other reduction orders) moves the values by at most 1.4e-4 relative (measured on the recording), so
the tolerance is 7x what rounding does and far below what a change of the maths does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import xla_flags

HERE = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((HERE / "data" / "digest.json").read_text())


def _digests(cache: str, n_dev: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), XLA_FLAGS=xla_flags(n_dev))
    out = subprocess.run(
        [sys.executable, str(HERE / "digest_run.py"), cache],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("digest-cache"))


@pytest.mark.parametrize("n_dev", [1, 4])
def test_metrics_digest_unchanged(cache, n_dev):
    got = _digests(cache, n_dev)
    want = {k: v for k, v in GOLDEN.items() if k.endswith(f"_{n_dev}dev") or (n_dev == 4 and "2x2" in k)}
    assert len(want) >= 2
    assert sorted(got) == sorted(want)
    for case, runs in want.items():
        runs = runs if isinstance(runs, list) else [runs]
        mine = got[case] if isinstance(got[case], list) else [got[case]]
        assert len(mine) == len(runs), case
        for i, (a, b) in enumerate(zip(mine, runs, strict=True)):
            # every recorded metric is still there (metrics added since are not recorded)
            assert not set(b) - set(a), f"{case}[{i}]: recorded metrics missing: {sorted(set(b) - set(a))}"
            for k in b:
                np.testing.assert_allclose(
                    a[k], b[k], rtol=1e-3, atol=1e-4, equal_nan=True, err_msg=f"{case}[{i}] {k}"
                )
