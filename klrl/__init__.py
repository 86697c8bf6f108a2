"""klrl: PPO with a KL penalty in JAX, with beta in the train state.

One iteration (rollout -> scoring -> KL shaping -> advantages -> PPO epochs x
minibatches -> beta controller) is one jitted function ``step(state, env)``.

The public names are imported on first use (PEP 562: :func:`__getattr__`), so that ``import klrl`` (and
the command line's ``klrl --help``, :mod:`klrl.cli`) does not import jax; ``klrl.X`` is the object it
always was (:data:`_NAMES`: where each one lives).
"""

import importlib
import importlib.util

__version__ = "0.1.0"

_CONFIGS = ("ConfigError", "ControllerConfig", "KLConfig", "ModelConfig", "OptimConfig", "PPOConfig",
            "RunConfig", "SamplingConfig", "TaskConfig", "TrainConfig")  # fmt: skip
# public name -> (module, attribute in it; None: the module itself)
_NAMES = {
    "advantages": ("klrl.algo.advantages", None),
    "control": ("klrl.algo.control", None),
    "kl": ("klrl.algo.kl", None),
    "losses": ("klrl.algo.losses", None),
    "shaping": ("klrl.algo.shaping", None),
    "plots": ("klrl.analysis.plots", None),  # matplotlib: about a second at import
    "tasks": ("klrl.tasks", None),
    "Controller": ("klrl.algo.control", "Controller"),
    "ControllerState": ("klrl.algo.control", "ControllerState"),
    "write_report": ("klrl.analysis.report", "write_report"),
    "hook": ("klrl.loop.user", "hook"),  # klrl.hook(fn, every=N), Levanter's add_hook
    "every": ("klrl.loop.user", "every"),  # klrl.every(N)(fn), @klrl.every(N)
    "RunResult": ("klrl.analysis.results", "RunResult"),
    "load_run": ("klrl.analysis.results", "load_run"),
    "load_sweep": ("klrl.analysis.results", "load_sweep"),
    "run": ("klrl.api", "run"),
    "sweep": ("klrl.api", "sweep"),
    "dpo": ("klrl.api", "dpo"),
    "DPOConfig": ("klrl.config.dpo", "DPOConfig"),
    "DPOResult": ("klrl.loop.dpo", "DPOResult"),
    **{n: ("klrl.config", n) for n in _CONFIGS},
    "samples": ("klrl.io.samples", "samples"),  # the function (reads samples.jsonl back)
    "GPT": ("klrl.models.gpt", "GPT"),
    "Rollout": ("klrl.models.rollout", "Rollout"),
    "generate": ("klrl.models.rollout", "generate"),
    "RewardModel": ("klrl.rewards.model", "RewardModel"),
    "load_reward_model": ("klrl.rewards.model", "load_reward_model"),
    "Phases": ("klrl.step.train", "Phases"),
    "Train": ("klrl.step.train", "Train"),
    "TrainState": ("klrl.step.train", "TrainState"),
    "make_train": ("klrl.step.train", "make_train"),
}


def __getattr__(name: str):
    """``klrl.NAME``: imported on first use, then kept in the module (the next lookup is a plain one).
    A sub-module or package of klrl (``klrl.config``, ``klrl.api``) is imported as ``import klrl.NAME``
    would, as importing the whole API once made them attributes."""
    if name in _NAMES:
        module, attr = _NAMES[name]
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
    elif not name.startswith("_") and importlib.util.find_spec(f"klrl.{name}") is not None:
        value = importlib.import_module(f"klrl.{name}")
    else:
        raise AttributeError(f"module 'klrl' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})


__all__ = [
    "ConfigError",
    "Controller",
    "ControllerConfig",
    "ControllerState",
    "DPOConfig",
    "DPOResult",
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
    "dpo",
    "every",
    "generate",
    "hook",
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
