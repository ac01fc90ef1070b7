"""The scoring runner: a reward that raises, hangs, returns NaN or the wrong count scores 0, is counted as
failed, and the first failure's text is kept."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engines.rewards import REWARDS, Scored
from engines.rewards.runner import FAILURE_TEXT_CHARS, score_samples

RELEASE = threading.Event()


@pytest.fixture(scope="module", autouse=True)
def test_rewards():
    @REWARDS.register("t_flaky")
    def flaky(prompts, completions, **_):
        """Raises on "raise" (and "multiline"), hangs on "hang", NaN on "nan", one value for "short";
        else len(completion)."""
        if "raise" in completions:
            raise RuntimeError("reward bug")
        if "multiline" in completions:
            raise KeyError("line one\n  line two " + "x" * 300)
        if "hang" in completions:
            RELEASE.wait(30)
        if "short" in completions:
            return [1.0]
        return [float("nan") if c == "nan" else float(len(c)) for c in completions]

    @REWARDS.register("t_async")
    async def async_reward(prompts, completions, *, bonus: float = 0.0, events=None, **_):
        await asyncio.sleep(0.01)
        return Scored([1.0 + bonus for _ in completions], events or {"checked": len(completions)})

    yield
    RELEASE.set()
    for name in ("t_flaky", "t_async"):
        REWARDS._entries.pop(name)


def test_failures_score_zero_per_chunk_and_are_counted():
    completions = ["ab", "raise", "abc", "nan", "short", "x"]
    rewards, events, failed, first = score_samples("t_flaky", ["p"] * 6, completions, {}, chunk_size=1)
    # ab: 2; raise: error -> 0; abc: 3; nan -> 0 counted; short: 1 value for 1 completion is right -> 1.0; x: 1
    assert rewards == [2.0, 0.0, 3.0, 0.0, 1.0, 1.0]
    assert events == {"error": 1, "nan": 1} and failed == 2
    assert first == "RuntimeError: reward bug"  # the first failure in chunk order, not the NaN after it
    rewards, events, failed, first = score_samples("t_flaky", ["p"] * 4, ["ab", "short", "abc", "x"], {}, chunk_size=2)
    # chunk [ab, short] returns 1 value for 2 completions: the whole chunk is an error
    assert rewards == [0.0, 0.0, 3.0, 1.0] and events == {"error": 2} and failed == 2
    assert first == "ValueError: reward returned 1 values for 2 completions"
    assert score_samples("t_flaky", ["p"], ["nan"], {}).first_failure == "non-finite reward: nan"


def test_the_first_failure_is_one_truncated_line():
    first = score_samples("t_flaky", ["p"] * 2, ["ab", "multiline"], {}, chunk_size=1).first_failure
    # KeyError's str() is the repr of its argument; newlines and runs of spaces become one space
    assert first.startswith("KeyError: 'line one\\n line two xxx")
    assert "\n" not in first and len(first) == FAILURE_TEXT_CHARS and first.endswith("x...")


def test_the_reward_s_own_events_are_not_failures():
    scoring = score_samples("t_async", ["p"], ["a"], {}, {"events": {"error": 1, "timeout": 1}})
    # the reward scored its sample and reports events of its own (a code sample that crashed): nothing failed
    assert scoring == (pytest.approx([1.0]), {"error": 1, "timeout": 1}, 0, None)


def test_a_hanging_reward_times_out_and_the_rest_still_scores():
    start = time.perf_counter()
    rewards, events, failed, first = score_samples("t_flaky", ["p"] * 3, ["ab", "hang", "abcd"], {}, chunk_size=1,
                                                   timeout_s=0.5)
    assert rewards == [2.0, 0.0, 4.0] and events == {"timeout": 1} and failed == 1
    assert first == "TimeoutError: no result within timeout_s=0.5"
    assert time.perf_counter() - start < 5


def test_async_rewards_options_and_events():
    rewards, events, failed, _ = score_samples("t_async", ["p"] * 3, ["a", "b", "c"], {}, {"bonus": 0.5}, chunk_size=2)
    assert rewards == [1.5, 1.5, 1.5] and events == {"checked": 3} and failed == 0
