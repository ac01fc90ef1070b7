from __future__ import annotations

import ray
from prefect import task

from engines.actors import get_from_engines
from engines.types import SamplingParams
from tasks.common import TASK_DEFAULTS


class WeightSyncError(RuntimeError):
    pass


@task(name="sync_weights", retries=1, **TASK_DEFAULTS)
def sync_weights(train_engine, rollout_engines: list, version: int, bucket_mb: int) -> str:
    """Push the trainer's weights to every rollout engine and verify them by checksum.

    Engines on the trainer's node read them from shared memory (one copy); the others, or all when
    ``/dev/shm`` has no room, get byte buckets through Ray's object store. The trainer copies in the
    background, hashing as it copies; engines hash each tensor once it is written. Idempotent (the
    same weights and version again), so one retry is allowed."""
    shared_ref = train_engine.export_shared.remote(version)
    expected_ref = train_engine.exported_checksum.remote()
    received_refs = [engine.update_weights_shared.remote(shared_ref) for engine in rollout_engines]
    expected = ray.get(expected_ref)  # first: a copy that failed raises here, not after the engines time out
    received = ray.get(received_refs)
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


@task(name="measure_drift", retries=1, **TASK_DEFAULTS)
def measure_drift(train_engine, rollout_engines: list, reward_worker, prompts: list[str], sampling: SamplingParams,
                  pad_token_id: int, timeout_s: float) -> dict[str, float]:
    """Check a sync by behaviour: every rollout engine samples one completion per prompt, the trainer scores
    the same tokens, and ``sync/logprob_drift_max`` / ``_mean`` are the largest and mean gap between the
    two log-probs over all engines (float rounding after a right sync; a stale or half-loaded weight shows
    as a gap far above it)."""
    generated = [engine.generate.remote(prompts, sampling) for engine in rollout_engines]
    drifts = get_from_engines(
        [reward_worker.logprob_drift.remote(ref, train_engine.rollout_logprobs.remote(ref), pad_token_id)
         for ref in generated], list(zip(rollout_engines, generated)), timeout_s)
    return {"sync/logprob_drift_max": max(d["max"] for d in drifts),
            "sync/logprob_drift_mean": sum(d["mean"] for d in drifts) / len(drifts)}


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
