"""Scoring that never stops a run: rewards in chunks, with a timeout, exceptions counted as 0.

``score_samples`` cuts a batch into chunks of ``chunk_size`` samples and runs the reward on each chunk
in a shared, bounded thread pool (``concurrency`` calls in flight per process). A chunk whose reward
raises, returns the wrong number of values, or runs past ``timeout_s`` scores 0.0 for each of its
samples and adds to the ``error`` / ``timeout`` event counts; NaN or infinite rewards score 0.0 and
count as ``nan``. ``async def`` rewards run on their own event loop in the worker thread.

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
from typing import Any

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


def score_samples(reward: str, prompts: list[str], completions: list[str], columns: dict[str, list],
                  options: dict[str, Any] | None = None, *, chunk_size: int = 8, concurrency: int = 4,
                  timeout_s: float = 30.0) -> tuple[list[float], dict[str, int]]:
    """Rewards of ``completions`` (one float each) and the counted events of scoring them.

    >>> score_samples("math", ["1+1=", "2+2="], ["2", "5"], {"answer": ["2", "4"]})
    ([1.0, 0.0], {})
    """
    fn, options = get_reward(reward), dict(options or {})
    pool = _pool(concurrency)
    starts = list(range(0, len(completions), chunk_size))
    jobs = [pool.submit(_call, fn, prompts[i:i + chunk_size], completions[i:i + chunk_size],
                        {k: v[i:i + chunk_size] for k, v in columns.items()}, options) for i in starts]
    rewards: list[float] = []
    events: Counter[str] = Counter()
    for start, job in zip(starts, jobs):
        size = len(completions[start:start + chunk_size])
        try:
            scored = job.result(timeout=timeout_s)  # chunks run concurrently, so this waits at most ~timeout_s each
        except futures.TimeoutError:
            rewards += [0.0] * size
            events["timeout"] += size
            continue
        except Exception:  # a reward bug or odd input: this chunk scores 0, the run goes on
            rewards += [0.0] * size
            events["error"] += size
            continue
        for value in scored.rewards:
            value = float(value)
            if not math.isfinite(value):
                events["nan"] += 1
                value = 0.0
            rewards.append(value)
        events.update({k: int(v) for k, v in scored.events.items() if v})
    return rewards, dict(events)
