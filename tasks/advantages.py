from __future__ import annotations

import ray
from prefect import task

from engines.algorithms.shaping import RunningMoments
from engines.batches import AdvantageSpec
from tasks.common import TASK_DEFAULTS


@task(name="compute_advantages", **TASK_DEFAULTS)
def compute_advantages(reward_worker, rollouts_ref, rewards_ref, group_ids: list[int], spec: AdvantageSpec, *,
                       reference=None, trainer=None, critic=None, kl_coef: float = 0.0,
                       moments: RunningMoments | None = None, base_reference=None):
    """Build the train batch with advantages; the engines given score the rollouts first (reference
    logprobs for KL, the trainer's own logprobs as PPO's old logprobs, the critic's values for GAE).
    ``base_reference``: a LoRA trainer whose frozen base (adapter disabled) gives the reference logprobs.

    Returns ``(batch_ref, summary metrics, running reward moments)``."""
    scored = {}
    if reference is not None:
        scored["ref_logprobs"] = reference.rollout_logprobs.remote(rollouts_ref)
    if base_reference is not None:
        scored["ref_logprobs"] = base_reference.reference_rollout_logprobs.remote(rollouts_ref)
    if trainer is not None:
        scored["old_logprobs"] = trainer.rollout_logprobs.remote(rollouts_ref)
    if critic is not None:
        scored["values"] = critic.rollout_values.remote(rollouts_ref)
    batch_ref, summary_ref, moments_ref = reward_worker.advantage_batch.options(num_returns=3).remote(
        rollouts_ref, rewards_ref, list(group_ids), spec, kl_coef=kl_coef, moments=moments, **scored
    )
    summary, moments = ray.get([summary_ref, moments_ref])
    return batch_ref, summary, moments
