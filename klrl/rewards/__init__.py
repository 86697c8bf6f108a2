"""Rewards on text: host-side reward functions behind one callback, and built-in text rewards."""

from klrl.rewards.host import (
    HostReward,
    RewardFunctionError,
    RewardLoadError,
    load_reward_fn,
    make_host_reward,
    parse_specs,
)
from klrl.rewards.text import get

__all__ = [
    "HostReward",
    "RewardFunctionError",
    "RewardLoadError",
    "get",
    "load_reward_fn",
    "make_host_reward",
    "parse_specs",
]
