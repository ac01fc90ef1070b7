"""``async.mode: one_step`` end to end (real Ray, Prefect, MLflow): every batch after the first is one weight
version behind, the correction and mismatch metrics are logged, and each checkpoint holds the batch
generated ahead of it."""

from __future__ import annotations

import pytest

from configs.loader import load_config

pytestmark = pytest.mark.ray


def test_one_step_flow_trains_one_version_behind(tmp_path, ray_cluster, prefect_server):
    import ray
    from mlflow.tracking import MlflowClient

    from engines import checkpoint_store as store
    from flows.asynchrony import PENDING_FILE, load_pending
    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    config = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", "run.name=one-step", "train.steps=4", "checkpoint.every=2", "checkpoint.keep=2",
        "eval.every=2", "async.mode=one_step", "algorithm.old_logprobs=trainer", "algorithm.correction=tis",
        "algorithm.entropy_coef=0.01", "run.torch_threads=1"])
    result = run_flow(config)
    assert set(result["heldout_accuracy"]) == {"0", "2", "4"}

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(result["mlflow_run_id"], key)]  # noqa: E731
    assert sorted(history("offpolicy/version_lag")) == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    # the trainer's weights moved between the batch's sampling and its training: the logprobs differ
    mismatch = dict(history("mismatch/mean_abs_logprob_diff"))
    assert mismatch[1] < 1e-4 < min(mismatch[2], mismatch[3], mismatch[4])
    assert [step for step, _ in sorted(history("offpolicy/clipped_fraction"))] == [1, 2, 3, 4]
    assert [step for step, _ in sorted(history("sync/logprob_drift_max"))] == [1]  # only the batch not behind

    # the checkpoint of step 2 holds step 3's batch, sampled with version 1; the last one holds none
    step2 = store.step_dir(str(run_dir), 2)
    manifest = store.read_json(store.join(step2, "MANIFEST.json"))
    assert PENDING_FILE in manifest["files"]
    step, scored = load_pending(store.read_bytes(store.join(step2, PENDING_FILE)))
    rollouts = ray.get(scored.rollouts_ref)
    assert step == 3 and rollouts.weights_version == 1
    assert len(scored.group_ids) == len(rollouts.completions) == config.rollout.prompts_per_step * config.rollout.group_size
    step4 = store.step_dir(str(run_dir), 4)
    assert store.read_bytes(store.join(step4, PENDING_FILE)) is None
