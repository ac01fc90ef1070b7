"""The supervised objectives handed to ``train_step``: SFT's mean over the step's answer tokens does not
depend on the micro-batching, DPO's pairs and reference, distillation's top-k buckets."""

from __future__ import annotations

import math

import pytest
import torch

from engines.algorithms.objective import DistillObjective, DPOObjective, SFTObjective
from engines.data.sft import sft_batch
from engines.training.torch import OptimSpec, TorchTrainEngine
from engines.types import TrainBatch


def _pairs(ref_logps: list[float]) -> TrainBatch:
    """Two pairs (rows c0, r0, c1, r1) of 3 tokens, the answer the last 2 of each row."""
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7]])
    mask = torch.tensor([[0.0, 1, 1]] * 4)
    return TrainBatch(ids, torch.ones_like(ids), mask, {"ref_logps": torch.tensor(ref_logps)[:, None]},
                      group_ids=torch.tensor([0, 0, 1, 1]))


def test_dpo_objective_reads_pairs_and_the_cached_reference():
    logprobs = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -2.0], [0.0, -0.5, -0.5], [0.0, -2.0, -2.0]])
    # summed answer log-probs: c0 -2, r0 -3, c1 -1, r1 -4; with the reference equal to them every log-ratio is
    # 0: loss ln 2, rewards 0
    loss, metrics = DPOObjective(beta=0.1)(logprobs=logprobs, batch=_pairs([-2.0, -3.0, -1.0, -4.0]))
    assert float(loss) == pytest.approx(math.log(2))
    assert metrics["rewards/margins"] == pytest.approx(0.0) and metrics["logps/chosen"] == pytest.approx(-1.5)
    # a reference 1 nat lower on each chosen answer: h = 1 per pair, loss −log σ(0.1) = 0.6444
    loss, metrics = DPOObjective(beta=0.1)(logprobs=logprobs, batch=_pairs([-3.0, -3.0, -2.0, -4.0]))
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-0.1))), rel=1e-6)
    assert metrics["rewards/chosen"] == pytest.approx(0.1) and metrics["rewards/accuracies"] == 1.0
    # the SFT term adds the chosen answers' token-mean NLL: (1 + 1 + 0.5 + 0.5) / 4 = 0.75
    with_sft, _ = DPOObjective(beta=0.1, sft_weight=2.0)(logprobs=logprobs, batch=_pairs([-3.0, -3.0, -2.0, -4.0]))
    assert float(with_sft - loss) == pytest.approx(2 * 0.75)
    with pytest.raises(ValueError, match="whole pairs"):
        DPOObjective()(logprobs=logprobs[:3], batch=_pairs([-2.0, -3.0, -1.0, -4.0]).select(slice(0, 3)))


def test_distill_objective_is_zero_when_the_student_is_the_teacher_and_mixes_in_cross_entropy():
    torch.manual_seed(0)
    vocab = torch.log_softmax(torch.randn(1, 3, 6), -1)  # [B, L, V]
    top, ids = vocab.topk(3, dim=-1)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    batch = TrainBatch(torch.tensor([[0, 1, 2]]), torch.ones(1, 3, dtype=torch.long), mask,
                       {"teacher_logprobs": top, "gather_ids": ids})
    logprobs = vocab.gather(-1, torch.tensor([[[0], [1], [2]]])).squeeze(-1)  # the data's tokens
    objective = DistillObjective(divergence="forward_kl", top_k=3)
    loss, metrics = objective(logprobs=logprobs, batch=batch, gathered_logprobs=top.clone())
    assert float(loss) == pytest.approx(0.0, abs=1e-6) and metrics["distill/top1_agreement"] == 1.0
    assert metrics["distill/topk_mass"] == pytest.approx(float(top[0, 1:].exp().sum(-1).mean()), rel=1e-6)
    # weight 0.25: a quarter of the divergence (0) and three quarters of the NLL of tokens 1 and 2
    mixed, metrics = DistillObjective(top_k=3, weight=0.25)(logprobs=logprobs, batch=batch, gathered_logprobs=top)
    assert float(mixed) == pytest.approx(0.75 * float(-(logprobs[0, 1] + logprobs[0, 2]) / 2), rel=1e-6)
    assert metrics["distill/ce"] == pytest.approx(float(-(logprobs[0, 1] + logprobs[0, 2]) / 2), rel=1e-6)


def test_sft_loss_is_the_mean_over_the_steps_answer_tokens_whatever_the_micro_batches(tiny_model_dir):
    # answers of 1, 2, 2 and 4 tokens (+ EOS): a per-micro-batch mean averaged over micro-batches would weigh
    # the short answers' tokens more; the step's token mean weighs every token alike
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20=", "3+4=", "21+9="], ["3", "30", "12", "3000"])
    grads, losses = [], []
    for micro in (4, 1, 3):
        trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=micro)
        metrics = trainer.train_step(batch, SFTObjective())
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})  # the step's gradient
        losses.append(metrics["train/loss"])
        assert 0 <= metrics["sft/token_accuracy"] <= 1
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-6)
    for other in grads[1:]:
        assert all(torch.allclose(other[n], grads[0][n], rtol=1e-4, atol=1e-7) for n in grads[0])
