"""Train batches of the supervised stages (SFT, DPO, offline distillation) from encoded rows and the
stage's cache: the reference's summed log-probs of each pair (DPO) or the teacher's top-k log-probs at each
answer token (distillation). Runs on Ray workers; the rows and the cache live in the object store."""

from __future__ import annotations

import math

import torch

from engines.data.chat import pair_batch_from, sft_batch_from
from engines.types import TrainBatch

STAGE_KINDS = ("sft", "dpo", "distill")


def stage_batch(kind: str, encoded: list, indices: list[int], pad_token_id: int, cache: list | None = None) -> TrainBatch:
    """The ``indices`` rows of ``encoded`` as one batch of stage ``kind``.

    sft: ``sft_batch_from``; dpo: the pairs' rows interleaved (chosen, rejected) with ``ref_logps`` [2P, 1]
    from ``cache`` (``(chosen, rejected)`` sums per pair); distill: ``sft_batch_from`` plus the teacher's
    tensors from ``cache`` (``teacher_tensors``)."""
    if kind == "dpo":
        ref = None
        if cache is not None:
            ref = torch.tensor([value for i in indices for value in cache[i]], dtype=torch.float32)[:, None]  # [2P, 1]
        return pair_batch_from([encoded[i] for i in indices], pad_token_id, ref_logps=ref)
    batch = sft_batch_from([encoded[i] for i in indices], pad_token_id)
    if kind == "distill":
        batch = batch.with_tensors(**teacher_tensors(batch, [cache[i] for i in indices]))
    return batch


def teacher_tensors(batch: TrainBatch, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Each row's cached teacher log-probs (``logprobs`` [n, K] at its n answer tokens, in order; with ``ids``
    [n, K] in the top-k form) placed at its ``loss_mask`` positions: ``teacher_logprobs`` [B, L, K] and, top-k,
    ``gather_ids`` [B, L, K]. Other positions hold a uniform distribution over K + 1 buckets at distinct ids,
    so every divergence stays finite there (the loss masks them out)."""
    first = rows[0]["logprobs"]
    width = first.shape[-1]
    shape = (*batch.input_ids.shape, width)  # [B, L, K]
    logprobs = torch.full(shape, -math.log(width + 1), dtype=torch.float32)
    ids = torch.arange(width).expand(shape).clone()  # [B, L, K]
    for b, row in enumerate(rows):
        positions = batch.loss_mask[b].nonzero().squeeze(-1)  # [n]
        if len(positions) != row["logprobs"].shape[0]:
            raise ValueError(f"cached teacher row has {row['logprobs'].shape[0]} answer tokens, the batch row "
                             f"{len(positions)}: the cache was made from other tokens; delete it to recompute")
        logprobs[b, positions] = row["logprobs"].float()
        if "ids" in row:
            ids[b, positions] = row["ids"].long()
    return {"teacher_logprobs": logprobs, **({"gather_ids": ids} if "ids" in rows[0] else {})}


def answer_rows(values: torch.Tensor, batch: TrainBatch) -> list[torch.Tensor]:
    """Per row of ``batch``, the entries of ``values`` ([B, L, ...]) at its ``loss_mask`` positions, in order."""
    return [values[b, batch.loss_mask[b] > 0] for b in range(len(batch))]
