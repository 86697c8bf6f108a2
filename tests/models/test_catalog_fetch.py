"""A Hub name not in the local cache is fetched with huggingface_hub (issue 48), tested against a Hub
served on 127.0.0.1 (``HF_ENDPOINT``; no internet): its model-info, tree and resolve routes, as
huggingface_hub calls them, over the files of ``tests/data/tiny_llama``. Each case runs in a fresh
process, since huggingface_hub reads ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` when it is imported."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = (
    ROOT / "tests" / "data" / "tiny_llama"
)  # config.json, generation_config.json, model.safetensors, golden.npz
SHA = "fedcba9876543210fedcba9876543210fedcba98"


class _Hub(http.server.BaseHTTPRequestHandler):
    """The Hub's routes huggingface_hub's ``snapshot_download`` reads, for one repository."""

    repo = "Org/Tiny"
    files = {p.name: p.read_bytes() for p in TINY.iterdir() if p.is_file()}
    fetched: list[str] = []

    def log_message(self, *args):  # (quiet)
        pass

    def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
        self.send_response(code)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_HEAD(self):  # noqa: N802
        self.do_GET(head=True)

    def do_GET(self, head: bool = False):  # noqa: N802
        path, js = self.path.split("?")[0], {"Content-Type": "application/json"}
        if path.startswith(f"/api/models/{self.repo}/tree/"):
            tree = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for f, d in self.files.items()]  # fmt: skip
            return self._send(200, json.dumps(tree).encode(), js, head)
        if path == f"/api/models/{self.repo}/revision/main":
            info = {"id": self.repo, "sha": SHA, "siblings": [{"rfilename": f} for f in self.files]}
            return self._send(200, json.dumps(info).encode(), js, head)
        pre = f"/{self.repo}/resolve/{SHA}/"
        if path.startswith(pre) and path[len(pre) :] in self.files:
            data = self.files[path[len(pre) :]]
            if not head:
                self.fetched.append(path[len(pre) :])
            return self._send(
                200, data, {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, head
            )
        self._send(
            404,
            b"{}",
            {"X-Error-Code": "RepoNotFound" if path.startswith("/api/") else "EntryNotFound"},
            head,
        )


@pytest.fixture(scope="module")
def endpoint():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


RESOLVE = """
import sys
from klrl.config import ConfigError
from klrl.models.catalog import resolve_model_path
try:
    print(resolve_model_path(sys.argv[1], "model.path", lambda line: print("LOG", line)))
except ConfigError as e:
    print("ERROR", e)
"""


def _resolve(name: str, cache: Path, endpoint: str, **env: str) -> list[str]:
    e = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # (conftest: offline)
    quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    e.update(PYTHONPATH=str(ROOT), HF_HUB_CACHE=str(cache), HF_ENDPOINT=endpoint, **quiet, **env)
    r = subprocess.run(
        [sys.executable, "-c", RESOLVE, name], env=e, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


def test_a_hub_name_not_cached_is_fetched_from_the_endpoint(endpoint, tmp_path):
    """Downloaded into the cache as huggingface_hub lays it out (the weights and the json files, not the
    .npz), resolved to the snapshot of its revision (what the run's config.json records), and loaded;
    the second time it is read from the cache without a request."""
    from klrl.models.pretrained import from_pretrained

    cache = tmp_path / "hub"
    _Hub.fetched.clear()
    out = _resolve("Org/Tiny", cache, endpoint)
    snap = cache / "models--Org--Tiny" / "snapshots" / SHA
    assert (
        out[0] == f"LOG model.path: Org/Tiny: fetching it from {endpoint} into {cache} (huggingface_hub) ..."
    )
    assert out[1] == f"LOG model.path: Org/Tiny: fetched revision {SHA} to {snap}"
    assert out[2] == str(snap) and (cache / "models--Org--Tiny" / "refs" / "main").read_text() == SHA
    assert sorted(_Hub.fetched) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not (snap / "golden.npz").exists()
    assert (snap / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()
    model, params, _ = from_pretrained(str(snap))
    assert type(model).__name__ == "Llama"
    _Hub.fetched.clear()
    assert _resolve("Org/Tiny", cache, endpoint) == [str(snap)] and _Hub.fetched == []  # cached now


def test_offline_missing_or_unreachable_is_one_line_naming_the_command(endpoint, tmp_path):
    cache = tmp_path / "hub"
    (line,) = _resolve("Org/Tiny", cache, endpoint, HF_HUB_OFFLINE="1")
    assert line.startswith(
        "ERROR model.path: Org/Tiny: no such file or directory, and not in the local Hugging"
    )
    assert "offline (HF_HUB_OFFLINE=1), so klrl fetches nothing: `hf download Org/Tiny`" in line
    assert not (cache / "models--Org--Tiny").exists()
    out = _resolve("Org/Missing", cache, endpoint)
    assert out[-1].startswith("ERROR model.path: Org/Missing: no such file or directory") and len(out) == 2
    assert f"the Hub at {endpoint} has no model Org/Missing you may read (not there;" in out[-1]
    dead = "http://127.0.0.1:9"  # (discard port: nothing listens)
    out = _resolve("Org/Tiny", cache, dead)
    assert out[-1].startswith("ERROR ") and f"fetching it from {dead} failed (" in out[-1]
    fetch = "`hf download Org/Tiny` (or `huggingface-cli download Org/Tiny`) fetches it into the cache"
    assert out[-1].endswith(f"{fetch}; `klrl models` lists the models klrl can see")


def test_without_huggingface_hub_it_is_one_line_naming_the_extra(endpoint, tmp_path):
    script = "import sys; sys.modules['huggingface_hub'] = None\n" + RESOLVE
    e = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    e.update(PYTHONPATH=str(ROOT), HF_HUB_CACHE=str(tmp_path), HF_ENDPOINT=endpoint)
    r = subprocess.run([sys.executable, "-c", script, "Org/Tiny"], env=e, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    (line,) = r.stdout.splitlines()
    assert "fetching it needs huggingface_hub (pip install 'klrl[hub]'), or `hf download Org/Tiny`" in line
