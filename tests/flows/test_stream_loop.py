"""The background loop of ``async.mode: full``'s streams: rounds repeat until closed, and a failed round
stops the loop and is raised on the waiting thread."""

from __future__ import annotations

import threading

import pytest

from tasks.stream_loop import StreamLoop


def test_rounds_repeat_until_closed():
    rounds, third = [], threading.Event()

    def round_():
        rounds.append(1)
        if len(rounds) == 3:
            third.set()

    loop = StreamLoop("test stream", round_)
    loop.start()
    assert third.wait(timeout=10)
    loop.close()
    after_close = len(rounds)
    assert after_close >= 3 and len(rounds) == after_close  # no round after close returned
    loop.raise_if_failed()  # nothing failed


def test_a_failed_round_stops_the_loop_and_is_raised_on_the_waiting_thread():
    rounds = []

    def round_():
        rounds.append(1)
        raise ValueError("engine gone")

    loop = StreamLoop("test stream", round_)
    with loop.changed:
        loop.start()
        assert loop.changed.wait(timeout=10)  # the failure notifies whoever waits
    with pytest.raises(RuntimeError, match="the test stream failed: engine gone") as raised:
        loop.raise_if_failed()
    assert isinstance(raised.value.__cause__, ValueError) and rounds == [1]
    loop.close()
