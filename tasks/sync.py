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
        return _expect_equal(version, *_sync_whole(train_engine, rollout_engines, version, bucket_mb)[:2])
    update_ref = train_engine.export_adapter.remote(version, bucket_mb << 20)
    expected = ray.get(train_engine.weights_checksum.remote())
    reports = ray.get([engine.update_adapter.remote(update_ref) for engine in rollout_engines])
    baseless = [i for i, report in enumerate(reports) if report is None]
    if baseless:  # the base once, then the adapter
        _expect_equal(version, *_sync_whole(train_engine, [rollout_engines[i] for i in baseless], version, bucket_mb)[:2])
        for i, report in zip(baseless, ray.get([rollout_engines[i].update_adapter.remote(update_ref) for i in baseless])):
            reports[i] = report
    return _expect_equal(version, expected, [report and report.checksum for report in reports])


def _sync_whole(train_engine, rollout_engines: list, version: int, bucket_mb: int) -> tuple[str, list, list[str]]:
    """Every weight ``export_weights`` sends to each engine, the fastest way it can take them: the trainer's
    checksum of what it sent, each engine's of what it holds, and the route each took: ``cuda`` (CUDA IPC),
    ``shared`` (``/dev/shm``) or ``buckets`` (Ray's object store)."""
    cuda = ray.get(train_engine.export_cuda_ipc.remote(version))  # None on CPU
    received = [None] * len(rollout_engines)
    routes = ["cuda"] * len(rollout_engines)
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
            received[i], routes[i] = checksum, "shared"
    unreached = [i for i, checksum in enumerate(received) if checksum is None]
    if unreached:
        buckets_ref = train_engine.export_weights.remote(bucket_mb << 20)
        checksums = ray.get([rollout_engines[i].update_weights.remote(version, buckets_ref) for i in unreached])
        for i, checksum in zip(unreached, checksums):
            received[i], routes[i] = checksum, "buckets"
    return expected, received, routes


class QueuedWeightSync:
    """Weight syncs that the caller does not wait for: each one goes into every rollout engine's call queue,
    behind the generation calls already there, and the trainer trains on meanwhile. The caller checks it
    (``confirm``: each engine's checksum against the trainer's) before it sends the next one.

    This is for ``async.partial_rollout: wait`` (``tasks/rollout_stream.py``). There, a rollout engine runs
    one call at a time, in the order its one caller sent them. So every call sent to an engine after its
    update runs with the new weights, and the stream labels those calls with the new version at once.
    The trainer's exports are queued on its actor before anything the flow sends it next, so they copy the
    weights of this version. A sync is confirmed before the next one is exported. An engine therefore has
    at most one update queued, and the trainer's shared-memory slot of that version is not reused before
    the engine has loaded it.

    Each engine takes the route of its last confirmed sync, shared memory or byte buckets. The first sync
    to an engine (one that replaced a dead engine, too) waits, as ``sync_weights`` does, and finds the
    route. So does every sync while some engine takes CUDA IPC, whose export buffer the next export reuses.
    An engine that finds its route closed (``None``: e.g. no room left in ``/dev/shm``) keeps its old
    weights, and the calls labelled with the new version report the version they really ran with
    (``Rollouts.weights_version``, which the staleness bound and the batch checks use). Its next sync then
    waits and finds a new route."""

    def __init__(self, train_engine, bucket_mb: int) -> None:
        self.train_engine, self.bucket_mb = train_engine, bucket_mb
        self.routes: dict[str, str] = {}  # engine's actor id -> the route of its last confirmed sync
        self.pending: tuple | None = None  # (version, engines, trainer's checksum ref, engines' checksum refs)

    def send(self, rollout_engines: list, version: int) -> None:
        """Send the trainer's weights, labelled ``version``, to ``rollout_engines`` without waiting for their
        loads (unless a route is unknown or CUDA IPC: then as ``sync_weights``). The sync before must have
        been confirmed."""
        if self.pending is not None:
            raise RuntimeError(f"weight sync v{self.pending[0]} is not confirmed yet: confirm() before sending v{version}")
        routes = [self.routes.get(_actor_id(engine)) for engine in rollout_engines]
        if any(route not in ("shared", "buckets") for route in routes):
            expected, received, routes = _sync_whole(self.train_engine, rollout_engines, version, self.bucket_mb)
            _expect_equal(version, expected, received)
            self.routes.update((_actor_id(engine), route) for engine, route in zip(rollout_engines, routes))
            return
        shared_ref = self.train_engine.export_shared.remote(version)  # the checksum is that of this copy
        expected_ref = self.train_engine.exported_checksum.remote()
        buckets_ref = self.train_engine.export_weights.remote(self.bucket_mb << 20) if "buckets" in routes else None
        received = [engine.update_weights_shared.remote(shared_ref) if route == "shared" else
                    engine.update_weights.remote(version, buckets_ref) for engine, route in zip(rollout_engines, routes)]
        self.pending = (version, list(rollout_engines), expected_ref, received)

    def confirm(self) -> list:
        """Wait for the sync in flight, if any, and check it; returns the engines that died before their load
        (the caller replaces them). ``WeightSyncError`` if an engine holds other weights than the trainer's."""
        if self.pending is None:
            return []
        version, engines, expected_ref, received_refs = self.pending
        self.pending = None
        expected = ray.get(expected_ref)
        received, died = [], []
        for engine, ref in zip(engines, received_refs):
            try:
                received.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                received.append(expected)  # nothing of it is used: a new engine gets the trainer's weights
                died.append(engine)
        for engine, checksum in zip(engines, received):
            if checksum is None:  # its route closed: it kept its old weights, and its next sync finds a new route
                self.routes.pop(_actor_id(engine), None)
        _expect_equal(version, expected, [expected if checksum is None else checksum for checksum in received])
        return died


def _actor_id(engine) -> str:
    return engine._actor_id.hex()


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
