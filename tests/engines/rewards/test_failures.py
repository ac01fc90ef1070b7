"""A domain whose reward keeps failing stops the run after ``patience`` steps, with one line naming the
domain, the reward and the first exception; a good step resets the count; the count survives a resume."""

from __future__ import annotations

import doctest
import logging

import pytest
import torch

import engines.rewards.failures as failures_module
from engines.rewards import REWARDS
from engines.rewards.failures import DomainFailures, RewardFailureError, RewardFailureMonitor, failures_by_domain
from engines.scoring import ScoreSpec, score_rollouts, summarize
from engines.types import Rollouts

BAD = {"code": DomainFailures("code", samples=8, failed=5, first="KeyError: 'tests'")}  # 5/8 = 0.625 > 0.5
GOOD = {"code": DomainFailures("code", samples=8, failed=4, first="KeyError: 'tests'")}  # 4/8 = 0.5, not above


def monitor(**kwargs) -> RewardFailureMonitor:
    return RewardFailureMonitor(max_failure_rate=0.5, patience=3, **kwargs)


def test_raises_after_exactly_patience_bad_steps_with_one_line():
    m = monitor()
    m.update(1, BAD)
    m.update(2, BAD)  # 2 of 3: not yet
    with pytest.raises(RewardFailureError) as raised:
        m.update(3, BAD)
    message = str(raised.value)
    assert "\n" not in message
    assert message == ("domain 'code': reward 'code' failed on 5/8 samples at step 3, above reward.max_failure_rate=0.5 "
                       "for 3 steps in a row (reward.failure_patience=3); first failure: KeyError: 'tests'")


def test_a_step_at_or_below_the_rate_resets_the_count():
    m = monitor()
    for step in (1, 2):
        m.update(step, BAD)
    m.update(3, GOOD)  # exactly max_failure_rate is not above it: the count starts over
    assert m.state() == {}
    m.update(4, BAD)
    m.update(5, BAD)
    with pytest.raises(RewardFailureError, match="at step 6"):
        m.update(6, BAD)


def test_domains_count_apart_and_the_state_resumes():
    m = monitor()
    ok = {"math": DomainFailures("math", samples=4, failed=0, first=None)}
    m.update(1, {**BAD, **ok})
    m.update(2, {**BAD, **ok})
    state = m.state()
    assert state == {"code": 2}  # math never failed: left out
    resumed = monitor(streaks=state)  # a run resumed from a checkpoint taken after step 2
    with pytest.raises(RewardFailureError, match="domain 'code'"):
        resumed.update(3, {**BAD, **ok})


def test_each_step_with_failures_logs_one_warning_line_per_domain(caplog):
    m = monitor()
    few = {"math": DomainFailures("math", samples=10, failed=1, first="TimeoutError: no result within timeout_s=30"),
           "gsm": DomainFailures("math", samples=10, failed=0, first=None)}
    with caplog.at_level(logging.WARNING, logger="engines.rewards.failures"):
        lines = m.update(7, few)
    expected = ["step 7: reward failures in domain math: 1/10 samples scored 0 (reward math); "
                "first: TimeoutError: no result within timeout_s=30"]
    assert lines == expected and [r.getMessage() for r in caplog.records] == expected
    assert m.state() == {}  # 1/10 is under the rate


def test_failures_by_domain_sums_calls_and_keeps_the_first_text():
    stats = [{"domain": "a", "reward": "math", "distinct": 4, "failed": 0, "first_failure": None},
             {"domain": "b", "reward": "code", "distinct": 3, "failed": 3, "first_failure": "OSError: x"},
             {"domain": "a", "reward": "math", "distinct": 2, "failed": 1, "first_failure": "ValueError: y"},
             {"domain": "a", "reward": "math", "distinct": 2, "failed": 2, "first_failure": "ValueError: z"}]
    assert failures_by_domain(stats) == {"a": DomainFailures("math", 8, 3, "ValueError: y"),
                                         "b": DomainFailures("code", 3, 3, "OSError: x")}


def test_invalid_settings():
    with pytest.raises(ValueError, match="max_failure_rate=1.5"):
        RewardFailureMonitor(max_failure_rate=1.5, patience=3)
    with pytest.raises(ValueError, match="patience=0"):
        RewardFailureMonitor(max_failure_rate=0.5, patience=0)


def test_a_reward_that_always_raises_ends_the_run_with_its_exception():
    """The flow's path at unit level: score_rollouts on the worker, failures_by_domain and the monitor on
    the driver, for as many steps as the patience."""
    @REWARDS.register("t_broken")
    def broken(prompts, completions, **_):
        raise KeyError("answer")

    try:
        rollouts = Rollouts(prompt_ids=[[1]] * 4, response_ids=torch.ones(4, 2, dtype=torch.long),
                            logprobs=torch.zeros(4, 2), response_lengths=torch.tensor([2, 2, 2, 2]),
                            finish_reasons=["stop"] * 4, completions=["a", "b", "c", "d"], weights_version=0)
        spec = ScoreSpec("t_broken", domain="gsm", chunk_size=2)
        m = RewardFailureMonitor(max_failure_rate=0.5, patience=2)
        _, stats = score_rollouts(rollouts, ["p"] * 4, {}, spec)
        assert summarize([stats])["reward/failed"] == 4.0
        m.update(1, failures_by_domain([stats]))
        with pytest.raises(RewardFailureError) as raised:
            m.update(2, failures_by_domain([score_rollouts(rollouts, ["p"] * 4, {}, spec)[1]]))
        assert str(raised.value).startswith("domain 'gsm': reward 't_broken' failed on 4/4 samples at step 2")
        assert str(raised.value).endswith("first failure: KeyError: 'answer'")
    finally:
        REWARDS._entries.pop("t_broken")


def test_docstring_example():
    assert doctest.testmod(failures_module, optionflags=doctest.ELLIPSIS).failed == 0
