"""Held-out accuracy of asynchronous RL against synchronous at equal samples consumed, over several seeds.

    python bench/async_learning.py [seeds=8] [steps=200] [modes=off,one_step,full_eta1,full_eta2]
                                   [old_logprobs=rollout] [correction=] [section.key=value ...]

``configs/quickstart.yaml``'s SFT warm start runs once (seed 0); every RL run then starts from that model
(``sft=null``), ``steps`` steps of the quickstart's batch (so every mode consumes the same samples), one
torch thread per engine, evaluation every ``steps / 10`` steps. A run's figure is the mean held-out
accuracy of its last three evaluations (steps 160, 180 and 200 by default). Each mode is compared with
``off`` seed by seed: the mean difference ± one standard error. ``old_logprobs`` and ``correction`` set
``algorithm.old_logprobs`` and ``algorithm.correction`` of every mode (``trainer`` and ``tis``: PPO's ratio
against the weights the batch starts from, with truncated importance weights). Any other
``section.key=value`` is a config override of every run, e.g. ``train.mini_batches=2``.

Last two lines: ``async_learning_worst_gap`` (the most negative mean difference, goal >= -0.03: no mode
more than 0.03 below ``off``) and ``async_learning_largest_gap`` (the largest absolute mean difference, goal
<= 0.03: the same accuracy within 0.03, above or below). A 200-step run takes about 50 s on 2 cores.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"off": ["async.mode=off"], "one_step": ["async.mode=one_step"],
         "full_eta1": ["async.mode=full", "async.max_staleness=1"],
         "full_eta2": ["async.mode=full", "async.max_staleness=2"]}
ARGUMENTS = ("seeds", "steps", "modes", "old_logprobs", "correction")
QUIET = ["tracking.sample_every=0", "tracking.log_model=false", "tracking.register_model=false", "run.torch_threads=1"]


def sft_model(scratch: str) -> str:
    """The quickstart's SFT warm start (seed 0), trained once: its ``sft_model`` folder."""
    from configs.loader import load_config
    from flows.pipeline import run_flow

    run_dir = f"{scratch}/sft"
    run_flow(load_config("configs/quickstart.yaml", [f"run.dir={run_dir}", "run.name=bench-async-learning-sft",
                                                     "train.steps=1", "eval.every=0", *QUIET]))
    return f"{run_dir}/sft_model"


def run(mode: str, seed: int, model: str, scratch: str, args: dict) -> float:
    """One RL run of ``mode`` from ``model``; the mean held-out accuracy of its last three evaluations."""
    from configs.loader import load_config
    from flows.pipeline import run_flow

    every = max(1, args["steps"] // 10)
    correction = [f"algorithm.correction={args['correction']}"] if args["correction"] else []
    config = load_config("configs/quickstart.yaml", [
        f"run.dir={scratch}/{mode}-{seed}", f"run.name=bench-async-learning-{mode}-{seed}", f"run.seed={seed}",
        "sft=null", "model.source=hf", f"model.path={model}", f"train.steps={args['steps']}", f"eval.every={every}",
        f"checkpoint.every={args['steps']}", f"algorithm.old_logprobs={args['old_logprobs']}", *correction,
        *args["overrides"], *MODES[mode], *QUIET])
    accuracy = run_flow(config)["heldout_accuracy"]
    last = sorted(accuracy, key=int)[-3:]
    return sum(accuracy[step] for step in last) / len(last)


def paired(diffs: list[float]) -> tuple[float, float]:
    """Mean and standard error of paired differences."""
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, float("nan")
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs))


def main(argv: list[str]) -> dict:
    from bench.common import result_line, scratch_dir, start_flow_services

    overrides = [a for a in argv if "." in a.split("=", 1)[0]]
    args = dict(a.split("=", 1) for a in argv if a not in overrides)
    unknown = set(args) - set(ARGUMENTS)
    if unknown:
        raise SystemExit(f"unknown arguments {sorted(unknown)}; known: {', '.join(ARGUMENTS)}, "
                         "and section.key=value overrides")
    args = {"seeds": int(args.get("seeds", 8)), "steps": int(args.get("steps", 200)),
            "modes": ["off", *(m for m in args.get("modes", ",".join(MODES)).split(",") if m != "off")],
            "old_logprobs": args.get("old_logprobs", "rollout"), "correction": args.get("correction", ""),
            "overrides": overrides}
    unknown = set(args["modes"]) - MODES.keys()
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    scratch = scratch_dir("async-learning")
    start_flow_services()
    started = time.perf_counter()
    model = sft_model(scratch)
    print(f"SFT warm start in {time.perf_counter() - started:.0f} s; {args['seeds']} seeds x {args['steps']} steps, "
          f"old_logprobs {args['old_logprobs']}, correction {args['correction'] or 'none'}, "
          f"overrides {' '.join(overrides) or 'none'}", flush=True)
    results: dict[str, list[float]] = {mode: [] for mode in args["modes"]}
    for seed in range(args["seeds"]):  # seed by seed: a cut-short run still pairs every mode
        for mode in args["modes"]:
            started = time.perf_counter()
            results[mode].append(run(mode, seed, model, scratch, args))
            print(f"seed {seed} {mode:<10} held-out {results[mode][-1]:.3f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    base = results["off"]
    print(f"{'mode':<10} {'held-out':>9} {'- off':>8} {'± se':>7}")
    gaps = {}
    for mode, values in results.items():
        mean = sum(values) / len(values)
        if mode == "off":
            print(f"{mode:<10} {mean:9.3f}")
            continue
        gaps[mode] = paired([a - b for a, b in zip(values, base)])
        print(f"{mode:<10} {mean:9.3f} {gaps[mode][0]:+8.3f} {gaps[mode][1]:7.3f}")
    worst = min((gap for gap, _ in gaps.values()), default=0.0)
    largest = max((abs(gap) for gap, _ in gaps.values()), default=0.0)
    print(result_line("async_learning_worst_gap", worst, ">=", -0.03))
    print(result_line("async_learning_largest_gap", largest, "<=", 0.03))
    return {"value": worst, "largest_gap": largest, "accuracy": results, "gaps": gaps}


if __name__ == "__main__":
    main(sys.argv[1:])
