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


# -- the admission rule and batch forming (engines.staleness) ---------------------------------------------

import random  # noqa: E402

from engines.staleness import StalenessBound  # noqa: E402


def _simulate(seed: int, *, batch_size: int, eta: int, batches: int = 25, fifo: bool = False, capacity: int = 12):
    """Rollout and training interleaved at random: units start (when admitted and a slot is free), finish in
    random order (or in start order), batches form and train, and the engines take the new weights after a
    random delay. Returns every trained unit's (batch, start version) and the bound's counters."""
    rng = random.Random(seed)
    bound = StalenessBound(batch_size, eta)
    engine_version, running, trained, next_unit = 0, [], [], 0
    for _ in range(100_000):
        if bound.trained_batches == batches:
            break
        action = rng.random()
        if action < 0.4 and len(running) < capacity and bound.can_start(engine_version):
            bound.start(engine_version)
            running.append((next_unit, engine_version))
            next_unit += 1
        elif action < 0.8 and running:
            unit, version = running.pop(0 if fifo else rng.randrange(len(running)))
            bound.finish(unit, version)
        elif action < 0.9:
            batch = bound.form_batch()
            if batch is not None:
                trained += [(bound.trained_batches - 1, version) for _, version in batch]
                oldest = bound.oldest_trainable()
                for unit in [u for u in running if u[1] < oldest]:
                    running.remove(unit)
                    bound.abort()
        elif engine_version < bound.trained_batches:
            engine_version = bound.trained_batches  # the sync lands
    assert bound.trained_batches == batches, "the run stalled"
    return trained, bound


@pytest.mark.invariant
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_no_trained_sample_exceeds_the_bound_whatever_the_finishing_order(eta, batch_size):
    worst = 0
    for seed in range(40):
        trained, bound = _simulate(seed, batch_size=batch_size, eta=eta)
        lags = [batch - version for batch, version in trained]
        assert min(lags) >= 0 and max(lags) <= eta, (seed, max(lags))
        assert len(trained) == 25 * batch_size
        worst = max(worst, max(lags))
    if eta:  # the bound is reached, not just respected: the rule lets rollout run ahead
        assert worst == eta


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_in_start_order_nothing_is_dropped_or_aborted(eta):
    for seed in range(20):
        _, bound = _simulate(seed, batch_size=4, eta=eta, fifo=True)
        assert bound.dropped == 0 and bound.aborted == 0


def test_admission_hand_worked():
    # batches of 2, η = 1: with the engines at v0, (0 + 1 + 1) · 2 = 4 units may have started
    bound = StalenessBound(batch_size=2, max_staleness=1)
    for _ in range(4):
        bound.start(0)
    assert not bound.can_start(0) and bound.can_start(1)
    with pytest.raises(RuntimeError, match="admission refused: 4 units started, engines at v0"):
        bound.start(0)
    # units 3, 1, 0 finish (2 is slow): batch 0 takes 3 and 1; batch 1 has only 0 yet
    for unit in (3, 1, 0):
        bound.finish(unit, 0)
    assert bound.form_batch() == [(3, 0), (1, 0)] and bound.form_batch() is None
    # the engines take v1: (1 + 1 + 1) · 2 = 6, so units 4 and 5 start; 4 finishes and fills batch 1
    bound.start(1)
    bound.start(1)
    assert not bound.can_start(1)
    bound.finish(4, 1)
    assert bound.form_batch() == [(0, 0), (4, 1)]
    assert bound.oldest_trainable() == 1  # batch 2 (trained by v2) takes v1 and newer: unit 2 (v0) can enter none
    bound.finish(2, 0)  # it finished before the caller aborted it: dropped when the next batch forms
    bound.finish(5, 1)
    assert bound.form_batch() is None and bound.dropped == 1 and bound.finished == [(5, 1)]
    assert bound.started == 5  # six started, one dropped
    bound.release()  # a running unit that will run again (its engine died): room for it, not counted as aborted
    assert bound.started == 4 and bound.aborted == 0 and bound.can_start(1)
    bound.abort()  # one no batch within the bound can take
    assert bound.started == 3 and bound.aborted == 1


def test_version_lag_metrics_count_each_lag_up_to_the_bound():
    from engines.staleness import version_lag_metrics

    # lags 0, 2, 1, 2 with η = 2: mean 5/4, max 2, one group at lag 0, one at 1, two at 2
    assert version_lag_metrics([0, 2, 1, 2], max_staleness=2) == {
        "async/version_lag_mean": 1.25, "async/version_lag_max": 2.0,
        "async/version_lag_0": 1.0, "async/version_lag_1": 1.0, "async/version_lag_2": 2.0}
