from __future__ import annotations

from dataclasses import dataclass

import ray
from prefect import task

from engines.actors import get_from_engines
from engines.scoring import ScoreSpec
from engines.types import SamplingParams
from tasks.common import TASK_DEFAULTS


@dataclass(frozen=True)
class Chunk:
    """One generation call and how its completions are scored (prompts repeated per group already)."""

    prompts: list[str]
    columns: dict[str, list]
    sampling: SamplingParams
    score: ScoreSpec


@dataclass(frozen=True)
class ScoredRound:
    """One generation round: its rollouts and rewards (Ray refs, every chunk joined in chunk order), each
    chunk's scoring stats, and with dynamic sampling the rows of the informative groups it keeps."""

    rollouts_ref: object
    rewards_ref: object
    stats: list[dict]
    kept_rows: list[int] | None = None


@dataclass
class ScoredBatch:
    """One step's scored rollouts (Ray refs, rows grouped by prompt) and what the driver keeps of them."""

    rollouts_ref: object
    rewards_ref: object
    group_ids: list[int]
    prompts: list[str]
    columns: dict[str, list]
    positions: dict[str, int]
    metrics: dict[str, float]
    agentic: dict | None = None  # agentic RL: step_advantages and masked_rows (compute_advantages)
    samples: list[dict] | None = None  # agentic RL: the sample episodes' table


def _flat(pairs):
    return [ref for pair in pairs for ref in pair]


@task(name="generate_and_score", retries=1, **TASK_DEFAULTS)
def generate_and_score(rollout_engines: list, reward_workers: list, chunks: list[Chunk], overlap: bool,
                       keep_groups: tuple[int, int] | None = None, *, timeout_s: float) -> ScoredRound:
    """Generate every chunk (chunk ``i`` on rollout replica ``i % len(rollout_engines)``) and score it; with
    ``keep_groups = (group_size, room)`` also find the rows of the first ``room`` groups whose rewards
    differ (dynamic sampling).

    With ``overlap`` each chunk's scoring is queued on a reward worker behind its own generation (Ray
    starts it when that chunk's rollouts exist), so rewards are computed while later chunks generate;
    without, scoring starts once the whole batch is generated. Sampling is seeded and rewards are pure,
    so a retry returns the same values. A rollout engine that dies, or takes longer than ``timeout_s``,
    fails the task with ``EngineFailure`` naming it."""
    engines = [rollout_engines[i % len(rollout_engines)] for i in range(len(chunks))]
    generated = [engine.generate.remote(c.prompts, c.sampling) for engine, c in zip(engines, chunks)]
    if not overlap:
        ray.wait(generated, num_returns=len(generated), timeout=timeout_s, fetch_local=False)
    scored = [reward_workers[i % len(reward_workers)].score.options(num_returns=2).remote(ref, c.prompts, c.columns, c.score)
              for i, (ref, c) in enumerate(zip(generated, chunks))]
    stats = get_from_engines([stats_ref for _, stats_ref in scored], list(zip(engines, generated)), timeout_s)
    if len(chunks) == 1:
        rollouts_ref, rewards_ref = generated[0], scored[0][0]
    else:
        rollouts_ref, rewards_ref = reward_workers[0].join.options(num_returns=2).remote(
            [None] * len(chunks), *_flat((ref, rewards_ref) for ref, (rewards_ref, _) in zip(generated, scored)))
    kept_rows = None
    if keep_groups is not None:
        kept_rows = ray.get(reward_workers[0].informative_rows.remote(rewards_ref, *keep_groups))
    return ScoredRound(rollouts_ref, rewards_ref, stats, kept_rows)


@task(name="join_rounds", retries=1, **TASK_DEFAULTS)
def join_rounds(reward_worker, rounds: list[ScoredRound]) -> tuple[object, object]:
    """The kept rows of every round as one batch: ``(rollouts_ref, rewards_ref)``."""
    return tuple(reward_worker.join.options(num_returns=2).remote(
        [r.kept_rows for r in rounds], *_flat((r.rollouts_ref, r.rewards_ref) for r in rounds)))


@task(name="rollout_samples", retries=1, **TASK_DEFAULTS)
def rollout_samples(reward_worker, rollouts_ref, rewards_ref, prompts: list[str], columns: dict[str, list],
                    limit: int) -> list[dict]:
    """A table of the first ``limit`` rollouts (prompt, completion, answer, reward, …) for tracking."""
    return ray.get(reward_worker.samples.remote(rollouts_ref, rewards_ref, prompts[:limit],
                                                {k: v[:limit] for k, v in columns.items()}, limit))
