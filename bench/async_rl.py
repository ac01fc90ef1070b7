"""Throughput of asynchronous RL against synchronous, through the real flow (Ray actors, Prefect tasks,
MLflow in a scratch sqlite store), in one run.

A disaggregated placement on a CPU: every engine runs one torch thread (``run.torch_threads=1``), so the
rollout engine and the trainer each keep one core busy (the CPU analogue of separate GPU pools). Response
lengths have a long tail: generation stops at the first of ``stops`` tokens (each about 1/vocabulary
likely under the untrained model) or at ``max_new_tokens``. Each mode runs ``steps`` RL steps of
``prompts`` x 8 completions from the same model and seed, at a learning rate (1e-9) that leaves the
samples, and with them the work per step, the same in both modes; the figure is samples trained per second over
the steps after the first (whose batch nobody generated ahead), evaluation and checkpoints off.

    python bench/async_rl.py [steps=20] [prompts=8] [max_new_tokens=64] [size=bench] [engine=hf] [modes=off,...]
                             [ppo_epochs=1]

Overlap can at best turn a step of generating (G) then the rest (R: old log-probs, advantages, the optimizer
step, the sync) into one of max(G, R): a speedup of (G + R) / max(G, R), at most 2 when the two are equal.
The synchronous run prints G (``generate``, with scoring) and the optimizer step alone (``train``) as medians;
``ppo_epochs`` trains each batch that many times, adding training work to R.

Modes: ``off`` (synchronous, always run: the baseline), ``one_step``, ``full`` with η = 1 and 2 (a sync waits
for the generation call in flight), and with η = 2 and ``partial_rollout: keep`` (a sync lands between
decoding steps); with vLLM also ``keep`` with a batch of groups per call instead of one (``_batch``). Last
line: ``async_full_speedup <full (η = 2, else the best full mode) samples/s ÷ off samples/s> goal >=1.8``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"off": ["async.mode=off"], "one_step": ["async.mode=one_step"],
         "full_eta1": ["async.mode=full", "async.max_staleness=1"], "full_eta2": ["async.mode=full", "async.max_staleness=2"],
         "full_eta2_keep": ["async.mode=full", "async.max_staleness=2", "async.partial_rollout=keep"],
         "full_eta2_keep_batch": ["async.mode=full", "async.max_staleness=2", "async.partial_rollout=keep",
                                  "async.groups_per_call={prompts}"]}  # vLLM only: the others batch per call
STOPS = "['9']"


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def run_mode(mode: str, scratch: str, model_dir: str, args: dict) -> dict:
    """One run in ``mode``; its samples trained per second, step-time and generation-time medians."""
    from mlflow.tracking import MlflowClient

    from configs.loader import load_config
    from flows.pipeline import run_flow

    run_dir = f"{scratch}/{mode}"
    engine = args.get("engine", "hf")
    config = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"run.name=bench-async-{mode}", "model.source=hf", f"model.path={model_dir}",
        "run.torch_threads=1", *(o.format(**args) for o in MODES[mode]), "algorithm.old_logprobs=trainer", f"rollout.engine={engine}",
        f"train.steps={args['steps']}", f"train.ppo_epochs={args['ppo_epochs']}", "train.optim.lr=1e-9",
        f"rollout.prompts_per_step={args['prompts']}", "rollout.group_size=8",
        f"rollout.max_new_tokens={args['max_new_tokens']}", f"rollout.stop={STOPS}", "train.micro_batch_size=16",
        "eval.every=0", "eval.num_prompts=8", "checkpoint.every=1000", "tracking.sample_every=0",
        "tracking.log_model=false", "tracking.register_model=false"])
    start = time.perf_counter()
    result = run_flow(config)
    wall = time.perf_counter() - start
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = {key: [m.value for m in sorted(client.get_metric_history(result["mlflow_run_id"], key), key=lambda m: m.step)]
               for key in ("time/step", "time/train", "time/generate_and_score", "response/length_mean",
                           "response/length_max")}
    later = history["time/step"][1:-1]  # the first step waits for its own batch; the last one evaluates
    samples = args["prompts"] * 8 * len(later)
    return {"samples_per_s": samples / sum(later), "step_s": sorted(later)[len(later) // 2],
            "train_s": sorted(history["time/train"])[len(later) // 2], "wall_s": wall,
            "generate_s": median(history["time/generate_and_score"]),
            "length_mean": sum(history["response/length_mean"]) / len(history["response/length_mean"]),
            "length_max": max(history["response/length_max"])}


def main(argv: list[str]) -> dict:
    from bench.common import arithmetic_rows, build_model, result_line, scratch_dir, start_flow_services

    args = dict(a.split("=", 1) for a in argv)
    args = {"steps": int(args.get("steps", 20)), "prompts": int(args.get("prompts", 8)),
            "max_new_tokens": int(args.get("max_new_tokens", 64)), "size": args.get("size", "bench"),
            "engine": args.get("engine", "hf"), "ppo_epochs": int(args.get("ppo_epochs", 1)),
            "modes": ["off", *(m for m in args.get("modes", ",".join(MODES)).split(",") if m != "off")]}
    start_flow_services()
    scratch = scratch_dir("async")
    train, _ = arithmetic_rows()
    model_dir = build_model(args["size"], f"{scratch}/model", train, max_positions=128)
    print(f"{args['steps']} steps of {args['prompts']} x 8 completions, <= {args['max_new_tokens']} tokens (stop at "
          f"{STOPS}), model size {args['size']}, rollout engine {args['engine']}, torch_threads 1 per engine, "
          f"ppo_epochs {args['ppo_epochs']}")
    results = {}
    for mode in args["modes"]:
        if mode == "full_eta2_keep_batch" and args["engine"] != "vllm":
            continue  # the HF engine's default already
        results[mode] = figures = run_mode(mode, scratch, model_dir, args)
        generate = f"generate {figures['generate_s']:.2f} s   " if mode == "off" else ""
        print(f"{mode:<15} {figures['samples_per_s']:7.1f} samples/s   step {figures['step_s']:.2f} s   {generate}"
              f"train {figures['train_s']:.2f} s   response length mean {figures['length_mean']:.1f} "
              f"max {figures['length_max']:.0f}   ({figures['wall_s']:.0f} s with start-up)", flush=True)
    base = results["off"]["samples_per_s"]
    print("of synchronous: " + ", ".join(f"{mode} {r['samples_per_s'] / base:.2f}x" for mode, r in results.items()))
    best_full = max((r["samples_per_s"] for mode, r in results.items() if mode.startswith("full")), default=0.0)
    speedup = results["full_eta2"]["samples_per_s"] / base if "full_eta2" in results else best_full / base
    print(result_line("async_full_speedup", speedup, ">=", 1.8))
    return {"value": speedup, **{f"{mode}_{k}": v for mode, r in results.items() for k, v in r.items()}}


if __name__ == "__main__":
    main(sys.argv[1:])
