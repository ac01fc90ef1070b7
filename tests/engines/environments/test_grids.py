"""Corridor-v0 and FrozenLake-v0: hand-worked transcripts from pinned seeds.

A reset observation is the generator's draw for that seed (pinned here, so a change to the generator
shows); every step after it is worked out by hand from the rules in the env's docstring.
"""

from __future__ import annotations

import pytest

from engines.environments import make

PENALTY = -0.1  # the default format_penalty


def run(env, actions):
    """``(observation, reward, terminated, action_is_valid, success)`` after each action."""
    rows = []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert truncated is False
        rows.append((obs, reward, terminated, info["action_is_valid"], info["success"]))
    return rows


def test_corridor_transcript():
    env = make("Corridor-v0")
    obs, info = env.reset(seed=0)
    assert obs == "...A.G"  # seed 0: goal at the right end (cell 5), agent on cell 3
    assert info == {"action_is_valid": True, "success": False, "metrics": {}}
    assert run(env, ["l", "forward", "R", " r\n", "R"]) == [
        ("..A..G", 0.0, False, True, False),  # "l" is L: one cell left
        ("..A..G", PENALTY, False, False, False),  # not an action: penalty, nothing moves
        ("...A.G", 0.0, False, True, False),
        ("....AG", 0.0, False, True, False),  # " r\n" is R
        (".....A", 1.0, True, True, True),  # on the goal: A is drawn over G
    ]


def test_corridor_wall_is_a_valid_no_op():
    env = make("Corridor-v0")
    assert env.reset(seed=1)[0] == "G....A"  # seed 1: goal left, agent on the last cell
    assert run(env, ["R", "L"]) == [("G....A", 0.0, False, True, False), ("G...A.", 0.0, False, True, False)]


def test_corridor_length_option_and_oracle():
    env = make("Corridor-v0", length=3)
    obs, _ = env.reset(seed=0)
    assert len(obs) == 3 and obs.count("G") == 1 and obs.count("A") == 1
    goal, agent = obs.index("G"), obs.index("A")
    assert env.scripted_action() == ("L" if goal < agent else "R")
    with pytest.raises(ValueError, match="length must be at least 2"):
        make("Corridor-v0", length=1)


def test_frozenlake_transcript_to_the_goal():
    env = make("FrozenLake-v0")
    obs, _ = env.reset(seed=0)
    assert obs == "HH..\nP...\n....\n.H.G"  # seed 0: P at (1,0), G at (3,3), holes (0,0) (0,1) (3,1)
    assert run(env, ["L", "d", "x", "R", "R", "R", "D"]) == [
        ("HH..\nP...\n....\n.H.G", 0.0, False, True, False),  # off the grid: stays
        ("HH..\n....\nP...\n.H.G", 0.0, False, True, False),
        ("HH..\n....\nP...\n.H.G", PENALTY, False, False, False),
        ("HH..\n....\n.P..\n.H.G", 0.0, False, True, False),
        ("HH..\n....\n..P.\n.H.G", 0.0, False, True, False),
        ("HH..\n....\n...P\n.H.G", 0.0, False, True, False),
        ("HH..\n....\n....\n.H.P", 1.0, True, True, True),  # the goal
    ]


def test_frozenlake_hole_ends_without_success():
    env = make("FrozenLake-v0")
    env.reset(seed=0)
    # From (1,0): U is the hole at (0,0); P is drawn over it.
    assert run(env, ["U"]) == [("PH..\n....\n....\n.H.G", 0.0, True, True, False)]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("D")


def test_frozenlake_options_and_a_path_always_exists():
    env = make("FrozenLake-v0", size=3, hole_fraction=0.6)
    for seed in range(20):
        rows = env.reset(seed=seed)[0].split("\n")
        assert [len(row) for row in rows] == [3, 3, 3]
        assert env._path() is not None  # maps without a path are drawn again
    with pytest.raises(ValueError, match="hole_fraction"):
        make("FrozenLake-v0", hole_fraction=1.0)


def test_step_before_reset_is_a_caller_error():
    with pytest.raises(RuntimeError, match="before reset"):
        make("Corridor-v0").step("L")


def test_corridor_arrows_point_from_the_agent_to_the_goal():
    env = make("Corridor-v0", arrows=True)
    assert env.reset(seed=0)[0] == "...A>G"  # seed 0: goal at cell 5, agent on cell 3 (as above)
    assert env.step("L")[0] == "..A>>G"
    env = make("Corridor-v0", arrows=True)
    env.reset(seed=0)
    assert [env.step("R")[0] for _ in range(2)] == ["....AG", ".....A"]  # adjacent: no arrow; at the goal
    left = make("Corridor-v0", arrows=True)
    observation = left.reset(seed=next(s for s in range(50) if make("Corridor-v0").reset(seed=s)[0][0] == "G"))[0]
    assert observation.startswith("G") and set(observation[1: observation.index("A")]) <= {"<"}
