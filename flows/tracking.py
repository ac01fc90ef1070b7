"""MLflow tracking for the flow process: one run per training run, metrics in batches, no duplicates.

Batches due by time are sent on a background thread (a sqlite ``log_batch`` of a few hundred metrics
takes ~100 ms, which would otherwise stall a training step); ``flush`` sends synchronously and is
called before every checkpoint, so a checkpoint never claims steps whose metrics are not stored.

Each metric stream ("sft", "rl") has a marker key ``progress/<stream>_step`` logged last in every batch.
After a resume, steps at or below the marker's last value were already logged and are skipped, so
re-running the steps between the last checkpoint and a crash leaves exactly one value per step.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

MAX_BATCH = 900  # MLflow's log_batch takes at most 1000 entries


def tracking_uri(run_dir: str) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a sqlite file in the (local) run directory."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if "://" in run_dir:
        raise ValueError(f"run.dir {run_dir} is remote: set MLFLOW_TRACKING_URI to a tracking server "
                         "(or a sqlite:///… file) for its MLflow run")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(run_dir).resolve()}/mlflow.db"


def local_artifact_root(uri: str) -> str | None:
    """Where a new experiment keeps artifacts: ``mlartifacts/`` beside a local sqlite store (the run
    directory's own, or a user's ``sqlite:///…`` file), not in the working directory's ./mlruns; a
    tracking server decides for itself (None)."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts")
    return None


SECRET_ENV_WORDS = ("SECRET", "PASSWORD", "TOKEN", "ACCESS_KEY", "CREDENTIAL", "API_KEY", "PRIVATE_KEY")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s:]+:[^/@\s]+@")


def redact(text: str) -> str:
    """``text`` without credentials: ``scheme://user:password@`` becomes ``scheme://***@``, and the value
    of every environment variable whose name says it is a secret (``AWS_SECRET_ACCESS_KEY``,
    ``MLFLOW_TRACKING_PASSWORD``, ``HF_TOKEN``, …) becomes ``***``."""
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    for name, value in os.environ.items():
        if len(value) >= 4 and any(word in name.upper() for word in SECRET_ENV_WORDS):
            text = text.replace(value, "***")
    return text


class RunTracker:
    def __init__(self, uri: str, run_id: str) -> None:
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.run_id = run_id
        self._last_step: dict[str, int] = {}
        self._pending: list[Metric] = []
        self._flushed_at = time.monotonic()
        self._sender: ThreadPoolExecutor | None = None
        self._sending: tuple[Future, list[Metric]] | None = None

    @classmethod
    def create(cls, uri: str, experiment: str, run_name: str, params: dict[str, str], config_yaml: str,
               artifact_root: str | None = None, tags: dict[str, str] | None = None) -> "RunTracker":
        """A new MLflow run with the config as params and ``config.yaml``; every value passes ``redact``.

        A new experiment keeps its artifacts at ``artifact_root``, by default ``local_artifact_root(uri)``."""
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(
            experiment, artifact_location=artifact_root or local_artifact_root(uri))
        all_tags = {"rollflow.run_name": run_name, **(tags or {})}
        run = client.create_run(experiment_id, run_name=run_name, tags={k: redact(v) for k, v in all_tags.items()})
        tracker = cls(uri, run.info.run_id)
        items = [Param(k, redact(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            client.log_batch(run.info.run_id, params=items[start : start + 100])
        client.log_text(run.info.run_id, redact(config_yaml), "config.yaml")
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

    @contextmanager
    def sent_on_error(self):
        """On an exception in the block, send the queued metrics before it propagates."""
        try:
            yield
        except BaseException:
            with suppress(Exception):  # the block's error is the one to report
                self.flush()
            raise

    def flush_if_due(self, every_s: float) -> None:
        """Send the queue on a background thread when the last send was ``every_s`` seconds ago or more
        (and the previous background send has finished); its error, if any, is raised here or by ``flush``."""
        if not self._pending or time.monotonic() - self._flushed_at < every_s:
            return
        if self._sending is not None and not self._sending[0].done():
            return  # still sending: this queue goes with the next one
        self._collect_sent()
        self._flushed_at = time.monotonic()
        pending, self._pending = self._pending, []
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="mlflow-metrics")
        self._sending = (self._sender.submit(self._send, pending), pending)

    def flush(self) -> None:
        """Send queued metrics, in as few ``log_batch`` calls as MLflow allows, and return once they
        (and any background send) are stored."""
        self._collect_sent()
        self._stop_sender()
        self._flushed_at = time.monotonic()
        pending, self._pending = self._pending, []
        try:
            self._send(pending)
        except BaseException:
            self._pending = pending + self._pending  # kept for the next flush
            raise

    def _collect_sent(self) -> None:
        """Wait for the background send; if it failed, its metrics go back to the queue's front and its
        error is raised."""
        sending, self._sending = self._sending, None
        if sending is None:
            return
        future, metrics = sending
        try:
            future.result()
        except BaseException:
            self._pending = metrics + self._pending
            raise

    def _stop_sender(self) -> None:
        """The background thread ends (idle: its last send was collected); the next due send starts one."""
        if self._sender is not None:
            self._sender.shutdown(wait=False)
            self._sender = None

    def _send(self, metrics: list[Metric]) -> None:
        """``log_batch`` ``metrics`` in order, removing each batch once stored: after an error the list
        holds exactly the unsent ones."""
        while metrics:
            self.client.log_batch(self.run_id, metrics=metrics[:MAX_BATCH])
            del metrics[:MAX_BATCH]

    def log_samples(self, name: str, rows: list[dict]) -> None:
        if rows:
            columns = {key: [row[key] for row in rows] for key in rows[0]}
            self.client.log_table(self.run_id, data=columns, artifact_file=f"samples/{name}.json")

    def log_dir(self, local_dir: str, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def register_model(self, name: str, artifact_path: str | None, source: str, tags: dict[str, str]) -> int:
        """A new version of registered model ``name`` from this run; returns its version number.

        The source is the run's logged artifact ``artifact_path`` when given (the registry then points
        into MLflow's artifact store), else ``source`` (the final folder, local or s3://)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        if artifact_path is not None:
            source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
        version = self.client.create_model_version(name, source=redact(source), run_id=self.run_id,
                                                   tags={k: redact(v) for k, v in tags.items()})
        return int(version.version)  # a str from a tracking server, an int from a local store

    def finish(self, status: str = "FINISHED") -> None:
        try:
            self._collect_sent()
        finally:
            self._stop_sender()
            self.client.set_terminated(self.run_id, status=status)
