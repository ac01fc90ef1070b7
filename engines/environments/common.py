"""What the shipped text environments share: the registry, action parsing, ``info`` and a shortest-path search.

Nothing here holds random state: every environment owns a ``random.Random`` seeded at ``reset(seed)``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Hashable, Iterable

from engines.registry import Registry

ENVIRONMENTS: Registry[type] = Registry("environment")
register = ENVIRONMENTS.register

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
"""Grid moves as ``(row, column)`` steps; rows grow downwards, so ``U`` is one row up."""


def parse_choice(action_text: Any, choices: Iterable[str]) -> str | None:
    """The upper-case choice that ``action_text`` names, ignoring surrounding whitespace and case; else ``None``.

    ``" r\\n"`` names ``R``; ``"right"``, ``"R R"`` and non-strings name nothing.
    """
    if not isinstance(action_text, str):
        return None
    text = action_text.strip().upper()
    return text if text in choices else None


def step_info(*, valid: bool = True, success: bool = False, **metrics: float) -> dict[str, Any]:
    """The ``info`` every step and reset returns: ``action_is_valid``, ``success`` and float ``metrics``."""
    return {"action_is_valid": valid, "success": success, "metrics": {k: float(v) for k, v in metrics.items()}}


def check_running(env: Any, done: bool, started: bool) -> None:
    """Refuse ``step`` before the first ``reset`` or after the episode ended (a caller's bug, not bad text)."""
    name = type(env).__name__
    if not started:
        raise RuntimeError(f"{name}.step before reset: call reset(seed) first")
    if done:
        raise RuntimeError(f"{name}.step after the episode ended: call reset(seed) for a new one")


def shortest_moves(
    start: Hashable,
    successors: Callable[[Hashable], Iterable[tuple[str, Hashable]]],
    is_goal: Callable[[Hashable], bool],
) -> list[str] | None:
    """Breadth-first search: the moves of a shortest path from ``start`` to a goal state, ``None`` if none.

    ``successors(state)`` yields ``(move, next_state)``; ties go to the move yielded first, so the answer
    is deterministic.
    """
    parents: dict[Hashable, tuple[Hashable, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if is_goal(state):
            moves = []
            while parents[state] is not None:
                state, move = parents[state]
                moves.append(move)
            return moves[::-1]
        for move, nxt in successors(state):
            if nxt not in parents:
                parents[nxt] = (state, move)
                queue.append(nxt)
    return None
