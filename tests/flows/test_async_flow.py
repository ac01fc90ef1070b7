"""Asynchronous RL end to end (real Ray, Prefect, MLflow). ``one_step``: every batch after the first is one
weight version behind, the correction and mismatch metrics are logged, and each checkpoint holds the batch
generated ahead of it. ``full``: no trained group is more than ``async.max_staleness`` versions behind, each
group is scored with its own prompt, the data drawn is accounted for, and a rollout engine killed mid-generation is replaced while the run goes on."""

from __future__ import annotations

import pytest

from configs.loader import load_config

pytestmark = pytest.mark.ray

# 1.0 for a sample scored with its own prompt, whatever it says; a reward by path, as a user's own reward is
PROMPT_REWARD = "tests.flows.prompt_rewards:prompt_holds_its_answer"


def test_one_step_flow_trains_one_version_behind(tmp_path, ray_cluster, prefect_server):
    import ray
    from mlflow.tracking import MlflowClient

    from engines import checkpoint_store as store
    from tasks.pending_batch import PENDING_FILE, load_pending
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


def _history(run_dir, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


@pytest.mark.parametrize("eta", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_full_flow_keeps_every_batch_within_the_staleness_bound(eta, tmp_path, ray_cluster, prefect_server):
    from engines import checkpoint_store as store
    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    steps = 6
    config = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"run.name=full-{eta}", f"train.steps={steps}", "checkpoint.every=3", "eval.every=3",
        "async.mode=full", f"async.max_staleness={eta}", "algorithm.old_logprobs=trainer",
        "algorithm.entropy_coef=0.01", "run.torch_threads=1", f"reward.name={PROMPT_REWARD}"])
    result = run_flow(config)
    run_id = result["mlflow_run_id"]
    # a call generates several groups (the HF engine's default): each is scored with its own prompt
    assert _history(run_dir, run_id, "reward/mean") == {step: 1.0 for step in range(1, steps + 1)}
    lag_max, lag_mean = _history(run_dir, run_id, "async/version_lag_max"), _history(run_dir, run_id, "async/version_lag_mean")
    assert sorted(lag_max) == list(range(1, steps + 1))
    assert lag_max[1] == 0 and max(lag_max.values()) <= eta  # the first batch: nothing trained before it
    assert max(lag_max.values()) >= 1  # rollout ran ahead of the trainer
    # the per-lag counts add up to the batch's groups, and agree with the mean
    for step in range(1, steps + 1):
        counts = [_history(run_dir, run_id, f"async/version_lag_{lag}")[step] for lag in range(eta + 1)]
        assert sum(counts) == config.rollout.prompts_per_step
        assert sum(lag * c for lag, c in enumerate(counts)) / sum(counts) == pytest.approx(lag_mean[step])
    # the trainer's check agrees: the oldest group of each batch
    assert _history(run_dir, run_id, "offpolicy/version_lag") == lag_max
    state = store.read_json(store.join(store.step_dir(str(run_dir), 3), "state.json"))
    drawn = sum(state["domain_positions"].values())
    assert drawn == 3 * config.rollout.prompts_per_step + state["untrained_groups"]  # nothing lost unseen
    assert set(result["heldout_accuracy"]) == {"0", "3", "6"}


@pytest.mark.slow  # kept out of the default suite's ~12 minutes
def test_full_flow_replaces_a_rollout_engine_killed_mid_generation(tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from cli_runs import run_killing_engine

    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", "run.name=full-kill", "train.steps=10", "checkpoint.every=2", "eval.every=0",
                 "async.mode=full", "async.max_staleness=1", "run.torch_threads=1", "rollout.max_new_tokens=32"]
    run_killing_engine(tmp_path, "configs/tiny.yaml", overrides, run_dir / "checkpoints" / "step_000002" / "MANIFEST.json")
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    [run] = client.search_runs(client.get_experiment_by_name("rollflow").experiment_id)
    restarts = _history(run_dir, run.info.run_id, "async/engine_restarts")
    assert sorted(restarts) == list(range(1, 11))  # every step trained, none twice
    assert restarts[10] >= 1 and restarts[1] == 0
    assert (run_dir / "final" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("partial, engine", [("keep", "hf"), ("abort", "hf"), pytest.param("keep", "vllm", marks=pytest.mark.vllm)])
def test_full_flow_partial_rollouts(partial, engine, tmp_path, ray_cluster, prefect_server):
    # The engine generates all the time, so syncs land inside generation calls: keep lets those groups finish
    # with the new weights (recorded per token), abort stops them and draws them again.
    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    config = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"run.name=partial-{partial}-{engine}", "train.steps=6", "checkpoint.every=6",
        "eval.every=0", "async.mode=full", f"async.partial_rollout={partial}", "rollout.max_new_tokens=32",
        f"rollout.engine={engine}", "algorithm.old_logprobs=trainer", "run.torch_threads=1"])
    run_id = run_flow(config)["mlflow_run_id"]
    partial_groups = sum(_history(run_dir, run_id, "async/partial_groups").values())
    aborted = max(_history(run_dir, run_id, "async/aborted_groups").values())
    assert (partial_groups > 0 and aborted == 0) if partial == "keep" else (aborted > 0 and partial_groups == 0)
    assert max(_history(run_dir, run_id, "async/version_lag_max").values()) <= 1
