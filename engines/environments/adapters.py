"""``gem:<id>`` and ``gym:<id>``: environments from GEM (``pip install gem-llm``) or gymnasium text envs.

Both packages speak this protocol already (``reset(seed=...)``, five-tuple ``step``), so one thin
wrapper fills the ``info`` keys, turns an action outside a gymnasium ``action_space`` into an invalid
action, and keys states by the last observation. Neither package is a dependency: it is imported only
here, when such an id is made. Adapted envs have no ``valid_actions`` or ``scripted_action``.
"""

from __future__ import annotations

import importlib
from typing import Any

from engines.environments.common import step_info

PACKAGES = {"gem": ("gem", "gem-llm"), "gym": ("gymnasium", "gymnasium")}
"""Adapter prefix → (module to import, pip package to install)."""


def make_adapted(env_id: str, *, format_penalty: float = -0.1, **options: Any) -> "TextEnvAdapter":
    """``gem.make(name, **options)`` or ``gymnasium.make(name, **options)`` for ``env_id`` ``gem:name``/``gym:name``."""
    prefix, _, name = env_id.partition(":")
    module_name, package = PACKAGES[prefix]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    if not callable(getattr(module, "make", None)):  # also PyPI's unrelated ``gem`` math library
        raise ModuleNotFoundError(f"environment {env_id!r} needs the {package} package: pip install {package}")
    return TextEnvAdapter(module.make(name, **options), format_penalty=format_penalty, check_space=prefix == "gym")


class TextEnvAdapter:
    """An outside text environment behind this package's interface (``info`` keys, ``close``, ``state_key``)."""

    instructions = ""

    def __init__(self, env: Any, *, format_penalty: float = -0.1, check_space: bool = False) -> None:
        self.env, self.format_penalty = env, format_penalty
        self.space = env.action_space if check_space else None  # gymnasium's Text space, checked before a step
        self.last_observation = ""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        observation, info = self.env.reset(seed=seed)
        self.last_observation = str(observation)
        return self.last_observation, {**step_info(), **info}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action_text, str) or (self.space is not None and not self.space.contains(action_text)):
            return self.last_observation, self.format_penalty, False, False, step_info(valid=False)
        observation, reward, terminated, truncated, info = self.env.step(action_text)
        self.last_observation = str(observation)
        return self.last_observation, float(reward), bool(terminated), bool(truncated), {**step_info(), **info}

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def state_key(self) -> str:
        return self.last_observation
