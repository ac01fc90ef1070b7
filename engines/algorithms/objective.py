"""Training objectives handed to ``TrainEngine.train_step``: picklable, backend-agnostic callables.

An objective receives the current policy's per-token ``logprobs`` and ``entropy`` for one micro-batch
and returns ``(loss, metrics)``. ``micro_weight`` says how much of the full batch's loss a micro-batch
carries, so gradient accumulation over micro-batches equals one pass over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.algorithms import aggregation, kl, losses
from engines.types import TrainBatch


def micro_weight(agg: str, micro: TrainBatch, full: TrainBatch) -> float:
    """Share of the full-batch aggregate that ``micro`` contributes: tokens for token-mean, rows otherwise."""
    if agg == "token-mean":
        return float(micro.response_mask.sum() / full.response_mask.sum().clamp(min=1))
    return len(micro) / len(full)


@dataclass(frozen=True)
class PolicyObjective:
    """``loss = policy_loss(agg) + kl_coef · agg(kl_estimator(logπ, logπ_ref)) − entropy_coef · agg(H)``.

    Reads ``advantages`` and ``old_logprobs`` (and ``ref_logprobs`` when ``kl_coef > 0``) from the batch.
    """

    policy_loss: str = "ppo_clip"
    agg: str = "token-mean"
    loss_options: dict = field(default_factory=dict)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __call__(self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch):
        mask = batch.response_mask  # [B, L]
        loss, metrics = losses.compute(
            self.policy_loss,
            logprobs=logprobs,
            old_logprobs=batch.tensors["old_logprobs"],
            advantages=batch.tensors["advantages"],
            response_mask=mask,
            agg=self.agg,
            **self.loss_options,
        )
        if self.kl_coef > 0:
            kl_tok = kl.compute(self.kl_estimator, logprobs=logprobs, ref_logprobs=batch.tensors["ref_logprobs"])
            kl_value = aggregation.aggregate(self.agg, values=kl_tok, mask=mask)
            loss = loss + self.kl_coef * kl_value
            metrics["actor/kl"] = float(kl_value.detach())
        if entropy is not None:
            entropy_value = aggregation.aggregate(self.agg, values=entropy, mask=mask)
            metrics["actor/entropy"] = float(entropy_value.detach())
            if self.entropy_coef:
                loss = loss - self.entropy_coef * entropy_value
        return loss, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return micro_weight(self.agg, micro, full)


@dataclass(frozen=True)
class SFTObjective:
    """Supervised fine-tuning: ``loss = −mean over response tokens of log π(y_t | y_<t, x)``."""

    agg: str = "token-mean"

    def __call__(self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch):
        nll = aggregation.aggregate(self.agg, values=-logprobs, mask=batch.response_mask)
        metrics = {"sft/nll": float(nll.detach())}
        if entropy is not None:
            metrics["sft/entropy"] = float(aggregation.aggregate(self.agg, values=entropy, mask=batch.response_mask))
        return nll, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return micro_weight(self.agg, micro, full)
