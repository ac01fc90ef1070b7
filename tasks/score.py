from __future__ import annotations

import ray
from prefect import task

from engines.rollout_ops import score_rollouts
from tasks.common import TASK_DEFAULTS

# Scoring is a pure function of its inputs: Ray may rerun it once if its worker dies.
score_remote = ray.remote(num_returns=2, max_retries=1)(score_rollouts)


@task(name="score", retries=1, **TASK_DEFAULTS)
def score(rollouts_ref, prompts: list[str], columns: dict[str, list], reward: str):
    """Reward every completion; returns ``(rewards_ref, summary metrics)``."""
    rewards_ref, summary_ref = score_remote.remote(rollouts_ref, prompts, columns, reward)
    return rewards_ref, ray.get(summary_ref)
