"""benchmarks/load.py runs and reports what it promises (on the tiny GGUF; not how fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_benchmark_smoke():
    args = [
        "--path",
        "tests/data/tiny_gguf/tiny.gguf",
        "--batch",
        "2",
        "--len",
        "8",
        "--decode",
        "3",
        "--n",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, "benchmarks/load.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n_params"] == 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32) + 2 * 256 * 32 + 32
    for k in ("load_s", "peak_rss_mb", "forward_compile_s_fp32", "forward_s_bf16"):
        assert out[k] > 0, k
    assert out["peak_rss_mb"] >= out["runtime_rss_mb"] and "rss_over_params" in out
    assert out["decode_ms_per_token_fp32"] > 0 and out["batch"] == [2, 8]
