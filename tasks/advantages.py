from __future__ import annotations

import ray
import torch
from prefect import task

from engines.rollout_ops import AdvantageSpec
from tasks.common import TASK_DEFAULTS


@task(name="compute_advantages", **TASK_DEFAULTS)
def compute_advantages(reward_worker, rollouts_ref, rewards_ref, group_ids: list[int], spec: AdvantageSpec,
                       reference_engine=None):
    """Build the train batch with advantages (and reference logprobs when a reference model is used);
    returns ``(batch_ref, summary metrics)``."""
    ref_logprobs = reference_engine.rollout_logprobs.remote(rollouts_ref) if reference_engine is not None else None
    batch_ref, summary_ref = reward_worker.advantage_batch.options(num_returns=2).remote(
        rollouts_ref, rewards_ref, torch.tensor(group_ids), spec, ref_logprobs
    )
    return batch_ref, ray.get(summary_ref)
