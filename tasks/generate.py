from __future__ import annotations

import ray
from prefect import task

from engines.types import SamplingParams
from tasks.common import TASK_DEFAULTS


@task(name="generate", retries=1, **TASK_DEFAULTS)
def generate(rollout_engine, prompts: list[str], sampling: SamplingParams):
    """Sample completions for ``prompts``; returns a reference to the ``Rollouts``.

    Sampling is seeded, so a retry returns the same completions."""
    rollouts_ref = rollout_engine.generate.remote(prompts, sampling)
    ray.wait([rollouts_ref], fetch_local=False)
    return rollouts_ref
