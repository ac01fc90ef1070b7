"""Prefect deployments end to end, every service real and on 127.0.0.1: a Prefect server and process
worker, an MLflow server (`infra/mlflow/start.sh`) keeping artifacts on S3 (moto); `rollflow deploy`,
`prefect deployment run`, and a SIGKILLed flow process retried with `prefect flow-run retry`."""

from __future__ import annotations

import json
import re
import signal
import os
import subprocess
import sys
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from services import REPO_ROOT, S3_SECRET, base_env, kill_all, mlflow_server, process_group, processes_with_env, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # Prefect worker, MLflow server, three flow runs

SECRET = "s3cr3t-" + os.urandom(6).hex()  # in the worker's environment; must never reach MLflow or logs
ARTIFACTS = "rollflow-mlflow-artifacts"
QUICK = ["eval.every=0", "tracking.sample_every=0"]


def _prefect(env, *args: str, timeout: int = 120) -> str:
    result = subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _api(url: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, method="GET" if body is None else "POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _state(url: str, flow_run_id: str) -> str:
    return _api(url, f"/flow_runs/{flow_run_id}")["state"]["type"]


def _mlflow(tracking_uri: str, run_name: str):
    client = MlflowClient(tracking_uri=tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name("rollflow").experiment_id],
                               filter_string=f"tags.`rollflow.run_name` = '{run_name}'")
    return client, run


@pytest.fixture(scope="module")
def tracking(s3_server, tmp_path_factory):
    client, aws = s3_server
    client.create_bucket(Bucket=ARTIFACTS)
    tmp = tmp_path_factory.mktemp("mlflow")
    with mlflow_server(tmp, base_env(**aws, MLFLOW_ARTIFACTS_DESTINATION=f"s3://{ARTIFACTS}/mlflow")) as uri:
        yield uri, client


@pytest.fixture(scope="module")
def worker(prefect_api, tracking, tmp_path_factory):
    url, env = prefect_api
    env = {**env, "MLFLOW_TRACKING_URI": tracking[0], "HF_TOKEN": SECRET}
    deployed = subprocess.run([sys.executable, "-m", "flows.cli", "deploy"], env=env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=180)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "rollflow-process"]
    with process_group(cmd, env, log) as proc:
        yield url, env, proc, log


def test_deployments_are_registered_with_typed_parameters_and_a_schedule(worker):
    url, *_ = worker
    deployments = {d["name"]: d for d in _api(url, "/deployments/filter", {})}
    assert set(deployments) == {"tiny", "quickstart-nightly", "form", "sft", "dpo", "distill-offline",
                                "distill-onpolicy", "pipeline"}
    assert deployments["tiny"]["entrypoint"] == "flows/deployments.py:rlvr_preset"
    assert deployments["tiny"]["work_pool_name"] == "rollflow-process"
    # The typed config is the flow parameter of "form": the UI renders its fields from this schema.
    schema = deployments["form"]["parameter_openapi_schema"]
    assert "config" in schema["properties"]
    assert {"RolloutConfig", "AlgorithmConfig", "OptimConfig"} <= set(schema["definitions"])
    assert schema["definitions"]["RolloutConfig"]["properties"]["group_size"]["type"] == "integer"
    [schedule] = deployments["quickstart-nightly"]["schedules"]
    assert schedule["schedule"]["cron"] == "0 3 * * *" and schedule["active"] is False  # ships paused
    for name, cron in (("distill-offline", "0 2 * * *"), ("distill-onpolicy", "0 4 * * 0")):
        [schedule] = deployments[name]["schedules"]
        assert schedule["schedule"]["cron"] == cron and schedule["active"] is False
        # one run at a time: a run scheduled while one is going is cancelled, not queued
        assert deployments[name]["global_concurrency_limit"]["limit"] == 1
        assert deployments[name]["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"


def test_dpo_deployment_run_completes_and_registers_each_stage(worker, tracking, tmp_path):
    _, env, _, _ = worker
    tracking_uri, _ = tracking
    run_dir = tmp_path / "dpo"
    params = {"preset": "dpo/tiny", "overrides": [f"run.dir={run_dir}", "run.name=deployed-dpo", "sft.steps=4",
                                                  "dpo.steps=3", "dpo.data.num_train=32", "dpo.data.num_heldout=8"]}
    out = _prefect(env, "deployment", "run", "rollflow-preset/dpo", "--params", json.dumps(params), "--watch",
                   "--watch-interval", "2", "--watch-timeout", "400", timeout=420)
    assert "Completed" in out, out[-2000:]

    client, run = _mlflow(tracking_uri, "deployed-dpo")
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "dpo/loss")) == [1, 2, 3]
    assert client.get_metric_history(run.info.run_id, "dpo/eval/rewards/accuracies")
    [version] = client.search_model_versions("name='deployed-dpo'")
    assert version.run_id == run.info.run_id and (run_dir / "dpo_model" / "MANIFEST.json").exists()


def test_deployment_run_completes_and_registers_the_model(worker, tracking, tmp_path):
    url, env, _, worker_log = worker
    tracking_uri, s3 = tracking
    run_dir = tmp_path / "run"
    params = {"preset": "tiny", "overrides": [f"run.dir={run_dir}", "run.name=deployed", *QUICK]}
    out = _prefect(env, "deployment", "run", "rlvr-preset/tiny", "--params", json.dumps(params), "--watch",
                   "--watch-interval", "2", "--watch-timeout", "400", timeout=420)
    assert "Completed" in out, out[-2000:]

    client, run = _mlflow(tracking_uri, "deployed")
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "progress/rl_step")) == [1, 2, 3, 4]
    [version] = client.search_model_versions("name='deployed'")
    assert version.run_id == run.info.run_id and version.source.endswith("/final_model")
    # The server proxied the artifacts to S3: the registered model's weights are in the bucket.
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=ARTIFACTS)["Contents"]]
    assert any(k.endswith(f"{run.info.run_id}/artifacts/final_model/model.safetensors") for k in keys), keys[:10]
    from configs.loader import load_config
    from flows.lineage import config_hash, dataset_fingerprint
    from flows.setup import load_rows

    config = load_config("tiny", params["overrides"])
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert version.tags["rollflow.config_hash"] == config_hash(config)
    assert version.tags["rollflow.dataset_fingerprint"] == dataset_fingerprint(*load_rows(config))
    assert version.tags["rollflow.git_commit"].startswith(head)
    assert "rollflow.parent_run_id" not in version.tags  # started from a fresh tiny model: no parent stage

    # Credentials in the worker's environment (an HF token, the S3 key the MLflow server uses) appear
    # nowhere: params, tags, artifacts, run dir, worker and Prefect logs.
    artifacts = client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts"))
    texts = [json.dumps(run.data.params), json.dumps(run.data.tags), json.dumps(version.tags), worker_log.read_text()]
    for folder in (artifacts, run_dir):
        texts += [p.read_bytes().decode(errors="ignore") for p in __import__("pathlib").Path(folder).rglob("*")
                  if p.is_file() and p.suffix in {".json", ".yaml", ".txt", ""}]
    logs = _api(url, "/logs/filter", {"limit": 200})
    texts.append(json.dumps(logs))
    assert len(texts) > 6 and not [t[:80] for t in texts if SECRET in t or S3_SECRET in t]


def test_killed_flow_run_retried_from_prefect_resumes_from_its_checkpoint(worker, tracking, tmp_path):
    url, env, worker_proc, _ = worker
    run_dir = tmp_path / "run"
    params = {"preset": "tiny", "overrides": [f"run.dir={run_dir}", "run.name=crashy", "train.steps=6",
                                              "checkpoint.every=2", *QUICK]}
    out = _prefect(env, "deployment", "run", "rlvr-preset/tiny", "--params", json.dumps(params))
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    wait_for(lambda: (run_dir / "checkpoints" / "step_000002" / "MANIFEST.json").exists(), 300, "the first checkpoint")

    # SIGKILL the flow process the worker started (the Ray it started in-process dies with it).
    flow_processes = processes_with_env("PREFECT__FLOW_RUN_ID", flow_run_id)
    [flow_pid] = [pid for pid, ppid in flow_processes if ppid == worker_proc.pid]
    os.kill(flow_pid, signal.SIGKILL)
    assert wait_for(lambda: _state(url, flow_run_id) in {"CRASHED", "FAILED"}, 60, "the worker to report the crash")
    kill_all([pid for pid, _ in processes_with_env("PREFECT__FLOW_RUN_ID", flow_run_id)])  # any orphan
    steps_done = [int(p.parent.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*/MANIFEST.json")]
    assert not (run_dir / "final").exists()

    _prefect(env, "flow-run", "retry", flow_run_id)
    state = wait_for(lambda: (s := _state(url, flow_run_id)) in {"COMPLETED", "FAILED", "CRASHED"} and s, 400,
                     "the retried flow run")
    assert state == "COMPLETED"
    final_state = json.loads((run_dir / "final" / "state.json").read_text())
    assert final_state["step"] == 6
    assert final_state["resumed_from"] == [max(steps_done)]  # continued from the newest checkpoint, not step 0
    client, run = _mlflow(tracking[0], "crashy")
    for key in ("progress/rl_step", "reward/mean", "train/loss"):  # every step exactly once across both attempts
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3, 4, 5, 6], key
    assert run.info.status == "FINISHED"
    assert [int(v.version) for v in client.search_model_versions("name='crashy'")] == [1]
