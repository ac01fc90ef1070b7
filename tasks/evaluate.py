from __future__ import annotations

import ray
from prefect import task

from engines.actors import get_from_engines
from engines.scoring import ScoreSpec
from engines.types import SamplingParams
from tasks.common import TASK_DEFAULTS


@task(name="evaluate", retries=1, **TASK_DEFAULTS)
def evaluate(rollout_engines: list, reward_worker, rows: list[dict], sampling: SamplingParams,
             spec: ScoreSpec, *, timeout_s: float) -> tuple[float, list[dict]]:
    """Accuracy of the rollout engines' completions on ``rows`` (held-out), split in contiguous parts over the
    replicas; returns ``(accuracy, samples)``."""
    parts = min(len(rollout_engines), len(rows))
    bounds = [round(i * len(rows) / parts) for i in range(parts + 1)]
    pieces = [rows[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    generated = [engine.generate.remote([row["prompt"] for row in part], sampling)
                 for engine, part in zip(rollout_engines, pieces)]
    scored = [reward_worker.score.options(num_returns=2).remote(
        ref, [row["prompt"] for row in part], {k: [row[k] for row in part] for k in part[0] if k != "prompt"}, spec)
        for ref, part in zip(generated, pieces)]
    rollouts = get_from_engines(generated, list(zip(rollout_engines, generated)), timeout_s)
    scored = [ray.get(refs) for refs in scored]  # [(rewards, stats)]
    samples = [
        {"prompt": row["prompt"], "completion": c, "answer": str(row.get("answer")), "reward": float(r), "domain": spec.domain}
        for part, out, (rewards, _) in zip(pieces, rollouts, scored)
        for row, c, r in zip(part, out.completions, rewards.tolist())
    ]
    return sum(stats["correct"] for _, stats in scored) / max(sum(stats["n"] for _, stats in scored), 1), samples
