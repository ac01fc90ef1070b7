"""Reward functions, registered by name.

A reward function is a batched callable ``(prompts, completions, **columns, **options) -> list[float]``
(it may be ``async def``): ``prompts`` and ``completions`` are ``list[str]`` of the same length, every
dataset column other than ``prompt`` (``answer`` among them, see ``engines.data.prompts``) arrives as a
keyword list aligned with them, and ``options`` are the scalar keyword-only settings a domain's config
gives it (``reward_options``; each must have a default). It returns one float per completion, or a
``Scored`` that also counts events (``timeout``, ``sandbox_violation``, …) for the metrics.

Register one with ``@REWARDS.register("name")``; a duplicate name is an error and ``get_reward`` of an
unknown name lists the registered ones. A function of your own needs no registration: name it by import
path, ``"package.module:function"``. It is imported where rewards run (the reward workers), so the module
must be importable there: on a local Ray cluster the driver's working directory is on the workers' path;
on a cluster you join, install it or ship it with the job's ``runtime_env``. A reward whose first calls in
a process are slow (parsers built on first use) may also register a warm-up, ``WARM_UPS["name"] = fn``,
which reward workers run when they start, so a run's first steps do not pay it. The scoring runner
(``engines.rewards.runner``) calls a reward on small chunks of samples with a timeout: an exception or a
timeout scores the chunk 0.0 and is counted, so one bad completion or a buggy reward never stops a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from engines.protocols import RewardFn
from engines.registry import DOTTED_PATH, Registry, import_path


@dataclass
class Scored:
    """Rewards plus counted events, e.g. ``Scored([1.0, 0.0], {"timeout": 1})``."""

    rewards: list[float]
    events: dict[str, int] = field(default_factory=dict)


REWARDS: Registry[RewardFn] = Registry("reward function")


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``, or the one at import path ``name``
    (``"package.module:function"``, imported now); ``KeyError`` listing the registered names for an
    unknown name, ``ValueError`` naming the path for one that does not import or is not callable."""
    if ":" not in name:
        return REWARDS.get(name)
    if not DOTTED_PATH.fullmatch(name):
        raise ValueError(f"reward {name!r} is not 'package.module:function'")
    try:
        fn = import_path(name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward {name!r} does not import ({type(error).__name__}: {error}); a reward by path is "
                         "'package.module:function', importable from the working directory or an installed package") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not a function: a reward by path is 'package.module:function'")
    return fn


def is_reward(name: str) -> bool:
    """Whether ``name`` is a registered reward or an import path (``"package.module:function"``), which
    ``get_reward`` checks when it imports it."""
    return name in REWARDS or ":" in name


def reward_names() -> list[str]:
    """Registered reward names, sorted."""
    return REWARDS.names()


WARM_UPS: dict[str, Callable[[], object]] = {}
"""Reward name -> a call that does the reward's first-use work in this process (see the module docstring)."""


def warm_up(names: Iterable[str]) -> list[str]:
    """Run the warm-up of each reward in ``names`` that has one; returns the names warmed.
    ``KeyError`` (listing the registered ones) for a name that is not a registered reward."""
    warmed = []
    for name in dict.fromkeys(names):
        get_reward(name)
        if name in WARM_UPS:
            WARM_UPS[name]()
            warmed.append(name)
    return warmed


# Imported for its @REWARDS.register side effect; after REWARDS exists, since it imports REWARDS.
from engines.rewards import math as _math  # noqa: E402,F401
from engines.rewards import code as _code  # noqa: E402,F401
from engines.rewards import judge as _judge  # noqa: E402,F401
from engines.rewards import format as _format  # noqa: E402,F401
from engines.rewards import ifeval as _ifeval  # noqa: E402,F401
from engines.rewards import reasoning_gym as _reasoning_gym  # noqa: E402,F401
