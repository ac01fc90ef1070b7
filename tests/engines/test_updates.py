"""PPO's inner loop (engines/training/updates.py): mini-batch partitions, a hand-worked two-mini-batch
update, clipping that acts once the ratio leaves 1, and GSPO against GRPO on a real tiny model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engines.algorithms.objective import PolicyObjective
from engines.data.sft import sft_batch
from engines.training.torch import OptimSpec, TorchTrainEngine
from engines.training.updates import UpdateSpec, combine, mini_batch_rows, run_updates
from engines.types import TrainBatch


def _partition(group_ids, spec, epochs=1):
    generator = torch.Generator().manual_seed(spec.seed)
    ids = None if group_ids is None else torch.tensor(group_ids)
    return [[part.tolist() for part in mini_batch_rows(8, ids, spec, generator)] for _ in range(epochs)]


def test_mini_batches_hold_whole_groups_and_cover_every_row_once():
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    for seed in range(5):
        for parts in _partition(groups, UpdateSpec(mini_batches=2, seed=seed), epochs=3):
            assert sorted(r for part in parts for r in part) == list(range(8))
            assert [len(part) for part in parts] == [4, 4]
            for part in parts:  # rows of a group stay together: each part is two whole groups
                assert sorted({groups[r] for r in part}) == sorted(groups[r] for r in part[::2])
    # the order is the seed's: the same seed gives the same mini-batches, epochs reshuffle
    assert _partition(groups, UpdateSpec(mini_batches=4, seed=1), 2) == _partition(groups, UpdateSpec(mini_batches=4, seed=1), 2)
    epochs = [_partition(groups, UpdateSpec(mini_batches=4, seed=s), 2) for s in range(6)]
    assert any(e[0] != e[1] for e in epochs) and len({str(e) for e in epochs}) > 1


def test_rows_split_when_groups_need_not_stay_whole_and_one_mini_batch_keeps_the_batch():
    parts = _partition([0, 0, 0, 0, 1, 1, 1, 1], UpdateSpec(mini_batches=3, keep_groups=False, seed=0))[0]
    assert [len(p) for p in parts] == [3, 3, 2] and sorted(sum(parts, [])) == list(range(8))
    # more mini-batches than groups: one group each
    assert [len(p) for p in _partition([0, 0, 0, 0, 1, 1, 1, 1], UpdateSpec(mini_batches=4, seed=0))[0]] == [4, 4]
    assert mini_batch_rows(8, None, UpdateSpec(), torch.Generator()) == [None]


def test_combine_averages_and_keeps_extremes():
    merged = combine([{"a": 1.0, "r_max": 2.0, "r_min": 0.5}, {"a": 3.0, "r_max": 1.5, "r_min": 0.9}], [1.0, 3.0])
    assert merged == {"a": (1.0 + 9.0) / 4, "r_max": 2.0, "r_min": 0.5}


class _Scalar(torch.nn.Module):
    """A policy whose log-probability of every token is one parameter θ: each step's move is worked out by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(()))

    def forward(self, micro: TrainBatch) -> dict:
        return {"logprobs": self.theta * torch.ones(micro.input_ids.shape), "entropy": None}


def _two_row_batch() -> TrainBatch:
    """Two rows, one response token each (column 1), advantage +1, old logprob 0, each row its own group."""
    mask = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    return TrainBatch(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long), mask,
                      {"old_logprobs": torch.zeros(2, 2), "advantages": mask.clone()}, group_ids=torch.tensor([0, 1]))


def _update(mini_batches: int, clip_high: float) -> tuple[float, dict]:
    model = _Scalar()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    objective = PolicyObjective(policy_loss="ppo_clip", agg="token-mean", loss_options={"clip_low": 0.2, "clip_high": clip_high})
    metrics = run_updates(_two_row_batch(), objective, UpdateSpec(mini_batches=mini_batches), forward=model,
                          parameters=list(model.parameters()), optimizer=optimizer, scheduler=scheduler,
                          micro_batch_size=8, grad_clip=1e9)
    return float(model.theta.detach()), metrics


def test_two_mini_batch_update_worked_by_hand():
    # loss = -A·exp(θ - 0) on one token, A = 1, SGD lr 0.1, so each unclipped step adds 0.1·exp(θ).
    # One mini-batch of both rows: θ = 0 + 0.1·1 = 0.1, one optimizer step.
    theta, metrics = _update(mini_batches=1, clip_high=0.2)
    assert theta == pytest.approx(0.1) and metrics["train/optimizer_steps"] == 1
    # Two mini-batches: θ1 = 0.1; the second row then sees ratio e^0.1 = 1.105 (< 1.2, unclipped),
    # θ2 = 0.1 + 0.1·e^0.1 = 0.21052.
    theta, metrics = _update(mini_batches=2, clip_high=0.2)
    assert theta == pytest.approx(0.1 + 0.1 * math.exp(0.1))
    assert metrics["train/optimizer_steps"] == 2 and metrics["actor/clipfrac"] == 0
    assert metrics["actor/ratio_max"] == pytest.approx(math.exp(0.1)) and metrics["actor/ratio_min"] == 1.0
    # clip_high 0.05: the second step's ratio 1.105 is past 1.05 with A > 0, so its token is clipped and
    # carries no gradient: θ stays at 0.1. Half the steps' tokens were clipped.
    theta, metrics = _update(mini_batches=2, clip_high=0.05)
    assert theta == pytest.approx(0.1) and metrics["actor/clipfrac"] == 0.5


def test_drift_is_measured_before_the_first_optimizer_step_only():
    # θ = 0 and rollout logprobs -0.05 (row 0) and +0.2 (row 1) on the one response token each: before any
    # step the gaps are 0.05 and 0.2. The second mini-batch sees θ = 0.1 and is not measured: a gap of
    # the synced weights, not of weights the first step already moved.
    model = _Scalar()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    batch = _two_row_batch()
    batch.tensors["rollout_logprobs"] = torch.tensor([[9.0, -0.05], [9.0, 0.2]])  # column 0 is prompt: masked
    objective = PolicyObjective(policy_loss="ppo_clip", agg="token-mean")
    gaps = {0: 0.05, 1: 0.2}
    for mini_batches in (1, 2):
        model.theta.data.zero_()
        spec = UpdateSpec(mini_batches=mini_batches, seed=0)
        metrics = run_updates(batch, objective, spec, forward=model, parameters=list(model.parameters()),
                              optimizer=optimizer, scheduler=scheduler, micro_batch_size=8, grad_clip=1e9)
        first = mini_batch_rows(2, batch.group_ids, spec, torch.Generator().manual_seed(0))[0]
        measured = [gaps[row] for row in ([0, 1] if first is None else first.tolist())]
        assert len(measured) == 3 - mini_batches  # both rows in one step; the first step's row of two
        assert metrics["sync/logprob_drift_max"] == pytest.approx(max(measured))
        assert metrics["sync/logprob_drift_mean"] == pytest.approx(sum(measured) / len(measured))


PROMPTS, TARGETS = ["12+3=", "1+1=", "29+30=", "7+8=", "3+4=", "10+10=", "5+6=", "2+2="], ["15", "2", "59", "15", "7", "20", "11", "4"]


def _policy_batch(engine: TorchTrainEngine, model_dir: str) -> TrainBatch:
    """Eight rows in four groups of two, advantages ±1 per row, old logprobs the engine's own (ratio 1 at first)."""
    batch = sft_batch(model_dir, PROMPTS, TARGETS)
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0])[:, None]
    return dataclasses.replace(batch, tensors={"old_logprobs": engine.logprobs(batch), "advantages": signs * batch.loss_mask},
                               group_ids=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))


def _trained(model_dir: str, loss: str, clip: dict, mini_batches: int) -> tuple[dict[str, torch.Tensor], dict]:
    torch.manual_seed(0)
    engine = TorchTrainEngine(model_dir, OptimSpec(lr=1e-2), micro_batch_size=4, packing=False)
    objective = PolicyObjective(policy_loss=loss, agg="seq-mean-token-mean", loss_options=clip)
    metrics = engine.train_step(_policy_batch(engine, model_dir), objective, UpdateSpec(mini_batches=mini_batches, seed=3))
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}, metrics


def test_four_mini_batches_clip_and_gspo_then_trains_differently_from_grpo(tiny_model_dir):
    grpo_clip, gspo_clip = {"clip_low": 0.2, "clip_high": 0.2}, {"clip_low": 3e-4, "clip_high": 4e-4}
    # One mini-batch: the ratio is 1 everywhere, nothing clips, and GSPO's gradient equals GRPO's
    # (s_i = 1 and ∇s = ∇LP under seq-mean-token-mean), so the updates agree to float rounding.
    grpo_one, metrics = _trained(tiny_model_dir, "ppo_clip", grpo_clip, 1)
    gspo_one, _ = _trained(tiny_model_dir, "gspo", gspo_clip, 1)
    assert metrics["actor/clipfrac"] == 0 and metrics["actor/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert all(torch.allclose(grpo_one[n], gspo_one[n], atol=1e-6) for n in grpo_one)
    # Four mini-batches: after the first step the ratio moves off 1, GSPO's tiny sequence clip acts,
    # and the two losses train to different weights.
    grpo_four, grpo_metrics = _trained(tiny_model_dir, "ppo_clip", grpo_clip, 4)
    gspo_four, gspo_metrics = _trained(tiny_model_dir, "gspo", gspo_clip, 4)
    assert gspo_metrics["actor/clipfrac"] > 0 and gspo_metrics["train/optimizer_steps"] == 4
    assert grpo_metrics["actor/ratio_max"] > 1.0 or grpo_metrics["actor/ratio_min"] < 1.0
    assert max(float((grpo_four[n] - gspo_four[n]).abs().max()) for n in grpo_four) > 1e-4
