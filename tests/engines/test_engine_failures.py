"""A rollout engine that dies or hangs fails the call in one line naming it, with its last log lines; a
hung one is stopped. And the sync check's drift measure."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from engines.actors import EngineFailure, describe, get_from_engines, start_engine
from engines.batches import logprob_drift
from engines.types import Rollouts, SamplingParams


@pytest.mark.ray
def test_a_dead_engine_fails_the_call_naming_it_with_its_last_log_lines(tiny_model_dir, ray_cluster):
    engine = start_engine("rollout/hf", run_name="failures", role="rollout", reuse=False, model_path=tiny_model_dir)
    ray.get(engine.__ray_call__.remote(lambda e: print("engine says goodbye", flush=True)))
    pid = describe(engine)["pid"]
    os.kill(pid, signal.SIGKILL)
    time.sleep(1)
    call = engine.generate.remote(["1+1="], SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineFailure) as raised:
        get_from_engines([call], [(engine, call)], timeout_s=60)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("engine failures/rollout#") and " died " in message
    assert "engine says goodbye" in message  # the engine's own last output


@pytest.mark.ray
def test_a_hung_engine_fails_the_call_after_the_timeout_and_is_stopped(tiny_model_dir, ray_cluster):
    engine = start_engine("rollout/hf", run_name="failures", role="rollout", reuse=False, model_path=tiny_model_dir)
    ray.get(engine.__ray_ready__.remote())
    call = engine.__ray_call__.remote(lambda e: time.sleep(120))
    start = time.monotonic()
    with pytest.raises(EngineFailure, match=r"^engine failures/rollout#\w+ did not answer within 2s and was stopped"):
        get_from_engines([call], [(engine, call)], timeout_s=2)
    assert time.monotonic() - start < 30
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(engine.__ray_ready__.remote(), timeout=30)


@pytest.mark.ray
def test_an_error_raised_by_the_call_itself_passes_through(tiny_model_dir, ray_cluster):
    engine = start_engine("rollout/hf", run_name="failures", role="rollout", reuse=False, model_path=tiny_model_dir)
    engine_ref = engine.commit.remote(3)  # no update open: the engine raises, it does not die
    with pytest.raises(RuntimeError, match="without begin_update"):
        get_from_engines([engine_ref], [(engine, engine_ref)], timeout_s=60)


def test_logprob_drift_is_the_gap_over_model_tokens():
    # two rows, prompt [5, 6] then 2 and 1 sampled tokens; rollout logprobs vs a trainer off by 0.1 and 0.3
    rollouts = Rollouts(prompt_ids=[[5, 6], [5, 6]], response_ids=torch.tensor([[7, 8], [9, 0]]),
                        logprobs=torch.tensor([[-1.0, -2.0], [-0.5, 0.0]]), response_lengths=torch.tensor([2, 1]),
                        finish_reasons=["length", "stop"], completions=["", ""], weights_version=0)
    trainer = torch.zeros(2, 4)  # [B, L]: logprob of token t given those before, aligned like the batch
    trainer[0, 2:4] = torch.tensor([-1.1, -2.0])
    trainer[1, 2] = -0.2
    trainer[1, 3] = 99.0  # past the response: padding, never counted
    drift = logprob_drift(rollouts, trainer, pad_token_id=0)
    assert drift["max"] == pytest.approx(0.3)
    assert drift["mean"] == pytest.approx((0.1 + 0.0 + 0.3) / 3)
