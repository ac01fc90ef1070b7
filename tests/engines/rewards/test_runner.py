"""The scoring runner: a reward that raises, hangs, returns NaN or the wrong count scores 0 and is counted."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engines.rewards import REWARDS, Scored
from engines.rewards.runner import score_samples

RELEASE = threading.Event()


@pytest.fixture(scope="module", autouse=True)
def test_rewards():
    @REWARDS.register("t_flaky")
    def flaky(prompts, completions, **_):
        """Raises on "raise", hangs on "hang", NaN on "nan", two values for "short"; else len(completion)."""
        if "raise" in completions:
            raise RuntimeError("reward bug")
        if "hang" in completions:
            RELEASE.wait(30)
        if "short" in completions:
            return [1.0]
        return [float("nan") if c == "nan" else float(len(c)) for c in completions]

    @REWARDS.register("t_async")
    async def async_reward(prompts, completions, *, bonus: float = 0.0, **_):
        await asyncio.sleep(0.01)
        return Scored([1.0 + bonus for _ in completions], {"checked": len(completions)})

    yield
    RELEASE.set()
    for name in ("t_flaky", "t_async"):
        REWARDS._entries.pop(name)


def test_failures_score_zero_per_chunk_and_are_counted():
    completions = ["ab", "raise", "abc", "nan", "short", "x"]
    rewards, events = score_samples("t_flaky", ["p"] * 6, completions, {}, chunk_size=1)
    # ab: 2; raise: error -> 0; abc: 3; nan -> 0 counted; short: 1 value for 1 completion is right -> 1.0; x: 1
    assert rewards == [2.0, 0.0, 3.0, 0.0, 1.0, 1.0]
    assert events == {"error": 1, "nan": 1}
    rewards, events = score_samples("t_flaky", ["p"] * 4, ["ab", "short", "abc", "x"], {}, chunk_size=2)
    # chunk [ab, short] returns 1 value for 2 completions: the whole chunk is an error
    assert rewards == [0.0, 0.0, 3.0, 1.0] and events == {"error": 2}


def test_a_hanging_reward_times_out_and_the_rest_still_scores():
    start = time.perf_counter()
    rewards, events = score_samples("t_flaky", ["p"] * 3, ["ab", "hang", "abcd"], {}, chunk_size=1, timeout_s=0.5)
    assert rewards == [2.0, 0.0, 4.0] and events == {"timeout": 1}
    assert time.perf_counter() - start < 5


def test_async_rewards_options_and_events():
    rewards, events = score_samples("t_async", ["p"] * 3, ["a", "b", "c"], {}, {"bonus": 0.5}, chunk_size=2)
    assert rewards == [1.5, 1.5, 1.5] and events == {"checked": 3}
