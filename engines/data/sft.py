"""Supervised batches: ``prompt ++ target ++ EOS`` with the loss on the target tokens only."""

from __future__ import annotations

from functools import lru_cache

import torch

from engines.models import load_tokenizer
from engines.types import TrainBatch


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    return load_tokenizer(path)


def sft_batch(tokenizer_path: str, prompts: list[str], targets: list[str]) -> TrainBatch:
    tokenizer = _tokenizer(tokenizer_path)
    rows = []
    for prompt, target in zip(prompts, targets):
        p = tokenizer.encode(prompt, add_special_tokens=False)
        t = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((p, t))
    width = max(len(p) + len(t) for p, t in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (p, t) in enumerate(rows):
        input_ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        attention_mask[i, : len(p) + len(t)] = 1
        loss_mask[i, len(p) : len(p) + len(t)] = 1.0
    return TrainBatch(input_ids, attention_mask, loss_mask)
