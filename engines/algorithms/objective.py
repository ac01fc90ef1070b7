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

    Reads ``advantages``, ``old_logprobs``, ``rollout_logprobs``, ``is_weights`` when an off-policy correction
    made them (``engines.algorithms.corrections``) and ``ref_logprobs`` when ``kl_coef > 0`` from the batch. ``kl_coef`` is the KL *loss* term; a KL in the reward is applied
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
            is_weights=batch.tensors.get("is_weights"),
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
    """Supervised fine-tuning: ``loss = −mean over answer tokens of log π(y_t | y_<t, x)``.

    The mean runs over the loss tokens of the whole optimizer step (``micro_weight``: each micro-batch's
    token share, summed over micro-batches and ranks), so gradient accumulation leaves it unchanged.
    ``sft/token_accuracy``: the share of answer tokens that are the model's most likely next token."""

    agg: str = "token-mean"
    needs_entropy_grad = False  # the entropy is a metric only
    outputs = frozenset({"top1"})

    def __call__(self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch,
                 top1_correct: torch.Tensor | None = None, **_):
        nll = aggregation.aggregate(self.agg, values=-logprobs, mask=batch.loss_mask)
        metrics = {"sft/nll": float(nll.detach())}
        if entropy is not None:
            metrics["sft/entropy"] = float(aggregation.aggregate(self.agg, values=entropy.detach(), mask=batch.loss_mask))
        if top1_correct is not None:
            metrics["sft/token_accuracy"] = float(aggregation.aggregate(self.agg, values=top1_correct, mask=batch.loss_mask))
        return nll, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return micro_weight(self.agg, micro, full)


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's answer: ``Σ_t logprobs[b, t] · mask[b, t]``, [B, L] → [B]."""
    return (logprobs * mask).sum(-1)


@dataclass(frozen=True)
class DPOObjective:
    """A preference loss (``engines.algorithms.preference``) over pairs: rows ``2i`` (chosen) and ``2i + 1``
    (rejected) of each micro-batch, with the reference's summed log-probs in ``batch.tensors["ref_logps"]``
    ([B, 1]). ``loss = mean over pairs of ℓ(pair) + sft_weight · NLL(chosen)`` (the NLL a token-mean over the
    chosen answers: RPO, Pang et al. 2024). Each micro-batch carries its share of the step's pairs."""

    loss: str = "sigmoid"
    beta: float = 0.1
    options: dict = field(default_factory=dict)
    sft_weight: float = 0.0
    needs_entropy_grad = False

    def __call__(self, *, logprobs: torch.Tensor, batch: TrainBatch, **_):
        from engines.algorithms import preference

        if len(batch) % 2:
            raise ValueError(f"a preference micro-batch holds whole pairs (chosen, rejected); got {len(batch)} rows")
        mask = batch.loss_mask  # [B, L]
        logps = sequence_logps(logprobs, mask)  # [B]
        ref = batch.tensors["ref_logps"][:, 0].to(logps.dtype)  # [B]
        lengths = mask.sum(-1)  # [B]
        pair_loss, metrics = preference.compute(
            self.loss, policy_chosen_logps=logps[0::2], policy_rejected_logps=logps[1::2],
            ref_chosen_logps=ref[0::2], ref_rejected_logps=ref[1::2],
            chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2], beta=self.beta, **self.options)
        loss = pair_loss.mean()
        if self.sft_weight:
            chosen = mask[0::2]
            nll = -(logprobs[0::2] * chosen).sum() / chosen.sum().clamp(min=1)
            loss = loss + self.sft_weight * nll
            metrics["sft/nll"] = float(nll.detach())
        return loss, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return len(micro) / len(full)


@dataclass(frozen=True)
class DistillObjective:
    """``loss = weight · T^2 · D(p_teacher ‖ q_student) + (1 − weight) · NLL`` per answer token, token-mean over
    the step (``micro_weight``); ``D`` a divergence of ``engines.algorithms.distillation`` (T^2 only with
    ``temperature_squared``).

    Top-k form (``top_k > 0``): the batch carries the teacher's top-k ids (``gather_ids`` [B, L, k]) and
    their full-vocabulary log-probs (``teacher_logprobs`` [B, L, k]); the student's log-probs at those ids
    plus each side's tail mass make k + 1 buckets (``distillation.topk_buckets``), exact for forward KL when
    the top-k holds the teacher's support. Full form: ``teacher_logprobs`` is [B, L, V].

    Metrics: ``distill/loss``, ``distill/ce`` (NLL of the data's tokens), ``distill/topk_mass`` (the teacher's
    mass in its top-k), ``distill/top1_agreement`` (the teacher's most likely token is the student's most
    likely among the teacher's top-k; over the vocabulary in the full form)."""

    divergence: str = "forward_kl"
    options: dict = field(default_factory=dict)
    weight: float = 1.0
    temperature: float = 1.0
    temperature_squared: bool = True
    top_k: int = 0
    needs_entropy_grad = False

    @property
    def outputs(self) -> frozenset:
        return frozenset({"gathered_logprobs" if self.top_k else "vocab_logprobs"})

    def __call__(self, *, logprobs: torch.Tensor, batch: TrainBatch, gathered_logprobs: torch.Tensor | None = None,
                 vocab_logprobs: torch.Tensor | None = None, **_):
        from engines.algorithms import distillation

        mask = batch.loss_mask  # [B, L]
        teacher = batch.tensors["teacher_logprobs"].float()  # [B, L, k] or [B, L, V]
        if self.top_k:
            teacher_buckets, student_buckets = distillation.topk_buckets(
                teacher_topk_logprobs=teacher, student_topk_logprobs=gathered_logprobs)  # [B, L, k + 1]
            student_top = gathered_logprobs
        else:
            teacher_buckets, student_buckets, student_top = teacher, vocab_logprobs, vocab_logprobs
        divergence, metrics = distillation.compute(self.divergence, teacher_logprobs=teacher_buckets,
                                                   student_logprobs=student_buckets, mask=mask, **self.options)
        if self.temperature_squared:
            divergence = divergence * self.temperature**2
        ce = aggregation.aggregate("token-mean", values=-logprobs, mask=mask)
        loss = self.weight * divergence + (1 - self.weight) * ce if self.weight < 1 else divergence
        with torch.no_grad():
            teacher_mass = teacher.exp().sum(-1) if self.top_k else torch.ones_like(mask)  # [B, L]
            agree = (student_top.argmax(-1) == teacher.argmax(-1)).float()  # [B, L]
            metrics.update({"distill/loss": float(divergence.detach()), "distill/ce": float(ce.detach()),
                            "distill/topk_mass": float(aggregation.aggregate("token-mean", values=teacher_mass, mask=mask)),
                            "distill/top1_agreement": float(aggregation.aggregate("token-mean", values=agree, mask=mask))})
        return loss, metrics

    def micro_weight(self, micro: TrainBatch, full: TrainBatch) -> float:
        return micro_weight("token-mean", micro, full)
