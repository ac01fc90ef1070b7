"""Reward functions, registered by name.

A reward function is a batched callable ``(prompts, completions, **columns) -> list[float]``: ``prompts``
and ``completions`` are ``list[str]`` of the same length, and every dataset column other than ``prompt``
(``answer`` among them, see ``engines.data.prompts``) arrives as a keyword list aligned with them.
It returns one float per completion. Register one with ``@REWARDS.register("name")``; a duplicate name
is an error and ``get_reward`` of an unknown name lists the registered ones.
"""

from __future__ import annotations

from typing import Any, Protocol

from engines.registry import Registry


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]: ...


REWARDS: Registry[RewardFn] = Registry("reward function")


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``; ``KeyError`` listing the names otherwise."""
    return REWARDS.get(name)


def reward_names() -> list[str]:
    """Registered reward names, sorted."""
    return REWARDS.names()


# Imported for its @REWARDS.register side effect; after REWARDS exists, since it imports REWARDS.
from engines.rewards import math as _math  # noqa: E402,F401
