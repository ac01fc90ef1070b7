"""Steps between generation and training that run on Ray workers: scoring and advantage batches.

Plain functions over engine types; ``RewardWorker`` serves them from a Ray actor next to the object
store, and tests call them directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engines.algorithms import advantages
from engines.rewards import get_reward
from engines.types import Rollouts, build_train_batch


def score_rollouts(rollouts: Rollouts, prompts: list[str], columns: dict[str, list], reward: str):
    """Reward each completion; returns ``(rewards [B], summary)``. Inputs are per-row (already repeated)."""
    start = time.perf_counter()
    reward_fn = get_reward(reward)
    rewards = torch.tensor(reward_fn(prompts, rollouts.completions, **columns), dtype=torch.float32)
    lengths = rollouts.response_lengths.float()
    summary = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/accuracy": float((rewards >= 1.0).float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": sum(r == "length" for r in rollouts.finish_reasons) / len(rollouts.finish_reasons),
        "rollout/tokens": float(lengths.sum()),
        "perf/generate_compute_s": rollouts.compute_seconds,
        "perf/score_compute_s": time.perf_counter() - start,
    }
    return rewards, summary


@dataclass(frozen=True)
class AdvantageSpec:
    """Which estimator to run and its options; ``pad_token_id`` pads the train batch."""

    estimator: str
    pad_token_id: int
    options: dict = field(default_factory=dict)


def outcome_token_rewards(sequence_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's reward on its last response token: [B] → [B, L]."""
    last = (response_mask * torch.arange(response_mask.shape[1])).argmax(-1)  # [B]
    token_rewards = torch.zeros_like(response_mask)
    token_rewards[torch.arange(len(last)), last] = sequence_rewards
    return token_rewards * response_mask


def advantage_batch(rollouts: Rollouts, rewards: torch.Tensor, group_ids: torch.Tensor, spec: AdvantageSpec,
                    ref_logprobs: torch.Tensor | None = None):
    """Build the TrainBatch with ``advantages``, ``old_logprobs`` (rollout engine's) and ``ref_logprobs``."""
    batch = build_train_batch(rollouts, spec.pad_token_id)
    token_rewards = outcome_token_rewards(rewards, batch.response_mask)
    adv, returns = advantages.compute(
        spec.estimator, token_rewards=token_rewards, response_mask=batch.response_mask, group_ids=group_ids,
        values=None, **spec.options,
    )
    tensors = {"advantages": adv, "returns": returns, "old_logprobs": batch.tensors["rollout_logprobs"]}
    if ref_logprobs is not None:
        tensors["ref_logprobs"] = ref_logprobs[:, : batch.input_ids.shape[1]]
    batch = batch.with_tensors(**tensors)
    mask = batch.response_mask.bool()
    summary = {"advantage/mean": float(adv[mask].mean()), "advantage/abs_mean": float(adv[mask].abs().mean())}
    return batch, summary


class RewardWorker:
    """Ray actor that scores rollouts and builds advantage batches next to the object store.

    An actor rather than Ray tasks: this module's imports (the reward libraries) happen once, when the
    actor starts in parallel with the model engines, and calls never hit a cold worker."""

    def score(self, rollouts: Rollouts, prompts: list[str], columns: dict[str, list], reward: str):
        return score_rollouts(rollouts, prompts, columns, reward)

    def advantage_batch(self, rollouts: Rollouts, rewards: torch.Tensor, group_ids: torch.Tensor,
                        spec: AdvantageSpec, ref_logprobs: torch.Tensor | None = None):
        return advantage_batch(rollouts, rewards, group_ids, spec, ref_logprobs)
