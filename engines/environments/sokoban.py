"""``Sokoban-v0``: a small room, push every box onto a target; levels come from reverse play, so all are solvable."""

from __future__ import annotations

import random
from typing import Any, Iterator

from engines.environments.common import MOVES, check_running, parse_choice, register, shortest_moves, step_info

Cell = tuple[int, int]
State = tuple[Cell, frozenset]  # (player, boxes)

GENERATION_ATTEMPTS = 1000
"""Levels drawn per ``reset`` before giving up (only rooms too small to move a box in run out)."""


@register("Sokoban-v0")
class Sokoban:
    """Sokoban in a ``size`` x ``size`` room walled on its border, with ``num_boxes`` boxes and as many targets.

    Observation: ``size`` rows joined with ``\\n``: ``#`` wall, ``.`` floor, ``T`` target, ``B`` box,
    ``X`` box on a target, ``P`` player, ``S`` player on a target; e.g. ``######\\n#.T..#\\n#.B..#\\n#..P.#\\n
    #....#\\n######``. Actions ``U D L R``; walking into a wall, or pushing a box into a wall or another box,
    is a valid move that changes nothing.

    ``reset(seed)`` draws distinct inner cells for the targets and the player, puts every box on its
    target, then plays ``scramble_steps`` random reverse moves: the player steps to a free neighbour and
    pulls along a box standing right behind it. Played forwards, those moves solve the level, so every
    level is solvable; a level that ends solved is drawn again. Reward: 1.0 on the move that puts the
    last box on a target (terminated, success), ``step_penalty`` on every other valid move. The oracle
    follows a breadth-first shortest solution: it solves within ``scramble_steps`` moves (the reverse
    play is one solution).
    """

    instructions = "Push every B onto a T. Answer U, D, L or R."
    actions = ("U", "D", "L", "R")

    def __init__(
        self,
        *,
        size: int = 6,
        num_boxes: int = 1,
        scramble_steps: int = 8,
        step_penalty: float = 0.0,
        format_penalty: float = -0.1,
    ) -> None:
        if size < 4 or num_boxes < 1 or num_boxes + 2 > (size - 2) ** 2 or scramble_steps < 1:
            raise ValueError(
                f"Sokoban-v0: needs size >= 4, num_boxes >= 1, num_boxes + 2 <= (size - 2)**2 and scramble_steps"
                f" >= 1; got size={size}, num_boxes={num_boxes}, scramble_steps={scramble_steps}"
            )
        self.size, self.num_boxes, self.scramble_steps = size, num_boxes, scramble_steps
        self.step_penalty, self.format_penalty = step_penalty, format_penalty
        self._targets: frozenset[Cell] = frozenset()
        self._state: State = ((-1, -1), frozenset())
        self._done = False
        self._plan: dict[State, str] = {}  # the oracle's next move along the last solution it found

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        inner = [(row, col) for row in range(1, self.size - 1) for col in range(1, self.size - 1)]
        for _ in range(GENERATION_ATTEMPTS):
            *targets, player = rng.sample(inner, self.num_boxes + 1)
            boxes = set(targets)
            for _ in range(self.scramble_steps):
                d_row, d_col = MOVES[rng.choice(self.actions)]
                nxt, behind = (player[0] + d_row, player[1] + d_col), (player[0] - d_row, player[1] - d_col)
                if self._is_wall(nxt) or nxt in boxes:
                    continue
                if behind in boxes:
                    boxes.remove(behind)
                    boxes.add(player)
                player = nxt
            if boxes != set(targets):
                break
        else:
            raise RuntimeError(f"Sokoban-v0: no unsolved level in {GENERATION_ATTEMPTS} draws; use a larger size")
        self._targets, self._state = frozenset(targets), (player, frozenset(boxes))
        self._done = False
        self._plan = {}
        return self._render(), step_info(**self._metrics())

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_running(self, self._done, started=bool(self._targets))
        move = parse_choice(action_text, self.actions)
        if move is None:
            return self._render(), self.format_penalty, False, False, step_info(valid=False, **self._metrics())
        self._state = self._moved(self._state, move)
        self._done = self._state[1] == self._targets
        reward = 1.0 if self._done else self.step_penalty
        return self._render(), reward, self._done, False, step_info(success=self._done, **self._metrics())

    def close(self) -> None:
        """Nothing to release."""

    def state_key(self) -> str:
        return self._render()

    def valid_actions(self) -> list[str]:
        return list(self.actions)

    def scripted_action(self) -> str:
        """The first move of a shortest solution from here (``U`` when a box is stuck and none exists)."""
        if self._state not in self._plan:
            moves = shortest_moves(self._state, self._successors, lambda state: state[1] == self._targets)
            state = self._state
            for move in moves or []:
                self._plan[state] = move
                state = self._moved(state, move)
        return self._plan.get(self._state, self.actions[0])

    def _is_wall(self, cell: Cell) -> bool:
        return not (0 < cell[0] < self.size - 1 and 0 < cell[1] < self.size - 1)

    def _moved(self, state: State, move: str) -> State:
        (row, col), boxes = state
        d_row, d_col = MOVES[move]
        nxt = (row + d_row, col + d_col)
        if self._is_wall(nxt):
            return state
        if nxt in boxes:
            beyond = (nxt[0] + d_row, nxt[1] + d_col)
            if self._is_wall(beyond) or beyond in boxes:
                return state
            boxes = boxes - {nxt} | {beyond}
        return nxt, boxes

    def _successors(self, state: State) -> Iterator[tuple[str, State]]:
        for move in self.actions:
            nxt = self._moved(state, move)
            if nxt != state:
                yield move, nxt

    def _metrics(self) -> dict[str, float]:
        return {"boxes_on_target": len(self._state[1] & self._targets)}

    def _render(self) -> str:
        player, boxes = self._state
        rows = [["#" if self._is_wall((r, c)) else "." for c in range(self.size)] for r in range(self.size)]
        for row, col in self._targets:
            rows[row][col] = "T"
        for row, col in boxes:
            rows[row][col] = "X" if (row, col) in self._targets else "B"
        rows[player[0]][player[1]] = "S" if player in self._targets else "P"
        return "\n".join("".join(row) for row in rows)
