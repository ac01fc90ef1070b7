"""Text environments for agentic RL, made by id: ``make("FrozenLake-v0", size=4)``.

The protocol is GEM's (``engines.protocols.Env``): ``reset(seed) -> (observation, info)``,
``step(action_text) -> (observation, reward, terminated, truncated, info)``, ``close()``; ``info``
always holds ``action_is_valid``, ``success`` and ``metrics`` (a dict of floats). The shipped envs, all
pure Python with no downloads, also give:

- ``state_key()``: the GiGPO anchor, one string per env state (identical exactly when the states are;
  a secret drawn from the seed is not part of it, since the envs of one group share their seed);
- ``valid_actions()``: the action texts valid now (the random policy, the warm start);
- ``scripted_action()``: a good action now (the oracle behind the ``scripted`` policy and the tests);
- ``instructions``: one short line for a system message.

Options are keyword-only, each with a default, ``format_penalty`` (-0.1) among them. Every env owns a
``random.Random`` seeded at ``reset(seed)``, so a seed and a list of actions give one transcript, in any
thread. Action text is matched ignoring surrounding whitespace and case; text that names no action never
raises: reward ``format_penalty``, ``action_is_valid=False``, nothing changes, the episode goes on.
Observations are a few characters, for tiny models.

=====================  ==========================================  ==========================================
id                     observation                                 actions
=====================  ==========================================  ==========================================
``Corridor-v0``        ``G...A.``                                  ``L R``
``FrozenLake-v0``      ``P...\\n.H..\\n...H\\n..G.``                  ``U D L R``
``Sokoban-v0``         ``######\\n#.T..#\\n#.B..#\\n#..P.#\\n...``      ``U D L R``
``GuessTheNumber-v0``  ``1-16?``, then ``higher lower correct``     an integer in range
``Bandit-v0``          ``A B C D?``, then ``correct wrong``         ``A B C D``
``Calculator-v0``      ``7*13+4=?``, then a value, ``correct``...   ``<calc>EXPR</calc>``, ``<answer>N</answer>``
=====================  ==========================================  ==========================================

Ids ``gem:<id>`` and ``gym:<id>`` adapt GEM and gymnasium text envs when their package is installed
(``engines.environments.adapters``). Register a new env class with ``@register("Name-v0")``.
"""

from __future__ import annotations

from typing import Any

from engines.environments import dialog, grids, sokoban  # noqa: F401  (registers the shipped envs)
from engines.environments.adapters import PACKAGES, make_adapted
from engines.environments.common import ENVIRONMENTS, register
from engines.protocols import Env

__all__ = ["ENVIRONMENTS", "instructions", "make", "names", "register", "state_key"]


def make(env_id: str, **options: Any) -> Env:
    """A new env ``env_id`` built with ``options``; a one-line error for an unknown id or option."""
    prefix, sep, _ = env_id.partition(":")
    if sep and prefix in PACKAGES:
        return make_adapted(env_id, **options)
    if env_id not in ENVIRONMENTS:
        adapters = ", ".join(f"{p}:<id>" for p in PACKAGES)
        raise KeyError(f"unknown environment {env_id!r}; registered: {', '.join(names())}; adapters: {adapters}")
    ENVIRONMENTS.check_options(env_id, options)
    return ENVIRONMENTS.get(env_id)(**options)


def instructions(env_id: str, **options: Any) -> str | None:
    """The one-line instructions of env ``env_id`` (for a system message); None for an env without any."""
    env = make(env_id, **options)
    try:
        return getattr(env, "instructions", None)
    finally:
        env.close()


def names() -> list[str]:
    """The registered environment ids, sorted (adapter ids are open-ended and not listed)."""
    return ENVIRONMENTS.names()


def state_key(env: Any, observation: str | None = None) -> str:
    """``env.state_key()`` when the env defines it, else its last observation text.

    An env with neither a ``state_key`` method nor a ``last_observation`` attribute needs ``observation``.
    """
    method = getattr(env, "state_key", None)
    if callable(method):
        return method()
    if observation is None:
        observation = getattr(env, "last_observation", None)
    if observation is None:
        raise TypeError(f"{type(env).__name__} has no state_key(): pass the last observation")
    return observation
