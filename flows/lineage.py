"""Where a trained model came from: config hash, dataset fingerprint, code commit, parent run.

Set as tags on the MLflow run when it starts and on the registered model version when it ends, so a
model in the registry can be traced back to the exact config, data and code that made it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from configs.loader import dump_config
from configs.schema import Config
from engines import checkpoint_store as store

REPO_ROOT = Path(__file__).resolve().parents[1]


def config_hash(config: Config) -> str:
    """sha256 of the resolved config (every default filled in), so equal configs hash equal."""
    return hashlib.sha256(dump_config(config).encode()).hexdigest()


def dataset_fingerprint(*splits: list[dict]) -> str:
    """sha256 over the rows of every split, in order, as canonical JSON."""
    from engines.data.chat import records_fingerprint

    return records_fingerprint(*splits)


def git_commit() -> str:
    """The checked-out commit of the RollFlow code (``ROLLFLOW_GIT_COMMIT`` in images without .git), with
    ``-dirty`` when tracked files have local changes; ``unknown`` outside a checkout."""
    if os.environ.get("ROLLFLOW_GIT_COMMIT"):
        return os.environ["ROLLFLOW_GIT_COMMIT"]
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def parent_run_id(config: Config) -> str | None:
    """The MLflow run of the stage this one continues: ``tracking.parent_run_id``, or the run that wrote
    ``model.path`` when that is a RollFlow output folder (``final/`` or ``sft_model/`` with its state)."""
    if config.tracking.parent_run_id:
        return config.tracking.parent_run_id
    if config.model.source != "hf" or not config.model.path:
        return None
    path = config.model.path
    if not store.is_remote(path) and not Path(path).is_dir():
        return None  # a hub id
    state = store.read_json(store.join(path, "state.json")) or {}
    return state.get("mlflow_run_id")


def lineage_tags(config: Config, train_rows: list[dict], heldout_rows: list[dict]) -> dict[str, str]:
    tags = {
        "rollflow.config_hash": config_hash(config),
        "rollflow.dataset_fingerprint": dataset_fingerprint(train_rows, heldout_rows),
        "rollflow.git_commit": git_commit(),
        "rollflow.run_dir": config.run.resolved_dir,
    }
    parent = parent_run_id(config)
    if parent:
        tags["rollflow.parent_run_id"] = parent
    return tags
