"""Colocated engines take turns in the order verl and ROLL settled on (``tasks.sync.set_memory_phase``):
offload the trainer, wake the rollout engine, sync, generate, sleep it, reload the trainer."""

from __future__ import annotations

import pytest
import ray

from tasks.sync import engine_memory, set_memory_phase

pytestmark = pytest.mark.ray


class Recorder:
    """Stands in for an engine handle: ``engine.method.remote()`` appends ``"<name>.<method>"`` to ``log``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method: str):
        recorder = self

        class Method:
            @staticmethod
            def remote(*args):
                if method == "__ray_call__":  # a function run inside the engine's process: here, this one
                    return ray.put(args[0](None))
                recorder.log.append(f"{recorder.name}.{method}")
                return ray.put(None)

        return Method


def test_each_phase_frees_memory_before_taking_it(ray_cluster):
    log: list[str] = []
    rollouts, trainers = [Recorder("rollout", log)], [Recorder("trainer", log), Recorder("critic", log)]
    figures = {}
    for phase in ("sync", "generate", "train"):  # the end of one step, the next step's generation, its training
        figures.update(set_memory_phase.fn(rollouts, trainers, phase))
    assert log == ["trainer.offload", "critic.offload", "rollout.wake",  # sync: from the offloaded trainer
                   "trainer.offload", "critic.offload", "rollout.wake",  # generate: already so (idempotent calls)
                   "rollout.sleep", "trainer.reload", "critic.reload"]
    # what each side holds after each phase: here every "engine" is this process (no CUDA: 0 on a device)
    assert sorted(figures) == sorted(f"memory/{phase}/{side}_{kind}_mb" for phase in ("sync", "generate", "train")
                                     for side in ("rollout", "train") for kind in ("device", "host"))
    host = engine_memory()["host"] / 2**20
    assert figures["memory/train/rollout_device_mb"] == 0
    assert figures["memory/train/rollout_host_mb"] == pytest.approx(host, rel=0.2)  # one process
    assert figures["memory/train/train_host_mb"] == pytest.approx(2 * host, rel=0.2)  # two "engines"
    with pytest.raises(ValueError, match="unknown memory phase 'eval'"):
        set_memory_phase.fn(rollouts, trainers, "eval")
