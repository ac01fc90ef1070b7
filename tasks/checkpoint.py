from __future__ import annotations

import ray
from prefect import get_run_logger, task

from engines import checkpoint_store as store
from tasks.common import TASK_DEFAULTS


@task(name="checkpoint", retries=0, **TASK_DEFAULTS)
def checkpoint(train_engines: dict, run_dir: str, step: int, state: dict, keep: int,
               extra_files: dict[str, bytes] | None = None) -> str:
    """Save each engine's state under its role (``policy/``, ``critic/``), ``state`` (data position,
    MLflow run id, …) and ``extra_files`` (name → bytes: the batch generated ahead, ``flows/asynchrony.py``), then
    the manifest, then prune.

    Any failed write raises before the manifest exists, so the previous checkpoint stays the newest."""
    uri = store.step_dir(run_dir, step)
    try:
        saved = {role: engine.save.remote(store.join(uri, role)) for role, engine in train_engines.items()}
        files = [f"{role}/{name}" for role, ref in saved.items() for name in ray.get(ref)]
        for name, data in (extra_files or {}).items():
            store.write_bytes(store.join(uri, name), data)
        store.write_json(store.join(uri, "state.json"), {**state, "step": step})
        store.write_manifest(uri, step, [*files, *(extra_files or {}), "state.json"])
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the actor's exception
        raise CheckpointError(f"checkpoint of step {step} to {uri} failed ({type(cause).__name__}: {cause}); "
                              "it has no manifest, so resume uses the newest complete checkpoint before it") from exc
    try:
        store.prune(run_dir, keep)
    except OSError as exc:  # the checkpoint is complete; old ones left behind cost space, not correctness
        get_run_logger().warning("could not delete old checkpoints under %s: %s", run_dir, exc)
    return uri


class CheckpointError(RuntimeError):
    """A checkpoint could not be written completely."""


@task(name="restore", retries=0, **TASK_DEFAULTS)
def restore(train_engines: dict, checkpoint_uri: str) -> dict:
    """Load each engine's state (by role) from a complete checkpoint; returns its ``state.json``."""
    ray.get([engine.load.remote(store.join(checkpoint_uri, role)) for role, engine in train_engines.items()])
    return store.read_json(store.join(checkpoint_uri, "state.json"))


@task(name="save_model", retries=0, **TASK_DEFAULTS)
def save_model(train_engine, out_dir: str, step: int, state: dict | None = None, key: str | None = None) -> str:
    """The engine's model in HF format (model.safetensors + tokenizer) at ``out_dir`` (local or s3://), plus
    ``state.json`` when given, manifest last, with the stage's ``key`` in it: the stage's done-marker
    (``flows/stages.py``). A failed write raises before the manifest exists."""
    files = ray.get(train_engine.save_pretrained.remote(out_dir))
    if state is not None:
        store.write_json(store.join(out_dir, "state.json"), state)
        files.append("state.json")
    store.write_manifest(out_dir, step, files, key=key)
    return out_dir
