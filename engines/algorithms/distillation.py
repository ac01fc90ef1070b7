"""Distillation divergences: teacher and student log-probabilities over K buckets ``[B, L, K]`` → scalar loss.

The K buckets are either the full vocabulary (K = V) or the top-k+tail form: the teacher's k most likely
token ids plus one bucket for the rest of the vocabulary (``topk_buckets``). Each registered divergence
returns the per-token divergence ``[B, L]``; ``compute`` takes its token-mean over the mask::

    loss, metrics = distillation.compute("forward_kl", teacher_logprobs=T, student_logprobs=S, mask=M)

With p the teacher's and q the student's distribution over the buckets (``KL(a || b) = sum a log(a/b)``):

- ``forward_kl``  KL(p || q), mass-covering;  ``reverse_kl``  KL(q || p), mode-seeking.
- ``js``  ½ KL(p || m) + ½ KL(q || m), m = ½ p + ½ q.
- ``gkd_jsd``  generalized JSD with weight ``beta`` (GKD, Agarwal et al. 2024).
- ``skewed_forward_kl`` / ``skewed_reverse_kl``  DistiLLM's skew ``lam`` (Ko et al. 2024).
- ``adaptive_kl``  forward and reverse KL weighted by head/tail gaps (Wu et al. 2024).
- ``mixed``  ``weight`` · forward_kl + (1 − weight) · reverse_kl.

The teacher is a constant (detached). Log-probs should already be at the distillation temperature; a
T² factor is the caller's (a scalar on the loss). Zero-probability buckets never make a NaN value or
gradient: ``-inf`` log-probs are read as ``LOG_PROB_FLOOR``, so a term
``a log(a/b)`` with ``a = 0`` is 0 to float resolution (also when ``b = 0``), and where ``a > 0`` but
``b = 0`` (an infinite divergence) the term is the large but bounded ``a (log a + 100)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from engines.registry import Registry

DivergenceFn = Callable[..., torch.Tensor]

DIVERGENCES: Registry[DivergenceFn] = Registry("distillation divergence")
register = DIVERGENCES.register

LOG_PROB_FLOOR = -100.0
"""``-inf`` log-probs are read as ``-100`` (probability ~4e-44) inside the divergences: a bucket the other
side gives mass ``a`` costs ``a · (log a + 100)`` instead of ``+inf``."""


def compute(
    name: str,
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K] log p over K buckets (constant)
    student_logprobs: torch.Tensor,  # [B, L, K] log q over the same buckets, requires grad
    mask: torch.Tensor,  # [B, L] 1.0 on distilled tokens
    **options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean over ``mask`` of the named per-token divergence: ``sum(D * M) / max(sum(M), 1)``, a scalar.

    Positions outside ``mask`` never contribute, whatever they hold. Metrics (python floats):
    ``distill/loss`` and ``distill/top1_agreement``, the share of masked tokens whose most likely bucket is
    the same for teacher and student (in the top-k+tail form the tail counts as one bucket).
    """
    per_token = divergence(name, teacher_logprobs=teacher_logprobs, student_logprobs=student_logprobs, **options)
    if mask.shape != per_token.shape:
        raise ValueError(f"distillation divergence {name!r}: mask must be [B, L] = {tuple(per_token.shape)}, "
                         f"got {tuple(mask.shape)}")
    on = mask > 0
    weights = torch.where(on, mask, torch.zeros_like(mask)).to(per_token.dtype)
    loss = (torch.where(on, per_token, torch.zeros_like(per_token)) * weights).sum() / weights.sum().clamp(min=1)
    with torch.no_grad():
        agree = (teacher_logprobs.argmax(-1) == student_logprobs.argmax(-1)).to(weights.dtype)  # [B, L]
        metrics = {"distill/loss": float(loss.detach()),
                   "distill/top1_agreement": float((agree * weights).sum() / weights.sum().clamp(min=1))}
    return loss, metrics


def divergence(
    name: str,
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
    **options: Any,
) -> torch.Tensor:
    """The named divergence per token, ``[B, L]`` (no mask, no reduction), for callers that normalise
    over more than one micro-batch. Checks the options and that both inputs have the same shape."""
    DIVERGENCES.check_options(name, options)
    if teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(f"distillation divergence {name!r}: teacher and student log-probs must have the same "
                         f"[B, L, K] shape, got {tuple(teacher_logprobs.shape)} and {tuple(student_logprobs.shape)}")
    return DIVERGENCES.get(name)(teacher_logprobs=teacher_logprobs.detach(), student_logprobs=student_logprobs,
                                 **options)


def names() -> list[str]:
    """The registered divergences, sorted."""
    return DIVERGENCES.names()


def option_names(name: str) -> set[str]:
    """Options ``compute(name, ...)`` accepts: the divergence's own keyword options."""
    return DIVERGENCES.keyword_options(name)


def topk_buckets(
    *,
    teacher_topk_logprobs: torch.Tensor,  # [B, L, k] log p of the teacher's top-k ids (full-vocabulary log-probs)
    student_topk_logprobs: torch.Tensor,  # [B, L, k] log q of the same ids (full-vocabulary log-softmax)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append each side's tail bucket ``log(1 - sum_k exp(logprobs))``: returns teacher and student ``[B, L, k+1]``.

    The tail is computed as ``log(-expm1(logsumexp(top-k)))`` in float32 or wider (the outputs' dtype),
    and is exactly ``-inf`` when the top-k hold all the mass up to the rounding of their sum (a tail at
    most ``k · eps`` of that dtype; pass float64 for a finer tail). So forward KL over the buckets is the
    full-vocabulary forward KL whenever the k ids cover the teacher's support, and every divergence
    equals its full-vocabulary value at k = V. The student's tail is differentiable in its top-k
    log-probs (gradient 0 where it is ``-inf``).
    """
    return _with_tail(teacher_topk_logprobs.detach()), _with_tail(student_topk_logprobs)


def full_to_topk(teacher_vocab_logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` most likely token ids ``[B, L, k]`` (long) and their log-probs ``[B, L, k]``,
    most likely first, from full-vocabulary log-probs ``[B, L, V]``."""
    if not 1 <= k <= teacher_vocab_logprobs.shape[-1]:
        raise ValueError(f"k must be in [1, {teacher_vocab_logprobs.shape[-1]}] (the vocabulary), got {k}")
    values, ids = torch.topk(teacher_vocab_logprobs, k, dim=-1, largest=True, sorted=True)
    return ids, values


def _with_tail(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` → ``[..., k+1]`` with the tail bucket ``log(1 - sum exp)`` last, in float32 or wider (a
    half-precision sum could not tell a tail of a few percent from rounding)."""
    topk_logprobs = topk_logprobs.to(torch.promote_types(topk_logprobs.dtype, torch.float32))
    k = topk_logprobs.shape[-1]
    finfo = torch.finfo(topk_logprobs.dtype)
    log_covered = torch.logsumexp(topk_logprobs, dim=-1, keepdim=True).clamp(max=0.0)  # [..., 1] log sum_k
    tail_mass = -torch.expm1(log_covered)  # [..., 1] 1 - sum_k, accurate when sum_k is near 1
    empty = tail_mass <= k * finfo.eps
    tail = torch.where(empty, torch.full_like(tail_mass, -math.inf), torch.log(tail_mass.clamp(min=finfo.tiny)))
    return torch.cat([topk_logprobs, tail], dim=-1)


def _floor(logprobs: torch.Tensor) -> torch.Tensor:
    """``-inf`` read as ``LOG_PROB_FLOOR``; finite values (even below it) and their gradients are kept, so a
    student far off a teacher token still gets pulled back."""
    return torch.where(torch.isneginf(logprobs), torch.full_like(logprobs, LOG_PROB_FLOOR), logprobs)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``KL(a || b) = sum_K a (log a - log b)`` over the last dim, ``[..., K]`` → ``[...]``.

    ``-inf`` on either side reads as the floor, so a bucket with ``a = 0`` weighs ``e^-100`` (~4e-44, below
    the resolution of any sum it joins): ``0 log 0 = 0`` without a NaN.
    """
    la, lb = _floor(log_a), _floor(log_b)
    return (torch.exp(la) * (la - lb)).sum(-1)


def _log_mix(log_a: torch.Tensor, log_b: torch.Tensor, weight: float) -> torch.Tensor:
    """``log(weight · a + (1 - weight) · b)``, elementwise and stable, for ``weight`` in ``[0, 1]``."""
    if weight == 0.0:
        return _floor(log_b)
    if weight == 1.0:
        return _floor(log_a)
    return torch.logaddexp(_floor(log_a) + math.log(weight), _floor(log_b) + math.log1p(-weight))


def _check_unit(name: str, option: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"distillation divergence {name!r}: {option} must be in [0, 1], got {value}")


@register("forward_kl")
def forward_kl(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
) -> torch.Tensor:
    """``KL(p || q) = sum_K p (log p - log q)``, returns ``[B, L]``. Supervised KD (Hinton et al. 2015,
    arXiv:1503.02531) on token distributions; mass-covering: the student must cover every teacher token."""
    return _kl(teacher_logprobs, student_logprobs)


@register("reverse_kl")
def reverse_kl(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
) -> torch.Tensor:
    """``KL(q || p) = sum_K q (log q - log p)``, returns ``[B, L]``. Mode-seeking (MiniLLM, Gu et al. 2024,
    arXiv:2306.08543): the student is pushed off buckets the teacher finds unlikely."""
    return _kl(student_logprobs, teacher_logprobs)


def _generalized_jsd(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``, for ``0 < beta < 1``."""
    log_m = _log_mix(teacher_logprobs, student_logprobs, beta)
    return beta * _kl(teacher_logprobs, log_m) + (1.0 - beta) * _kl(student_logprobs, log_m)


@register("js")
def js(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
) -> torch.Tensor:
    """Jensen–Shannon divergence (Lin 1991), symmetric and bounded by ``ln 2``, returns ``[B, L]``::

        JS = ½ KL(p || m) + ½ KL(q || m),   m = ½ p + ½ q

    ``gkd_jsd`` with ``beta = 0.5``.
    """
    return _generalized_jsd(teacher_logprobs, student_logprobs, 0.5)


@register("gkd_jsd")
def gkd_jsd(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
    beta: float = 0.5,
) -> torch.Tensor:
    """Generalized JSD of GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
    from Self-Generated Mistakes", arXiv:2306.13649, eq. 1), as TRL's ``GKDTrainer.generalized_jsd_loss``::

        m    = beta p + (1 - beta) q
        JSD  = beta KL(p || m) + (1 - beta) KL(q || m)       for 0 < beta < 1
             = KL(p || q)  (forward KL)                      for beta = 0
             = KL(q || p)  (reverse KL)                      for beta = 1

    The ends are TRL's definitions, not limits of the formula (which tends to 0 there); they make
    ``beta`` slide from mass-covering to mode-seeking. Returns ``[B, L]``.
    """
    _check_unit("gkd_jsd", "beta", beta)
    if beta == 0.0:
        return _kl(teacher_logprobs, student_logprobs)
    if beta == 1.0:
        return _kl(student_logprobs, teacher_logprobs)
    return _generalized_jsd(teacher_logprobs, student_logprobs, beta)


@register("skewed_forward_kl")
def skewed_forward_kl(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
    lam: float = 0.1,
) -> torch.Tensor:
    """Skew KL of DistiLLM (Ko et al. 2024, "DistiLLM: Towards Streamlined Distillation for Large Language
    Models", arXiv:2402.03898): ``KL(p || lam p + (1 - lam) q)``, returns ``[B, L]``.

    Mixing a little of the teacher into the student keeps the divergence and its gradient bounded where
    the student gives a teacher token almost no mass. ``lam = 0`` is ``forward_kl``; the paper uses 0.1.
    The gradient flows through ``q`` inside the mixture.
    """
    _check_unit("skewed_forward_kl", "lam", lam)
    return _kl(teacher_logprobs, _log_mix(teacher_logprobs, student_logprobs, lam))


@register("skewed_reverse_kl")
def skewed_reverse_kl(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
    lam: float = 0.1,
) -> torch.Tensor:
    """Skew reverse KL of DistiLLM (Ko et al. 2024, arXiv:2402.03898): ``KL(q || lam q + (1 - lam) p)``,
    returns ``[B, L]``. ``lam = 0`` is ``reverse_kl``; the paper uses 0.1."""
    _check_unit("skewed_reverse_kl", "lam", lam)
    return _kl(student_logprobs, _log_mix(student_logprobs, teacher_logprobs, lam))


@register("adaptive_kl")
def adaptive_kl(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
    alpha: float = 0.5,
) -> torch.Tensor:
    """Adaptive KL (Wu et al. 2024, "Rethinking Kullback-Leibler Divergence in Knowledge Distillation for
    Large Language Models", arXiv:2404.02657): forward KL fits the teacher's head, reverse KL its tail,
    so each is weighted by how far the student is off in that part::

        tail    = the least likely teacher buckets whose cumulative teacher mass is <= alpha
        head    = the other buckets
        g_head  = sum_head |p - q|,  g_tail = sum_tail |p - q|                (detached)
        AKL     = (g_head KL(p || q) + g_tail KL(q || p)) / (g_head + g_tail)

    The split follows ROLL's and DistiLLM's implementations (ascending teacher probabilities, cumulative
    mass <= alpha is the tail); the paper's ``mu`` is the head's share, ``1 - alpha``. Ties between equal
    teacher probabilities are split in sort order. Where ``p == q`` both gaps are 0 and so is AKL.
    Returns ``[B, L]``.
    """
    _check_unit("adaptive_kl", "alpha", alpha)
    with torch.no_grad():
        p, q = teacher_logprobs.exp(), student_logprobs.detach().exp()  # [B, L, K]
        p_sorted, order = p.sort(dim=-1)  # ascending
        gap = (p_sorted - q.gather(-1, order)).abs()  # [B, L, K]
        tail = (torch.cumsum(p_sorted, dim=-1) <= alpha).to(gap.dtype)
        g_head, g_tail = (gap * (1 - tail)).sum(-1), (gap * tail).sum(-1)  # [B, L]
        total = (g_head + g_tail).clamp(min=torch.finfo(gap.dtype).tiny)
    return (g_head / total) * _kl(teacher_logprobs, student_logprobs) + (g_tail / total) * _kl(
        student_logprobs, teacher_logprobs)


@register("mixed")
def mixed(
    *,
    teacher_logprobs: torch.Tensor,  # [B, L, K]
    student_logprobs: torch.Tensor,  # [B, L, K]
    weight: float = 0.5,
) -> torch.Tensor:
    """``weight · KL(p || q) + (1 - weight) · KL(q || p)``, a fixed blend of forward and reverse KL,
    returns ``[B, L]``. ``weight = 1`` is ``forward_kl``, ``weight = 0`` is ``reverse_kl``."""
    _check_unit("mixed", "weight", weight)
    return weight * _kl(teacher_logprobs, student_logprobs) + (1.0 - weight) * _kl(student_logprobs, teacher_logprobs)
