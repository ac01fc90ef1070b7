"""``async.mode: one_step``'s schedule (flows/asynchrony.py) with stand-in sampling and sync functions:
which weights each batch is generated with, what an evaluation and a resume change (nothing)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from flows.asynchrony import OneStepAhead


@dataclass
class Batch:
    step: int
    version: int  # the rollout engines' weights version when the batch was generated
    positions: dict


class Engines:
    """Records the batches sampled and the versions synced; sampling reads the engines' version."""

    def __init__(self, version: int = 0):
        self.version, self.sampled, self.synced = version, [], []
        self.generating = threading.Event()

    def sample(self, step, positions):
        self.generating.set()
        batch = Batch(step, self.version, {"default": positions.get("default", 0) + 2})
        self.sampled.append((step, self.version))
        self.generating.clear()
        return batch

    def sync(self, version):
        assert not self.generating.is_set(), "weights synced while a batch was generating"
        self.synced.append(version)
        self.version = version


def _run(steps, *, start=0, evals=(), checkpoint_at=None, engines=None, restore=None):
    """The flow's loop: take, train (the trainer's version becomes the step), evaluate at ``evals``."""
    engines = engines or Engines(start)
    ahead = OneStepAhead(engines.sample, engines.sync, engines.version, steps)
    if restore is not None:
        ahead.restore(*restore)
    positions, version, trained, saved = {"default": 2 * start}, start, [], None
    for step in range(start + 1, steps + 1):
        batch = ahead.take(step, positions, version)
        trained.append((step, batch.version, version))  # (step, batch's weights, trainer's weights)
        positions, version = batch.positions, step
        if step in evals:
            ahead.settle(version)
        if step == checkpoint_at:
            saved = ahead.pending()
    ahead.close()
    return trained, engines, saved


def test_each_batch_is_one_version_behind_the_trainer():
    trained, engines, _ = _run(5)
    # step k's batch: generated with version k-2 (the first two with 0), trained by version k-1
    assert trained == [(1, 0, 0), (2, 0, 1), (3, 1, 2), (4, 2, 3), (5, 3, 4)]
    assert engines.synced == [1, 2, 3, 4]  # each before the next batch starts; none after the last step
    assert [step for step, _ in engines.sampled] == [1, 2, 3, 4, 5]  # nothing beyond the last step


def test_evaluating_changes_no_batch():
    plain, _, _ = _run(6)
    evaluated, engines, _ = _run(6, evals=(2, 4, 6))
    assert evaluated == plain
    assert engines.version == 6  # the final evaluation saw the final weights


@pytest.mark.parametrize("at", [1, 2, 3])
def test_resume_from_a_checkpoint_with_its_pending_batch_repeats_the_run(at):
    straight, _, saved = _run(5, checkpoint_at=at)
    assert saved[0] == at + 1 and saved[1].version == max(at - 1, 0)
    # a fresh process: the engines start from the checkpoint's weights (version `at`), the batch ahead restored
    resumed, engines, _ = _run(5, start=at, restore=saved, engines=Engines(at))
    assert resumed == straight[at:]
    assert engines.sampled[0][0] == at + 2  # the restored batch is not sampled again


def test_take_refuses_a_batch_of_another_step():
    engines = Engines()
    ahead = OneStepAhead(engines.sample, engines.sync, 0, 5)
    ahead.take(1, {}, 0)
    with pytest.raises(RuntimeError, match="step 2's, but step 3"):
        ahead.take(3, {}, 1)
    ahead.close()


@pytest.mark.parametrize("text, mode", [("off", "off"), ("one_step", "one_step"), ("'off'", "off")])
def test_async_mode_in_yaml(text, mode):
    from configs.loader import load_config

    assert load_config("configs/tiny.yaml", [f"async.mode={text}"]).async_.mode == mode


@pytest.mark.parametrize("overrides, message", [
    (["async.mode=one_step", "async.max_staleness=2"], "async.max_staleness is an option of async.mode full"),
    (["async.partial_rollout=keep"], "async.partial_rollout is an option of async.mode full"),
    (["async.mode=one_step", "async.groups_per_call=4"], "async.groups_per_call is an option of async.mode full"),
    (["async.mode=full", "async.partial_rollout=keep", "rollout.engine=vllm", "model.lora.r=4"],
     "an adapter update cannot reach a running request"),
    (["async.mode=full", "algorithm.dynamic_sampling.enabled=true"], "dynamic sampling"),
])
def test_async_options_without_effect_are_refused(overrides, message):
    from configs.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", overrides)


@pytest.mark.parametrize("overrides, calls", [
    (["rollout.engine=hf", "async.partial_rollout=keep"], (2, 8)),  # the HF engine batches within a call only
    (["rollout.engine=vllm", "async.partial_rollout=wait"], (2, 8)),  # one call at a time: no shared batches
    (["rollout.engine=vllm", "async.partial_rollout=keep"], (16, 1)),  # calls share vLLM's batches
    (["rollout.engine=vllm", "async.partial_rollout=keep", "async.groups_per_call=4"], (4, 4)),
])
def test_stream_calls_in_flight_and_groups_per_call(overrides, calls):
    from configs.loader import load_config
    from tasks.rollout_stream import stream_calls

    config = load_config("configs/tiny.yaml", ["async.mode=full", "rollout.prompts_per_step=8", *overrides])
    assert stream_calls(config) == calls


def test_agentic_full_takes_updates_between_turns_only():
    from configs.loader import ConfigError, load_config

    assert load_config("configs/agentic/corridor.yaml", ["async.mode=full"]).async_.mode == "full"
    with pytest.raises(ConfigError, match="between turns"):
        load_config("configs/agentic/corridor.yaml", ["async.mode=full", "async.partial_rollout=keep"])
