"""The entropy keeps an autograd graph over the vocabulary only when the objective trains through it."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms.objective import PolicyObjective, SFTObjective
from engines.data.sft import sft_batch
from engines.training.logprobs import token_entropy
from engines.training.torch import OptimSpec, TorchTrainEngine


def test_token_entropy_hand_worked_with_and_without_grad():
    # p = (0.5, 0.25, 0.25): H = -(0.5 ln 0.5 + 2 * 0.25 ln 0.25) = 0.5 ln 2 + ln 2 = 1.5 ln 2 = 1.0397208
    log_probs = torch.log(torch.tensor([[0.5, 0.25, 0.25]])).requires_grad_(True)
    with_grad, metric = token_entropy(log_probs, grad=True), token_entropy(log_probs, grad=False)
    assert with_grad.requires_grad and not metric.requires_grad
    assert torch.equal(with_grad.detach(), metric)
    assert metric.item() == pytest.approx(1.5 * torch.log(torch.tensor(2.0)).item(), rel=1e-6)


@pytest.mark.parametrize("packing", [True, False])
def test_entropy_requires_grad_only_with_an_entropy_bonus(tiny_model_dir, packing):
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(), packing=packing)
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20="], ["3", "30"])
    batch = batch.with_tensors(advantages=torch.zeros_like(batch.loss_mask), old_logprobs=torch.zeros_like(batch.loss_mask))
    trainer.model.train()
    outputs, metrics = {}, {}
    for coef in (0.0, 0.1):
        objective = PolicyObjective(entropy_coef=coef)
        outputs[coef] = trainer._forward(batch, entropy_grad=objective.needs_entropy_grad)
        metrics[coef] = objective(**outputs[coef], batch=batch)[1]["actor/entropy"]
    assert outputs[0.0]["logprobs"].requires_grad and not outputs[0.0]["entropy"].requires_grad
    assert outputs[0.1]["logprobs"].requires_grad and outputs[0.1]["entropy"].requires_grad
    # Same forward, same weights: the values (and the logged metric) do not depend on the graph.
    assert torch.equal(outputs[0.0]["entropy"], outputs[0.1]["entropy"].detach())
    assert metrics[0.0] == metrics[0.1] > 0
    assert not SFTObjective().needs_entropy_grad
