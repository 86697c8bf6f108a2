"""experiments/beta_study.ipynb runs top to bottom (nbclient, a real python3 kernel) at tiny sizes set
by a cell injected after its ``parameters`` cell (as papermill does), and is stored without outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "experiments" / "beta_study.ipynb"


def test_notebook_is_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_notebook_runs_at_tiny_sizes(tiny_cfg, tiny_task, cache_dir, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # the tiny config of the other tests: tiny_task pretrained its reference into cache_dir (KLRL_CACHE)
    tiny = tiny_cfg.to_dict()
    overrides = {s: tiny[s] for s in ("model", "sampling", "ppo")}
    overrides["task"] = {k: v for k, v in tiny["task"].items() if k not in ("name", "cache_dir")}
    overrides["train"] = {k: tiny["train"][k] for k in ("batch_size", "devices")}
    params = {
        "ITERATIONS": 3,
        "TASK": "wordclass",
        "BETAS": [0.01],
        "TARGET": 1.0,
        "OUT_DIR": str(tmp_path / "runs"),
        "OVERRIDES": overrides,
    }
    for k, v in {"KLRL_CACHE": cache_dir, "MPLBACKEND": "Agg"}.items():
        monkeypatch.setenv(k, v)  # the kernel inherits the environment of this process
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the parameters cell (tagged, as papermill expects) is followed by one setting the tiny sizes
    (at,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert set(params) <= {ln.split(" = ")[0] for ln in nb.cells[at].source.splitlines() if " = " in ln}
    injected = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(injected, metadata={"tags": ["injected-parameters"]}))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError (with the traceback) on any error
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # the figures were displayed and the report written
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 5
    sweeps = list((tmp_path / "runs").iterdir())
    assert len(sweeps) == 1 and (sweeps[0] / "report.md").is_file()
    assert len(json.loads((sweeps[0] / "sweep.json").read_text())["members"]) == 2
