from __future__ import annotations

import ray
from prefect import task

from tasks.common import TASK_DEFAULTS


class WeightSyncError(RuntimeError):
    pass


@task(name="sync_weights", retries=1, **TASK_DEFAULTS)
def sync_weights(train_engine, rollout_engines: list, version: int, bucket_mb: int) -> str:
    """Push the trainer's weights to every rollout engine and verify them by checksum.

    A trainer on a GPU first exports a CUDA IPC handle: engines on the same GPU (colocated) copy device to
    device. Of the rest, engines on the trainer's node that read shared memory (the HF engine) take one
    host copy from ``/dev/shm``; the others (another node, the vLLM engine, no room in ``/dev/shm``) get
    byte buckets through Ray's object store. The trainer copies to shared memory in the background,
    hashing as it copies; engines hash each tensor once it is written. Idempotent (the same weights and
    version again), so one retry is allowed."""
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
    bad = [i for i, checksum in enumerate(received) if checksum != expected]
    if bad:
        raise WeightSyncError(f"weight sync v{version}: rollout engines {bad} hold other weights than the trainer")
    return expected


@task(name="set_memory_phase", retries=1, **TASK_DEFAULTS)
def set_memory_phase(rollout_engines: list, train_engines: list, phase: str) -> None:
    """Colocated roles take turns on their GPUs (``placement.colocate``): ``generate`` offloads the training
    engines, then wakes the rollout engines; ``train`` puts the rollout engines to sleep, then reloads the
    training engines; ``sync`` wakes the rollout engines beside the loaded trainer, for the weight sync.
    Memory is freed before it is taken. Each call is idempotent, so one retry is allowed."""
    if phase == "generate":
        ray.get([engine.offload.remote() for engine in train_engines])
        ray.get([engine.wake.remote() for engine in rollout_engines])
    elif phase == "train":
        ray.get([engine.sleep.remote() for engine in rollout_engines])
        ray.get([engine.reload.remote() for engine in train_engines])
    elif phase == "sync":
        ray.get([engine.wake.remote() for engine in rollout_engines])
    else:
        raise ValueError(f"unknown memory phase {phase!r}: generate, train or sync")
