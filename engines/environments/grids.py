"""Grid walks: ``Corridor-v0`` (one row, L/R) and a non-slippery ``FrozenLake-v0`` (U/D/L/R).

The observation is the whole board, so it is also the state (``state_key``). A move into a wall or off
the grid is a valid move that leaves the agent in place; text that names no move is invalid: reward
``format_penalty``, the same board back, nothing changes.
"""

from __future__ import annotations

import random
from typing import Any

from engines.environments.common import MOVES, check_running, parse_choice, register, shortest_moves, step_info


@register("Corridor-v0")
class Corridor:
    """A row of ``length`` cells: walk the agent ``A`` to the goal ``G`` at one end.

    Observation: the row, ``.`` for an empty cell, e.g. ``G...A.``; once the agent reaches the goal it
    shows ``A`` there (``A.....``). Actions ``L``, ``R``. ``reset(seed)`` draws the goal's end (left or
    right), then the agent's cell among the others. Reaching ``G``: reward 1.0, terminated, success; any
    other valid move: reward 0.0. The oracle walks towards ``G``: it solves in at most ``length - 1`` steps.

    ``arrows``: the cells between the agent and the goal show the way (``G<<A..``, ``.A>>>G``). The plain row
    tells the two directions apart only by the order of its tokens (``G...A.`` and ``.A...G`` hold the same
    ones), which a tiny untrained model reads poorly; with arrows the tokens themselves differ, and a tiny
    model learns the task by RL in minutes on a CPU (the learning test's setting).
    """

    instructions = "Move A to G. Answer L or R."
    actions = ("L", "R")

    def __init__(self, *, length: int = 6, arrows: bool = False, format_penalty: float = -0.1) -> None:
        if length < 2:
            raise ValueError(f"Corridor-v0: length must be at least 2, got {length}")
        self.length, self.arrows, self.format_penalty = length, arrows, format_penalty
        self._goal = self._agent = -1
        self._done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self._goal = rng.choice((0, self.length - 1))
        self._agent = rng.choice([cell for cell in range(self.length) if cell != self._goal])
        self._done = False
        return self._render(), step_info()

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_running(self, self._done, started=self._goal >= 0)
        move = parse_choice(action_text, self.actions)
        if move is None:
            return self._render(), self.format_penalty, False, False, step_info(valid=False)
        self._agent = min(max(self._agent + MOVES[move][1], 0), self.length - 1)
        self._done = self._agent == self._goal
        return self._render(), float(self._done), self._done, False, step_info(success=self._done)

    def close(self) -> None:
        """Nothing to release."""

    def state_key(self) -> str:
        return self._render()

    def valid_actions(self) -> list[str]:
        return list(self.actions)

    def scripted_action(self) -> str:
        return "L" if self._goal < self._agent else "R"

    def _render(self) -> str:
        cells = ["."] * self.length
        if self.arrows:
            lo, hi = sorted((self._agent, self._goal))
            cells[lo + 1: hi] = ["<" if self._goal < self._agent else ">"] * (hi - lo - 1)
        cells[self._goal] = "G"
        cells[self._agent] = "A"
        return "".join(cells)


@register("FrozenLake-v0")
class FrozenLake:
    """A non-slippery frozen lake on a ``size`` x ``size`` grid: walk ``P`` to the goal ``G``, avoiding holes.

    Observation: ``size`` rows joined with ``\\n``; ``.`` ice, ``H`` hole, ``G`` goal, ``P`` the player
    (drawn over the cell it stands on), e.g. ``P...\\n.H..\\n...H\\n..G.``. Actions ``U D L R``.
    ``reset(seed)`` draws the start and goal cells (distinct), then each other cell is a hole with
    probability ``hole_fraction``; a map with no path from start to goal is drawn again. Goal: reward 1.0,
    terminated, success; hole: reward 0.0, terminated, no success; other valid moves: reward 0.0. The
    oracle follows a shortest path (ties: U before D before L before R): at most ``size**2 - 1`` steps.
    """

    instructions = "Move P to G, avoid H. Answer U, D, L or R."
    actions = ("U", "D", "L", "R")

    def __init__(self, *, size: int = 4, hole_fraction: float = 0.2, format_penalty: float = -0.1) -> None:
        if size < 2:
            raise ValueError(f"FrozenLake-v0: size must be at least 2, got {size}")
        if not 0.0 <= hole_fraction < 1.0:
            raise ValueError(f"FrozenLake-v0: hole_fraction must be in [0, 1), got {hole_fraction}")
        self.size, self.hole_fraction, self.format_penalty = size, hole_fraction, format_penalty
        self._holes: frozenset[tuple[int, int]] = frozenset()
        self._goal = self._player = (-1, -1)
        self._done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        cells = [(row, col) for row in range(self.size) for col in range(self.size)]
        while True:
            start, self._goal = rng.sample(cells, 2)
            self._holes = frozenset(c for c in cells if c not in (start, self._goal) and rng.random() < self.hole_fraction)
            self._player = start
            if self._path() is not None:
                break
        self._done = False
        return self._render(), step_info()

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_running(self, self._done, started=self._goal[0] >= 0)
        move = parse_choice(action_text, self.actions)
        if move is None:
            return self._render(), self.format_penalty, False, False, step_info(valid=False)
        self._player = self._moved(self._player, move)
        success = self._player == self._goal
        self._done = success or self._player in self._holes
        return self._render(), float(success), self._done, False, step_info(success=success)

    def close(self) -> None:
        """Nothing to release."""

    def state_key(self) -> str:
        return self._render()

    def valid_actions(self) -> list[str]:
        return list(self.actions)

    def scripted_action(self) -> str:
        path = self._path()
        return path[0] if path else self.actions[0]

    def _moved(self, cell: tuple[int, int], move: str) -> tuple[int, int]:
        row, col = cell[0] + MOVES[move][0], cell[1] + MOVES[move][1]
        return (row, col) if 0 <= row < self.size and 0 <= col < self.size else cell

    def _path(self) -> list[str] | None:
        """A shortest list of moves from the player to the goal over ice, ``None`` when holes cut it off."""

        def successors(cell):
            for move in self.actions:
                nxt = self._moved(cell, move)
                if nxt not in self._holes:
                    yield move, nxt

        return shortest_moves(self._player, successors, lambda cell: cell == self._goal)

    def _render(self) -> str:
        rows = [["."] * self.size for _ in range(self.size)]
        for row, col in self._holes:
            rows[row][col] = "H"
        rows[self._goal[0]][self._goal[1]] = "G"
        rows[self._player[0]][self._player[1]] = "P"
        return "\n".join("".join(row) for row in rows)
