"""Advantage estimators: per-token rewards ``[B, L]`` → ``(advantages, returns)``, both ``[B, L]``.

Every estimator is a registered function with keyword-only arguments::

    adv, ret = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=G, values=None)

- ``token_rewards`` ``[B, L]``: reward per token; an outcome reward sits on the last response token,
  so a sequence's reward is ``(R * M).sum(-1)``.
- ``response_mask`` ``[B, L]``: 1.0 on response tokens, 0 elsewhere.
- ``group_ids`` ``[B]`` int64: rows with the same id are completions of the same prompt; ids need not
  be contiguous or sorted.
- ``values`` ``[B, L]`` or ``None``: critic values, for estimators that use one.

Outputs are 0 outside ``response_mask`` and carry no gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engines.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
register = ADV_ESTIMATORS.register


def compute(
    name: str,
    *,
    token_rewards: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # [B, L]
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the named estimator; returns ``(advantages, returns)``, each ``[B, L]``."""
    estimator = ADV_ESTIMATORS.get(name)
    return estimator(
        token_rewards=token_rewards,
        response_mask=response_mask,
        group_ids=group_ids,
        values=values,
        **options,
    )


def names() -> list[str]:
    """The registered advantage estimators, sorted."""
    return ADV_ESTIMATORS.names()


def group_mean_std(
    scores: torch.Tensor,  # [B]
    group_ids: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's group mean and unbiased group std, gathered back to ``[B]``; no loop over groups.

    A group of size 1 has std defined as 1 (its deviation from its own mean is 0 anyway), so the
    division in GRPO never sees ``0 / 0``.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B] in 0..K-1
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)  # [K]
    counts.index_add_(0, inverse, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, inverse, scores)  # [K]
    mean = sums / counts  # [K]
    sq_dev = (scores - mean[inverse]).square()  # [B]
    sq_dev_sums = torch.zeros_like(counts).index_add_(0, inverse, sq_dev)  # [K]
    var = sq_dev_sums / (counts - 1).clamp(min=1)  # [K], Bessel-corrected
    std = torch.where(counts > 1, var.sqrt(), torch.ones_like(var))  # [K]
    return mean[inverse], std[inverse]


@register("grpo")
def grpo(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # unused: GRPO has no critic
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage, broadcast over the response tokens.

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2 (outcome supervision)::

        r_i = sum_t R[i, t] * M[i, t]                                  # [B]
        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)   if norm_by_std
        A_i =  r_i - mean_g(r)                       otherwise (Dr.GRPO, arXiv:2503.20783)
        A[i, t] = A_i * M[i, t]                                        # [B, L]

    ``mean_g`` and ``std_g`` are over the rows sharing ``group_ids[i]``; std is unbiased
    (``torch.std``'s default, as in DeepSeekMath/verl) and a group of size 1 has std 1.

    Args:
        norm_by_std: divide by the group std; ``False`` keeps only the mean baseline.
        eps: added to the std so an all-equal group gives 0, not NaN.

    Returns:
        ``(advantages, returns)``, each ``[B, L]``; for GRPO ``returns`` is ``advantages``.
    """
    with torch.no_grad():
        scores = (token_rewards * response_mask).sum(dim=-1)  # [B]
        mean, std = group_mean_std(scores, group_ids)  # [B], [B]
        seq_advantages = scores - mean  # [B]
        if norm_by_std:
            seq_advantages = seq_advantages / (std + eps)
        advantages = seq_advantages.unsqueeze(-1) * response_mask  # [B, L]
    return advantages, advantages
