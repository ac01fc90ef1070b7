"""Engines as named Ray actors, one set per run, backends found by dotted path (imported when chosen).

An actor is named ``<run>/<role>#<fingerprint>``, the fingerprint hashing the engine kind and every
constructor argument. A flow run that finds a live actor of its run, role and fingerprint reattaches
to it instead of loading the model again (its trainable state is then restored from the checkpoint, as
for a fresh actor); one with another fingerprint (the config changed) is replaced. On a cluster the
driver joined (``RAY_ADDRESS``), actors are detached, so they outlive a crashed or finished driver
until ``stop_engine`` or ``rollflow engines stop RUN``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any

import ray

from engines.backends import backend_env, engine_class
from engines.envs import engine_runtime_env

NAMESPACE = "rollflow"


def actor_name(run_name: str, role: str, fingerprint: str) -> str:
    return f"{run_name}/{role}#{fingerprint}"


def fingerprint(kind: str, kwargs: dict[str, Any]) -> str:
    """Short hash of what the actor was built from: equal only when a reattached actor is interchangeable."""
    def plain(value):
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value

    text = repr((kind, sorted((k, plain(v)) for k, v in kwargs.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_actor_names(run_name: str | None, role: str | None = None, exact: bool = True) -> list[str]:
    """Names of the live actors of ``run_name`` (of one ``role`` when given, or of the roles that start with
    it unless ``exact``; of every run for None)."""
    prefix = "" if run_name is None else f"{run_name}/{role}{'#' if exact else ''}" if role else f"{run_name}/"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))


def _responsive(handle, timeout_s: float) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        return True
    except (ray.exceptions.RayError, TimeoutError):
        return False


def engine_actor_name(kind: str, run_name: str, role: str, *, num_gpus: float = 0, scheduling_strategy=None,
                      max_concurrency: int | None = None, **kwargs: Any) -> str:
    """The name ``start_engine`` gives the actor of ``kind`` built from these options and constructor ``kwargs``."""
    group = getattr(scheduling_strategy, "placement_group", None)
    where = (group.id.hex(), scheduling_strategy.placement_group_bundle_index) if group is not None else \
        getattr(scheduling_strategy, "node_id", None)
    placed = {"placement": (num_gpus, where)} if num_gpus or where else {}
    return actor_name(run_name, role, fingerprint(kind, {**kwargs, "max_concurrency": max_concurrency, **placed}))


def start_engine(kind: str, *, run_name: str, role: str, reuse: bool = True, num_cpus: float = 0,
                 num_gpus: float = 0, runtime_env: dict | None = None, max_concurrency: int | None = None,
                 scheduling_strategy=None, unfingerprinted: dict | None = None,
                 concurrency_groups: dict[str, int] | None = None, **kwargs: Any):
    """The actor ``<run>/<role>`` of engine ``kind``, ``"<role kind>/<backend>"`` (``engines.backends``: a
    short name or a dotted path, imported here): the live one built from the same ``kind`` and ``kwargs``
    if there is one and ``reuse``, else a new one (replacing any actor of this run and role). Pass ``reuse=False``
    for a trainable engine that will not be restored from a checkpoint: its weights may have moved.

    Actors never restart and their calls never retry: a crash fails the step, and resume goes through
    the checkpoint instead of a half-updated actor. ``num_gpus`` and ``scheduling_strategy`` (a placement
    group bundle, ``engines.placement``, or a node) are part of what the actor was built from: a changed
    placement replaces it. ``unfingerprinted`` constructor keywords are not (a rank's rendezvous address).
    Starting one actor for ``role`` also stops the ranks of an earlier sharded ``role`` (``engines.rank_group``)."""
    groups = {"concurrency_groups": concurrency_groups} if concurrency_groups else {}
    name = engine_actor_name(kind, run_name, role, num_gpus=num_gpus, scheduling_strategy=scheduling_strategy,
                             max_concurrency=max_concurrency, **groups, **kwargs)
    for other in run_actor_names(run_name, role) + run_actor_names(run_name, f"{role}.rank", exact=False):
        if other != name or not reuse:
            _kill_named(other)  # built from another config: not interchangeable
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        handle = None
    if handle is not None:
        if _responsive(handle, timeout_s=float(os.environ.get("ROLLFLOW_REATTACH_TIMEOUT_S", "600"))):
            return handle  # still busy with a dead driver's last call at worst: ours queue behind it
        _kill_named(name)
    env = backend_env(kind)
    if env is not None:  # a backend in its own venv: its actor runs that venv's Python
        runtime_env = engine_runtime_env(env, runtime_env)
    # concurrency groups: named thread pools of a threaded actor (calls pick one with .options(concurrency_group=))
    cls = ray.remote(**groups)(engine_class(kind)) if groups else ray.remote(engine_class(kind))
    return cls.options(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached" if joined_cluster() else None,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=0,
        max_task_retries=0,
        runtime_env=runtime_env,
        scheduling_strategy=scheduling_strategy,
        **({"max_concurrency": max_concurrency} if max_concurrency else {}),  # threaded actor: calls overlap
    ).remote(**kwargs, **(unfingerprinted or {}))


def joined_cluster() -> bool:
    """True when this driver joined a cluster that outlives it (``RAY_ADDRESS``), not one it started."""
    return bool(os.environ.get("RAY_ADDRESS"))


def describe(handle) -> dict[str, Any]:
    """``{"actor_id", "pid", "node_ip", "gpu_ids"}`` of a live actor, read inside it (``gpu_ids``: those Ray
    assigned it, as strings); ``{"ranks": [...]}`` of each rank's for a ``RankGroup``."""
    if hasattr(handle, "ranks"):
        return {"ranks": [describe(rank) for rank in handle.ranks]}
    def where(_self):
        import os as _os

        context = ray.get_runtime_context()
        return {"actor_id": context.get_actor_id(), "pid": _os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}

    return ray.get(handle.__ray_call__.remote(where))


def _kill_named(name: str, timeout_s: float = 30.0) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the name frees once the kill has gone through
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    raise RuntimeError(f"actor {name!r} from an earlier attempt did not stop within {timeout_s:.0f}s")


def stop_named(name: str) -> None:
    _kill_named(name)


def stop_engine(handle) -> None:
    """Kill the actor, after letting it release what outlives a process (``close()``: shared memory); every
    rank of a ``RankGroup``."""
    if hasattr(handle, "ranks"):
        for rank in handle.ranks:
            stop_engine(rank)
        return
    try:
        ray.get(handle.__ray_call__.remote(lambda engine: getattr(engine, "close", lambda: None)()), timeout=10)
    except Exception:  # noqa: BLE001 - an actor that is dead or stuck is killed all the same
        pass
    ray.kill(handle, no_restart=True)


class EngineFailure(RuntimeError):
    """An engine actor died or stopped answering; the message is one line naming it, with its last log lines."""


def get_from_engines(refs, engine_calls: list[tuple[Any, Any]], timeout_s: float):
    """``ray.get(refs)`` within ``timeout_s``; when it fails because an engine of ``engine_calls`` (pairs of
    actor handle and the ref of a call to it) died or hung, ``EngineFailure`` naming that engine instead.
    A hung engine is killed, so the run's resume starts a fresh one."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
        failure = _engine_failure(engine_calls, timeout_s, hung=isinstance(error, ray.exceptions.GetTimeoutError))
        if failure is None:
            raise
        raise failure from None


def _engine_failure(engine_calls: list[tuple[Any, Any]], timeout_s: float, hung: bool) -> EngineFailure | None:
    for handle, ref in engine_calls:
        ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
        if not ready:
            if hung:
                name, logs = _actor_name(handle), last_log_lines(handle)
                ray.kill(handle, no_restart=True)
                return EngineFailure(f"engine {name} did not answer within {timeout_s:.0f}s and was stopped; "
                                     f"its last log lines: {logs}")
            continue
        try:
            ray.get(ref, timeout=10)
        except ray.exceptions.RayActorError as error:
            cause = str(error).strip().splitlines()[0][:200]
            return EngineFailure(f"engine {_actor_name(handle)} died ({cause}); its last log lines: "
                                 f"{last_log_lines(handle)}")
        except Exception:  # noqa: BLE001 - the call itself raised: not an engine failure
            continue
    return None


def _actor_record(handle) -> dict:
    return ray._private.state.actors(handle._actor_id.hex()) or {}


def _actor_name(handle) -> str:
    return _actor_record(handle).get("Name") or handle._actor_id.hex()


def last_log_lines(handle, lines: int = 5) -> str:
    """The last ``lines`` non-empty lines of the actor's stderr file and of its stdout file on this node,
    each labelled, joined by `` | ``; says where they are when the actor ran on another node."""
    import glob

    pid = _actor_record(handle).get("Pid")
    node = getattr(getattr(ray._private, "worker", None), "_global_node", None)
    if not pid or node is None:
        return "(no log: the actor's process is unknown)"
    parts = []
    for stream, suffix in (("stderr", "err"), ("stdout", "out")):
        for file in glob.glob(os.path.join(node.get_logs_dir_path(), f"worker-*-{pid}.{suffix}")):
            with open(file, errors="replace") as log:
                tail = [line.strip()[:200] for line in log.readlines()[-200:] if line.strip()][-lines:]
            if tail:
                parts.append(f"{stream}: " + " | ".join(tail))
    return " | ".join(parts) or f"(no log lines on this node for pid {pid})"
