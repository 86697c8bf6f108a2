"""klrl: PPO with a KL penalty in JAX, with beta in the train state.

One iteration (rollout -> scoring -> KL shaping -> advantages -> PPO epochs x
minibatches -> beta controller) is one jitted function ``step(state, env)``.
"""

from klrl import advantages, control, kl, losses, shaping
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
from klrl.control import Controller, ControllerState
from klrl.model import GPT
from klrl.rollout import Rollout, generate
from klrl.runner import RunResult, load_run, run
from klrl.train import Train, TrainState, make_train

__version__ = "0.1.0"

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
    "load_run",
    "losses",
    "make_train",
    "run",
    "shaping",
]
