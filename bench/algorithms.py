"""How much each algorithm preset learns on the tiny task in a fixed budget, side by side, through the real
flow (``flows.pipeline.run_flow``: Ray actors, Prefect tasks, MLflow in a scratch sqlite store).

Every preset of ``configs/algorithms/`` runs the same number of RL steps from the same tiny model
(seed 0), with its own mini-batches and epochs, and a reward the untrained model meets ~15% of the time:
the completion is a bare 1–2 digit number (``regex_match``). A run with lr ≈ 0 is the no-learning
baseline. Prints, per preset, the mean reward over the first and last ``window`` steps, the gain, the
mean ``actor/clipfrac`` (non-zero where several optimizer steps per batch let the ratio leave 1 and a
clip act) and seconds per step; the last line is the preset with the largest gain.

    python bench/algorithms.py [steps=30] [window=8] [lr=3e-3] [presets=grpo,ppo,...]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESETS = ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "lite_ppo",
           "raft_pp", "topr")
NUMBER_FORMAT = (r"{name: digits, reward: regex_match, reward_options: {pattern: '\d{1,2}'}, share: 4, "
                 "source: arithmetic, arithmetic: {num_train: 300, num_heldout: 8, max_operand: 30}}")


def run_preset(preset: str, scratch: str, model_dir: str, steps: int, lr: float) -> tuple[dict[str, list[float]], float]:
    """One run of ``preset``; returns its per-step metric histories and its seconds per step."""
    from mlflow.tracking import MlflowClient

    from configs.loader import load_config
    from flows.pipeline import run_flow

    run_dir = f"{scratch}/{preset}-{lr:g}"
    config = load_config(f"algorithms/{preset}", [
        f"run.dir={run_dir}", f"run.name=bench-{preset}", "model.source=hf", f"model.path={model_dir}",
        "data.source=domains", f"data.domains=[{NUMBER_FORMAT}]", f"train.steps={steps}", f"train.optim.lr={lr}",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=4", "rollout.group_size=8", "eval.every=0",
        "checkpoint.every=1000", "tracking.sample_every=0", "tracking.log_model=false", "tracking.register_model=false"])
    result = run_flow(config)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    history = {key: [m.value for m in sorted(client.get_metric_history(result["mlflow_run_id"], key), key=lambda m: m.step)]
               for key in ("reward/mean", "actor/clipfrac", "time/step")}
    return history, sum(history["time/step"]) / max(len(history["time/step"]), 1)


def main(argv: list[str]) -> None:
    for key, value in {"PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}.items():
        os.environ.setdefault(key, value)
    from bench.common import arithmetic_rows, build_model, scratch_dir
    from flows.setup import ensure_ray, start_prefect_server

    args = dict(a.split("=", 1) for a in argv)
    steps, window, lr = int(args.get("steps", 30)), int(args.get("window", 8)), float(args.get("lr", 3e-3))
    presets = args["presets"].split(",") if "presets" in args else list(PRESETS)
    scratch = scratch_dir("algorithms")
    train, _ = arithmetic_rows(num_train=300, num_heldout=20, max_operand=30)
    model_dir = build_model(dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
                            f"{scratch}/model", train, max_positions=128)
    ensure_ray()
    start_prefect_server()
    print(f"{steps} steps, 4 prompts x 8 completions, <= 4 new tokens, lr {lr:g}, seed 0, through the flow; "
          f"mean reward of the first and last {window} steps, mean actor/clipfrac")
    print(f"{'preset':<24}{'first':>7}{'last':>7}{'gain':>7}{'clipfrac':>10}{'s/step':>8}")
    gains = {}
    for name, preset_lr in [("control (grpo, lr 1e-12)", 1e-12)] + [(p, lr) for p in presets]:
        preset = "grpo" if name.startswith("control") else name
        start = time.perf_counter()
        history, seconds = run_preset(preset, scratch, model_dir, steps, preset_lr)
        rewards, clipfrac = history["reward/mean"], history["actor/clipfrac"]
        first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
        gains[name] = last - first
        mean_clipfrac = sum(clipfrac) / max(len(clipfrac), 1)
        print(f"{name:<24}{first:>7.2f}{last:>7.2f}{last - first:>+7.2f}{mean_clipfrac:>10.4f}{seconds:>8.2f}"
              f"   ({time.perf_counter() - start:.0f} s with start-up)", flush=True)
    best = max((n for n in gains if not n.startswith("control")), key=gains.get)
    print(f"best_gain {best} {gains[best]:+.2f} (control {gains['control (grpo, lr 1e-12)']:+.2f})")


if __name__ == "__main__":
    main(sys.argv[1:])
