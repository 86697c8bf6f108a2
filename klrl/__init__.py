"""klrl: PPO with a KL penalty in JAX, with beta in the train state.

One iteration (rollout -> scoring -> KL shaping -> advantages -> PPO epochs x
minibatches -> beta controller) is one jitted function ``step(state, env)``.
"""

import importlib

from klrl import tasks  # noqa: F401  (tasks: registers them)
from klrl.algo import advantages, control, kl, losses, shaping
from klrl.algo.control import Controller, ControllerState
from klrl.analysis.report import write_report
from klrl.analysis.results import RunResult, load_run, load_sweep
from klrl.api import run, sweep
from klrl.config import (
    ConfigError,
    ControllerConfig,
    KLConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    TrainConfig,
)
from klrl.io.samples import samples  # the function (reads samples.jsonl back)
from klrl.models.gpt import GPT
from klrl.models.rollout import Rollout, generate
from klrl.rewards.model import RewardModel, load_reward_model
from klrl.step.train import Phases, Train, TrainState, make_train

__version__ = "0.1.0"


def __getattr__(name: str):
    """``klrl.analysis.plots`` is imported on first use: matplotlib costs about a second at import."""
    if name == "plots":
        return importlib.import_module("klrl.analysis.plots")
    raise AttributeError(f"module 'klrl' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "Controller",
    "ControllerConfig",
    "ControllerState",
    "GPT",
    "KLConfig",
    "ModelConfig",
    "OptimConfig",
    "PPOConfig",
    "Phases",
    "RewardModel",
    "Rollout",
    "RunConfig",
    "RunResult",
    "SamplingConfig",
    "TaskConfig",
    "Train",
    "TrainConfig",
    "TrainState",
    "advantages",
    "control",
    "generate",
    "kl",
    "load_reward_model",
    "load_run",
    "load_sweep",
    "losses",
    "make_train",
    "plots",
    "run",
    "samples",
    "shaping",
    "sweep",
    "write_report",
]
