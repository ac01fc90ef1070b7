"""The process group of a sharded training engine's ranks (FSDP2, DeepSpeed ZeRO).

Each rank is one Ray actor (``engines.rank_group``). Rank 0's node hosts the TCP store at
``rendezvous`` ("host:port", picked by the driver next to rank 0); every rank joins it with its rank
and the world size. The backend is NCCL when the rank has a CUDA device, gloo otherwise.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_address() -> str:
    """``host:port`` on this machine where a TCP store can listen: this node's IP and a free port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: this host
        host = "127.0.0.1"
    return f"{host}:{port}"


def init_ranks(rank: int, world_size: int, rendezvous: str | None, device: torch.device,
               timeout_s: float = 1800.0) -> None:
    """Join the default process group as ``rank`` of ``world_size`` at ``rendezvous`` (None: a group of one
    on a free local port); a no-op when this process already joined one of that size.

    ``timeout_s`` bounds each collective: a rank whose peer died raises instead of waiting forever."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"this process is rank {dist.get_rank()} of {dist.get_world_size()} already, "
                               f"asked to be rank {rank} of {world_size}")
        return
    if rendezvous is None:
        if world_size != 1:
            raise ValueError(f"a world of {world_size} ranks needs a rendezvous address")
        rendezvous = free_address()
    host, _, port = rendezvous.rpartition(":")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            **({"device_id": device} if device.type == "cuda" else {}))


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj):
    """``obj`` of every rank, in rank order (``[obj]`` outside a process group)."""
    rank, world_size = world()
    if world_size == 1:
        return [obj]
    out = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
