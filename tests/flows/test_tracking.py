"""MLflow tracking against a real sqlite store: one value per step even when steps are re-run."""

from __future__ import annotations

from tasks.tracking import RunTracker


def test_resumed_tracker_skips_steps_already_logged(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = RunTracker.create(uri, "exp", "run-a", {"rollout.group_size": "8"}, "run: {}\n")
    for step in (1, 2, 3):
        assert tracker.log_step("rl", step, {"reward/mean": step / 10})
    # a crash after step 3, a checkpoint at step 2: the resumed process replays step 3, then goes on
    resumed = RunTracker(uri, tracker.run_id)
    assert resumed.last_step("rl") == 3
    assert resumed.log_step("rl", 3, {"reward/mean": 99.0}) is False
    assert resumed.log_step("rl", 4, {"reward/mean": 0.4})
    history = resumed.client.get_metric_history(tracker.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    run = resumed.client.get_run(tracker.run_id)
    assert run.data.params == {"rollout.group_size": "8"}


def test_buffered_steps_flush_in_one_batch(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = RunTracker.create(uri, "exp", "run-b", {}, "")
    for step in range(1, 6):
        tracker.log_step("sft", step, {"sft/nll": 1.0 / step}, flush=False)
    assert tracker.client.get_metric_history(tracker.run_id, "sft/nll") == []
    tracker.flush()
    assert [m.step for m in tracker.client.get_metric_history(tracker.run_id, "sft/nll")] == [1, 2, 3, 4, 5]
