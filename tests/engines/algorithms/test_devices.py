"""Algorithms create their tensors on their inputs' device, never as CPU constants: run on meta tensors
(no data, but a CPU tensor mixed in raises), every KL estimator, aggregation mode and advantage estimator
whose ops meta supports stays on meta. tests/gpu/ runs all of them, losses included, on CUDA."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms import advantages, aggregation, kl

B, L = 4, 5


def _meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("name", kl.names())
def test_kl_estimators_stay_on_the_input_device(name):
    assert kl.compute(name, logprobs=_meta(B, L), ref_logprobs=_meta(B, L)).device.type == "meta"


@pytest.mark.parametrize("name", aggregation.names())
def test_aggregations_stay_on_the_input_device(name):
    options = {"norm": 4} if name == "seq-mean-token-sum-norm" else {}
    assert aggregation.aggregate(name, values=_meta(B, L), mask=_meta(B, L), **options).device.type == "meta"


# torch.unique (the group statistics) has no meta kernel: the group estimators run on CUDA in tests/gpu/
@pytest.mark.parametrize("name", sorted(set(advantages.names()) - advantages.GROUP_ESTIMATORS - {"raft_pp"}))
def test_advantage_estimators_without_groups_stay_on_the_input_device(name):
    adv, returns = advantages.compute(name, token_rewards=_meta(B, L), loss_mask=_meta(B, L),
                                      group_ids=_meta(B, dtype=torch.long), values=_meta(B, L),
                                      outcome_rewards=_meta(B))
    assert adv.device.type == returns.device.type == "meta"
