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
from flows.setup import base_model_path, ensure_ray, final_dir, is_finished, load_rows
from flows.sft import sft_flow
from tasks.tracking import RunTracker, tracking_uri


def open_tracking(config: Config) -> RunTracker:
    """The run's MLflow run: created on the first attempt, the same one on every resume."""
    run_dir = config.run.resolved_dir
    record_uri = store.join(run_dir, "run.json")
    record = store.read_json(record_uri)
    uri = tracking_uri(run_dir)
    if record is not None:
        return RunTracker(uri, record["mlflow_run_id"])
    tracker = RunTracker.create(uri, config.tracking.experiment, config.run.name, flat_params(config),
                                dump_config(config))
    store.write_json(record_uri, {"mlflow_run_id": tracker.run_id, "tracking_uri": uri, "name": config.run.name})
    return tracker


def summary(config: Config) -> dict:
    state = store.read_json(store.join(final_dir(config), "state.json")) or {}
    return {"final_dir": final_dir(config), "heldout_accuracy": state.get("heldout_accuracy", {}),
            "mlflow_run_id": state.get("mlflow_run_id"), "already_finished": False}


def finished_summary(config: Config) -> dict:
    """Summary of a finished run; also closes its MLflow run if the last attempt died just before that."""
    open_tracking(config).finish()
    return {**summary(config), "already_finished": True}


@flow(name="rollflow-run", persist_result=False)
def run_flow(config: Config) -> dict:
    """Run (or resume) ``config`` to completion; returns where the model is and its held-out accuracy."""
    if is_finished(config):
        return finished_summary(config)
    ensure_ray()
    tracker = open_tracking(config)
    train_rows, _ = load_rows(config)
    model_path = base_model_path(config, train_rows)
    if config.sft is not None:
        model_path = sft_flow(config, model_path, tracker.uri, tracker.run_id)
    rlvr_flow(config, model_path, tracker.uri, tracker.run_id)
    tracker.finish()
    return summary(config)
