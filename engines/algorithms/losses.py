"""Policy losses: log-probabilities and advantages ``[B, L]`` → ``(scalar loss, metrics)``.

Every registered loss returns the per-token loss ``[B, L]`` and its metrics; ``compute`` applies the
optional truncated importance-sampling correction and reduces with an ``aggregation`` mode::

    loss, metrics = losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A,
                                   loss_mask=M, agg="token-mean", clip_low=0.2, clip_high=0.28)

Positions outside ``M`` get log-ratio 0 before any ``exp``, so padding can never make an inf or NaN.
``metrics`` holds detached python floats under ``actor/...`` (token-means over ``M``) and, when rollout
logprobs are given, the train/rollout mismatch under ``mismatch/...``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engines.algorithms import aggregation
from engines.registry import Registry

TokenLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

POLICY_LOSSES: Registry[TokenLossFn] = Registry("policy loss")
register = POLICY_LOSSES.register

COMMON_OPTIONS = ("agg_options", "tis_cap")
"""Options ``compute`` takes for every loss (besides ``agg``), on top of each loss's own."""

LOG_RATIO_CLAMP = 20.0
"""Sequence-level log-ratios are clamped to ``[-20, 20]`` before ``exp``."""


def compute(
    name: str,
    *,
    logprobs: torch.Tensor,  # [B, L] log pi_theta(o_t), requires grad
    old_logprobs: torch.Tensor,  # [B, L] log pi_old(o_t), the policy the advantages belong to
    advantages: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    agg: str = "token-mean",
    agg_options: dict[str, Any] | None = None,
    rollout_logprobs: torch.Tensor | None = None,  # [B, L] log pi_rollout(o_t), the inference engine's
    tis_cap: float = 0.0,
    is_weights: torch.Tensor | None = None,  # [B, L] an off-policy correction's weights (engines.algorithms.corrections)
    **options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the named loss, weight it by ``is_weights`` when given and by truncated IS when ``tis_cap > 0``,
    aggregate with ``agg``.

    Truncated importance sampling for the train/rollout mismatch (Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl)::

        w_t    = min(exp(OLP_t - RLP_t), tis_cap)     # detached; OLP from the trainer, RLP from the sampler
        loss_t = w_t * loss_t

    Whenever ``rollout_logprobs`` are given, ``mismatch/k3`` (k3 KL of rollout vs trainer policy) and
    ``mismatch/max_abs_logprob_diff`` are reported, corrected or not.
    """
    token_losses, metrics = POLICY_LOSSES.get(name)(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        loss_mask=loss_mask,
        **options,
    )
    if rollout_logprobs is not None:
        metrics.update(mismatch_metrics(old_logprobs, rollout_logprobs, loss_mask))
    if is_weights is not None:
        token_losses = token_losses * is_weights
    if tis_cap > 0:
        if rollout_logprobs is None:
            raise ValueError("tis_cap > 0 needs rollout_logprobs (the inference engine's logprobs)")
        weights = truncated_is_weights(old_logprobs, rollout_logprobs, loss_mask, cap=tis_cap)
        token_losses = token_losses * weights
        metrics["actor/tis_weight_mean"] = _token_mean(weights, loss_mask)
    loss = aggregation.aggregate(agg, values=token_losses, mask=loss_mask, **(agg_options or {}))
    metrics["actor/pg_loss"] = float(loss.detach())
    return loss, metrics


def names() -> list[str]:
    """The registered policy losses, sorted."""
    return POLICY_LOSSES.names()


def option_names(name: str) -> set[str]:
    """Options ``compute(name, ...)`` accepts: the loss's own keyword options plus ``COMMON_OPTIONS``."""
    import inspect

    params = inspect.signature(POLICY_LOSSES.get(name)).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is not p.empty} | set(COMMON_OPTIONS)


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                         cap: float) -> torch.Tensor:
    """``min(exp(OLP - RLP), cap)`` per token, ``[B, L]``, detached (the ``tis`` correction's weights); 1 outside
    ``mask`` (masked later)."""
    from engines.algorithms import corrections

    weights, _, _ = corrections.compute("tis", prox_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                                        loss_mask=mask, cap=cap)
    return weights


def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's token logprobs are from the trainer's: k3 estimate of KL(pi_rollout || pi_train)
    (tokens were sampled by the rollout engine, so ``r = pi_train / pi_rollout``) and the largest gap."""
    with torch.no_grad():
        log_ratio = _masked_log_ratio(old_logprobs.detach(), rollout_logprobs, mask)  # log r = log(pi_train / pi_rollout)
        k3 = torch.exp(log_ratio.clamp(max=LOG_RATIO_CLAMP)) - log_ratio - 1.0
        return {"mismatch/k3": _token_mean(k3, mask), "mismatch/mean_abs_logprob_diff": _token_mean(log_ratio.abs(), mask),
                "mismatch/max_abs_logprob_diff": float((log_ratio.abs() * mask).max())}


# Losses of the form ``A[i, t] · f(π)[i, t]``: a row whose advantages are all 0 adds exactly 0 to the loss
# and to its gradient, so the train step may skip it (tests/algorithms check every name listed here).
ZERO_AT_ZERO_ADVANTAGE = frozenset({"ppo_clip", "gspo", "topr", "importance_sampling", "cispo"})


@register("ppo_clip")
def ppo_clip(
    *,
    logprobs: torch.Tensor,  # [B, L]
    old_logprobs: torch.Tensor,  # [B, L]
    advantages: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), as a loss to minimise::

        ratio     = exp(LP - OLP)                                           # [B, L]
        pg_loss1  = -A * ratio
        pg_loss2  = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)
        pg_loss   = max(pg_loss1, pg_loss2)
        pg_loss   = min(pg_loss, -A * dual_clip)   where A < 0, if dual_clip > 0

    ``clip_low != clip_high`` is DAPO's "clip-higher" (Yu et al. 2025, arXiv:2503.14476). Dual-clip
    (Ye et al. 2020, arXiv:1912.09729, eq. 5) bounds the loss of a negative-advantage token whose ratio
    has grown far above 1; ``dual_clip`` must then be > 1 (3.0 in the paper).

    Metrics: ``actor/clipfrac`` (fraction of tokens where the clip is active), ``actor/dual_clipfrac``,
    ``actor/ratio_mean`` and ``ratio_metrics``' ``actor/approx_kl``, ``actor/ratio_max``, ``actor/ratio_min``.
    """
    if dual_clip and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or 0 to disable), got {dual_clip}")
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, loss_mask)  # [B, L]
    ratio = torch.exp(log_ratio)  # [B, L]
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    dual_clipped = torch.zeros_like(pg_losses, dtype=torch.bool)
    if dual_clip:
        pg_losses3 = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (pg_losses > pg_losses3)
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, pg_losses3), pg_losses)
    with torch.no_grad():
        metrics = {
            "actor/clipfrac": _token_mean((pg_losses2 > pg_losses1).float(), loss_mask),
            "actor/dual_clipfrac": _token_mean(dual_clipped.float(), loss_mask),
            "actor/ratio_mean": _token_mean(ratio, loss_mask),
            **ratio_metrics(log_ratio, loss_mask),
        }
    return pg_losses, metrics


@register("importance_sampling")
def importance_sampling(
    *,
    logprobs: torch.Tensor,  # [B, L]
    old_logprobs: torch.Tensor,  # [B, L] the sampler's (old_logprobs: rollout) or the trainer's at scoring time
    advantages: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance-sampled policy gradient, no clip: the surrogate whose gradient is REINFORCE's on samples
    drawn from the old policy (Kakade & Langford 2002; the update of on-policy distillation, Lu & Thinking
    Machines 2025, "On-Policy Distillation")::

        ratio    = exp(LP - OLP)                                             # [B, L]
        pg_loss  = -A * ratio               # gradient -A * ratio * grad LP

    At the first step after sampling ``ratio`` is 1 and the gradient is the on-policy one. Truncate the
    trainer/sampler weight with ``tis_cap`` (``old_logprobs: trainer``); for a trust region use ``ppo_clip``.

    Metrics: ``actor/ratio_mean`` and ``ratio_metrics``' ``actor/approx_kl``, ``actor/ratio_max``,
    ``actor/ratio_min``.
    """
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, loss_mask)  # [B, L]
    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_CLAMP))  # [B, L]
    with torch.no_grad():
        metrics = {"actor/ratio_mean": _token_mean(ratio, loss_mask), **ratio_metrics(log_ratio, loss_mask)}
    return -advantages * ratio, metrics


@register("gspo")
def gspo(
    *,
    logprobs: torch.Tensor,  # [B, L]
    old_logprobs: torch.Tensor,  # [B, L]
    advantages: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO, sequence-level importance ratio and clipping (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7),
    in its token form GSPO-token (eq. 13), whose gradient equals GSPO's when ``A`` is constant per row::

        log s_i   = (1 / |o_i|) * sum_t M[i, t] (LP - OLP)[i, t]          # [B] length-normalised
        s[i, t]   = exp(sg(log s_i) + LP[i, t] - sg(LP[i, t]))             # value s_i, gradient of LP
        loss[i,t] = max(-A * s, -A * clamp(s, 1 - clip_low, 1 + clip_high))

    Pair with ``agg: seq-mean-token-mean`` (the paper's per-sequence mean). The paper's clip range is
    tiny (3e-4 / 4e-4) because ``s_i`` is a geometric mean over the response.

    Metrics: ``actor/clipfrac`` (fraction of sequences clipped), ``actor/seq_ratio_mean``, and
    ``ratio_metrics`` with the sequence ratios ``s_i`` as ``actor/ratio_max`` / ``actor/ratio_min``.
    """
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, loss_mask)  # [B, L]
    lengths = loss_mask.sum(-1).clamp(min=1)  # [B]
    seq_log_ratio = ((log_ratio * loss_mask).sum(-1) / lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()  # [B, L]
    ratio = torch.exp(torch.where(loss_mask > 0, token_log_ratio, torch.zeros_like(token_log_ratio)))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    with torch.no_grad():
        has_tokens = (loss_mask.sum(-1) > 0).float()  # [B]
        seq_clipped = ((pg_losses2 > pg_losses1).float() * loss_mask).amax(-1)  # [B]
        metrics = {
            "actor/clipfrac": float((seq_clipped * has_tokens).sum() / has_tokens.sum().clamp(min=1)),
            "actor/seq_ratio_mean": float((seq_log_ratio.exp() * has_tokens).sum() / has_tokens.sum().clamp(min=1)),
            **ratio_metrics(log_ratio, loss_mask, seq_log_ratio=seq_log_ratio),
        }
    return pg_losses, metrics


@register("topr")
def topr(
    *,
    logprobs: torch.Tensor,  # [B, L]
    old_logprobs: torch.Tensor,  # [B, L]
    advantages: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv:2503.14286, eq. 9)::

        rho_i     = exp(sum_t M[i, t] (LP - OLP)[i, t])                    # [B] sequence ratio
        c_i       = 1                     if A_i >= 0   (positive: SFT-like, no ratio)
                  = sg(clamp(rho_i, 0, 1)) if A_i < 0   (negative: ratio truncated at 1)
        loss[i,t] = -c_i * A[i, t] * LP[i, t]

    Positive samples are pushed up at full strength however unlikely they became; negative ones are
    pushed down only while still likely, which keeps the update stable off-policy without a KL term.
    Use with the ``topr`` advantage (signed, separately weighted returns).

    Metrics: ``actor/negative_frac`` (share of rows with ``A < 0``), ``actor/negative_weight_mean``,
    ``actor/truncated_frac`` (share of rows whose ratio the truncation cuts: ``A_i < 0`` and ``rho_i > 1``;
    with old logprobs from the rollout engine, float noise alone puts ``rho_i`` either side of 1), and
    ``ratio_metrics`` with the sequence ratios ``rho_i``.
    """
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, loss_mask)
    seq_log_ratio = (log_ratio * loss_mask).sum(-1).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    negative = (advantages * loss_mask).sum(-1) < 0  # [B]
    weights = torch.where(negative, seq_log_ratio.exp().clamp(max=1.0), torch.ones_like(seq_log_ratio))  # [B]
    masked_logprobs = torch.where(loss_mask > 0, logprobs, torch.zeros_like(logprobs))
    pg_losses = -weights.unsqueeze(-1) * advantages * masked_logprobs
    with torch.no_grad():
        metrics = {
            "actor/negative_frac": float(negative.float().mean()),
            "actor/negative_weight_mean": float(weights[negative].mean()) if negative.any() else 1.0,
            "actor/truncated_frac": float((negative & (seq_log_ratio > 0)).float().mean()),
            **ratio_metrics(log_ratio, loss_mask, seq_log_ratio=seq_log_ratio),
        }
    return pg_losses, metrics


@register("cispo")
def cispo(
    *,
    logprobs: torch.Tensor,  # [B, L]
    old_logprobs: torch.Tensor,  # [B, L]
    advantages: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO, clipped importance-sampling weight policy optimisation (MiniMax 2025, arXiv:2506.13585,
    eq. 4-5): the ratio is clipped and its gradient stopped, then it weights REINFORCE's term, so a token
    whose ratio leaves the range keeps its gradient (PPO's clip zeroes it)::

        ratio     = exp(LP - OLP)                                          # [B, L]
        pg_loss   = -sg(clamp(ratio, 1 - clip_low, 1 + clip_high)) * A * LP

    ``clip_low`` 1.0 leaves the ratio unbounded below (the paper sets no lower bound). At ``ratio = 1`` the
    gradient is PPO's, ``-A * grad LP``. Off-policy data (``old_logprobs: rollout``, or asynchronous
    rollouts) is what the clipped weight is for.

    Metrics: ``actor/clipfrac`` (share of tokens whose weight the clip changed), ``actor/ratio_mean`` and
    ``ratio_metrics``.
    """
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, loss_mask)  # [B, L]
    ratio = torch.exp(log_ratio.detach().clamp(max=LOG_RATIO_CLAMP))  # [B, L]
    weights = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    masked_logprobs = torch.where(loss_mask > 0, logprobs, torch.zeros_like(logprobs))
    with torch.no_grad():
        metrics = {"actor/clipfrac": _token_mean((weights != ratio).float(), loss_mask),
                   "actor/ratio_mean": _token_mean(ratio, loss_mask), **ratio_metrics(log_ratio, loss_mask)}
    return -weights * advantages * masked_logprobs, metrics


def value_loss(
    *,
    values: torch.Tensor,  # [B, L] V_phi(s_t), requires grad
    old_values: torch.Tensor,  # [B, L] the critic's values when the rollout was scored
    returns: torch.Tensor,  # [B, L] regression targets (GAE returns)
    loss_mask: torch.Tensor,  # [B, L]
    clip_range: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss (Schulman et al. 2017; as in OpenAI baselines ``ppo2``), per token::

        V_clip = OV + clamp(V - OV, -clip_range, clip_range)
        loss   = 0.5 * max((V - ret)^2, (V_clip - ret)^2)

    ``clip_range == 0`` disables clipping. Returns the per-token loss ``[B, L]`` and metrics
    ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/explained_variance``.
    """
    losses_unclipped = (values - returns).square()
    if clip_range > 0:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        losses_clipped = (clipped_values - returns).square()
        token_losses = 0.5 * torch.maximum(losses_unclipped, losses_clipped)
        clipfrac = _token_mean((losses_clipped > losses_unclipped).float(), loss_mask)
    else:
        token_losses, clipfrac = 0.5 * losses_unclipped, 0.0
    with torch.no_grad():
        mask = loss_mask > 0
        target, predicted = returns[mask], values[mask]
        explained = 1.0 - float((target - predicted).var() / target.var()) if mask.sum() > 1 and target.var() > 0 else 0.0
        metrics = {"critic/vf_clipfrac": clipfrac, "critic/vpred_mean": _token_mean(values, loss_mask),
                   "critic/explained_variance": explained}
    return token_losses, metrics


def ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, *,
                  seq_log_ratio: torch.Tensor | None = None) -> dict[str, float]:
    """How far the policy has moved from the rollout's: ``actor/approx_kl`` (token-mean of
    ``0.5 * (LP - OLP)^2`` over ``mask``, Schulman's approximation of KL(old || new)) and the largest and
    smallest importance ratio, ``actor/ratio_max`` / ``actor/ratio_min``: of the tokens, or of the rows'
    ``seq_log_ratio`` [B] for a sequence-level loss (rows without tokens left out). 1 when nothing counts."""
    with torch.no_grad():
        has_tokens = mask.sum(-1) > 0  # [B]
        ratios = (seq_log_ratio[has_tokens] if seq_log_ratio is not None else log_ratio[mask > 0]).exp()
        return {"actor/approx_kl": _token_mean(0.5 * log_ratio.square(), mask),
                "actor/ratio_max": float(ratios.max()) if ratios.numel() else 1.0,
                "actor/ratio_min": float(ratios.min()) if ratios.numel() else 1.0}


def _masked_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``LP - OLP`` on response tokens, 0 elsewhere (so ``exp`` never sees padding values)."""
    return torch.where(mask > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Detached token-mean of ``values`` ``[B, L]`` over ``mask`` ``[B, L]``, as a python float."""
    return aggregation.aggregate("token-mean", values=values.detach(), mask=mask).item()
