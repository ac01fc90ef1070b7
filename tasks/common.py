"""Shared task settings. Caching is off: resume comes from checkpoints, not from Prefect's cache, whose
default key would include the flow-run id and Ray object refs that do not outlive a driver."""

from __future__ import annotations

import time
from contextlib import contextmanager

from prefect.cache_policies import NO_CACHE

TASK_DEFAULTS = dict(cache_policy=NO_CACHE, persist_result=False)


@contextmanager
def timed(metrics: dict, key: str):
    start = time.perf_counter()
    yield
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start  # repeated work adds up
