"""Weight versions: a batch reaches the trainer at most the allowed number of versions behind it."""

from __future__ import annotations

import pytest
import torch

from engines.batches import AdvantageSpec, StaleRolloutsError, advantage_batch, check_version_lag
from tests.engines.test_reward_worker import _rollouts


@pytest.mark.parametrize("rollouts, policy, allowed, lag", [(3, 3, 0, 0), (2, 3, 1, 1), (0, 2, 2, 2)])
def test_lag_within_bound(rollouts, policy, allowed, lag):
    assert check_version_lag(rollouts, policy, allowed) == lag


@pytest.mark.parametrize("rollouts, policy, allowed, message", [
    (1, 3, 1, "2 versions behind, the run allows 0 to 1"),
    (4, 3, 1, "-1 versions behind"),  # weights the trainer never had: a sync from another run, or a bug
    (2, 3, 0, "1 versions behind, the run allows 0 to 0"),
])
def test_lag_out_of_bound_raises(rollouts, policy, allowed, message):
    with pytest.raises(StaleRolloutsError, match=message):
        check_version_lag(rollouts, policy, allowed)


def test_advantage_batch_checks_and_reports_the_lag():
    rollouts = _rollouts([2, 2])  # weights_version 0
    spec = AdvantageSpec("grpo", pad_token_id=0)
    _, summary, _ = advantage_batch(rollouts, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), spec,
                                    policy_version=1, max_version_lag=1)
    assert summary["offpolicy/version_lag"] == 1.0
    with pytest.raises(StaleRolloutsError):
        advantage_batch(rollouts, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), spec, policy_version=1)
