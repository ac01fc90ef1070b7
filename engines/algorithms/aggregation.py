"""Loss aggregation: reduce a per-token quantity ``[B, L]`` to a scalar over the response mask.

The mode decides how tokens and sequences are weighted, which is where GRPO variants differ:

- ``token-mean``: every response token in the batch weighs the same (DAPO, verl's default).
- ``seq-mean-token-sum``: sum inside each sequence, mean over sequences.
- ``seq-mean-token-mean``: mean inside each sequence, mean over sequences (original GRPO, Shao et al. 2024).
- ``seq-mean-token-sum-norm``: sum over all tokens divided by ``B * norm`` with a constant ``norm``
  (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783), removing the length bias of per-sequence means.

``mask`` is 1.0 on response tokens and 0 elsewhere; positions outside it never contribute.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engines.registry import Registry

AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry("loss aggregation")
register = AGGREGATIONS.register


def aggregate(mode: str, *, values: torch.Tensor, mask: torch.Tensor, **options: Any) -> torch.Tensor:
    """Reduce ``values`` ``[B, L]`` over ``mask`` ``[B, L]`` with the named ``mode``; returns a scalar."""
    return AGGREGATIONS.get(mode)(values=values, mask=mask, **options)


def names() -> list[str]:
    """The registered aggregation modes, sorted."""
    return AGGREGATIONS.names()


@register("token-mean")
def token_mean(
    *,
    values: torch.Tensor,  # [B, L]
    mask: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``sum(X * M) / max(sum(M), 1)``: the mean over every response token in the batch.

    Returns a scalar. An all-zero mask gives 0.
    """
    return (values * mask).sum() / mask.sum().clamp(min=1)


@register("seq-mean-token-sum")
def seq_mean_token_sum(
    *,
    values: torch.Tensor,  # [B, L]
    mask: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``mean_i sum_t X[i, t] * M[i, t]``: per-sequence token sums, averaged over the ``B`` rows.

    Returns a scalar.
    """
    seq_sums = (values * mask).sum(dim=-1)  # [B]
    return seq_sums.mean()


@register("seq-mean-token-mean")
def seq_mean_token_mean(
    *,
    values: torch.Tensor,  # [B, L]
    mask: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``mean_i (sum_t X[i, t] * M[i, t]) / max(sum_t M[i, t], 1)``: per-sequence token means, averaged.

    The per-sequence mean of GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3).
    A row with no response tokens counts as 0 and still counts in the ``B`` of the outer mean.
    Returns a scalar.
    """
    seq_sums = (values * mask).sum(dim=-1)  # [B]
    seq_lens = mask.sum(dim=-1).clamp(min=1)  # [B]
    return (seq_sums / seq_lens).mean()


@register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    *,
    values: torch.Tensor,  # [B, L]
    mask: torch.Tensor,  # [B, L]
    norm: float | None = None,
) -> torch.Tensor:
    """``sum(X * M) / (B * norm)``: token sums divided by a constant, not by each sequence's length.

    Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783) replaces the
    per-sequence ``1/|o_i|`` of GRPO with one constant so long and short answers are not reweighted.

    Args:
        norm: the constant normaliser, usually the maximum generation length; ``None`` means ``L``,
            the second dimension of ``values``.

    Returns a scalar.
    """
    batch_size, seq_len = values.shape
    norm = seq_len if norm is None else norm
    return (values * mask).sum() / (batch_size * norm)
