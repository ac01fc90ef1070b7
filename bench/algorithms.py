"""How much each algorithm preset learns on the tiny task in a fixed budget, side by side.

Every preset of ``configs/algorithms/`` runs the same number of RL steps from the same tiny model
(seed 0) through ``flows.inprocess.run_inprocess`` — the flow's step, without Ray or Prefect — with a
reward the untrained model meets ~10% of the time: the completion is a bare 1–2 digit number. A run
with lr ≈ 0 is the no-learning baseline. Prints mean reward over the first and last ``window`` steps,
the gain, and seconds per step; the last line is the preset with the largest gain.

    python bench/algorithms.py [steps=30] [window=8] [lr=3e-3] [presets=grpo,ppo,...]
"""

from __future__ import annotations

import re
import sys
import tempfile
import time

PRESETS = ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "lite_ppo",
           "raft_pp", "topr")


def number_format(prompts, completions, **_):
    """1.0 for a completion that is a bare 1–2 digit number (``"42"``), else 0.0 (``"4+2"``, ``""``)."""
    return [1.0 if re.fullmatch(r"\d{1,2}", c.strip()) else 0.0 for c in completions]


def main(argv: list[str]) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from configs.loader import load_config
    from engines.data.arithmetic import arithmetic_corpus, make_arithmetic_splits
    from engines.models import TinyModelSpec, build_tiny_model
    from flows.inprocess import run_inprocess

    args = dict(a.split("=", 1) for a in argv)
    steps, window, lr = int(args.get("steps", 30)), int(args.get("window", 8)), float(args.get("lr", 3e-3))
    presets = args["presets"].split(",") if "presets" in args else list(PRESETS)
    train, _ = make_arithmetic_splits(num_train=300, num_heldout=20, max_operand=30, seed=0)
    model_dir = f"{tempfile.mkdtemp(prefix='rollflow-bench-')}/model"
    build_tiny_model(model_dir, arithmetic_corpus(train), TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4,
                                                                        num_kv_heads=2, intermediate_size=128), seed=0)
    print(f"{steps} steps, 4 prompts x 8 completions, <= 4 new tokens, lr {lr:g}, seed 0; "
          f"mean reward of the first and last {window} steps")
    print(f"{'preset':<24}{'first':>7}{'last':>7}{'gain':>7}{'s/step':>8}")
    gains = {}
    for name, preset_lr in [("control (grpo, lr 1e-12)", 1e-12)] + [(p, lr) for p in presets]:
        preset = "grpo" if name.startswith("control") else name
        config = load_config(f"algorithms/{preset}", [f"train.steps={steps}", f"train.optim.lr={preset_lr}",
                                                      "rollout.max_new_tokens=4", "rollout.prompts_per_step=4",
                                                      "rollout.group_size=8", "run.torch_threads=2"])
        start = time.perf_counter()
        rewards = [m["reward/mean"] for m in run_inprocess(config, model_dir, train, number_format)]
        seconds = (time.perf_counter() - start) / steps
        first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
        gains[name] = last - first
        print(f"{name:<24}{first:>7.2f}{last:>7.2f}{last - first:>+7.2f}{seconds:>8.2f}", flush=True)
    best = max((n for n in gains if not n.startswith("control")), key=gains.get)
    print(f"best_gain {best} {gains[best]:+.2f} (control {gains['control (grpo, lr 1e-12)']:+.2f})")


if __name__ == "__main__":
    main(sys.argv[1:])
