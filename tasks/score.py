from __future__ import annotations

from dataclasses import dataclass

import ray
from prefect import task

from engines.rollout_ops import ScoreSpec
from engines.types import SamplingParams
from tasks.common import TASK_DEFAULTS


@dataclass(frozen=True)
class Chunk:
    """One generation call and how its completions are scored (prompts repeated per group already)."""

    prompts: list[str]
    columns: dict[str, list]
    sampling: SamplingParams
    score: ScoreSpec


@task(name="generate_and_score", retries=1, **TASK_DEFAULTS)
def generate_and_score(rollout_engine, reward_workers: list, chunks: list[Chunk], overlap: bool) -> list[tuple]:
    """Generate every chunk and score it; returns ``[(rollouts_ref, rewards_ref, stats)]`` in chunk order.

    With ``overlap`` each chunk's scoring is queued on a reward worker behind its own generation (Ray
    starts it when that chunk's rollouts exist), so rewards are computed while later chunks generate;
    without, scoring starts once the whole batch is generated. Sampling is seeded and rewards are pure,
    so a retry returns the same values."""
    generated = [rollout_engine.generate.remote(c.prompts, c.sampling) for c in chunks]
    if not overlap:
        ray.wait(generated, num_returns=len(generated), fetch_local=False)
    scored = [reward_workers[i % len(reward_workers)].score.options(num_returns=2).remote(ref, c.prompts, c.columns, c.score)
              for i, (ref, c) in enumerate(zip(generated, chunks))]
    stats = ray.get([stats_ref for _, stats_ref in scored])
    return [(ref, rewards_ref, s) for ref, (rewards_ref, _), s in zip(generated, scored, stats)]
