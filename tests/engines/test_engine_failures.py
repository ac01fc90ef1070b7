"""A rollout engine that dies or hangs fails the call in one line naming it, with its last log lines; a
hung one is stopped."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from engines.actors import EngineFailure, describe, get_from_engines, start_engine
from engines.types import SamplingParams


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

