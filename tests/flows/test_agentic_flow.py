"""Agentic RL end to end on real Ray, a real Prefect server and a real MLflow sqlite store: the SFT warm
start on random moves, environment workers, per-environment metrics and sample episodes, the final model."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = pytest.mark.ray

SMALL = ["train.steps=2", "checkpoint.every=1", "eval.every=1", "tracking.sample_every=1", "sft.steps=4",
         "sft.batch_size=8", "rollout.prompts_per_step=2", "rollout.group_size=4", "agentic.eval_seeds=6",
         "agentic.max_turns=4", "agentic.warm_start_episodes=32", "run.torch_threads=1",
         "algorithm.entropy_coef=0.01"]  # a gradient every step, whatever the episodes earn


@pytest.mark.parametrize("mode", ["trajectory", pytest.param("step", marks=pytest.mark.slow)])
def test_agentic_run_trains_and_tracks_episodes(mode, tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    config = load_config("configs/agentic/corridor.yaml", [f"run.dir={run_dir}", f"run.name=agentic-{mode}",
                                                           f"agentic.mode={mode}", "agentic.workers=2", *SMALL])
    result = run_flow(config)
    out = run_dir / "agentic_model"
    trained, start = load_file(out / "model.safetensors"), load_file(run_dir / "sft_model" / "model.safetensors")
    assert any(not (trained[k] == start[k]).all() for k in start)

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    for key in ("agentic/Corridor-v0/success_rate", "agentic/Corridor-v0/return_mean", "agentic/Corridor-v0/turns_mean",
                "agentic/Corridor-v0/invalid_action_rate", "agentic/Corridor-v0/ending/max_turns", "reward/mean",
                "actor/clipfrac", "train/grad_norm", "time/rollout"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    turns = client.get_metric_history(run.info.run_id, "agentic/Corridor-v0/turns_mean")
    assert all(1 <= m.value <= 4 for m in turns)
    evals = client.get_metric_history(run.info.run_id, "eval/heldout_accuracy")
    assert sorted(m.step for m in evals) == [0, 1, 2] and all(0 <= m.value <= 1 for m in evals)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/Corridor-v0/success_rate")] == [0, 1, 2]

    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert {"samples/episodes_step_000001.json", "samples/eval_step_000000.json"} <= samples
    table = json.loads(open(client.download_artifacts(run.info.run_id, "samples/episodes_step_000001.json")).read())
    transcript = table["data"][0][table["columns"].index("transcript")]
    assert transcript.startswith("[env] ") and "[model] " in transcript
    state = json.loads((out / "state.json").read_text())
    assert state["step"] == 2


@pytest.mark.slow
def test_agentic_one_step_runs_episodes_ahead_within_one_version(tmp_path, ray_cluster, prefect_server):
    # Env-level async under the same bound as RLVR's one_step: step k+1's episodes run (environments on their
    # own, turns batched as they come) while step k trains, and every batch is checked to be at most one
    # weight version behind the trainer.
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    run_dir = tmp_path / "run"
    config = load_config("configs/agentic/corridor.yaml", [
        f"run.dir={run_dir}", "run.name=agentic-one-step", "async.mode=one_step", "algorithm.old_logprobs=trainer",
        "algorithm.correction=tis", *SMALL, "train.steps=3", "eval.every=3", "checkpoint.every=3"])
    result = run_flow(config)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = lambda key: sorted((m.step, m.value) for m in client.get_metric_history(result["mlflow_run_id"], key))  # noqa: E731
    assert history("offpolicy/version_lag") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    mismatch = dict(history("mismatch/mean_abs_logprob_diff"))
    assert mismatch[1] < 1e-4 < min(mismatch[2], mismatch[3])  # the trainer moved between sampling and training
    assert [step for step, _ in history("agentic/Corridor-v0/success_rate")] == [1, 2, 3]


@pytest.mark.slow  # ~80 s, kept out of the default suite's ~12 minutes
def test_agentic_full_streams_episode_groups_within_the_staleness_bound(tmp_path, ray_cluster, prefect_server):
    # async.mode full with environments: episode groups run continuously while the trainer trains, weights
    # reach the engines between turns, and no trained group started more than η versions behind.
    from mlflow.tracking import MlflowClient

    from engines import checkpoint_store as store
    from flows.pipeline import run_flow
    from flows.setup import checkpoint_root

    run_dir, steps = tmp_path / "run", 4
    config = load_config("configs/agentic/corridor.yaml", [
        f"run.dir={run_dir}", "run.name=agentic-full", "async.mode=full", "async.max_staleness=1",
        "algorithm.old_logprobs=trainer", *SMALL, f"train.steps={steps}", "eval.every=0", "checkpoint.every=2"])
    result = run_flow(config)
    client, groups = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db"), config.rollout.prompts_per_step
    history = lambda key: {m.step: m.value for m in client.get_metric_history(result["mlflow_run_id"], key)}  # noqa: E731
    lag_max = history("async/version_lag_max")
    assert sorted(lag_max) == list(range(1, steps + 1))
    assert lag_max[1] == 0 and max(lag_max.values()) == 1  # rollout ran ahead, never past η
    assert history("offpolicy/version_lag") == lag_max  # the trainer's own check agrees
    for step in range(1, steps + 1):
        assert sum(history(f"async/version_lag_{lag}")[step] for lag in (0, 1)) == groups
    # every group number handed out is trained, waiting, or counted as dropped or aborted
    state = store.read_json(store.join(store.step_dir(checkpoint_root(config, "agentic"), 2), "state.json"))
    lost = sum(history(f"async/{kind}_groups")[2] for kind in ("dropped", "aborted"))
    assert state["domain_positions"]["episode_groups"] == 2 * groups + state["untrained_groups"] + lost


@pytest.mark.slow  # ~90 s
def test_agentic_full_replaces_a_rollout_engine_killed_mid_run(tmp_path, ray_cluster, prefect_server):
    # The episode stream keeps the engine busy with turns: killed, its groups run again under the same numbers on
    # a new engine, and every group number handed out is still trained, waiting, or counted.
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from cli_runs import run_killing_engine
    from engines import checkpoint_store as store
    from flows.setup import checkpoint_root

    run_dir, steps = tmp_path / "run", 8
    overrides = [f"run.dir={run_dir}", "run.name=agentic-full-kill", "async.mode=full", "async.max_staleness=1",
                 *SMALL, f"train.steps={steps}", "eval.every=0", "checkpoint.every=2"]
    config = load_config("configs/agentic/corridor.yaml", overrides)
    checkpoints = Path(checkpoint_root(config, "agentic"))
    run_killing_engine(tmp_path, "configs/agentic/corridor.yaml", overrides,
                       checkpoints / "checkpoints" / "step_000002" / "MANIFEST.json")
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    [run] = [r for r in client.search_runs(client.get_experiment_by_name("rollflow").experiment_id)
             if client.get_metric_history(r.info.run_id, "async/engine_restarts")]
    history = lambda key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}  # noqa: E731
    restarts = history("async/engine_restarts")
    assert sorted(restarts) == list(range(1, steps + 1))  # every step trained once
    assert restarts[1] == 0 and restarts[steps] >= 1
    assert max(history("async/version_lag_max").values()) <= 1
    state = store.read_json(store.join(store.step_dir(str(checkpoints), steps), "state.json"))
    lost = sum(history(f"async/{kind}_groups")[steps] for kind in ("dropped", "aborted"))
    groups = config.rollout.prompts_per_step
    assert state["domain_positions"]["episode_groups"] == steps * groups + state["untrained_groups"] + lost
