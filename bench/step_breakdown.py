"""Seconds per task of RLVR iterations, and the share spent outside generate/score/train compute.

Runs ``configs/tiny.yaml`` (or the config given) through the real flow — local Ray, embedded Prefect,
MLflow sqlite — then reads the per-step timings from MLflow. Orchestration overhead is the share of a
step not spent inside the engines' generate, reward-scoring and train_step calls (each timed inside the
actor): Prefect task runs, Ray calls and object transfer, advantage/batch building, weight sync, MLflow.
Each task's wall time is split into its body (the Ray calls it makes and waits for, timed here by
wrapping the task's function) and the rest, Prefect's task engine (run creation, state events, result).

    python bench/step_breakdown.py [CONFIG] [key=value ...]
"""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
import time

TASKS = ("generate_and_score", "advantages", "train", "sync_weights", "evaluate", "checkpoint")
BODIES = {"generate_and_score": "generate_and_score", "advantages": "compute_advantages", "train": "train",
          "sync_weights": "sync_weights"}  # metric key -> the task in flows.rlvr whose body is timed


def time_task_bodies(module) -> dict[str, list[float]]:
    """Wrap the function of each task in ``BODIES`` so every call's seconds inside it are recorded."""
    seconds: dict[str, list[float]] = {}
    for key, name in BODIES.items():
        task = getattr(module, name)

        def timed_body(*args, _fn=task.fn, _out=seconds.setdefault(key, []), **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _out.append(time.perf_counter() - start)

        task.fn = functools.wraps(task.fn)(timed_body)
    return seconds


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
    import flows.rlvr
    from flows.pipeline import run_flow

    bodies = time_task_bodies(flows.rlvr)
    result = run_flow(config)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run_id = result["mlflow_run_id"]

    def per_step(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    steps = sorted(per_step("time/step"))[1:]  # the first step pays warm-up
    step_time = per_step("time/step")
    print(f"{'task':<20}{'wall s':>9}{'body s':>9}{'Prefect s':>11}   (medians)")
    prefect = 0.0
    for task in TASKS:
        values = per_step(f"time/{task}")
        if not values:
            continue
        wall = statistics.median(values[s] for s in steps if s in values)
        if task in bodies:  # the body's first call (the sync before step 1, or step 1) is left out like step 1
            body = statistics.median(bodies[task][1:] if task != "sync_weights" else bodies[task][2:])
            print(f"{task:<20}{wall:>9.4f}{body:>9.4f}{wall - body:>11.4f}")
            prefect += wall - body
        else:
            print(f"{task:<20}{wall:>9.4f}")
    gen, train, score = (per_step(f"perf/{k}_compute_s") for k in ("generate", "train", "score"))
    for name, values in (("generate compute", gen), ("score compute", score), ("train compute", train)):
        print(f"{name:<20}{statistics.median(values[s] for s in steps):>9.4f}")
    compute = [gen[s] + train[s] + score[s] for s in steps]
    total = [step_time[s] for s in steps]
    overhead = 1 - sum(compute) / sum(total)
    print(f"{'step':<20}{statistics.median(total):>9.4f}")
    print(f"Prefect's task engine, the step's tasks together: {prefect:.4f} s ({prefect / statistics.median(total):.1%} of a step)")
    print(f"orchestration_overhead_share {overhead:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
