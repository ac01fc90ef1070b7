"""On-policy distillation: the teacher's per-token reverse KL on the student's own samples as advantage.

The student samples completions; a teacher scores the same token ids; each sampled token gets the
advantage ``-λ (log q_student - log p_teacher)``, a one-sample estimate of the per-token reverse KL
``KL(q ‖ p)`` that a policy-gradient update (importance-sampled or PPO-clip) then lowers. Optionally it is
added to the verifiable-reward advantage (``A = A_RL - λ k``). Rows go to one of several teachers by a data
column (``route_rows``).

References: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD, arXiv:2306.13649); Lu & Thinking Machines Lab 2025, "On-Policy Distillation"
(thinkingmachines.ai/blog/on-policy-distillation), whose per-token advantage this is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def distill_advantages(
    *,
    student_logprobs: torch.Tensor,  # [B, L] log q(y_t): the sampler's recorded log-prob of each sampled token
    teacher_logprobs: torch.Tensor,  # [B, L] log p(y_t): the teacher's log-prob of the same token, temperature 1
    loss_mask: torch.Tensor,  # [B, L] 1.0 on the completion (model) tokens
    coef: float,  # λ
    rl_advantages: torch.Tensor | None = None,  # [B, L] A_RL, or None for the teacher's signal alone
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token on-policy distillation advantage::

        k_t = log q(y_t) - log p(y_t)                 # [B, L], on loss_mask tokens, 0 elsewhere
        A_t = A_RL_t - λ k_t    (rl_advantages given)
            =        - λ k_t    (otherwise)

    ``E_{y_t ~ q}[k_t] = KL(q ‖ p)`` at each position, so the token-mean of ``k`` over the completion tokens
    estimates the student's reverse KL to the teacher (``teacher_kl``). ``A_RL`` enters as given: whatever
    normalisation its estimator does (a group's whitening) has happened before and never sees ``k``.

    Returns ``(advantages [B, L], k [B, L])``, both 0 outside ``loss_mask`` and without gradient.
    """
    mask = loss_mask.to(torch.float32)
    k = torch.where(mask > 0, student_logprobs.float() - teacher_logprobs.float(), torch.zeros_like(mask)).detach()
    adv = -coef * k
    if rl_advantages is not None:
        adv = adv + rl_advantages.detach() * mask
    return adv, k


def route_rows(values: Sequence, teachers: Sequence[tuple[str, Sequence[str]]], route_key: str = "domain") -> dict[str, list[int]]:
    """Row indices per teacher: row ``i`` goes to the teacher whose ``values`` hold ``str(values[i])``, else
    to the one with empty ``values`` (the default). ``teachers``: ``(name, values)`` pairs in config order.
    Every teacher is listed, possibly with no rows; a row no teacher takes is a one-line ``ValueError``."""
    routes: dict[str, list[int]] = {name: [] for name, _ in teachers}
    takers = {str(v): name for name, taken in teachers for v in taken}
    default = next((name for name, taken in teachers if not taken), None)
    for i, value in enumerate(values):
        name = takers.get(str(value), default)
        if name is None:
            raise ValueError(f"row {i} has {route_key} {value!r}, which no teacher takes; add it to a teacher's "
                             f"values or leave one teacher's values empty (onpolicy_distill.teachers)")
        routes[name].append(i)
    return routes


def teacher_kl_metrics(k: torch.Tensor, loss_mask: torch.Tensor,
                       groups: dict[str, Sequence[int]] | None = None) -> dict[str, float]:
    """``teacher_kl``: the token-mean of ``k`` [B, L] over ``loss_mask`` [B, L], and ``teacher_kl/<name>``
    over the rows of each of ``groups`` (a domain's or a teacher's); a group without tokens is left out."""
    def token_mean(rows: torch.Tensor | slice) -> float | None:
        tokens = loss_mask[rows].sum()
        return float((k[rows] * loss_mask[rows]).sum() / tokens) if tokens > 0 else None

    metrics = {"teacher_kl": token_mean(slice(None)) or 0.0}
    for name, rows in (groups or {}).items():
        value = token_mean(torch.as_tensor(list(rows), dtype=torch.long))
        if value is not None:
            metrics[f"teacher_kl/{name}"] = value
    return metrics
