"""Run directories on S3 (s3fs against a moto S3 server on 127.0.0.1): checkpoints, the final model and
resume from ``s3://…``; a bucket that disappears mid-run fails the run loudly and leaves the previous
checkpoint complete and resumable."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from services import REPO_ROOT, S3_SECRET as SECRET, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # four CLI runs against S3

BUCKET = "rollflow-ckpt"


@pytest.fixture(scope="module")
def s3(s3_server, prefect_api):
    client, aws = s3_server
    client.create_bucket(Bucket=BUCKET)
    _, prefect_env = prefect_api
    yield client, {**prefect_env, **aws}


def _exists(client, key: str) -> bool:
    return client.list_objects_v2(Bucket=BUCKET, Prefix=key).get("KeyCount", 0) > 0


def _json(client, key: str) -> dict:
    return json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _rollflow(run: str, tmp_path, extra=()):
    return [sys.executable, "-m", "flows.cli", "run", "tiny", f"run.dir=s3://{BUCKET}/runs/{run}", f"run.name={run}",
            "train.steps=6", "checkpoint.every=2", "eval.every=0", "tracking.sample_every=0", *extra]


def test_checkpoints_and_resume_on_s3(s3, tmp_path):
    client, env = s3
    env = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    cmd = _rollflow("s3-resume", tmp_path)
    first = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _exists(client, "runs/s3-resume/checkpoints/step_000002/MANIFEST.json"), 300, "a checkpoint on S3")
    first.send_signal(signal.SIGKILL)
    first.wait()
    manifest = _json(client, "runs/s3-resume/checkpoints/step_000002/MANIFEST.json")
    assert {"policy/model.safetensors", "policy/optimizer.pt", "state.json"} <= set(manifest["files"])

    second = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stderr[-3000:]
    state = _json(client, "runs/s3-resume/final/state.json")
    assert state["step"] == 6 and len(state["resumed_from"]) == 1 and state["resumed_from"][0] >= 2
    for key in ("base_model/MANIFEST.json", "final/MANIFEST.json", "final/model.safetensors", "run.json"):
        assert _exists(client, f"runs/s3-resume/{key}"), key

    mlflow = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    [run] = mlflow.search_runs([mlflow.get_experiment_by_name("rollflow").experiment_id])
    assert sorted(m.step for m in mlflow.get_metric_history(run.info.run_id, "progress/rl_step")) == [1, 2, 3, 4, 5, 6]
    [version] = mlflow.search_model_versions("name='s3-resume'")
    assert version.tags["rollflow.run_dir"] == f"s3://{BUCKET}/runs/s3-resume"
    # The S3 secret the run used is in none of MLflow's params, tags, the config artifact or the run record.
    texts = [json.dumps(run.data.params), json.dumps(run.data.tags), json.dumps(version.tags),
             mlflow.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)),
             json.dumps(_json(client, "runs/s3-resume/run.json")), second.stdout, second.stderr]
    texts[3] = open(texts[3]).read()
    assert not [t[:80] for t in texts if SECRET in t]


def test_bucket_removed_mid_run_fails_loudly_and_keeps_the_previous_checkpoint(s3, tmp_path):
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    client, env = s3
    env = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    cmd = _rollflow("s3-outage", tmp_path)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _exists(client, "runs/s3-outage/checkpoints/step_000002/MANIFEST.json"), 300, "a checkpoint on S3")
    # Remove the bucket from the S3 service (NoSuchBucket for every request) while the run goes on.
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    bucket, account = backend.buckets.pop(BUCKET), s3_backends.bucket_accounts.pop(BUCKET)
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        backend.buckets[BUCKET], s3_backends.bucket_accounts[BUCKET] = bucket, account  # restored from backup
    assert proc.returncode != 0  # the run failed; it did not report success
    # One line says what failed, where, and what resume will use.
    assert re.search(rf"CheckpointError: checkpoint of step \d+ to s3://{BUCKET}/runs/s3-outage/checkpoints/step_\d+ "
                     r"failed \(FileNotFoundError: The specified bucket does not exist", stderr), stderr[-3000:]

    from engines import checkpoint_store as store

    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                           "AWS_DEFAULT_REGION")})
    try:
        complete = store.complete_checkpoints(f"s3://{BUCKET}/runs/s3-outage")
    finally:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
            os.environ.pop(key, None)
    assert [step for step, _ in complete] == [2]  # the checkpoint before the outage, with its manifest
    assert not _exists(client, "runs/s3-outage/final/")
    mlflow = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    [run] = mlflow.search_runs([mlflow.get_experiment_by_name("rollflow").experiment_id])
    assert run.info.status == "FAILED"

    rerun = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _json(client, "runs/s3-outage/final/state.json")["resumed_from"] == [2]
    assert mlflow.get_run(run.info.run_id).info.status == "FINISHED"
