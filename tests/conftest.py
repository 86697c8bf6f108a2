"""Shared fixtures: a tiny run configuration and its task, built (pretrained) once per session.

``KLRL_CACHE`` points at a session temporary directory for the whole session, so no test
(nor any subprocess a test starts) writes to ``~/.cache``.
"""

from __future__ import annotations

import os

import pytest


def tiny_config(cache_dir: str = ""):
    """A tiny but complete RunConfig: fast to pretrain and to compile."""
    from klrl.config import RunConfig

    return RunConfig().replace(
        model={"n_layers": 1, "d_model": 32, "n_heads": 2},
        task={
            "name": "wordclass",
            "pretrain_steps": 100,
            "pretrain_batch": 32,
            "pretrain_len": 16,
            "prompt_len": 6,
            "prompt_pool": 256,
            "cache_dir": cache_dir,
        },
        sampling={"response_len": 8},
        train={"batch_size": 16, "iterations": 3, "devices": 1, "quiet": True},
        ppo={"minibatches": 2, "epochs": 2},
    )


@pytest.fixture(scope="session", autouse=True)
def klrl_cache_env(tmp_path_factory):
    """Every cache lookup of the session (and of its subprocesses) lands in a temporary directory."""
    path = str(tmp_path_factory.mktemp("klrl-cache-env"))
    old = os.environ.get("KLRL_CACHE")
    os.environ["KLRL_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("KLRL_CACHE", None)
    else:
        os.environ["KLRL_CACHE"] = old


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("klrl-cache"))


@pytest.fixture(scope="session")
def tiny_cfg(cache_dir):
    return tiny_config(cache_dir)


@pytest.fixture(scope="session")
def tiny_task(tiny_cfg):
    """The wordclass task of ``tiny_cfg``: its reference is pretrained here, once per session."""
    from klrl.tasks.wordclass import make_task

    return make_task(tiny_cfg)
