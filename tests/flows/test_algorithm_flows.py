"""Algorithms through the real flow (Ray, Prefect, MLflow sqlite): PPO's critic is checkpointed and
resumed bit-identically; DAPO's dynamic sampling refills batches across Ray actors."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = pytest.mark.ray


def _ppo(run_dir, steps: int):
    # Critic warm-up 1: step 1 trains only the critic. KL in the reward (k1, adaptive) gives the
    # untrained model a non-zero token reward, so GAE advantages and both models move every step.
    return load_config("algorithms/ppo", [f"run.dir={run_dir}", "run.name=ppo-test", f"train.steps={steps}",
                                          "checkpoint.every=2", "eval.every=0", "tracking.sample_every=0",
                                          "algorithm.entropy_coef=0.01", "data.arithmetic.num_heldout=8"])


@pytest.mark.slow  # three flow runs
def test_ppo_critic_is_checkpointed_and_resumed(tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_flow(_ppo(straight, 4))
    first_leg = run_flow(_ppo(resumed, 2))  # finishes at step 2; raising train.steps continues it from
    result = run_flow(_ppo(resumed, 4))  # the step-2 checkpoint, as a run killed there resumes

    for role in ("policy", "critic"):
        a = load_file(straight / "checkpoints" / "step_000004" / role / "model.safetensors")
        b = load_file(resumed / "checkpoints" / "step_000004" / role / "model.safetensors")
        assert a.keys() == b.keys()
        assert all((a[k] == b[k]).all() for k in a), role  # resume restored the critic and its optimizer exactly
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)  # the extended run's final model is the uninterrupted run's
    critic_start = load_file(resumed / "checkpoints" / "step_000002" / "critic" / "model.safetensors")
    assert any(not (critic_start[k] == b[k]).all() for k in b)  # and it kept training after the resume
    state = json.loads((resumed / "final" / "state.json").read_text())
    assert state["kl_coef"] != 0.05  # the adaptive controller moved and its value was carried across the resume
    assert state["kl_coef"] == json.loads((straight / "final" / "state.json").read_text())["kl_coef"]

    client = MlflowClient(tracking_uri=f"sqlite:///{resumed}/mlflow.db")
    assert result["mlflow_run_id"] == first_leg["mlflow_run_id"]
    for key in ("critic/vf_loss", "critic/explained_variance", "kl/coef", "kl/seq_mean", "advantage/abs_mean"):
        assert [m.step for m in client.get_metric_history(result["mlflow_run_id"], key)] == [1, 2, 3, 4], key
    # Warm-up: no policy update (and no policy metrics) at step 1.
    assert [m.step for m in client.get_metric_history(result["mlflow_run_id"], "actor/pg_loss")] == [2, 3, 4]


def test_dapo_dynamic_sampling_through_the_flow(tmp_path, ray_cluster, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import run_flow

    # Single-digit answers: the untrained model's random digits sometimes match, so some groups have
    # mixed rewards and others are all 0 — the groups dynamic sampling must drop and replace.
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5) if a + b < 10]
    for name in ("train", "heldout"):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run_dir = tmp_path / "run"
    config = load_config("algorithms/dapo", [f"run.dir={run_dir}", "run.name=dapo-test", "train.steps=2",
                                             "eval.every=0", "tracking.sample_every=1", "data.source=files",
                                             f"data.train_path={tmp_path}/train.jsonl",
                                             f"data.heldout_path={tmp_path}/heldout.jsonl",
                                             "rollout.temperature=1.5", "algorithm.dynamic_sampling.max_rounds=4"])
    result = run_flow(config)

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = lambda key: [m.value for m in sorted(client.get_metric_history(result["mlflow_run_id"], key),  # noqa: E731
                                                   key=lambda m: m.step)]
    fill, rounds = history("dynamic/fill_ratio"), history("dynamic/rounds")
    assert len(fill) == 2 and all(0 < f <= 1 for f in fill) and all(1 <= r <= 4 for r in rounds)
    # Every round draws prompts_per_step prompts; the data position counts them all.
    state = json.loads((run_dir / "final" / "state.json").read_text())
    assert state["data_position"] == config.rollout.prompts_per_step * sum(rounds)
    # A refilled batch holds only informative groups, so no advantage is zero on it.
    assert all(a > 0 for a in history("advantage/abs_mean"))
