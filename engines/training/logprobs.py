"""Per-token log-probabilities (policy) and values (critic) of given sequences, shared by the training and
reference engines. Both are aligned with ``input_ids``: entry ``t`` is computed from tokens ``< t``."""

from __future__ import annotations

import torch

from engines.types import TrainBatch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left and right padding give the same values."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L] int64
    attention_mask: torch.Tensor,  # [B, L]
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logprobs[:, t] = log softmax(logits_{t-1} / temperature)[input_ids[:, t]]``; column 0 is 0.

    Returns ``(logprobs [B, L], entropy [B, L] or None)``; entropy is of the same tempered distribution.
    """
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits[:, :-1]
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    log_probs = torch.log_softmax(logits, dim=-1)  # [B, L-1, V]
    picked = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
    zero = picked.new_zeros(picked.shape[0], 1)
    entropy = None
    if with_entropy:  # differentiable: the entropy bonus trains through it
        entropy = torch.cat([zero, -(log_probs.exp() * log_probs).sum(-1)], dim=1)
    return torch.cat([zero, picked], dim=1), entropy


def token_values(
    model: torch.nn.Module,  # a ...ForTokenClassification with one label
    input_ids: torch.Tensor,  # [B, L] int64
    attention_mask: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``values[:, t] = V(tokens < t)``: the head's output at position ``t - 1``; column 0 is 0. ``[B, L]``."""
    scores = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits[:, :-1, 0].float()  # [B, L-1]
    return torch.cat([scores.new_zeros(scores.shape[0], 1), scores], dim=1)


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """``token_logprobs`` over ``batch`` in micro-batches, padded back to the batch width, [B, L]."""
    return _batched(lambda m: token_logprobs(model, m.input_ids, m.attention_mask, temperature=temperature)[0],
                    batch, micro_batch_size)


@torch.no_grad()
def batched_values(model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    """``token_values`` over ``batch`` in micro-batches, padded back to the batch width, [B, L]."""
    return _batched(lambda m: token_values(model, m.input_ids, m.attention_mask), batch, micro_batch_size)


def _batched(forward, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    start = 0
    for micro in batch.micro_batches(micro_batch_size):
        values = forward(micro)
        out[start : start + len(micro), : values.shape[1]] = values
        start += len(micro)
    return out
