"""The RLVR flow end to end on real Ray, a real Prefect server and a real MLflow sqlite store."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = pytest.mark.ray


def test_two_step_flow(tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    # kl.coef > 0 brings in the reference engine; the untrained tiny model earns no reward yet, so the
    # entropy bonus is what gives every parameter a gradient in two steps.
    config = load_config("configs/tiny.yaml", [f"run.dir={run_dir}", "run.name=two-step", "train.steps=2",
                                               "checkpoint.every=1", "eval.every=1", "tracking.sample_every=1",
                                               "algorithm.kl.coef=0.01", "algorithm.entropy_coef=0.01",
                                               "sft.steps=3", "sft.batch_size=8"])
    result = run_flow(config)

    assert result["already_finished"] is False
    final = run_dir / "final"
    assert (final / "model.safetensors").exists() and (final / "tokenizer.json").exists()
    trained, base = load_file(final / "model.safetensors"), load_file(run_dir / "sft_model" / "model.safetensors")
    changed = [name for name in base if not (trained[name] == base[name]).all()]
    assert len(changed) == len(base)  # every parameter moved
    assert set(result["heldout_accuracy"]) == {"0", "1", "2"}

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["rollout.group_size"] == "8"
    for key in ("reward/mean", "reward/std", "reward/accuracy", "response/length_mean", "actor/kl",
                "actor/entropy", "actor/clipfrac", "train/grad_norm", "train/lr", "time/generate_and_score", "time/train",
                "perf/tokens_per_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    evals = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/heldout_accuracy"))
    assert evals == [0, 1, 2]  # before the first step, then every step
    drift = client.get_metric_history(run.info.run_id, "sync/logprob_drift_max")
    assert [m.step for m in drift] == [1, 2] and all(m.value < 1e-4 for m in drift)  # each sync checked
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sft/nll")] == [1, 2, 3]
    for key in run.data.metrics:  # SFT and RL streams never write the same key at the same step
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), key
    assert (run_dir / "sft_model" / "MANIFEST.json").exists()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples", "final_model"} <= artifacts
    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert "samples/rollouts_step_000001.json" in samples
    state = json.loads((final / "state.json").read_text())
    assert state["step"] == 2 and state["data_position"] == 2 * config.rollout.prompts_per_step

    again = run_flow(config)  # finished runs say so and do nothing
    assert again["already_finished"] is True and again["heldout_accuracy"] == result["heldout_accuracy"]
