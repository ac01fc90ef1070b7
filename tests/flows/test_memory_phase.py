"""Colocated engines take turns in the order verl and ROLL settled on (``tasks.sync.set_memory_phase``):
offload the trainer, wake the rollout engine, sync, generate, sleep it, reload the trainer."""

from __future__ import annotations

import pytest
import ray

from tasks.sync import set_memory_phase

pytestmark = pytest.mark.ray


class Recorder:
    """Stands in for an engine handle: ``engine.method.remote()`` appends ``"<name>.<method>"`` to ``log``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method: str):
        recorder = self

        class Method:
            @staticmethod
            def remote():
                recorder.log.append(f"{recorder.name}.{method}")
                return ray.put(None)

        return Method


def test_each_phase_frees_memory_before_taking_it(ray_cluster):
    log: list[str] = []
    rollouts, trainers = [Recorder("rollout", log)], [Recorder("trainer", log), Recorder("critic", log)]
    for phase in ("sync", "generate", "train"):  # the end of one step, the next step's generation, its training
        set_memory_phase.fn(rollouts, trainers, phase)
    assert log == ["trainer.offload", "critic.offload", "rollout.wake",  # sync: from the offloaded trainer
                   "trainer.offload", "critic.offload", "rollout.wake",  # generate: already so (idempotent calls)
                   "rollout.sleep", "trainer.reload", "critic.reload"]
    with pytest.raises(ValueError, match="unknown memory phase 'eval'"):
        set_memory_phase.fn(rollouts, trainers, "eval")
