from __future__ import annotations

import ray
from prefect import task

from tasks.common import TASK_DEFAULTS


@task(name="score", retries=1, **TASK_DEFAULTS)
def score(reward_worker, rollouts_ref, prompts: list[str], columns: dict[str, list], reward: str):
    """Reward every completion; returns ``(rewards_ref, summary metrics)``. Pure, so a retry is safe."""
    rewards_ref, summary_ref = reward_worker.score.options(num_returns=2).remote(rollouts_ref, prompts, columns, reward)
    return rewards_ref, ray.get(summary_ref)
