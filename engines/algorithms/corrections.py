"""Off-policy corrections: reweight or reject the tokens of samples a different policy generated.

The tokens of a batch were sampled by the rollout engine's policy ``μ`` (``rollout_logprobs``): a vLLM
kernel that rounds differently from the trainer, or older weights under asynchronous training. ``π_prox``
is the trainer's policy at the weights the batch starts from (``old_logprobs: trainer``, recomputed; with
``old_logprobs: rollout`` it is ``μ`` itself, "bypass", and every correction is a no-op). Per token::

    log ρ_t = log π_prox(o_t) - log μ(o_t)          # 0 outside the loss mask

A correction maps ``log ρ`` to detached per-token ``weights`` that multiply the policy-gradient term and a
``keep`` mask of the tokens that stay in the loss at all (rejection sampling: a rejected token leaves the
numerator *and* the denominator of the aggregation, so the kept tokens' weight does not shrink). Every
correction depends on the batch only, not on the weights being trained, so it is applied once when the
train batch is built (``engines.batches.advantage_batch``) and micro-batching leaves it unchanged::

    weights, keep, metrics = corrections.compute("icepop", prox_logprobs=OLP, rollout_logprobs=RLP,
                                                 loss_mask=M, low=0.5, high=5.0)

Each one is the identity when ``ρ ≡ 1`` (weights 1, every token kept); its options are validated so that
this holds. CISPO, the other correction the asynchronous-RL literature uses, changes the loss itself and is
the policy loss ``cispo`` (``engines.algorithms.losses``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from engines.algorithms.losses import LOG_RATIO_CLAMP, _masked_log_ratio
from engines.registry import Registry

CorrectionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

CORRECTIONS: Registry[CorrectionFn] = Registry("off-policy correction")
register = CORRECTIONS.register

def compute(name: str, *, prox_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
            **options) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The named correction's ``(weights [B, L], keep [B, L], metrics)``, all detached; ``weights`` are 1 and
    ``keep`` is 0 outside ``loss_mask``.

    Metrics over the response tokens of ``loss_mask``: ``offpolicy/masked_fraction`` (share rejected),
    ``offpolicy/clipped_fraction`` (share whose weight a cap lowered), ``offpolicy/weight_mean`` (over the
    kept tokens)."""
    with torch.no_grad():
        mask = loss_mask > 0
        log_ratio = _masked_log_ratio(prox_logprobs, rollout_logprobs, loss_mask)
        weights, keep, clipped = CORRECTIONS.get(name)(log_ratio=log_ratio, mask=mask, **options)
        weights = torch.where(mask, weights, torch.ones_like(weights))
        keep = keep & mask
        tokens = max(int(mask.sum()), 1)
        kept = int(keep.sum())
        metrics = {"offpolicy/masked_fraction": 1.0 - kept / tokens if mask.any() else 0.0,
                   "offpolicy/clipped_fraction": float((clipped & mask).sum()) / tokens,
                   "offpolicy/weight_mean": float(weights[keep].mean()) if kept else 1.0}
    return weights, keep.to(loss_mask.dtype), metrics


def names() -> list[str]:
    """The registered corrections, sorted."""
    return CORRECTIONS.names()


def check(name: str, options: dict) -> None:
    """Raise when ``name`` is not registered, takes none of ``options``, or ``options`` would make it act on
    on-policy tokens (ρ ≡ 1 must leave every token as it is)."""
    CORRECTIONS.check_options(name, options)
    log_ratio, mask = torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
    weights, keep, _ = CORRECTIONS.get(name)(log_ratio=log_ratio, mask=mask, **options)
    if not (bool(keep.all()) and torch.equal(weights, torch.ones_like(weights))):
        raise ValueError(f"off-policy correction {name!r} with {options} changes on-policy tokens (ρ = 1): "
                         "a cap must be >= 1 and a [low, high] range must hold 1")


def _sequence_sum(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t log ρ_t`` per row, ``[B, 1]``, over ``mask`` (``log_ratio`` is 0 elsewhere)."""
    return (log_ratio * mask).sum(-1, keepdim=True)


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@register("tis")
def tis(*, log_ratio: torch.Tensor, mask: torch.Tensor, cap: float = 2.0):
    """Token-level truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl)::

        w_t = min(ρ_t, C)        keep_t = 1

    ``cap`` C >= 1 (2 in the post)."""
    weights = _ratio(log_ratio).clamp(max=cap)
    return weights, torch.ones_like(mask), log_ratio > math.log(cap)


@register("icepop")
def icepop(*, log_ratio: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 5.0):
    """IcePop's token-level masked importance sampling (Ling Team 2025, "Every Step Evolves: Scaling RL for
    Trillion-Scale Thinking Model", arXiv:2510.18855, eq. 4-5)::

        w_t = ρ_t                keep_t = 1[α <= ρ_t <= β]

    ``low`` α <= 1 <= ``high`` β (0.5 and 5 in the paper): tokens whose probabilities disagree by more are
    dropped, the rest reweighted exactly."""
    ratio = _ratio(log_ratio)
    return ratio, (ratio >= low) & (ratio <= high), torch.zeros_like(mask)


@register("seq_tis")
def seq_tis(*, log_ratio: torch.Tensor, mask: torch.Tensor, cap: float = 2.0):
    """Sequence-level truncated importance sampling (Liu, Li et al. 2025, "When Speed Kills Stability:
    Demystifying RL Collapse from the Training-Inference Mismatch", yingru.notion.site): the product of the
    row's token ratios, truncated, on every token of the row::

        w_t = min(Π_s ρ_s, C)    keep_t = 1

    ``cap`` C >= 1."""
    sequence = _sequence_sum(log_ratio, mask)  # [B, 1]
    weights = _ratio(sequence).clamp(max=cap).expand_as(log_ratio)
    return weights, torch.ones_like(mask), (sequence > math.log(cap)).expand_as(mask)


@register("seq_mis")
def seq_mis(*, log_ratio: torch.Tensor, mask: torch.Tensor, cap: float = 2.0):
    """Sequence-level masked importance sampling (Liu, Li et al. 2025, as ``seq_tis``): rows whose ratio
    product passes the cap are rejected whole, the others reweighted by it::

        w_t = Π_s ρ_s            keep_t = 1[Π_s ρ_s <= C]

    ``cap`` C >= 1."""
    sequence = _sequence_sum(log_ratio, mask)  # [B, 1]
    return _ratio(sequence).expand_as(log_ratio), (sequence <= math.log(cap)).expand_as(mask), torch.zeros_like(mask)


@register("geo_mask")
def geo_mask(*, log_ratio: torch.Tensor, mask: torch.Tensor, low: float = 0.9, high: float = 1.1):
    """Geometric-mean rejection (Liu, Li et al. 2025, as ``seq_tis``): a row stays when the geometric mean
    of its token ratios lies within bounds; weights are not changed. It does not grow with length as the
    product does::

        g   = exp(Σ_s log ρ_s / n)   (n: the row's response tokens)
        w_t = 1                  keep_t = 1[low <= g <= high]

    ``low`` <= 1 <= ``high``."""
    tokens = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    mean_log = _sequence_sum(log_ratio, mask) / tokens  # [B, 1]
    keep = (mean_log >= math.log(low)) & (mean_log <= math.log(high))
    return torch.ones_like(log_ratio), keep.expand_as(mask), torch.zeros_like(mask)


@register("decoupled_ppo")
def decoupled_ppo(*, log_ratio: torch.Tensor, mask: torch.Tensor, cap: float = 5.0):
    """AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
    Learning System for Language Reasoning", arXiv:2505.24298, eq. 5): PPO's clipped ratio is taken against
    the proximal policy ``π_prox`` (``old_logprobs``: the trainer's, recomputed), and the behaviour policy
    ``μ`` that sampled the token enters only as an importance weight; tokens whose weight passes the cap
    are dropped (AReaL's ``behav_imp_weight_cap``)::

        loss_t = -(π_prox/μ)_t · min(r_t A_t, clip(r_t, 1-ε, 1+ε) A_t),   r_t = π_θ/π_prox
        w_t    = ρ_t             keep_t = 1[ρ_t <= C]

    ``cap`` C >= 1. Use it with ``policy_loss: ppo_clip`` and ``old_logprobs: trainer``."""
    ratio = _ratio(log_ratio)
    return ratio, ratio <= cap, torch.zeros_like(mask)
