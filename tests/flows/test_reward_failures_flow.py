"""A run whose reward raises on every call stops after reward.failure_patience steps with one line naming
the domain, the reward and the exception (the unit-level checks are in tests/engines/rewards/test_failures.py)."""

from __future__ import annotations

import pytest

from configs.loader import load_config

pytestmark = pytest.mark.ray


def test_a_reward_that_always_raises_stops_the_run(tmp_path, ray_cluster, prefect_server):
    from flows.pipeline import run_flow

    # The arithmetic rows carry no `tests` column, so every call of the code reward raises a TypeError
    # (its keyword-only argument is missing): every sample fails, 8/8 distinct ones per step at least.
    config = load_config("configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}", "run.name=reward-fails",
                                               "reward.name=code", "reward.failure_patience=2", "train.steps=4",
                                               "eval.every=0", "checkpoint.every=4", "tracking.sample_every=0"])
    with pytest.raises(Exception) as raised:
        run_flow(config)
    message = str(raised.value)
    assert message.startswith("domain 'default': reward 'code' failed on ")
    assert "at step 2, above reward.max_failure_rate=0.5 for 2 steps in a row (reward.failure_patience=2)" in message
    assert message.endswith("first failure: TypeError: code_reward() missing 1 required keyword-only argument: 'tests'")
