"""Weight transfer from a training engine to inference engines, each transfer verified by checksum.

Two transports:

* Shared memory (engines on one node): the trainer copies every parameter once into a slot, a file
  under ``/dev/shm``; a receiver of the same dtype makes its parameters views into that mapping, so the
  sync costs one copy and no (de)serialisation. Slots are versioned: each receiver leases the versions it
  reads (a small file of its own), and the trainer writes a new version only into a slot whose version
  is neither leased nor the newest, adding a slot when every one is in use (two suffice when every
  receiver takes each version; a receiver left behind keeps its slot). A receiver checks that its slot
  still holds its version (``SharedWeightReader.check``), so weights overwritten under it fail loudly.
  The trainer copies on up to ``torch.get_num_threads()`` threads, each through its own group of
  tensors in chunks, hashing each source chunk right after its copy while it is still in cache. The
  copy may run in the background (``write(..., background=True)``), so the Ray round trips of a sync
  overlap it: the slot's header counts each group's finished tensors and holds the version whose bytes
  are complete (-1 while written); a receiver hashes each tensor as soon as its group has passed it.
* Buckets (any node): parameters flattened into contiguous byte buckets of at most ``bucket_bytes``
  (one tensor larger than that gets a bucket of its own). Buckets are numpy byte arrays so Ray's
  object store hands them to the receiving actor without a pickle copy.

``weights_checksum`` is XXH3-128 over every parameter's name and bytes, read in place.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

try:
    import xxhash

    CHECKSUM_PREFIX = ""
except ImportError:  # a bare host without it (tests/gpu/run.sh): BLAKE2b-128 through the same calls, other digests
    import hashlib
    from types import SimpleNamespace

    xxhash = SimpleNamespace(xxh3_128=lambda data=b"": hashlib.blake2b(data, digest_size=16))
    CHECKSUM_PREFIX = "blake2b:"  # a checksum compared with an XXH3 one shows why they differ


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
        buckets.append(Bucket(tuple(metas), torch.cat(chunks).cpu().numpy()))  # a CUDA model's bytes come to host memory
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
    """``(name, tensor)`` views into ``bucket.data`` (read-only: copy before writing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Ray hands out read-only arrays; we only read them
        raw = torch.from_numpy(bucket.data)
    return byte_views(raw, bucket.metas)


def byte_views(raw: torch.Tensor, metas: Iterable[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of each meta's bytes in the uint8 tensor ``raw`` (on any device)."""
    for meta in metas:
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
    return tensors_checksum(model.named_parameters())


def tensors_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``weights_checksum`` of the ``(name, tensor)`` pairs given (on any device: CUDA tensors are hashed
    from host copies)."""
    named = list(named_tensors)
    nbytes = sum(param.numel() * param.element_size() for _, param in named)
    mapper = map if nbytes < SERIAL_HASH_BYTES else _hash_pool().map
    digests = mapper(_tensor_digest, [param for _, param in named])
    return _combine_digests((name, param, digest) for (name, param), digest in zip(named, digests))


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    """XXH3-128 of a tensor's bytes, read in place."""
    return xxhash.xxh3_128(memoryview(_tensor_bytes(tensor.detach().cpu()).numpy())).digest()


def _combine_digests(entries: Iterable[tuple[str, torch.Tensor, bytes]]) -> str:
    """The checksum from each tensor's (name, tensor, XXH3-128 digest of its bytes), taken in name order."""
    digest = xxhash.xxh3_128()
    for name, tensor, tensor_digest in sorted(entries, key=lambda entry: entry[0]):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode() + tensor_digest)
    return CHECKSUM_PREFIX + digest.hexdigest()


COPY_CHUNK_BYTES = 512 << 10  # small enough to be hashed from cache right after it is copied


def _copy_and_hash(pairs: list[tuple[int, np.ndarray, np.ndarray]], done: np.ndarray, slot: int) -> list[tuple[int, bytes]]:
    """Copy each ``(index, source, destination)`` byte array chunk by chunk; returns each source's XXH3-128
    digest, hashed chunk after chunk while the chunk is in cache (numpy and xxhash release the GIL).
    ``done[slot]`` counts the finished arrays (x86 keeps stores in order; elsewhere checksums catch it)."""
    digests = []
    for count, (index, source, destination) in enumerate(pairs, 1):
        digest = xxhash.xxh3_128()
        for start in range(0, source.size, COPY_CHUNK_BYTES):
            chunk = source[start : start + COPY_CHUNK_BYTES]
            np.copyto(destination[start : start + COPY_CHUNK_BYTES], chunk)
            digest.update(chunk)
        digests.append((index, digest.digest()))
        done[slot] = count
    return digests


def _balanced_groups(sizes: list[int], groups: int) -> list[list[int]]:
    """Indices split into ``groups`` lists of about equal total size (largest first, to the lightest)."""
    out: list[list[int]] = [[] for _ in range(groups)]
    loads = [0] * groups
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        out[lightest].append(index)
        loads[lightest] += sizes[index]
    return [group for group in out if group]


SERIAL_HASH_BYTES = 16 << 20
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _POOL
    threads = max(1, torch.get_num_threads())
    if _POOL is None or _POOL[0] != threads:
        _POOL = (threads, ThreadPoolExecutor(threads, thread_name_prefix="checksum"))
    return _POOL[1]


def node_id() -> str:
    """Ray node of this process ("local" outside Ray, or without it installed): shared memory only reaches
    engines on the same node."""
    try:
        import ray
    except ImportError:
        return "local"
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


# -- shared memory --------------------------------------------------------------------------------------

SHM_DIR = "/dev/shm"
MAX_SLOTS = 4  # versions held at once: the newest, the one being written, and those receivers still read
SLOT_HEADER_BYTES = 64  # int64s: [0] the version complete in this slot (-1 while written), [1 + g] tensors done by group g
MAX_COPY_GROUPS = SLOT_HEADER_BYTES // 8 - 1
ASSUMED_COPY_BYTES_PER_S = 4e9  # a copy thread's pace (it measures 5-7 GB/s): receivers sleep on it, not spin


@dataclass(frozen=True)
class SharedWeights:
    """Where version ``version`` of the weights lies: a file under ``/dev/shm`` on node ``node_id``."""

    version: int
    path: str
    node_id: str
    metas: tuple[TensorMeta, ...]
    nbytes: int
    groups: tuple[tuple[int, ...], ...] = ()  # indices into ``metas``, in the order each copy thread writes them
    lease_prefix: str = ""  # where receivers lease the versions they read: files ``<lease_prefix><pid>-<n>``


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """A uint8 tensor over the file at ``path`` mapped shared (created and sized when ``create``)."""
    if create:
        with open(path, "ab") as f:
            f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class SharedWeightWriter:
    """The trainer's side: versioned shared-memory slots. A version goes into a slot holding neither the
    newest version nor one a receiver leases; a new slot is added (up to ``MAX_SLOTS``) when none is free.

    Files are named ``rollflow-<tag>-<pid>-<slot>``, receivers' leases ``rollflow-<tag>-<pid>-lease-<pid>-<n>``;
    ``close`` (and a later writer of the same tag, for files of dead processes) removes them."""

    def __init__(self, tag: str) -> None:
        self.prefix = f"rollflow-{tag}-"
        self.pid = os.getpid()
        self.lease_prefix = f"{self.prefix}{self.pid}-lease-"
        self._slots: dict[int, torch.Tensor] = {}
        self._slot_versions: dict[int, int] = {}  # the version each slot holds (complete or being written)
        self._newest: int | None = None  # the last version written: receivers may still be told to read it
        self._layout: tuple[list, tuple[TensorMeta, ...], int] | None = None
        self._plans: dict[int, tuple] = {}  # per slot: (buffer, sources, layout metas, copy pairs, copy groups)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pending: Future | None = None
        self._checksum: str | None = None
        self._remove_stale()

    def _remove_stale(self) -> None:
        for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
            if name.startswith(self.prefix):
                pid = name.removeprefix(self.prefix).split("-")[0]
                if pid.isdigit() and int(pid) != self.pid and not os.path.exists(f"/proc/{pid}"):
                    _unlink(os.path.join(SHM_DIR, name))

    def leased_versions(self) -> set[int]:
        """The versions live receivers read or are loading (leases of dead processes are removed)."""
        leased = set()
        for name in os.listdir(SHM_DIR):
            if name.startswith(self.lease_prefix):
                path, pid = os.path.join(SHM_DIR, name), name.removeprefix(self.lease_prefix).split("-")[0]
                if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
                    _unlink(path)
                    continue
                try:
                    leased.update(int(v) for v in np.fromfile(path, dtype=np.int64, count=LEASE_SLOTS) if v >= 0)
                except FileNotFoundError:  # released meanwhile
                    pass
        return leased

    def _pick_slot(self) -> int:
        """A slot whose version is neither the newest nor leased (the oldest such), else a new one."""
        keep = self.leased_versions() | {self._newest}
        free = [slot for slot, version in self._slot_versions.items() if version not in keep]
        if free:
            return min(free, key=self._slot_versions.__getitem__)
        if len(self._slot_versions) < MAX_SLOTS:
            return len(self._slot_versions)
        raise RuntimeError(f"all {MAX_SLOTS} shared-memory weight slots hold versions still in use "
                           f"({sorted(self._slot_versions.values())}, receivers lease {sorted(keep - {self._newest})}): "
                           "a rollout engine has not taken a new version for several syncs")

    @staticmethod
    def fits(nbytes: int) -> bool:
        """Room for both slots (with a margin) in ``/dev/shm`` (small in a default Docker container)."""
        return os.path.isdir(SHM_DIR) and shutil.disk_usage(SHM_DIR).free > 2 * nbytes + (64 << 20)

    def write(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], node_id: str,
              background: bool = False) -> SharedWeights:
        """Copy ``named_tensors`` into a free slot (``_pick_slot``), hashing them on the way (``wait()``
        returns their checksum, equal to ``weights_checksum`` of them). With ``background`` the copy runs on
        threads and this returns at once: the tensors must not change until ``wait()`` returns."""
        self.wait()
        tensors = list(named_tensors)
        key = [(name, tensor.dtype, tensor.shape) for name, tensor in tensors]
        if self._layout is None or self._layout[0] != key:  # the same tensors every sync: laid out once
            metas, offset = [], SLOT_HEADER_BYTES
            for name, tensor in tensors:
                metas.append(_meta(name, tensor, offset))
                offset += -(-metas[-1].nbytes // 64) * 64  # 64-byte aligned views
            self._layout = (key, tuple(metas), offset)
        _, metas, offset = self._layout
        slot = self._pick_slot()
        path = os.path.join(SHM_DIR, f"{self.prefix}{self.pid}-{slot}")
        if slot not in self._slots or self._slots[slot].numel() != offset:
            if slot >= 2 and shutil.disk_usage(SHM_DIR).free < offset + (64 << 20):
                raise RuntimeError(f"no room in {SHM_DIR} for weight slot {slot} ({offset / 2**20:.0f} MiB): slots "
                                   f"hold versions {sorted(self._slot_versions.values())} that receivers still read")
            self._slots[slot] = _map(path, offset, create=True)
        buffer = self._slots[slot]
        header = buffer[:SLOT_HEADER_BYTES].numpy().view(np.int64)
        header[0], header[1:] = -1, 0
        self._slot_versions[slot], self._newest = version, version
        threads = 1 if offset < SERIAL_HASH_BYTES else min(MAX_COPY_GROUPS, max(1, torch.get_num_threads()))
        # the same parameters every sync: their byte views and the copy groups are made once per slot. Only
        # for contiguous tensors (a byte view of another is a copy); a moved tensor has another address
        sources = (threads, tuple(tensor.data_ptr() for _, tensor in tensors))
        plan = self._plans.get(slot)
        if plan is None or plan[0] is not buffer or plan[1] != sources or plan[2] is not metas:
            destination = buffer.numpy()
            pairs = [(i, _tensor_bytes(tensor).numpy(), destination[meta.offset : meta.offset + meta.nbytes])
                     for i, (meta, (_, tensor)) in enumerate(zip(metas, tensors))]
            plan = (buffer, sources, metas, pairs, _balanced_groups([m.nbytes for m in metas], threads))
            if all(tensor.is_contiguous() for _, tensor in tensors):
                self._plans[slot] = plan
        _, _, _, pairs, groups = plan

        def copy() -> str:
            helpers = [self._pool("copy", len(groups) - 1).submit(_copy_and_hash, [pairs[i] for i in group], header, 1 + g)
                       for g, group in enumerate(groups[1:], 1)]
            digests = dict(_copy_and_hash([pairs[i] for i in groups[0]], header, 1) if groups else [])
            for helper in helpers:
                digests.update(helper.result())
            header[0] = version
            return _combine_digests((name, tensor, digests[i]) for i, (name, tensor) in enumerate(tensors))

        if background:
            self._pending = self._pool("write", 1).submit(copy)
        else:
            self._checksum = copy()
        return SharedWeights(version, path, node_id, metas, offset, tuple(tuple(group) for group in groups),
                             self.lease_prefix)

    def _pool(self, kind: str, threads: int) -> ThreadPoolExecutor:
        pool = self._pools.get(kind)
        if pool is None or pool._max_workers != max(1, threads):
            pool = self._pools[kind] = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"weights-{kind}")
        return pool

    def wait(self) -> str | None:
        """Block until the last write has finished (re-raising its error); returns its checksum."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._checksum = pending.result()
        return self._checksum

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._slots.clear()
            self._plans.clear()
            for pool in self._pools.values():
                pool.shutdown()
        for slot in self._slot_versions:
            _unlink(os.path.join(SHM_DIR, f"{self.prefix}{self.pid}-{slot}"))
        self._slot_versions.clear()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


LEASE_SLOTS = 2  # int64s of a lease file: [0] the version the receiver's parameters view, [1] the one it loads
_leases = itertools.count()


class _Lease:
    """A receiver's lease on a writer's versions: ``/dev/shm/<lease_prefix><pid>-<n>``, two int64s (-1: none)."""

    def __init__(self, lease_prefix: str) -> None:
        self.prefix = lease_prefix
        self.path = os.path.join(SHM_DIR, f"{lease_prefix}{os.getpid()}-{next(_leases)}")
        self.versions = _map(self.path, 8 * LEASE_SLOTS, create=True).numpy().view(np.int64)
        self.versions[:] = -1

    def close(self) -> None:
        _unlink(self.path)


class SharedWeightReader:
    """The receiver's side: maps the writer's slots once and points parameters into them, leasing the
    version its parameters view so the writer leaves that slot alone."""

    def __init__(self) -> None:
        self._lease: _Lease | None = None
        self._held: SharedWeights | None = None  # the version the parameters view, while they do
        # a load holds the new version from the moment the parameters view its slot, while the writer may still
        # be copying into it; a check on another thread (a generate call ending) waits for the load to end
        self._lock = threading.RLock()
        self._maps: dict[str, torch.Tensor] = {}
        # per slot: the layout last read from it, its tensor views and their bytes (numpy slices to hash)
        self._views: dict[str, tuple[tuple[TensorMeta, ...], dict[str, torch.Tensor], list[np.ndarray]]] = {}

    def load(self, model: torch.nn.Module, shared: SharedWeights, timeout_s: float | None = None) -> str:
        """Make ``model``'s parameters views of ``shared`` (copies where dtype or device differ) and return
        their ``weights_checksum``. Views are hashed as soon as the writer's header shows their bytes
        written, so hashing follows the copy; copies wait for the whole slot. ``TimeoutError`` after
        ``timeout_s`` (default: 10 s plus a second per GB, for a writer that died or failed)."""
        with self._lock:
            return self._load(model, shared, timeout_s)

    def _load(self, model: torch.nn.Module, shared: SharedWeights, timeout_s: float | None) -> str:
        if shared.lease_prefix and (self._lease is None or self._lease.prefix != shared.lease_prefix):
            self.close()
            self._lease = _Lease(shared.lease_prefix)
        if self._lease is not None:
            self._lease.versions[1] = shared.version  # leased before reading: the writer keeps its slot
        buffer = self._maps.get(shared.path)
        if buffer is None or buffer.numel() != shared.nbytes:
            buffer = self._maps[shared.path] = _map(shared.path, shared.nbytes, create=False)
            self._views.pop(shared.path, None)
        params = dict(model.named_parameters())
        if {m.name for m in shared.metas} != set(params):
            raise ValueError(f"shared weights do not match the model: missing={sorted(set(params) - {m.name for m in shared.metas})}")
        timeout_s = 10.0 + shared.nbytes / 1e9 if timeout_s is None else timeout_s
        header, deadline = buffer[:SLOT_HEADER_BYTES].numpy().view(np.int64), time.monotonic() + timeout_s

        groups = shared.groups or (tuple(range(len(shared.metas))),)

        def missing_bytes(g: int, upto: int | None = None) -> int:
            """Bytes of group ``g``'s first ``upto`` tensors (all by default) the writer has not finished."""
            return sum(shared.metas[i].nbytes for i in groups[g][max(int(header[1 + g]), 0) : upto])

        def wait_for(slot: int, value: int) -> None:
            """Until header[0] == value (the version), or header[slot] >= value (group slot - 1's count).
            Sleeps about as long as the writer needs for the bytes still missing (of that group, or of the
            slowest group), so waiting costs little CPU and wakes the writer's threads seldom."""
            while True:
                done = int(header[slot])
                if (done == value) if slot == 0 else (done >= value):
                    return
                if slot == 0 and done > shared.version:
                    raise RuntimeError(f"weights v{shared.version} in {shared.path} were overwritten by v{done} "
                                       "before this receiver read them")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weights v{shared.version} in {shared.path} were not complete after "
                                       f"{timeout_s:.0f} s (header {header.tolist()}: [0] -1 while being written)")
                missing = max(map(missing_bytes, range(len(groups)))) if slot == 0 else missing_bytes(slot - 1, value)
                time.sleep(min(2e-3, max(5e-5, missing / ASSUMED_COPY_BYTES_PER_S)))

        cached = self._views.get(shared.path)
        if cached is None or cached[0] != shared.metas:  # the same layout every sync: views made once per slot
            data = buffer.numpy()
            cached = self._views[shared.path] = (shared.metas, dict(unpack_bucket(Bucket(shared.metas, data))),
                                                 [data[m.offset : m.offset + m.nbytes] for m in shared.metas])
        _, views, spans = cached
        if not all(params[m.name].dtype == views[m.name].dtype and params[m.name].device.type == "cpu" for m in shared.metas):
            wait_for(0, shared.version)
            with torch.no_grad():
                for name, view in views.items():
                    params[name].copy_(view)
            self._hold(None)  # copies: the parameters view no slot
            return weights_checksum(model)
        for name, view in views.items():
            params[name].data = view
        self._hold(shared)

        def hash_group(g: int, group: tuple[int, ...]) -> list[tuple[int, bytes]]:
            digests = []
            for count, i in enumerate(group, 1):
                wait_for(1 + g, count)
                digests.append((i, xxhash.xxh3_128(spans[i]).digest()))  # the parameter's bytes: it is a view of them
            return digests

        helpers = [_hash_pool().submit(hash_group, g, group) for g, group in enumerate(groups[1:], 1)]
        digests = dict(hash_group(0, groups[0]))
        for helper in helpers:
            digests.update(helper.result())
        wait_for(0, shared.version)
        return _combine_digests((m.name, params[m.name], digests[i]) for i, m in enumerate(shared.metas))

    def _hold(self, shared: SharedWeights | None) -> None:
        """The parameters view ``shared``'s slot from now on (None: no slot); the lease follows."""
        self._held = shared
        if self._lease is not None:
            self._lease.versions[0] = -1 if shared is None else shared.version
            self._lease.versions[1] = -1

    def check(self) -> None:
        """Raise if the slot the parameters view no longer holds their version (the writer overwrote it:
        what was computed with them mixed two versions). Waits for a load in progress."""
        with self._lock:
            held = self._held
            if held is None:
                return
            found = int(self._maps[held.path][:8].numpy().view(np.int64)[0])
            if found != held.version:
                lease = "no lease" if self._lease is None else f"lease [held, loading] {self._lease.versions.tolist()}"
                raise RuntimeError(f"weights v{held.version} in {held.path} were overwritten "
                                   f"({'being written' if found < 0 else f'now v{found}'}) while this engine used them "
                                   f"({lease})")

    def close(self) -> None:
        """Release the lease (the parameters must no longer view the slots)."""
        with self._lock:
            self._held = None
            if self._lease is not None:
                self._lease.close()
                self._lease = None

