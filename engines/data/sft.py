"""Supervised batches: ``prompt ++ target ++ EOS`` with the loss on the target tokens only."""

from __future__ import annotations

from functools import lru_cache

from engines.data.chat import encode_standard, sft_batch_from
from engines.models import load_tokenizer
from engines.types import TrainBatch


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    return load_tokenizer(path)


def sft_batch(tokenizer_path: str, prompts: list[str], targets: list[str]) -> TrainBatch:
    """Each prompt and target encoded on their own (``engines.data.chat.encode_standard``), left-aligned."""
    tokenizer = _tokenizer(tokenizer_path)
    rows = [encode_standard(tokenizer, prompt, target) for prompt, target in zip(prompts, targets)]
    return sft_batch_from(rows, tokenizer.pad_token_id)
