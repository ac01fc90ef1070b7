"""Training objectives handed to ``TrainEngine.train_step``: picklable, backend-agnostic callables.

An objective receives the current policy's per-token ``logprobs`` and ``entropy`` (or the critic's
``values``) for one micro-batch and returns ``(loss, metrics)``. ``micro_weight`` says how much of the full batch's loss a micro-batch
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
        return float(micro.loss_mask.sum() / full.loss_mask.sum().clamp(min=1))
    return len(micro) / len(full)


@dataclass(frozen=True)
class PolicyObjective:
    """``loss = policy_loss(agg) + kl_coef · agg(kl_estimator(logπ, logπ_ref)) − entropy_coef · agg(H)``.

    Reads ``advantages``, ``old_logprobs`` and ``rollout_logprobs`` (and ``ref_logprobs`` when
    ``kl_coef > 0``) from the batch. ``kl_coef`` is the KL *loss* term; a KL in the reward is applied
    before the estimator (``engines.batches.advantage_batch``) and leaves ``kl_coef`` at 0 here.
    ``agg_options`` go to the aggregation of every term (e.g. Dr.GRPO's constant ``norm``).
    """

    policy_loss: str = "ppo_clip"
    agg: str = "token-mean"
    loss_options: dict = field(default_factory=dict)
    agg_options: dict = field(default_factory=dict)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    @property
    def needs_entropy_grad(self) -> bool:
        """Whether the loss trains through the entropy (``entropy_coef != 0``); otherwise the engine computes
        it as a metric, without autograd over the vocabulary."""
        return self.entropy_coef != 0

    def __call__(self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch):
        mask = batch.loss_mask  # [B, L]
        loss, metrics = losses.compute(
            self.policy_loss,
            logprobs=logprobs,
            old_logprobs=batch.tensors["old_logprobs"],
            advantages=batch.tensors["advantages"],
            loss_mask=mask,
            agg=self.agg,
            agg_options=self.agg_options,
            rollout_logprobs=batch.tensors.get("rollout_logprobs"),
            **self.loss_options,
        )
        if self.kl_coef > 0:
            kl_tok = kl.compute(self.kl_estimator, logprobs=logprobs, ref_logprobs=batch.tensors["ref_logprobs"])
            kl_value = aggregation.aggregate(self.agg, values=kl_tok, mask=mask, **self.agg_options)
            loss = loss + self.kl_coef * kl_value
            metrics["actor/kl"] = float(kl_value.detach())
        if entropy is not None:
            entropy_value = aggregation.aggregate(self.agg, values=entropy, mask=mask, **self.agg_options)
            metrics["actor/entropy"] = float(entropy_value.detach())
            if self.entropy_coef:
                loss = loss - self.entropy_coef * entropy_value
        return loss, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return micro_weight(self.agg, micro, full)

    def rows_with_gradient(self, batch: TrainBatch) -> torch.Tensor | None:
        """Indices of the rows that can move the weights, or None for all of them.

        Without a KL or entropy term and with a loss in ``losses.ZERO_AT_ZERO_ADVANTAGE``, a row whose
        advantages are 0 on every response token (a GRPO group whose rewards are all equal) contributes
        exactly 0 to the loss and its gradient. Skipping its forward and backward, while each micro-batch
        keeps its weight relative to the full batch (``micro_weight``), leaves the gradient unchanged.
        At least one row stays, so every parameter still gets a (zero) gradient and the optimizer steps
        as it would have (AdamW's moments and weight decay)."""
        if self.kl_coef or self.entropy_coef or self.policy_loss not in losses.ZERO_AT_ZERO_ADVANTAGE:
            return None
        moving = ((batch.tensors["advantages"] != 0) & (batch.loss_mask > 0)).any(-1)  # [B]
        if bool(moving.all()):
            return None
        rows = moving.nonzero().squeeze(-1)
        return rows if len(rows) else torch.zeros(1, dtype=torch.long, device=rows.device)


@dataclass(frozen=True)
class ValueObjective:
    """The critic's ``loss = agg(value_loss(V, V_old, returns))`` (PPO's clipped value regression).

    Reads ``values`` (the critic's values at scoring time) and ``returns`` from the batch."""

    clip_range: float = 0.2
    agg: str = "token-mean"

    def __call__(self, *, values: torch.Tensor, batch: TrainBatch):
        token_losses, metrics = losses.value_loss(values=values, old_values=batch.tensors["values"],
                                                  returns=batch.tensors["returns"], loss_mask=batch.loss_mask,
                                                  clip_range=self.clip_range)
        loss = aggregation.aggregate(self.agg, values=token_losses, mask=batch.loss_mask)
        metrics["critic/vf_loss"] = float(loss.detach())
        return loss, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return micro_weight(self.agg, micro, full)


@dataclass(frozen=True)
class SFTObjective:
    """Supervised fine-tuning: ``loss = −mean over response tokens of log π(y_t | y_<t, x)``."""

    agg: str = "token-mean"
    needs_entropy_grad = False  # the entropy is a metric only

    def __call__(self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch):
        nll = aggregation.aggregate(self.agg, values=-logprobs, mask=batch.loss_mask)
        metrics = {"sft/nll": float(nll.detach())}
        if entropy is not None:
            metrics["sft/entropy"] = float(aggregation.aggregate(self.agg, values=entropy.detach(), mask=batch.loss_mask))
        return nll, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return micro_weight(self.agg, micro, full)
