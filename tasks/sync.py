from __future__ import annotations

import ray
from prefect import task

from engines.rank_group import RankGroup
from tasks.common import TASK_DEFAULTS


class WeightSyncError(RuntimeError):
    pass


@task(name="sync_weights", retries=1, **TASK_DEFAULTS)
def sync_weights(train_engine, rollout_engines: list, version: int, bucket_mb: int, adapter: bool = False) -> str:
    """Push the trainer's weights to every rollout engine and verify them by checksum.

    A trainer on a GPU first exports a CUDA IPC handle: engines on the same GPU (colocated) copy device to
    device. Of the rest, engines on the trainer's node that read shared memory (the HF engine) take one
    host copy from ``/dev/shm``; the others (another node, the vLLM engine, no room in ``/dev/shm``) get
    byte buckets through Ray's object store. The trainer copies to shared memory in the background,
    hashing as it copies; engines hash each tensor once it is written.

    ``adapter`` (a LoRA trainer): only the adapter goes to engines that hold the trainer's base
    (``update_adapter``, through Ray's object store); the others get the base as above first, once.
    Idempotent (the same weights and version again), so one retry is allowed."""
    if not adapter:
        return _expect_equal(version, *_sync_whole(train_engine, rollout_engines, version, bucket_mb))
    update_ref = train_engine.export_adapter.remote(version, bucket_mb << 20)
    expected = ray.get(train_engine.weights_checksum.remote())
    reports = ray.get([engine.update_adapter.remote(update_ref) for engine in rollout_engines])
    baseless = [i for i, report in enumerate(reports) if report is None]
    if baseless:  # the base once, then the adapter
        _expect_equal(version, *_sync_whole(train_engine, [rollout_engines[i] for i in baseless], version, bucket_mb))
        for i, report in zip(baseless, ray.get([rollout_engines[i].update_adapter.remote(update_ref) for i in baseless])):
            reports[i] = report
    return _expect_equal(version, expected, [report and report.checksum for report in reports])


def _sync_whole(train_engine, rollout_engines: list, version: int, bucket_mb: int) -> tuple[str, list]:
    """Every weight ``export_weights`` sends to each engine, the fastest way it can take them: the trainer's
    checksum of what it sent and each engine's of what it holds."""
    cuda = ray.get(train_engine.export_cuda_ipc.remote(version))  # None on CPU
    received = [None] * len(rollout_engines)
    if cuda is not None:
        received = ray.get([engine.update_weights_cuda_ipc.remote(cuda) for engine in rollout_engines])
    expected = cuda.checksum if cuda is not None else None
    unreached = [i for i, checksum in enumerate(received) if checksum is None]
    if unreached:
        shared_ref = train_engine.export_shared.remote(version)
        expected_ref = train_engine.exported_checksum.remote()
        shared_refs = [rollout_engines[i].update_weights_shared.remote(shared_ref) for i in unreached]
        expected = ray.get(expected_ref)  # first: a copy that failed raises here, not after the engines time out
        for i, checksum in zip(unreached, ray.get(shared_refs)):
            received[i] = checksum
    unreached = [i for i, checksum in enumerate(received) if checksum is None]
    if unreached:
        buckets_ref = train_engine.export_weights.remote(bucket_mb << 20)
        checksums = ray.get([rollout_engines[i].update_weights.remote(version, buckets_ref) for i in unreached])
        for i, checksum in zip(unreached, checksums):
            received[i] = checksum
    return expected, received


def _expect_equal(version: int, expected: str, received: list) -> str:
    bad = [i for i, checksum in enumerate(received) if checksum != expected]
    if bad:
        raise WeightSyncError(f"weight sync v{version}: rollout engines {bad} hold other weights than the trainer")
    return expected


@task(name="set_memory_phase", retries=1, **TASK_DEFAULTS)
def set_memory_phase(rollout_engines: list, train_engines: list, phase: str) -> dict[str, float]:
    """Colocated roles take turns on their GPUs (``placement.colocate``), in the order verl and ROLL settled
    on: after a train step the training engines offload and the rollout engines wake (phase ``sync``: the
    weights then go from the offloaded trainer's host copy), they generate (and evaluate) awake (phase
    ``generate``, a no-op after ``sync``), then sleep while the training engines reload (phase ``train``).
    Memory is freed before it is taken. Each call is idempotent, so one retry is allowed.

    Returns what each side holds once the phase is set (``engine_memory``, summed over the rollout engines and
    over the training engines' processes): ``memory/<phase>/{rollout,train}_{device,host}_mb``."""
    if phase in ("generate", "sync"):
        ray.get([engine.offload.remote() for engine in train_engines])
        ray.get([engine.wake.remote() for engine in rollout_engines])
    elif phase == "train":
        ray.get([engine.sleep.remote() for engine in rollout_engines])
        ray.get([engine.reload.remote() for engine in train_engines])
    else:
        raise ValueError(f"unknown memory phase {phase!r}: generate, train or sync")
    figures = {}
    for side, engines in (("rollout", rollout_engines), ("train", train_engines)):
        processes = [rank for engine in engines
                     for rank in (engine.ranks if isinstance(engine, RankGroup) else [engine])]  # every rank
        held = ray.get([process.__ray_call__.remote(engine_memory) for process in processes])
        for kind in ("device", "host"):
            figures[f"memory/{phase}/{side}_{kind}_mb"] = sum(h[kind] for h in held) / 2**20
    return figures


def engine_memory(_engine=None) -> dict[str, int]:
    """Bytes this process holds: ``device``, allocated by torch on its CUDA device (0 without one), and
    ``host``, its resident set. Called inside an engine's actor (``__ray_call__``)."""
    import os

    import torch

    device = torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    with open("/proc/self/statm") as statm:
        host = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"device": int(device), "host": host}
