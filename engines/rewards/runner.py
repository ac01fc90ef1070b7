"""Scoring that never stops a run: rewards in chunks, with a timeout, exceptions counted as 0.

``score_samples`` cuts a batch into chunks of ``chunk_size`` samples and runs the reward on each chunk
in a shared, bounded thread pool (``concurrency`` calls in flight per process). A chunk whose reward
raises, returns the wrong number of values, or runs past ``timeout_s`` scores 0.0 for each of its
samples and adds to the ``error`` / ``timeout`` event counts; NaN or infinite rewards score 0.0 and
count as ``nan``. Those samples are the call's ``failed`` ones, and the first failure in chunk order is
kept as one line of text (``RuntimeError: reward bug``) so that a run can say why its rewards fail
(``engines.rewards.failures``). ``async def`` rewards run on their own event loop in the worker thread.

A timed-out call cannot be killed from Python: its thread keeps its pool slot until the call returns.
Rewards that run user code (``code``) therefore bound their own subprocesses; the timeout here is the
backstop for a reward that hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as futures
import inspect
import math
import threading
from collections import Counter
from typing import Any, NamedTuple

from engines.rewards import Scored, get_reward

_POOLS: dict[int, futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(concurrency: int) -> futures.ThreadPoolExecutor:
    with _POOLS_LOCK:
        if concurrency not in _POOLS:
            _POOLS[concurrency] = futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward")
        return _POOLS[concurrency]


def _call(fn, prompts: list[str], completions: list[str], columns: dict[str, list], options: dict) -> Scored:
    result = fn(prompts, completions, **columns, **options)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    scored = result if isinstance(result, Scored) else Scored(list(result))
    if len(scored.rewards) != len(completions):
        raise ValueError(f"reward returned {len(scored.rewards)} values for {len(completions)} completions")
    return scored


async def _await(awaitable):
    return await awaitable


class Scoring(NamedTuple):
    """What ``score_samples`` returns."""

    rewards: list[float]
    """One per completion; 0.0 for a failed one."""
    events: dict[str, int]
    """Counted events: the runner's ``error`` / ``timeout`` / ``nan`` plus those the reward reports."""
    failed: int
    """Completions scored 0.0 because the reward raised, timed out, returned the wrong count or a
    non-finite value (the reward's own events, such as a code sample's ``error``, are not failures)."""
    first_failure: str | None
    """The first failure in chunk order, one line (``"ValueError: bad answer column"``); None if none."""


FAILURE_TEXT_CHARS = 200  # longest first-failure text kept


def failure_text(text: str) -> str:
    """``text`` on one line (runs of whitespace and newlines become one space), cut to FAILURE_TEXT_CHARS."""
    text = " ".join(text.split())
    return text if len(text) <= FAILURE_TEXT_CHARS else text[:FAILURE_TEXT_CHARS - 3] + "..."


def score_samples(reward: str, prompts: list[str], completions: list[str], columns: dict[str, list],
                  options: dict[str, Any] | None = None, *, chunk_size: int = 8, concurrency: int = 4,
                  timeout_s: float = 30.0) -> Scoring:
    """Rewards of ``completions`` (one float each), the counted events, and the failures (``Scoring``).

    >>> score_samples("math", ["1+1=", "2+2="], ["2", "5"], {"answer": ["2", "4"]})
    Scoring(rewards=[1.0, 0.0], events={}, failed=0, first_failure=None)
    """
    fn, options = get_reward(reward), dict(options or {})
    pool = _pool(concurrency)
    starts = list(range(0, len(completions), chunk_size))
    jobs = [pool.submit(_call, fn, prompts[i:i + chunk_size], completions[i:i + chunk_size],
                        {k: v[i:i + chunk_size] for k, v in columns.items()}, options) for i in starts]
    rewards: list[float] = []
    events: Counter[str] = Counter()
    runner: Counter[str] = Counter()  # the failures: error / timeout / nan, apart from the reward's own events
    first: str | None = None  # what the first failure in chunk order was
    for start, job in zip(starts, jobs):
        size = len(completions[start:start + chunk_size])
        try:
            scored = job.result(timeout=timeout_s)  # chunks run concurrently, so this waits at most ~timeout_s each
        except futures.TimeoutError:
            rewards += [0.0] * size
            runner["timeout"] += size
            first = first or f"TimeoutError: no result within timeout_s={timeout_s:g}"
            continue
        except Exception as exc:  # a reward bug or odd input: this chunk scores 0, the run goes on
            rewards += [0.0] * size
            runner["error"] += size
            first = first or f"{type(exc).__name__}: {exc}"
            continue
        for value in scored.rewards:
            value = float(value)
            if not math.isfinite(value):
                runner["nan"] += 1
                first = first or f"non-finite reward: {value}"
                value = 0.0
            rewards.append(value)
        events.update({k: int(v) for k, v in scored.events.items() if v})
    events.update(runner)
    return Scoring(rewards, dict(events), sum(runner.values()), first and failure_text(first))
