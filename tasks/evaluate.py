from __future__ import annotations

import ray
from prefect import task

from engines.types import SamplingParams
from tasks.common import TASK_DEFAULTS


@task(name="evaluate", retries=1, **TASK_DEFAULTS)
def evaluate(rollout_engine, reward_worker, rows: list[dict], sampling: SamplingParams, reward: str) -> tuple[float, list[dict]]:
    """Accuracy of the rollout engine's completions on ``rows`` (held-out); returns ``(accuracy, samples)``."""
    prompts = [row["prompt"] for row in rows]
    columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"}
    rollouts_ref = rollout_engine.generate.remote(prompts, sampling)
    rewards_ref, summary_ref = reward_worker.score.options(num_returns=2).remote(rollouts_ref, prompts, columns, reward)
    rollouts, rewards = ray.get([rollouts_ref, rewards_ref])
    samples = [
        {"prompt": p, "completion": c, "answer": str(row.get("answer")), "reward": float(r)}
        for p, c, row, r in zip(prompts, rollouts.completions, rows, rewards.tolist())
    ]
    return ray.get(summary_ref)["reward/accuracy"], samples
