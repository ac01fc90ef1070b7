"""``tasks.sync.QueuedWeightSync`` (``async.partial_rollout: wait``'s weight syncs) with a real trainer and HF
rollout engine in Ray actors: a sync goes into the engine's call queue and is not waited for, the call in
flight finishes with the old weights, every call sent after the sync runs with the new ones, and the next
sync waits until this one is confirmed."""

from __future__ import annotations

import time

import pytest

from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.training.torch import OptimSpec
from engines.types import SamplingParams

pytestmark = pytest.mark.ray

PROMPTS = ["1+2=", "3+4="]
# no stop token: the call in flight decodes all its tokens, long enough for a sync to queue behind it
LONG = SamplingParams(max_new_tokens=400, temperature=1.0, seed=0, stop_token_ids=(10**9,))
SHORT = SamplingParams(max_new_tokens=2, temperature=1.0, seed=0)


def _engines(tiny_model_dir, run_name: str):
    from engines.actors import start_engine

    rollout = start_engine("rollout/hf", run_name=run_name, role="rollout", model_path=tiny_model_dir, reuse=False)
    trainer = start_engine("train/torch", run_name=run_name, role="trainer", model_path=tiny_model_dir,
                           optim=OptimSpec(lr=1e-2), reuse=False)
    return rollout, trainer


def _train(ray, trainer, tiny_model_dir) -> None:
    ray.get(trainer.train_step.remote(sft_batch(tiny_model_dir, ["1+2=", "10+20="], ["3", "30"]), SFTObjective()))


def test_a_queued_sync_lands_after_the_call_in_flight_and_before_every_call_sent_after_it(tiny_model_dir, ray_cluster):
    from engines.actors import stop_engine
    from tasks.sync import QueuedWeightSync

    ray = ray_cluster
    rollout, trainer = _engines(tiny_model_dir, "t-queued-sync")
    queued = QueuedWeightSync(trainer, 1)
    _train(ray, trainer, tiny_model_dir)
    queued.send([rollout], 1)  # the first sync to an engine waits: it finds the engine's route
    assert queued.pending is None and queued.routes == {rollout._actor_id.hex(): "shared"}
    assert ray.get(rollout.weights_version.remote()) == 1

    _train(ray, trainer, tiny_model_dir)
    in_flight = rollout.generate.remote(PROMPTS, LONG)
    time.sleep(0.2)  # the call is running
    queued.send([rollout], 2)
    sent_after = rollout.generate.remote(PROMPTS, SHORT)
    assert queued.pending is not None
    assert ray.wait([in_flight], timeout=0)[1], "send() returned only after the call in flight ended"
    with pytest.raises(RuntimeError, match="v2 is not confirmed yet"):
        queued.send([rollout], 3)
    assert ray.get(in_flight).weights_version == 1
    assert ray.get(sent_after).weights_version == 2
    assert queued.confirm() == [] and queued.pending is None
    assert ray.get(rollout.weights_checksum.remote()) == ray.get(trainer.weights_checksum.remote())
    for handle in (rollout, trainer):
        stop_engine(handle)


def test_an_engine_that_dies_before_its_queued_load_is_handed_back_by_confirm(tiny_model_dir, ray_cluster):
    from engines.actors import stop_engine
    from tasks.sync import QueuedWeightSync

    ray = ray_cluster
    rollout, trainer = _engines(tiny_model_dir, "t-queued-sync-dies")
    queued = QueuedWeightSync(trainer, 1)
    queued.send([rollout], 1)
    in_flight = rollout.generate.remote(PROMPTS, LONG)
    _train(ray, trainer, tiny_model_dir)
    queued.send([rollout], 2)
    ray.kill(rollout)
    assert queued.confirm() == [rollout]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(in_flight)
    stop_engine(trainer)
