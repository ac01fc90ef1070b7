"""The RLVR flow with LoRA (model.lora): no reference engine, adapter checkpoints, merged + adapter export."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = pytest.mark.ray


def test_lora_flow_uses_the_frozen_base_as_the_kl_reference(tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    # a large LR, so that one step moves the adapter enough to be seen in the KL
    config = load_config("configs/tiny.yaml", [f"run.dir={run_dir}", "run.name=lora-flow", "train.steps=2",
                                               "checkpoint.every=1", "eval.every=0", "model.lora.r=4",
                                               "algorithm.kl.coef=0.01", "algorithm.entropy_coef=0.01",
                                               "train.optim.lr=1e-2"])
    result = run_flow(config)

    assert "reference" not in json.loads((run_dir / "engines.json").read_text())  # the trainer serves it
    adapter = load_file(run_dir / "checkpoints" / "step_000002" / "policy" / "model.safetensors")
    assert adapter and all(".lora_A." in name or ".lora_B." in name for name in adapter)  # no base weights
    final = run_dir / "final"
    merged = load_file(final / "model.safetensors")
    assert (final / "adapter" / "adapter_model.safetensors").exists()
    assert not all((merged[n] == w).all() for n, w in load_file(run_dir / "base_model" / "model.safetensors").items())

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    kl = {m.step: m.value for m in client.get_metric_history(result["mlflow_run_id"], "kl/seq_mean")}
    # step 1 samples from base + an adapter whose B is 0, i.e. the base: KL 0 up to the rollout engine's
    # rounding; step 2 samples from the trained adapter
    assert kl[1] < 1e-4 and kl[2] > 10 * max(kl[1], 1e-5)
    drift = client.get_metric_history(result["mlflow_run_id"], "sync/logprob_drift_max")
    assert [m.step for m in drift] == [1, 2] and all(m.value < 1e-4 for m in drift)  # the merged adapters match
