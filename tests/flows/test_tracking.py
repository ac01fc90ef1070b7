"""MLflow tracking against a real sqlite store: one value per step even when steps are re-run."""

from __future__ import annotations

from flows.tracking import RunTracker


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


def test_credentials_never_reach_mlflow(tmp_path, monkeypatch):
    from flows.tracking import redact

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-1234")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "tracking-pw-5678")
    monkeypatch.setenv("ROLLFLOW_SEED_NOTE", "not-secret-value")  # a name that says nothing secret: kept
    # userinfo in any URL, and any secret env value, wherever it appears
    assert redact("postgresql://mlflow:pw@db:5432/m s3://bucket/k aws-secret-1234") == \
        "postgresql://***@db:5432/m s3://bucket/k ***"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    params = {"data.train_path": "https://user:hf_tok@example.org/train.jsonl", "note": "tracking-pw-5678",
              "seed_note": "not-secret-value"}
    tracker = RunTracker.create(uri, "exp", "run-c", params, "data: {train_path: https://user:hf_tok@example.org/x}\n",
                                tags={"rollflow.run_dir": "s3://aws-secret-1234@bucket/run"})
    run = tracker.client.get_run(tracker.run_id)
    assert run.data.params == {"data.train_path": "https://***@example.org/train.jsonl", "note": "***",
                               "seed_note": "not-secret-value"}
    assert run.data.tags["rollflow.run_dir"] == "s3://***@bucket/run"
    config_text = open(tracker.client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path))).read()
    assert "hf_tok" not in config_text and "https://***@example.org/x" in config_text


def test_metrics_wait_for_their_flush_interval_and_are_sent_on_error(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = RunTracker.create(uri, "exp", "run-c", {}, "")
    tracker.log_step("rl", 1, {"reward/mean": 0.1}, flush=False)
    tracker.flush_if_due(3600)  # not due: still queued
    assert tracker.client.get_metric_history(tracker.run_id, "reward/mean") == []
    tracker.flush_if_due(0)  # due: sent on the background thread
    tracker._sending[0].result(timeout=30)
    assert [m.step for m in tracker.client.get_metric_history(tracker.run_id, "reward/mean")] == [1]
    try:
        with tracker.sent_on_error():
            tracker.log_step("rl", 2, {"reward/mean": 0.2}, flush=False)
            raise RuntimeError("engine died")
    except RuntimeError:
        pass
    assert [m.step for m in tracker.client.get_metric_history(tracker.run_id, "reward/mean")] == [1, 2]


def test_artifacts_live_beside_a_local_sqlite_store(tmp_path):
    tracker = RunTracker.create(f"sqlite:///{tmp_path}/db/mlflow.db", "exp", "run-d", {}, "run: {}\n")
    artifact_uri = tracker.client.get_run(tracker.run_id).info.artifact_uri
    assert artifact_uri.startswith(str(tmp_path / "db" / "mlartifacts"))
    assert (tmp_path / "db" / "mlartifacts").is_dir()  # config.yaml landed there, not in ./mlruns


def test_a_failed_background_send_loses_and_duplicates_nothing(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = RunTracker.create(uri, "exp", "run-e", {}, "")
    monkeypatch.setattr("flows.tracking.MAX_BATCH", 4)  # 3 batches for 2 steps of 5 entries each
    real_log_batch, calls = tracker.client.log_batch, []

    def log_batch_failing_second(run_id, metrics):
        calls.append(len(metrics))
        if len(calls) == 2:
            raise ConnectionError("tracking store went away")
        return real_log_batch(run_id, metrics=metrics)

    monkeypatch.setattr(tracker.client, "log_batch", log_batch_failing_second)
    for step in (1, 2):
        tracker.log_step("rl", step, {"a": step, "b": step, "c": step, "d": step}, flush=False)
    tracker.flush_if_due(0)
    tracker.log_step("rl", 3, {"a": 3, "b": 3, "c": 3, "d": 3}, flush=False)
    try:
        tracker.flush()  # the background send's error surfaces here; its unsent metrics are queued again
        raise AssertionError("the background error was swallowed")
    except ConnectionError:
        pass
    tracker.flush()
    for key in ("a", "d", "progress/rl_step"):
        history = tracker.client.get_metric_history(tracker.run_id, key)
        assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 3.0)], key
    assert tracker._sender is None  # flush leaves no idle thread behind
