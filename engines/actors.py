"""Engines as named Ray actors, one set per run, backends found by dotted path (imported when chosen)."""

from __future__ import annotations

import importlib
import time
from typing import Any

import ray

NAMESPACE = "rollflow"

ENGINE_CLASSES = {
    "rollout/hf": "engines.inference.hf:HFInferenceEngine",
    "train/torch": "engines.training.torch:TorchTrainEngine",
    "reference/torch": "engines.training.torch:ReferenceEngine",
    "reward/worker": "engines.rollout_ops:RewardWorker",
}


def engine_class(kind: str) -> type:
    try:
        module, _, name = ENGINE_CLASSES[kind].partition(":")
    except KeyError:
        raise KeyError(f"unknown engine {kind!r}; registered: {', '.join(sorted(ENGINE_CLASSES))}") from None
    return getattr(importlib.import_module(module), name)


def actor_name(run_name: str, role: str) -> str:
    return f"{run_name}/{role}"


def start_engine(kind: str, *, run_name: str, role: str, num_cpus: float = 0, num_gpus: float = 0,
                 runtime_env: dict | None = None, **kwargs: Any):
    """Create the named actor ``<run>/<role>``, replacing one of that name left by an earlier attempt.

    Actors never restart and their calls never retry: a crash fails the step, and resume goes through
    the checkpoint instead of a half-updated actor."""
    cls = ray.remote(engine_class(kind))
    name = actor_name(run_name, role)
    _kill_named(name)  # left over from an attempt that died in this cluster: its state is not the checkpoint's
    return cls.options(
        name=name,
        namespace=NAMESPACE,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=0,
        max_task_retries=0,
        runtime_env=runtime_env,
    ).remote(**kwargs)


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


def stop_engine(handle) -> None:
    ray.kill(handle, no_restart=True)
