"""Every algorithm preset learns on the tiny task: fixed seed, 30 steps, in one process.

The reward is the tiny task's answer format — the completion is a bare 1–2 digit number and then
stops — which an untrained tiny model meets ~10% of the time and can learn in a few dozen steps
(correct sums take an SFT warm start first, see configs/quickstart.yaml). Each preset runs its own
estimator, loss, aggregation, KL handling (reference model, adaptive controller), critic (PPO) and
dynamic sampling (DAPO) through ``flows.inprocess.run_inprocess``, the flow's step without Ray.
"""

from __future__ import annotations

import re

import pytest

from configs.loader import load_config
from flows.inprocess import run_inprocess

STEPS, WINDOW = 30, 8
PRESETS = ["dapo", "dr_grpo", "grpo", "gspo", "lite_ppo", "ppo", "raft_pp", "reinforce_pp", "reinforce_pp_baseline",
           "rloo", "topr"]


def number_format(prompts, completions, **_):
    """1.0 for a completion that is a bare 1–2 digit number, e.g. ``"42"``; 0.0 for ``"4+2"`` or ``""``."""
    return [1.0 if re.fullmatch(r"\d{1,2}", c.strip()) else 0.0 for c in completions]


@pytest.fixture(scope="module")
def task_rows():
    from engines.data.arithmetic import make_arithmetic_splits

    train, _ = make_arithmetic_splits(num_train=300, num_heldout=20, max_operand=30, seed=0)
    return train


def _run(name: str, model_dir: str, rows, lr: float = 3e-3):
    config = load_config(f"algorithms/{name}", [f"train.steps={STEPS}", f"train.optim.lr={lr}", "rollout.max_new_tokens=4",
                                                "rollout.prompts_per_step=4", "rollout.group_size=8", "run.torch_threads=2"])
    history = run_inprocess(config, model_dir, rows, number_format)
    rewards = [m["reward/mean"] for m in history]
    return sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW, history


@pytest.mark.parametrize("name", PRESETS)
def test_preset_learns(name, tiny_model_dir, task_rows):
    first, last, history = _run(name, tiny_model_dir, task_rows)
    # Measured at seed 0: every preset goes from ~0.15 to 0.5-0.95; a 0.15 gain is far outside the
    # step-to-step noise of the lr≈0 control below (|last - first| < 0.05).
    assert last > first + 0.15, (name, first, last)
    if name == "ppo":
        assert history[-1]["critic/vf_loss"] >= 0 and "critic/explained_variance" in history[-1]
        assert "actor/pg_loss" not in history[0]  # critic warm-up: step 1 trains only the critic
        assert history[-1]["kl/seq_mean"] > 0
    if name == "dapo":
        assert all(0 <= m["dynamic/fill_ratio"] <= 1 for m in history)


def test_control_without_learning_rate_does_not_improve(tiny_model_dir, task_rows):
    first, last, _ = _run("grpo", tiny_model_dir, task_rows, lr=1e-12)
    assert abs(last - first) < 0.1, (first, last)


def test_dynamic_sampling_stops_at_max_rounds_and_trains_on_what_it_kept(tiny_model_dir, task_rows):
    def _dapo(reward_fn, max_rounds=3):
        config = load_config("algorithms/dapo", ["train.steps=2", "rollout.max_new_tokens=4", "rollout.prompts_per_step=4",
                                                 "rollout.group_size=4", "run.torch_threads=2",
                                                 "algorithm.shaping.overlong_buffer=0",  # rewards exactly as given
                                                 f"algorithm.dynamic_sampling.max_rounds={max_rounds}"])
        return run_inprocess(config, tiny_model_dir, task_rows, reward_fn)

    # A constant reward: no group is ever informative, so each step uses every round and keeps nothing;
    # it trains on the last round as drawn, whose group advantages are all 0.
    for metrics in _dapo(lambda prompts, completions, **_: [0.0] * len(completions)):
        assert (metrics["dynamic/rounds"], metrics["dynamic/fill_ratio"]) == (3.0, 0.0)
        assert metrics["actor/pg_loss"] == 0.0
    # Only the first prompt of each round is informative (rewards 0, 1, 0, 1 within its group): each round
    # adds one of the four groups, so after 3 rounds the batch is 3/4 full and trains on those 3 groups.
    def first_group_informative(prompts, completions, **_):
        return [float(i % 2) if i < 4 else 0.0 for i in range(len(completions))]

    for metrics in _dapo(first_group_informative):
        assert (metrics["dynamic/rounds"], metrics["dynamic/fill_ratio"]) == (3.0, 0.75)
    # Every group informative: one round fills the batch.
    for metrics in _dapo(lambda prompts, completions, **_: [float(i % 2) for i in range(len(completions))]):
        assert (metrics["dynamic/rounds"], metrics["dynamic/fill_ratio"]) == (1.0, 1.0)
