"""Weight transfer between engines on one GPU (colocated roles): CUDA IPC handles and a device-to-device copy.

The trainer copies its parameters, in their compute dtype, into one flat uint8 buffer on its GPU (each
tensor 256-byte aligned) and exports that buffer once as a CUDA IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``, the way verl and OpenRLHF sync colocated engines);
each later sync rewrites the buffer in place and sends the same handle with the new version and checksum.
A receiver on the same physical GPU (matched by device UUID, not index: Ray gives each actor its own
``CUDA_VISIBLE_DEVICES``) opens the handle, copies every tensor into its parameter of the same name and
closes the handle again, so no mapping outlives the call and the trainer's ``offload`` really frees the
buffer. In one process (engines as plain objects) the receiver takes the trainer's buffer directly:
CUDA cannot open an IPC handle in the process that exported it.

Lifetime: the buffer lives in the trainer until its layout changes, ``offload`` or ``close``, and is read
only inside ``load_cuda_weights``, a call the sync waits for before the trainer trains again. So torch's
reader count of a shared CUDA block is not used: it expects exactly one reader per export (a buffer that
nobody opened stays allocated after it is freed; one opened twice underflows the unsigned count, the same).
The trainer releases its count at export, and receivers get the name of a counter that does not exist, so
their release (best effort in torch) changes nothing: freeing the buffer never waits for readers.
"""

from __future__ import annotations

import os
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from engines.weight_sync import TensorMeta, _meta, byte_views, node_id, tensors_checksum, weights_checksum

ALIGN_BYTES = 256
_EXPORTED: dict[str, weakref.ref] = {}  # token -> this process's exported buffer (the same-process path)
# positions in reduce_tensor's rebuild arguments (torch.multiprocessing.reductions.rebuild_cuda_tensor)
_IPC_STORAGE_CLS, _IPC_DEVICE, _IPC_COUNTER, _IPC_COUNTER_OFFSET = 4, 6, 11, 12
_NO_COUNTER = b"/rollflow-no-reader-count"  # a shared-memory name nobody creates: receivers' releases are no-ops


@dataclass(frozen=True)
class CudaWeights:
    """A small, picklable handle set for version ``version`` of the weights, lying on a GPU of node ``node_id``."""

    version: int
    node_id: str
    device_uuid: str  # torch.cuda.get_device_properties(...).uuid of the trainer's GPU
    pid: int  # the exporting process
    token: str  # names the buffer (new for every buffer the trainer allocates)
    metas: tuple[TensorMeta, ...]  # each parameter's name, shape, dtype and byte range in the buffer
    checksum: str  # engines.weight_sync.weights_checksum of the exported tensors
    ipc: tuple[Callable, tuple[Any, ...]]  # reduce_tensor(buffer): (rebuild function, its arguments)


def device_uuid(device: torch.device) -> str:
    """The physical GPU behind ``device`` (the same across processes whatever their visible devices)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _share(buffer: torch.Tensor) -> tuple[Callable, tuple[Any, ...]]:
    """``reduce_tensor(buffer)`` without torch's reader count (see the module docstring): the count it
    starts is released here, and receivers are pointed at a counter that does not exist."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(buffer)
    args = list(args)
    storage_cls = args[_IPC_STORAGE_CLS]
    storage_cls._release_ipc_counter(args[_IPC_COUNTER], args[_IPC_COUNTER_OFFSET], device=buffer.device)
    args[_IPC_COUNTER], args[_IPC_COUNTER_OFFSET] = _NO_COUNTER, 0
    return rebuild, tuple(args)


class CudaWeightExporter:
    """The trainer's side: one flat buffer on its GPU, exported once, rewritten at every ``export``."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._key: list | None = None
        self._metas: tuple[TensorMeta, ...] = ()
        self._ipc: tuple[Callable, tuple[Any, ...]] | None = None
        self._token = ""

    def export(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> CudaWeights:
        """Copy ``named_tensors`` (all on one CUDA device) into the buffer; returns its handle set."""
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        device = tensors[0][1].device
        key = [device] + [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors]
        if self._key != key:  # the same tensors every sync: laid out, allocated and shared once
            self.close()
            metas, offset = [], 0
            for name, tensor in tensors:
                metas.append(_meta(name, tensor, offset))
                offset += -(-metas[-1].nbytes // ALIGN_BYTES) * ALIGN_BYTES
            self._buffer = torch.empty(offset, dtype=torch.uint8, device=device)
            self._key, self._metas, self._ipc = key, tuple(metas), _share(self._buffer)
            self._token = uuid.uuid4().hex
            _EXPORTED[self._token] = weakref.ref(self._buffer)
        views = list(byte_views(self._buffer, self._metas))
        with torch.no_grad():
            for (_, view), (_, tensor) in zip(views, tensors):
                view.copy_(tensor)
        torch.cuda.current_stream(device).synchronize()  # receivers read the buffer on their own streams
        return CudaWeights(version, node_id(), device_uuid(device), os.getpid(), self._token, self._metas,
                           tensors_checksum(views), self._ipc)

    def close(self) -> None:
        """Free the buffer (its memory returns at once: no reader keeps a mapping of it)."""
        if self._buffer is not None:
            _EXPORTED.pop(self._token, None)
            self._buffer = self._ipc = self._key = None
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()


def reachable(weights: CudaWeights | None, device: torch.device) -> bool:
    """Whether ``weights`` lie on ``device``'s physical GPU, on this node."""
    return (weights is not None and device.type == "cuda" and weights.node_id == node_id()
            and weights.device_uuid == device_uuid(device))


def open_cuda_weights(weights: CudaWeights, device: torch.device) -> torch.Tensor:
    """The trainer's export buffer, mapped on ``device`` (``reachable`` first); drop it to close the mapping."""
    if weights.pid == os.getpid():
        buffer = _EXPORTED.get(weights.token, lambda: None)()
        if buffer is None:
            raise RuntimeError(f"CUDA weights v{weights.version}: the trainer no longer holds that buffer "
                               "(offloaded or re-laid out since the export)")
    else:
        rebuild, args = weights.ipc
        args = list(args)
        args[_IPC_DEVICE] = device.index if device.index is not None else torch.cuda.current_device()
        buffer = rebuild(*args)
    return buffer


def load_cuda_weights(model: torch.nn.Module, weights: CudaWeights | None) -> str | None:
    """Copy the exported tensors into ``model``'s parameters of the same names, device to device; returns
    the new ``weights_checksum``, or None when the buffer is not reachable from here (no handles, a model
    not on CUDA, another node or another GPU), so the caller sends the weights another way."""
    device = next(model.parameters()).device
    if not reachable(weights, device):
        return None
    params = dict(model.named_parameters())
    names = [meta.name for meta in weights.metas]
    if set(names) != set(params):
        raise ValueError(f"CUDA weights v{weights.version} do not match the receiving model: "
                         f"missing={sorted(set(params) - set(names))} unexpected={sorted(set(names) - set(params))}")
    buffer = open_cuda_weights(weights, device)
    with torch.no_grad():
        for name, view in byte_views(buffer, weights.metas):
            params[name].copy_(view)
    torch.cuda.current_stream(device).synchronize()  # the copies are done before the mapping closes
    del buffer  # closes the mapping: nothing of the trainer's stays open here
    return weights_checksum(model)
