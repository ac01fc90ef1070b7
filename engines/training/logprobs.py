"""Per-token log-probabilities (policy) and values (critic) of given sequences, shared by the training and
reference engines. Both are aligned with ``input_ids``: entry ``t`` is computed from tokens ``< t``.

``packed_token_logprobs`` is the padding-free form: sequences are packed into rows of the batch's longest
length (first-fit decreasing), each restarting its position ids so attention stays within it, and the
LM head runs only at the positions whose next token is needed (the response tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class PackedSequences:
    """Left-aligned rows of a ``[B, L]`` batch packed into ``[R, W]`` rows (``R <= B``).

    ``logit_index`` (rows, cols in the packed layout) are the positions whose logits predict the tokens at
    ``target_index`` (rows, cols in the ``[B, L]`` layout); ``target_ids`` are those tokens."""

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]; a new sequence (or the pad tail) starts at 0
    logit_index: tuple[torch.Tensor, torch.Tensor]  # ([N], [N])
    target_index: tuple[torch.Tensor, torch.Tensor]  # ([N], [N])
    target_ids: torch.Tensor  # [N]


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, needed: torch.Tensor,
                   pad_token_id: int = 0) -> PackedSequences:
    """Pack the rows of a left-aligned batch (first-fit decreasing into rows of its longest length).

    ``needed`` [B, L] marks the tokens whose log-probability is wanted (column 0 never is)."""
    lengths = attention_mask.sum(-1).tolist()
    width = max(lengths)
    free: list[int] = []  # room left in each packed row
    place = [(0, 0)] * len(lengths)  # (packed row, offset) of each sequence
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
        if row == len(free):
            free.append(width)
        place[i] = (row, width - free[row])
        free[row] -= lengths[i]
    packed_ids = torch.full((len(free), width), pad_token_id, dtype=torch.long)
    positions = torch.zeros((len(free), width), dtype=torch.long)
    for i, (row, offset) in enumerate(place):
        packed_ids[row, offset:offset + lengths[i]] = input_ids[i, :lengths[i]]
        positions[row, offset:offset + lengths[i]] = torch.arange(lengths[i])
    for row, room in enumerate(free):  # the pad tail is a sequence of its own
        positions[row, width - room:] = torch.arange(room)
    needed = needed.bool().clone()
    needed[:, 0] = False
    rows, cols = needed.nonzero(as_tuple=True)
    place_t = torch.tensor(place, dtype=torch.long).reshape(-1, 2)
    return PackedSequences(packed_ids, positions, (place_t[rows, 0], place_t[rows, 1] + cols - 1), (rows, cols),
                           input_ids[rows, cols])


def _output_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on hidden states ``[N, H]``, with the final soft-capping of models that have it (Gemma 2/3)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L] int64, left-aligned
    attention_mask: torch.Tensor,  # [B, L]
    needed: torch.Tensor,  # [B, L]: tokens whose logprob is wanted, e.g. the response mask
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` at the ``needed`` tokens (0 elsewhere), computed on packed rows without padding.

    Same values as the padded form up to float rounding; ``[B, L]`` outputs, differentiable."""
    packed = pack_sequences(input_ids, attention_mask, needed)
    hidden = model.get_decoder()(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                 use_cache=False).last_hidden_state  # no mask: sequences are told apart by positions
    logits = _output_logits(model, hidden[packed.logit_index]).float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    log_probs = torch.log_softmax(logits, dim=-1)  # [N, V]
    out = log_probs.new_zeros(input_ids.shape)
    out[packed.target_index] = log_probs.gather(-1, packed.target_ids[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = log_probs.new_zeros(input_ids.shape)
        entropy[packed.target_index] = -(log_probs.exp() * log_probs).sum(-1)
    return out, entropy


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
def batched_logprobs(model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, temperature: float,
                     packing: bool = False) -> torch.Tensor:
    """``token_logprobs`` over ``batch`` in micro-batches, padded back to the batch width, [B, L].

    With ``packing`` only the response tokens get logprobs (0 elsewhere), computed without padding."""
    if packing:
        return _batched(lambda m: packed_token_logprobs(model, m.input_ids, m.attention_mask, m.response_mask,
                                                        temperature=temperature)[0], batch, micro_batch_size)
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
