from __future__ import annotations

import ray
from prefect import task

from engines.algorithms.shaping import RunningMoments
from engines.batches import AdvantageSpec
from tasks.common import TASK_DEFAULTS


@task(name="compute_advantages", **TASK_DEFAULTS)
def compute_advantages(reward_worker, rollouts_ref, rewards_ref, group_ids: list[int], spec: AdvantageSpec, *,
                       reference=None, trainer=None, critic=None, kl_coef: float = 0.0,
                       moments: RunningMoments | None = None, base_reference=None,
                       teachers: list[tuple[object, list[int]]] = (), distill: dict | None = None,
                       agentic: dict | None = None, policy_version: int | None = None, max_version_lag: int = 0):
    """Build the train batch with advantages; the engines given score the rollouts first (reference
    logprobs for KL, the trainer's own logprobs as PPO's old logprobs, the critic's values for GAE).
    ``base_reference``: a LoRA trainer whose frozen base (adapter disabled) gives the reference logprobs.
    ``teachers``: on-policy distillation's ``(teacher engine, its rows)``; each scores its rows once, and
    ``distill`` (``teacher_coef``, ``distill_only``, ``teacher_kl_groups``) says how their scores enter.
    ``agentic``: ``step_advantages`` and ``masked_rows`` of an agentic batch (``advantage_batch``).
    ``policy_version``: the trainer's weights version, checked against the rollouts' (at most
    ``max_version_lag`` behind).

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
    routed = [(teacher, rows) for teacher, rows in teachers if rows]
    parts = [teacher.rollout_logprobs.remote(rollouts_ref if len(rows) == len(group_ids) else
                                             reward_worker.join.options(num_returns=2).remote([rows], rollouts_ref, rewards_ref)[0])
             for teacher, rows in routed]
    batch_ref, summary_ref, moments_ref = reward_worker.advantage_batch.options(num_returns=3).remote(
        rollouts_ref, rewards_ref, list(group_ids), spec, *parts, kl_coef=kl_coef, moments=moments,
        teacher_rows=[rows for _, rows in routed], **(distill or {}), **(agentic or {}), **scored,
        policy_version=policy_version, max_version_lag=max_version_lag
    )
    summary, moments = ray.get([summary_ref, moments_ref])
    return batch_ref, summary, moments
