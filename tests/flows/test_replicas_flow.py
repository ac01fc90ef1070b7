"""Two rollout replicas through the real flow (Ray, Prefect, MLflow sqlite), placed on declared GPUs
(``ray_cluster`` declares four; none are real, so the engines run on CPU): every step's chunks and the
held-out rows are spread over both, every weight sync reaches both, and the run trains exactly as one
replica given the same chunks."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from configs.loader import load_config

pytestmark = pytest.mark.ray


class CountingHandle:
    """An actor handle that counts the calls the driver makes through it, by method name."""

    def __init__(self, handle) -> None:
        self._handle, self.calls = handle, {}

    def __getattr__(self, name: str):
        if name == "_handle":
            raise AttributeError(name)
        method, calls = getattr(self._handle, name), self.calls

        class Counted:
            def remote(self, *args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                return method.remote(*args, **kwargs)

        return Counted()


def _run(tmp_path, name: str, model_dir: str, monkeypatch, *overrides: str) -> tuple[list[dict], dict]:
    """Run 2 SFT steps and 2 RL steps; returns each rollout replica's driver calls, engines.json, the
    SFT trainer's GPUs and the final model's tensors."""
    import flows.rlvr as rlvr
    import flows.supervised as sft
    from engines.actors import describe, stop_engine
    from flows.pipeline import run_flow

    counted: list[CountingHandle] = []
    original = getattr(rlvr.start_rl_engines, "original", rlvr.start_rl_engines)  # (patched by an earlier run)

    def start(*args, **kwargs):
        engines = original(*args, **kwargs)
        engines.rollouts = [CountingHandle(h) for h in engines.rollouts]
        counted.extend(engines.rollouts)
        return engines

    start.original = original
    monkeypatch.setattr(rlvr, "start_rl_engines", start)
    monkeypatch.setattr(rlvr, "stop_engine", lambda handle: stop_engine(getattr(handle, "_handle", handle)))
    sft_gpus = []
    monkeypatch.setattr(sft, "stop_engine", lambda handle: (sft_gpus.extend(describe(handle)["gpu_ids"]),
                                                            stop_engine(handle)))
    run_dir = tmp_path / name
    run_flow(load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"run.name={name}", "model.source=hf", f"model.path={model_dir}", "train.steps=2",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.optim.lr=3e-3",
        "data.arithmetic.num_heldout=8", "eval.every=0", "checkpoint.every=1000", "tracking.sample_every=0",
        "tracking.log_model=false", "tracking.register_model=false", "sft.steps=2", "sft.batch_size=8",
        *overrides]))
    engines = json.loads((run_dir / "engines.json").read_text())
    work = ("generate", "update_weights_shared", "sleep", "wake")  # (describe's __ray_call__ aside)
    return [{k: h.calls.get(k, 0) for k in work} for h in counted], engines, sft_gpus, load_file(run_dir / "final" / "model.safetensors")


@pytest.mark.slow  # kept out of the default suite's ~12 minutes
def test_two_replicas_share_the_work_and_train_as_one(tmp_path, tiny_model_dir, ray_cluster, prefect_server,
                                                      monkeypatch):
    placement = ("placement={rollout: {replicas: 2, gpus: 0.25}, trainer: {gpus: 0.5}, "
                 "colocate: [[trainer, rollout]]}")
    calls, engines, sft_gpus, two = _run(tmp_path, "replicas-2", tiny_model_dir, monkeypatch, placement)
    # Per replica, 2 steps of 2 chunks (at least one per replica) are 2 generate calls, plus one part of the
    # held-out rows at each of the 2 evaluations (step 0 and the last); 3 syncs: before step 1, after each step.
    # Colocated with the trainer, each replica sleeps while the trainer trains and wakes to generate and for
    # the sync: per step one sleep, two wakes.
    assert calls == [{"generate": 4, "update_weights_shared": 3, "sleep": 2, "wake": 4}] * 2
    assert {role for role in engines if role.startswith("rollout")} == {"rollout-0", "rollout-1"}
    # Colocated with the trainer in bundle 0 of a 4-GPU cluster: rollout-0 sees the trainer's GPU.
    assert len(engines["trainer"]["gpu_ids"]) == 1 and engines["rollout-0"]["gpu_ids"] == engines["trainer"]["gpu_ids"]
    assert len(sft_gpus) == 1  # the SFT warm start runs on the trainer's share too

    # One replica, no placement, cut into the same two chunks (same prompts, same seeds): every call on it.
    calls, engines, sft_gpus, one = _run(tmp_path, "replicas-1", tiny_model_dir, monkeypatch, "reward.generation_chunks=2")
    assert calls == [{"generate": 2 * 2 + 2, "update_weights_shared": 3, "sleep": 0, "wake": 0}]  # nothing to share
    assert engines["rollout"]["gpu_ids"] == [] and sft_gpus == []
    # Generation is seeded per chunk and the chunks are the same, so training saw the same batches.
    assert one.keys() == two.keys() and all((one[k] == two[k]).all() for k in one)
