"""The whole run behind ``rollflow run``: optional SFT warm start, then RLVR, in one MLflow run.

Idempotent: a finished run (``final/MANIFEST.json``) returns its summary at once; an interrupted one
resumes where its stages left off (SFT: from its start; RL: from the newest complete checkpoint).
"""

from __future__ import annotations

from prefect import flow

from configs.loader import dump_config, flat_params
from configs.schema import Config
from engines import checkpoint_store as store
from flows.rlvr import rlvr_flow
from flows.lineage import lineage_tags
from flows.setup import (base_model_path, check_prompt_lengths, ensure_ray, final_dir, is_finished, load_rows,
                         start_prefect_server)
from flows.sft import sft_flow
from flows.tracking import RunTracker, redact, tracking_uri


def open_tracking(config: Config) -> RunTracker:
    """The run's MLflow run: created on the first attempt (tagged with its lineage), the same one on
    every resume."""
    run_dir = config.run.resolved_dir
    record_uri = store.join(run_dir, "run.json")
    record = store.read_json(record_uri)
    uri = tracking_uri(run_dir)
    if record is not None:
        return RunTracker(uri, record["mlflow_run_id"])
    tracker = RunTracker.create(uri, config.tracking.experiment, config.run.name, flat_params(config),
                                dump_config(config),
                                tags=lineage_tags(config, *load_rows(config)))
    store.write_json(record_uri, {"mlflow_run_id": tracker.run_id, "tracking_uri": redact(uri), "name": config.run.name})
    return tracker


def publish_model(config: Config, tracker: RunTracker, folder: str, artifact_path: str,
                  name: str | None = None) -> int | None:
    """Log ``folder`` as the run's ``artifact_path`` artifact and register it as ``name`` (default
    ``tracking.registered_model_name`` or the run name), each once: a rerun after a crash between the
    two finishes what is missing. Returns the registered version (None when registering is off)."""
    if config.tracking.log_model and not tracker.client.list_artifacts(tracker.run_id, artifact_path):
        tracker.log_dir(store.local_copy(folder), artifact_path)
    if not config.tracking.register_model:
        return None
    name = name or config.tracking.registered_model_name or config.run.name
    done = tracker.client.search_model_versions(f"run_id='{tracker.run_id}' and name='{name}'")
    if done:
        return int(done[0].version)
    tags = {k: v for k, v in tracker.client.get_run(tracker.run_id).data.tags.items() if k.startswith("rollflow.")}
    return tracker.register_model(name, artifact_path if config.tracking.log_model else None, folder,
                                  {**tags, "rollflow.mlflow_run_id": tracker.run_id})


def publish_final_model(config: Config, tracker: RunTracker) -> int | None:
    return publish_model(config, tracker, final_dir(config), "final_model")


def summary(config: Config) -> dict:
    state = store.read_json(store.join(final_dir(config), "state.json")) or {}
    return {"final_dir": final_dir(config), "heldout_accuracy": state.get("heldout_accuracy", {}),
            "mlflow_run_id": state.get("mlflow_run_id"), "already_finished": False}


def finished_summary(config: Config) -> dict:
    """Summary of a finished run; also publishes the model and closes the MLflow run if the last attempt
    died just before that."""
    tracker = open_tracking(config)
    version = publish_final_model(config, tracker)
    tracker.finish()
    return {**summary(config), "registered_version": version, "already_finished": True}


@flow(name="rollflow-run", persist_result=False)
def run_flow(config: Config = Config()) -> dict:
    """Run (or resume) ``config`` to completion; returns where the model is and its held-out accuracy."""
    if is_finished(config):
        return finished_summary(config)
    ensure_ray()
    start_prefect_server()  # before the first flow, so it runs at low priority
    tracker = open_tracking(config)
    tracker.client.update_run(tracker.run_id, status="RUNNING")  # again, after a failed attempt
    try:
        train_rows, heldout_rows = load_rows(config)
        model_path = base_model_path(config, train_rows)
        check_prompt_lengths(config, model_path, train_rows + heldout_rows)  # before any engine starts
        if config.sft is not None:
            model_path = sft_flow(config, model_path, tracker.uri, tracker.run_id)
        rlvr_flow(config, model_path, tracker.uri, tracker.run_id)
        version = publish_final_model(config, tracker)
    except BaseException:
        tracker.finish("FAILED")  # a crash (SIGKILL) leaves it RUNNING; the next attempt carries on
        raise
    tracker.finish()
    return {**summary(config), "registered_version": version}
