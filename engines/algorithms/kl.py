"""Per-token estimators of KL(pi_theta || pi_ref) from sampled tokens' log-probabilities.

Names follow Schulman (2020), "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html):
with the sample drawn from pi_theta and ``r = pi_ref / pi_theta``, i.e. ``log r = RLP - LP``,

- ``k1 = -log r``: unbiased, high variance, can be negative.
- ``k2 = 0.5 * (log r)^2``: biased, low variance, non-negative.
- ``k3 = (r - 1) - log r``: unbiased, low variance, non-negative; GRPO's KL term
  (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 4).

Each returns a ``[B, L]`` tensor; masking and reduction are the caller's (see ``aggregation``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engines.registry import Registry

KL_ESTIMATORS: Registry[Callable[..., torch.Tensor]] = Registry("KL estimator")
register = KL_ESTIMATORS.register

K3_LOG_RATIO_CLAMP = 20.0
"""``k3`` clamps ``RLP - LP`` to ``[-20, 20]`` before ``exp`` so a far-off token cannot overflow."""


def compute(name: str, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, **options: Any) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` from the named estimator."""
    return KL_ESTIMATORS.get(name)(logprobs=logprobs, ref_logprobs=ref_logprobs, **options)


def names() -> list[str]:
    """The registered KL estimators, sorted."""
    return KL_ESTIMATORS.names()


@register("k1")
def k1(
    *,
    logprobs: torch.Tensor,  # [B, L] log pi_theta(o_t)
    ref_logprobs: torch.Tensor,  # [B, L] log pi_ref(o_t)
) -> torch.Tensor:
    """``k1 = LP - RLP`` (= ``-log r``), returns ``[B, L]``. Schulman 2020, unbiased estimator."""
    return logprobs - ref_logprobs


@register("k2")
def k2(
    *,
    logprobs: torch.Tensor,  # [B, L]
    ref_logprobs: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``k2 = 0.5 * (LP - RLP)^2``, returns ``[B, L]``. Schulman 2020, low-variance biased estimator."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register("k3")
def k3(
    *,
    logprobs: torch.Tensor,  # [B, L]
    ref_logprobs: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``k3 = exp(RLP - LP) - (RLP - LP) - 1``, returns ``[B, L]``.

    Schulman 2020's unbiased, low-variance, non-negative estimator; the KL penalty of GRPO
    (Shao et al. 2024, arXiv:2402.03300, eq. 4). ``RLP - LP`` is clamped to ``[-20, 20]`` before ``exp``
    for numerical stability (``exp(20)`` is about 4.9e8, well inside float32/bf16 range).
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # [B, L]
    return torch.exp(log_ratio) - log_ratio - 1.0


def adaptive_kl_coef(*, coef: float, observed_kl: float, target_kl: float, horizon: int, num_samples: int) -> float:
    """Adaptive KL controller (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
    arXiv:1909.08593, sec. 2.2)::

        e      = clip(observed_kl / target_kl - 1, -0.2, 0.2)
        coef' = coef * (1 + e * num_samples / horizon)

    ``observed_kl`` is this step's mean per-sequence KL to the reference; ``num_samples`` the rollouts it
    was measured on; ``horizon`` how many samples it takes to move ``coef`` by a factor ~e^0.2.
    """
    error = min(max(observed_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_samples / horizon)
