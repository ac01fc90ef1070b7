"""Sokoban-v0: hand-worked transcripts from pinned seeds (the reset level is the generator's draw)."""

from __future__ import annotations

import pytest

from engines.environments import make

LEVEL_6 = "######\n#..T.#\n#.PB.#\n#....#\n#....#\n######"  # seed 6: P (2,2), B (2,3), T (1,3)


def test_push_onto_the_target():
    env = make("Sokoban-v0")
    obs, info = env.reset(seed=6)
    assert obs == LEVEL_6 and info["metrics"] == {"boxes_on_target": 0.0}
    # D, R: walk under the box to (3,3); U pushes it from (2,3) up onto the target (1,3).
    steps = [env.step(a) for a in ["D", "push", "r", "U"]]
    assert [(s[0], s[1], s[2], s[4]["action_is_valid"]) for s in steps] == [
        ("######\n#..T.#\n#..B.#\n#.P..#\n#....#\n######", 0.0, False, True),
        ("######\n#..T.#\n#..B.#\n#.P..#\n#....#\n######", -0.1, False, False),
        ("######\n#..T.#\n#..B.#\n#..P.#\n#....#\n######", 0.0, False, True),
        ("######\n#..X.#\n#..P.#\n#....#\n#....#\n######", 1.0, True, True),  # X: box on target
    ]
    assert steps[-1][4]["success"] and steps[-1][4]["metrics"] == {"boxes_on_target": 1.0}


def test_blocked_pushes_step_penalty_and_a_stuck_oracle():
    env = make("Sokoban-v0", step_penalty=-0.01)
    env.reset(seed=6)
    # R pushes the box to (2,4) against the right wall; R again cannot push it into the wall: no change.
    # U puts the player on the target (1,3): drawn S. The box is stuck on the wall column, off target.
    steps = [env.step(a) for a in ["R", "R", "U"]]
    assert [(s[0], s[1], s[2]) for s in steps] == [
        ("######\n#..T.#\n#..PB#\n#....#\n#....#\n######", -0.01, False),
        ("######\n#..T.#\n#..PB#\n#....#\n#....#\n######", -0.01, False),
        ("######\n#..S.#\n#...B#\n#....#\n#....#\n######", -0.01, False),
    ]
    assert env.scripted_action() == "U"  # no solution from a dead state: the documented fallback


def test_two_boxes():
    env = make("Sokoban-v0", num_boxes=2, scramble_steps=20)
    # seed 5: P (2,3), B (2,4), a box already on target (3,1), free target (3,4)
    assert env.reset(seed=5)[0] == "######\n#....#\n#..PB#\n#X..T#\n#....#\n######"
    # U, R: to (1,4) above the box; D pushes it onto (3,4): both boxes on targets.
    obs, reward, terminated, _, info = [env.step(a) for a in ["U", "R", "D"]][-1]
    assert obs == "######\n#....#\n#...P#\n#X..X#\n#....#\n######"
    assert (reward, terminated, info["success"], info["metrics"]) == (1.0, True, True, {"boxes_on_target": 2.0})


def test_oracle_follows_a_shortest_solution():
    env = make("Sokoban-v0")
    env.reset(seed=6)
    plan = []
    while not (plan and plan[-1][1]):
        action = env.scripted_action()
        plan.append((action, env.step(action)[2]))
    assert [a for a, _ in plan] == ["D", "R", "U"]  # the 3-move solution worked out above (U before D before L, R)


def test_options_are_checked():
    with pytest.raises(ValueError, match="Sokoban-v0: needs size >= 4"):
        make("Sokoban-v0", size=4, num_boxes=3)  # a 2x2 room cannot hold 3 boxes and the player with room to move


def test_a_room_too_small_to_pull_a_box_says_so():
    # A 2x2 inner room: stepping away from a box always walks into the wall, so no box ever leaves its target.
    with pytest.raises(RuntimeError, match="no unsolved level in 1000 draws; use a larger size"):
        make("Sokoban-v0", size=4).reset(seed=0)
