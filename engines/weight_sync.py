"""Weight transfer from a training engine to inference engines, each transfer verified by checksum.

Two transports:

* Shared memory (engines on one node): the trainer copies every parameter once into one of two
  files under ``/dev/shm`` (slot ``version % 2``); a receiver of the same dtype makes its parameters
  views into that mapping, so the sync costs one copy and no (de)serialisation. The receiver reads
  slot ``v % 2`` until the next sync switches it to the other slot, the one the trainer writes next.
* Buckets (any node): parameters flattened into contiguous byte buckets of at most ``bucket_bytes``
  (one tensor larger than that gets a bucket of its own). Buckets are numpy byte arrays so Ray's
  object store hands them to the receiving actor without a pickle copy.

``weights_checksum`` is XXH3-128 over every parameter's name and bytes, read in place.
"""

from __future__ import annotations

import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
import xxhash


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


def _meta(name: str, tensor: torch.Tensor, offset: int) -> TensorMeta:
    return TensorMeta(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset,
                      tensor.numel() * tensor.element_size())


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
            metas.append(_meta(name, tensor, offset))
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
    """XXH3-128 over every parameter's name, dtype, shape and the XXH3-128 of its bytes, in name order.

    Equal for bit-identical weights; any changed bit, tensor swap or rename changes it. Tensors are read
    in place (no copy) and hashed on ``torch.get_num_threads()`` threads (xxhash releases the GIL), or
    on this one below ``SERIAL_HASH_BYTES``, where handing tensors to threads costs more than hashing."""
    named = sorted(model.named_parameters(), key=lambda item: item[0])
    views = [memoryview(_tensor_bytes(param.detach().cpu()).numpy()) for _, param in named]
    mapper = map if sum(view.nbytes for view in views) < SERIAL_HASH_BYTES else _hash_pool().map
    digests = mapper(lambda view: xxhash.xxh3_128(view).digest(), views)
    digest = xxhash.xxh3_128()
    for (name, param), tensor_digest in zip(named, digests):
        digest.update(f"{name}:{param.dtype}:{tuple(param.shape)}:".encode() + tensor_digest)
    return digest.hexdigest()


SERIAL_HASH_BYTES = 16 << 20
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _POOL
    threads = max(1, torch.get_num_threads())
    if _POOL is None or _POOL[0] != threads:
        _POOL = (threads, ThreadPoolExecutor(threads, thread_name_prefix="checksum"))
    return _POOL[1]


def node_id() -> str:
    """Ray node of this process ("local" outside Ray): shared memory only reaches engines on the same node."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


# -- shared memory --------------------------------------------------------------------------------------

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SharedWeights:
    """Where version ``version`` of the weights lies: a file under ``/dev/shm`` on node ``node_id``."""

    version: int
    path: str
    node_id: str
    metas: tuple[TensorMeta, ...]
    nbytes: int


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """A uint8 tensor over the file at ``path`` mapped shared (created and sized when ``create``)."""
    if create:
        with open(path, "ab") as f:
            f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class SharedWeightWriter:
    """The trainer's side: two shared-memory slots, written alternately (``version % 2``).

    Files are named ``rollflow-<tag>-<pid>-<slot>``; ``close`` (and a later writer of the same tag, for
    files of dead processes) removes them."""

    def __init__(self, tag: str) -> None:
        self.prefix = f"rollflow-{tag}-"
        self.pid = os.getpid()
        self._slots: dict[int, torch.Tensor] = {}
        self._layout: tuple[list, tuple[TensorMeta, ...], int] | None = None
        self._remove_stale()

    def _remove_stale(self) -> None:
        for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
            if name.startswith(self.prefix):
                pid = name.removeprefix(self.prefix).split("-")[0]
                if pid.isdigit() and int(pid) != self.pid and not os.path.exists(f"/proc/{pid}"):
                    os.unlink(os.path.join(SHM_DIR, name))

    @staticmethod
    def fits(nbytes: int) -> bool:
        """Room for both slots (with a margin) in ``/dev/shm`` (small in a default Docker container)."""
        return os.path.isdir(SHM_DIR) and shutil.disk_usage(SHM_DIR).free > 2 * nbytes + (64 << 20)

    def write(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], node_id: str) -> SharedWeights:
        tensors = list(named_tensors)
        key = [(name, tensor.dtype, tensor.shape) for name, tensor in tensors]
        if self._layout is None or self._layout[0] != key:  # the same tensors every sync: laid out once
            metas, offset = [], 0
            for name, tensor in tensors:
                metas.append(_meta(name, tensor, offset))
                offset += -(-metas[-1].nbytes // 64) * 64  # 64-byte aligned views
            self._layout = (key, tuple(metas), offset)
        _, metas, offset = self._layout
        slot = version % 2
        path = os.path.join(SHM_DIR, f"{self.prefix}{self.pid}-{slot}")
        if slot not in self._slots or self._slots[slot].numel() != offset:
            self._slots[slot] = _map(path, offset, create=True)
        buffer = self._slots[slot]
        with torch.no_grad():
            for meta, (_, tensor) in zip(metas, tensors):
                buffer[meta.offset : meta.offset + meta.nbytes].copy_(_tensor_bytes(tensor))
        return SharedWeights(version, path, node_id, metas, offset)

    def close(self) -> None:
        self._slots.clear()
        for slot in (0, 1):
            try:
                os.unlink(os.path.join(SHM_DIR, f"{self.prefix}{self.pid}-{slot}"))
            except FileNotFoundError:
                pass


class SharedWeightReader:
    """The receiver's side: maps the writer's slots once and points parameters into them."""

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}

    def load(self, model: torch.nn.Module, shared: SharedWeights) -> int:
        """Make ``model``'s parameters views of ``shared`` (copies where dtype or device differ)."""
        buffer = self._maps.get(shared.path)
        if buffer is None or buffer.numel() != shared.nbytes:
            buffer = self._maps[shared.path] = _map(shared.path, shared.nbytes, create=False)
        params = dict(model.named_parameters())
        if {m.name for m in shared.metas} != set(params):
            raise ValueError(f"shared weights do not match the model: missing={sorted(set(params) - {m.name for m in shared.metas})}")
        with torch.no_grad():
            for name, view in unpack_bucket(Bucket(shared.metas, buffer.numpy())):
                param = params[name]
                if param.dtype == view.dtype and param.device.type == "cpu":
                    param.data = view
                else:
                    param.copy_(view)
        return len(shared.metas)
