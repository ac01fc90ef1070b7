"""Properties every shipped environment keeps: bad text never raises and changes nothing, seeds decide
the transcript (also with 16 envs stepping in threads), and the oracle solves within its documented bound."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engines.environments import make, names

GARBAGE = ["", "   \n", "hello", "🙂🙂", "x" * 10_000, "L R", "UU", "<calc>2**8</calc>", "<answer>abc</answer>",
           "9" * 10_000, "-", "\x00"]

SOLVED_WITHIN = {  # (options, steps): the bound each env's docstring gives for its oracle
    "Corridor-v0": ({}, 5),  # length - 1
    "FrozenLake-v0": ({}, 15),  # size**2 - 1
    "Sokoban-v0": ({}, 8),  # scramble_steps
    "GuessTheNumber-v0": ({}, 5),  # ceil(log2(16 + 1))
    "Calculator-v0": ({}, 2),  # one calc, one answer
    "Bandit-v0": ({}, 1),
}


def test_every_env_is_covered():
    assert sorted(SOLVED_WITHIN) == names()


@pytest.mark.parametrize("env_id", names())
def test_bad_text_is_an_invalid_action_that_changes_nothing(env_id):
    env = make(env_id, format_penalty=-0.5)
    for seed in range(3):
        env.reset(seed=seed)
        key = env.state_key()
        for text in GARBAGE:
            obs, reward, terminated, truncated, info = env.step(text)
            assert (reward, terminated, truncated) == (-0.5, False, False), text[:20]
            assert info["action_is_valid"] is False and info["success"] is False and isinstance(info["metrics"], dict)
            assert isinstance(obs, str) and len(obs) <= 41
            assert env.state_key() == key
        env.step(env.scripted_action())  # the episode still runs after all that


def play(env_id: str, seed: int, episodes: int = 3, pause: bool = False) -> list:
    """A seeded random policy over valid actions (with some bad text) for a few episodes: the transcript."""
    env = make(env_id)
    policy = random.Random(1000 + seed)
    transcript = []
    for episode in range(episodes):
        obs, info = env.reset(seed=seed * 10 + episode)
        transcript.append((obs, env.state_key()))
        for _ in range(12):
            delay = policy.random() * 0.002  # drawn either way, so the actions do not depend on ``pause``
            if pause:
                time.sleep(delay)  # lets the other threads' steps interleave with this one's
            action = policy.choice(env.valid_actions()) if policy.random() < 0.8 else "??"
            obs, reward, terminated, truncated, info = env.step(action)
            transcript.append((action, obs, reward, terminated, info, env.state_key()))
            if terminated:
                break
    env.close()
    return transcript


@pytest.mark.parametrize("env_id", names())
def test_same_seed_same_transcript_and_seeds_differ(env_id):
    assert play(env_id, 7) == play(env_id, 7)
    assert len({oracle_transcript(env_id, seed) for seed in range(20)}) >= 4  # the seed draws level or secret


def oracle_transcript(env_id: str, seed: int) -> str:
    """The oracle's actions and observations from ``seed``: they show the drawn level, or the secret."""
    env = make(env_id)
    transcript = [env.reset(seed=seed)[0]]
    while len(transcript) < 20:
        action = env.scripted_action()
        step = env.step(action)
        transcript += [action, step[0]]
        if step[2]:
            break
    return repr(transcript)


def test_sixteen_envs_in_threads_give_the_serial_transcripts():
    jobs = [(env_id, seed) for seed in range(3) for env_id in names()][:16]
    serial = [play(env_id, seed) for env_id, seed in jobs]
    with ThreadPoolExecutor(max_workers=16) as pool:
        threaded = list(pool.map(lambda job: play(*job, pause=True), jobs))
    assert threaded == serial


@pytest.mark.parametrize("env_id", names())
def test_oracle_solves_within_its_bound(env_id):
    options, bound = SOLVED_WITHIN[env_id]
    env = make(env_id, **options)
    for seed in range(20):
        env.reset(seed=seed)
        for step in range(1, bound + 1):
            obs, reward, terminated, truncated, info = env.step(env.scripted_action())
            if terminated:
                break
        assert terminated and info["success"] and reward == 1.0, (seed, step)


def test_two_box_sokoban_oracle():
    env = make("Sokoban-v0", num_boxes=2, scramble_steps=20)
    for seed in range(20):
        env.reset(seed=seed)
        steps = 0
        while not env.step(env.scripted_action())[2]:
            steps += 1
            assert steps < 20, seed  # the 20 reverse moves are one solution
