"""Reward and advantage shaping: pure functions applied between scoring and the policy loss.

Order inside ``engines.batches.advantage_batch`` (each step optional, all configured under
``algorithm.shaping``)::

    r_i  = reward_i + overlong_penalty(|y_i|) + length_penalty(|y_i|)   # [B] sequence rewards
    r_i  = clamp(r_i, -reward_clip, reward_clip)
    r_i  = normalize(reward_norm, r, group_ids, moments)              # none | batch | group | running
    R    = outcome_token_rewards(r) - kl_coef * KL_t                   # [B, L], KL only in reward mode
    A    = estimator(R, ...)                                           # [B, L]
    A    = whiten(A), clamp(A, -advantage_clip, advantage_clip)
    M_i  = 0 for truncated rows when overlong_filter                   # DAPO overlong filtering

Masks are 1.0 on the model's tokens and 0 elsewhere (prompt, padding and, in a multi-turn row, the
environment's observation tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engines.registry import Registry


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(X * M) / max(sum(M), 1)``; a scalar."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of ``values`` over ``mask`` (``sum(M) - 1`` in the denominator); a scalar."""
    mean = masked_mean(values, mask)
    return ((values - mean).square() * mask).sum() / (mask.sum() - 1).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(X - mean_M(X)) / sqrt(var_M(X) + eps) * M``: zero mean, unit variance over the masked entries."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), ``[B]`` → ``[B]``::

        R_len(y) = 0                                   if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                                  if |y| > L_max
        penalty  = factor * R_len(y)

    ``max_length`` is ``L_max`` (the generation limit), ``buffer`` is ``L_cache``; ``buffer == 0`` disables.
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    lengths = lengths.float()
    soft_start = max_length - buffer
    ramp = ((soft_start - lengths) / buffer).clamp(max=0.0)  # 0 down to -1 across the buffer
    return factor * torch.where(lengths > max_length, torch.full_like(lengths, -1.0), ramp)


def length_penalty(lengths: torch.Tensor, *, coef: float, max_length: int) -> torch.Tensor:
    """``-coef * |y| / max_length`` per sequence, ``[B]`` → ``[B]``: a linear cost on response length."""
    return -coef * lengths.float() / max_length


# -- reward normalisation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunningMoments:
    """Running count, mean and sum of squared deviations (Welford), kept across steps and checkpointed."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: torch.Tensor) -> "RunningMoments":
        """Chan et al.'s parallel update with a batch ``values`` ``[N]``."""
        n = float(values.numel())
        if n == 0:
            return self
        batch_mean = float(values.mean())
        batch_m2 = float((values - batch_mean).square().sum())
        total = self.count + n
        delta = batch_mean - self.mean
        return RunningMoments(total, self.mean + delta * n / total, self.m2 + batch_m2 + delta**2 * self.count * n / total)

    @property
    def std(self) -> float:
        return (self.m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 1.0


RewardNormFn = Callable[..., tuple[torch.Tensor, RunningMoments]]
REWARD_NORMS: Registry[RewardNormFn] = Registry("reward normalisation")


@REWARD_NORMS.register("none")
def no_norm(*, rewards: torch.Tensor, group_ids: torch.Tensor, moments: RunningMoments, eps: float = 1e-6):
    """``r`` unchanged."""
    return rewards, moments


@REWARD_NORMS.register("batch")
def batch_norm(*, rewards: torch.Tensor, group_ids: torch.Tensor, moments: RunningMoments, eps: float = 1e-6):
    """``(r - mean_batch(r)) / (std_batch(r) + eps)`` (unbiased std; a batch of one gives ``r - r = 0``)."""
    std = rewards.std() if rewards.numel() > 1 else rewards.new_ones(())
    return (rewards - rewards.mean()) / (std + eps), moments


@REWARD_NORMS.register("group")
def group_norm(*, rewards: torch.Tensor, group_ids: torch.Tensor, moments: RunningMoments, eps: float = 1e-6):
    """``(r - mean_g(r)) / (std_g(r) + eps)`` within each prompt's group (GRPO's normalisation of rewards)."""
    from engines.algorithms.advantages import group_mean_std

    mean, std = group_mean_std(rewards, group_ids)
    return (rewards - mean) / (std + eps), moments


@REWARD_NORMS.register("running")
def running_norm(*, rewards: torch.Tensor, group_ids: torch.Tensor, moments: RunningMoments, eps: float = 1e-6):
    """``r / (std_run + eps)`` with the running std over every reward seen so far, this batch included.

    Scale only, no mean shift (as in OpenAI's reward scaling, Engstrom et al. 2020, arXiv:2005.12729),
    so the sign of a reward is kept. ``moments`` is returned updated; the flow checkpoints it.
    """
    moments = moments.update(rewards)
    return rewards / (moments.std + eps), moments


def normalize_rewards(mode: str, *, rewards: torch.Tensor, group_ids: torch.Tensor,
                      moments: RunningMoments | None = None) -> tuple[torch.Tensor, RunningMoments]:
    """Apply the named normalisation to sequence rewards ``[B]``; returns ``(rewards, moments)``."""
    return REWARD_NORMS.get(mode)(rewards=rewards, group_ids=group_ids, moments=moments or RunningMoments())


# -- dynamic sampling --------------------------------------------------------------------------------


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows whose group has at least two different rewards.

    DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, eq. 11) drops groups whose rewards are
    all equal: their group-relative advantage is 0 and they only dilute the batch.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    lo = torch.full((num_groups,), float("inf"), device=rewards.device).scatter_reduce(0, inverse, rewards.float(), "amin")
    hi = torch.full((num_groups,), float("-inf"), device=rewards.device).scatter_reduce(0, inverse, rewards.float(), "amax")
    return (hi > lo)[inverse]


def refill_rows(rewards: torch.Tensor, group_size: int, room: int) -> list[int]:
    """Row indices of the first ``room`` informative groups of one generation round.

    Rows come in contiguous groups of ``group_size`` (one prompt each); a dynamic-sampling step keeps
    what this returns from each round until ``room`` reaches 0."""
    group_ids = torch.arange(len(rewards), device=rewards.device) // group_size
    keep = informative_groups(rewards, group_ids)
    kept = [j for j in range(len(rewards) // group_size) if keep[j * group_size]][:room]
    return [j * group_size + k for j in kept for k in range(group_size)]


@dataclass(frozen=True)
class ShapingSpec:
    """The shaping steps above, as plain values (the flow builds it from ``algorithm.shaping``)."""

    reward_norm: str = "none"
    reward_clip: float = 0.0  # 0 = off
    overlong_buffer: int = 0  # DAPO L_cache in tokens; 0 = off
    overlong_penalty_factor: float = 1.0
    length_penalty: float = 0.0
    max_length: int = 0  # L_max: the generation limit
    overlong_filter: bool = False
    whiten_advantages: bool = False
    advantage_clip: float = 0.0  # 0 = off


def shape_sequence_rewards(rewards: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor, spec: ShapingSpec,
                           moments: RunningMoments | None = None) -> tuple[torch.Tensor, RunningMoments]:
    """Length penalties, clipping and normalisation of sequence rewards ``[B]``; returns ``(rewards, moments)``."""
    rewards = rewards.float()
    if spec.overlong_buffer:
        rewards = rewards + overlong_penalty(lengths, max_length=spec.max_length, buffer=spec.overlong_buffer,
                                             factor=spec.overlong_penalty_factor)
    if spec.length_penalty:
        rewards = rewards + length_penalty(lengths, coef=spec.length_penalty, max_length=spec.max_length)
    if spec.reward_clip:
        rewards = rewards.clamp(-spec.reward_clip, spec.reward_clip)
    return normalize_rewards(spec.reward_norm, rewards=rewards, group_ids=group_ids, moments=moments)


def shape_advantages(advantages: torch.Tensor, mask: torch.Tensor, spec: ShapingSpec) -> torch.Tensor:
    """Optional batch whitening then clipping of ``advantages`` ``[B, L]`` over ``mask``."""
    if spec.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    if spec.advantage_clip:
        advantages = advantages.clamp(-spec.advantage_clip, spec.advantage_clip) * mask
    return advantages
