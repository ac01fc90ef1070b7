"""Policy losses: log-probabilities and advantages ``[B, L]`` → ``(scalar loss, metrics)``.

Every loss is a registered function with keyword-only arguments::

    loss, metrics = losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A,
                                   response_mask=M, agg="token-mean", clip_low=0.2, clip_high=0.2)

The per-token loss is reduced with ``aggregation.aggregate(agg, ...)``; ``metrics`` holds detached
python floats under ``actor/...``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engines.algorithms import aggregation
from engines.registry import Registry

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

POLICY_LOSSES: Registry[LossFn] = Registry("policy loss")
register = POLICY_LOSSES.register


def compute(
    name: str,
    *,
    logprobs: torch.Tensor,  # [B, L]
    old_logprobs: torch.Tensor,  # [B, L]
    advantages: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor,  # [B, L]
    **options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the named policy loss; returns ``(loss, metrics)`` with ``loss`` a scalar."""
    loss_fn = POLICY_LOSSES.get(name)
    return loss_fn(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        **options,
    )


def names() -> list[str]:
    """The registered policy losses, sorted."""
    return POLICY_LOSSES.names()


@register("ppo_clip")
def ppo_clip(
    *,
    logprobs: torch.Tensor,  # [B, L] log pi_theta(o_t), requires grad
    old_logprobs: torch.Tensor,  # [B, L] log pi_old(o_t), from the rollout policy
    advantages: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor,  # [B, L]
    agg: str = "token-mean",
    agg_options: dict[str, Any] | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), as a loss to minimise::

        ratio     = exp(LP - OLP)                                           # [B, L]
        pg_loss1  = -A * ratio                                              # [B, L]
        pg_loss2  = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)          # [B, L]
        pg_loss   = aggregate(agg, max(pg_loss1, pg_loss2), M)              # scalar

    ``clip_low != clip_high`` is DAPO's "clip-higher". Positions outside ``M`` get ratio 1, so
    padding log-probabilities can never make an inf or NaN.

    Args:
        agg: an ``aggregation`` mode, e.g. ``token-mean`` or ``seq-mean-token-sum-norm`` (Dr.GRPO).
        agg_options: extra options for that mode, e.g. ``{"norm": 4096}``.
        clip_low: the ratio is clipped below at ``1 - clip_low``.
        clip_high: the ratio is clipped above at ``1 + clip_high``.

    Metrics (token-means over ``M``, detached floats):
        ``actor/pg_loss``: the aggregated loss.
        ``actor/clipfrac``: fraction of response tokens where ``pg_loss2 > pg_loss1`` (the clip is active).
        ``actor/approx_kl``: token-mean of ``0.5 * (LP - OLP)^2`` (the k2 estimator, as in OpenAI baselines).
        ``actor/ratio_mean``: token-mean of ``ratio``.
    """
    is_response = response_mask > 0  # [B, L]
    log_ratio = torch.where(is_response, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, L]
    ratio = torch.exp(log_ratio)  # [B, L]
    pg_losses1 = -advantages * ratio  # [B, L]
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # [B, L]
    pg_losses = torch.maximum(pg_losses1, pg_losses2)  # [B, L]
    pg_loss = aggregation.aggregate(agg, values=pg_losses, mask=response_mask, **(agg_options or {}))

    with torch.no_grad():
        metrics = {
            "actor/pg_loss": pg_loss.item(),
            "actor/clipfrac": _token_mean((pg_losses2 > pg_losses1).to(pg_losses.dtype), response_mask),
            "actor/approx_kl": _token_mean(0.5 * log_ratio.square(), response_mask),
            "actor/ratio_mean": _token_mean(ratio, response_mask),
        }
    return pg_loss, metrics


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Detached token-mean of ``values`` ``[B, L]`` over ``mask`` ``[B, L]``, as a python float."""
    return aggregation.aggregate("token-mean", values=values.detach(), mask=mask).item()
