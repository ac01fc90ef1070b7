from __future__ import annotations

import ray
from prefect import task

from engines.scoring import ScoreSpec
from engines.types import SamplingParams
from tasks.common import TASK_DEFAULTS


@task(name="evaluate", retries=1, **TASK_DEFAULTS)
def evaluate(rollout_engine, reward_worker, rows: list[dict], sampling: SamplingParams,
             spec: ScoreSpec) -> tuple[float, list[dict]]:
    """Accuracy of the rollout engine's completions on ``rows`` (held-out); returns ``(accuracy, samples)``."""
    prompts = [row["prompt"] for row in rows]
    columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"}
    rollouts_ref = rollout_engine.generate.remote(prompts, sampling)
    rewards_ref, stats_ref = reward_worker.score.options(num_returns=2).remote(rollouts_ref, prompts, columns, spec)
    rollouts, rewards, stats = ray.get([rollouts_ref, rewards_ref, stats_ref])
    samples = [
        {"prompt": p, "completion": c, "answer": str(row.get("answer")), "reward": float(r), "domain": spec.domain}
        for p, c, row, r in zip(prompts, rollouts.completions, rows, rewards.tolist())
    ]
    return stats["correct"] / max(stats["n"], 1), samples
