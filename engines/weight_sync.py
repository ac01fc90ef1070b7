"""Weight transfer from a training engine to inference engines: buckets plus an exact checksum.

Parameters are flattened into contiguous byte buckets of at most ``bucket_bytes`` (one tensor larger
than that gets a bucket of its own). Buckets are numpy byte arrays so Ray's object store hands them to
the receiving actor without a pickle copy.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    offset: int  # byte offset inside the bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    metas: tuple[TensorMeta, ...]
    data: np.ndarray  # uint8, concatenated tensor bytes


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Group tensors, in the order given, into byte buckets of at most ``bucket_bytes`` each."""
    buckets: list[Bucket] = []
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if not pending:
            return
        metas, offset, chunks = [], 0, []
        for name, tensor in pending:
            raw = _tensor_bytes(tensor)
            metas.append(TensorMeta(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset, raw.numel()))
            chunks.append(raw)
            offset += raw.numel()
        buckets.append(Bucket(tuple(metas), torch.cat(chunks).numpy()))
        pending, size = [], 0

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            flush()
        pending.append((name, tensor))
        size += nbytes
    flush()
    return buckets


def unpack_bucket(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` views into ``bucket.data`` (read-only: copy before writing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Ray hands out read-only arrays; we only read them
        raw = torch.from_numpy(bucket.data)
    for meta in bucket.metas:
        flat = raw[meta.offset : meta.offset + meta.nbytes].view(getattr(torch, meta.dtype))
        yield meta.name, flat.view(meta.shape)


def load_buckets(model: torch.nn.Module, buckets: Iterable[Bucket]) -> int:
    """Copy every bucketed tensor into ``model``'s parameter of the same name; returns tensors loaded."""
    params = dict(model.named_parameters())
    loaded = 0
    with torch.no_grad():
        for bucket in buckets:
            for name, tensor in unpack_bucket(bucket):
                if name not in params:
                    raise KeyError(f"weight {name!r} is not a parameter of the receiving model")
                params[name].copy_(tensor)
                loaded += 1
    if loaded != len(params):
        raise ValueError(f"weight sync loaded {loaded} tensors but the model has {len(params)} parameters")
    return loaded


def weights_checksum(model: torch.nn.Module) -> str:
    """BLAKE2b over every parameter's name and bytes in name order: equal iff the weights are bit-identical."""
    digest = hashlib.blake2b(digest_size=16)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(_tensor_bytes(param).numpy().tobytes())
    return digest.hexdigest()
