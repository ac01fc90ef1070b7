"""MLflow tracking for the flow process: one run per training run, metrics in batches, no duplicates.

Each metric stream ("sft", "rl") has a marker key ``progress/<stream>_step`` logged last in every batch.
After a resume, steps at or below the marker's last value were already logged and are skipped, so
re-running the steps between the last checkpoint and a crash leaves exactly one value per step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

MAX_BATCH = 900  # MLflow's log_batch takes at most 1000 entries


def tracking_uri(run_dir: str) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a sqlite file in the (local) run directory."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if "://" in run_dir:
        raise ValueError(f"run.dir {run_dir} is remote: set MLFLOW_TRACKING_URI to a tracking server")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(run_dir).resolve()}/mlflow.db"


class RunTracker:
    def __init__(self, uri: str, run_id: str) -> None:
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.run_id = run_id
        self._last_step: dict[str, int] = {}
        self._pending: list[Metric] = []

    @classmethod
    def create(cls, uri: str, experiment: str, run_name: str, params: dict[str, str], config_yaml: str,
               artifact_root: str | None = None) -> "RunTracker":
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment, artifact_location=artifact_root)
        run = client.create_run(experiment_id, run_name=run_name, tags={"rollflow.run_name": run_name})
        tracker = cls(uri, run.info.run_id)
        items = [Param(k, v[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            client.log_batch(run.info.run_id, params=items[start : start + 100])
        client.log_text(run.info.run_id, config_yaml, "config.yaml")
        return tracker

    def last_step(self, stream: str) -> int:
        """Last step of ``stream`` already in MLflow (-1 if none)."""
        if stream not in self._last_step:
            history = self.client.get_metric_history(self.run_id, f"progress/{stream}_step")
            self._last_step[stream] = max((m.step for m in history), default=-1)
        return self._last_step[stream]

    def log_step(self, stream: str, step: int, metrics: dict[str, float], flush: bool = True) -> bool:
        """Queue ``metrics`` at ``step`` unless this step was logged before; ``flush`` sends the queue.

        Returns False for a step already in MLflow (a step re-run after resume)."""
        if step <= self.last_step(stream):
            return False
        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, step) for k, v in sorted(metrics.items()))
        self._pending.append(Metric(f"progress/{stream}_step", float(step), now, step))  # marker goes last
        self._last_step[stream] = step
        if flush:
            self.flush()
        return True

    def flush(self) -> None:
        """Send queued metrics in as few ``log_batch`` calls as MLflow allows."""
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[start : start + MAX_BATCH])

    def log_samples(self, name: str, rows: list[dict]) -> None:
        if rows:
            columns = {key: [row[key] for row in rows] for key in rows[0]}
            self.client.log_table(self.run_id, data=columns, artifact_file=f"samples/{name}.json")

    def log_dir(self, local_dir: str, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
