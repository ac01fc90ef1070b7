"""Seconds per task of RLVR iterations, and the share spent outside generate/score/train compute.

Runs ``configs/tiny.yaml`` (or the config given) through the real flow — local Ray, embedded Prefect,
MLflow sqlite — then reads the per-step timings from MLflow. Orchestration overhead is the share of a
step not spent inside the engines' generate, reward-scoring and train_step calls (each timed inside the
actor): Prefect task runs, Ray calls and object transfer, advantage/batch building, weight sync, MLflow.

    python bench/step_breakdown.py [CONFIG] [key=value ...]
"""

from __future__ import annotations

import statistics
import sys
import tempfile

TASKS = ("generate_and_score", "advantages", "train", "sync_weights", "evaluate", "checkpoint")


def main(argv: list[str]) -> None:
    from mlflow.tracking import MlflowClient

    from configs.loader import load_config
    from flows.cli import _ENV_DEFAULTS
    import os

    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    config_path = argv[0] if argv and "=" not in argv[0] else "configs/tiny.yaml"
    overrides = [a for a in argv if "=" in a]
    run_dir = tempfile.mkdtemp(prefix="rollflow-bench-")
    config = load_config(config_path, [f"run.dir={run_dir}", "run.name=bench", "train.steps=8", "eval.every=0",
                                       "checkpoint.every=1000", "tracking.sample_every=0", *overrides])
    from flows.pipeline import run_flow

    result = run_flow(config)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run_id = result["mlflow_run_id"]

    def per_step(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    steps = sorted(per_step("time/step"))[1:]  # the first step pays warm-up
    step_time = per_step("time/step")
    print(f"{'task (wall)':<14}{'median s':>10}")
    for task in TASKS:
        values = per_step(f"time/{task}")
        if values:
            print(f"{task:<14}{statistics.median(values[s] for s in steps if s in values):>10.4f}")
    gen, train, score = (per_step(f"perf/{k}_compute_s") for k in ("generate", "train", "score"))
    for name, values in (("generate compute", gen), ("score compute", score), ("train compute", train)):
        print(f"{name:<18}{statistics.median(values[s] for s in steps):>6.4f}")
    compute = [gen[s] + train[s] + score[s] for s in steps]
    total = [step_time[s] for s in steps]
    overhead = 1 - sum(compute) / sum(total)
    print(f"{'step':<14}{statistics.median(total):>10.4f}")
    print(f"orchestration_overhead_share {overhead:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
