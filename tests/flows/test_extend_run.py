"""Raising ``train.steps`` on a finished run continues it (real Ray, Prefect, MLflow sqlite): the RL stage
resumes from its newest checkpoint, writes a new ``final/``, and the new model is registered as a new
version while the first keeps its weights."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = pytest.mark.ray


@pytest.mark.slow  # kept out of the default suite's ~12 minutes
def test_raising_train_steps_continues_a_finished_run_to_the_new_step(tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    # the untrained tiny model earns no reward yet: the entropy bonus gives every step a gradient
    common = [f"run.dir={run_dir}", "run.name=extend", "eval.every=0", "tracking.sample_every=0",
              "algorithm.entropy_coef=0.01"]
    first = run_flow(load_config("configs/tiny.yaml", [*common, "train.steps=2"]))
    first_marker = json.loads((run_dir / "final" / "MANIFEST.json").read_text())
    first_weights = load_file(run_dir / "final" / "model.safetensors")
    assert first_marker["step"] == 2 and first["already_finished"] is False

    result = run_flow(load_config("configs/tiny.yaml", [*common, "train.steps=3"]))

    assert result["already_finished"] is False and result["mlflow_run_id"] == first["mlflow_run_id"]
    state = json.loads((run_dir / "final" / "state.json").read_text())
    assert state["step"] == 3 and state["resumed_from"] == [2]  # continued from the step-2 checkpoint
    marker = json.loads((run_dir / "final" / "MANIFEST.json").read_text())
    assert marker["step"] == 3 and marker["key"] == first_marker["key"]  # train.steps is not part of the key
    weights = load_file(run_dir / "final" / "model.safetensors")
    assert any(not (weights[k] == first_weights[k]).all() for k in weights)  # step 3 trained
    assert set(result["heldout_accuracy"]) == {"0", "2", "3"}  # evaluated at the end of each leg

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["rollflow.config_changes"] == "train.steps: 2 -> 3"
    for key in ("reward/mean", "train/grad_norm", "progress/rl_step"):  # each step once across both legs
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3], key
    versions = sorted(client.search_model_versions("name='extend'"), key=lambda v: int(v.version))
    assert [(int(v.version), v.tags["rollflow.step"]) for v in versions] == [(1, "2"), (2, "3")]
    assert versions[0].source.endswith("/final_model") and versions[1].source.endswith("/final_model_step_000003")

    again = run_flow(load_config("configs/tiny.yaml", [*common, "train.steps=3"]))
    assert again["already_finished"] is True and again["registered_version"] == 2
