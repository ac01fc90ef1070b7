"""Extra forward outputs an objective asks for (``outputs``): token accuracy, the whole distribution and
its values at given ids, from the one log-softmax of the padded and the packed forward."""

from __future__ import annotations

import math

import pytest
import torch

from engines.data.sft import sft_batch
from engines.training.logprobs import VocabLogprobs, token_outputs
from engines.training.torch import OptimSpec, TorchTrainEngine

EXTRAS = frozenset({"top1", "vocab_logprobs", "gathered_logprobs"})


def _batch(model_dir: str, vocab: int, k: int = 3):
    """Answers of different lengths (so micro-batches trim and pack differently), with random ``gather_ids``."""
    batch = sft_batch(model_dir, ["12+3=", "1+1=", "29+30=", "7+8="], ["15", "2", "59", "15 and more"])
    gen = torch.Generator().manual_seed(0)
    return batch.with_tensors(gather_ids=torch.randint(0, vocab, (*batch.input_ids.shape, k), generator=gen))


def _forward(trainer: TorchTrainEngine, batch, outputs=EXTRAS):
    trainer.model.train()
    return trainer._forward(batch, entropy_grad=False, outputs=outputs)


@pytest.fixture(scope="module")
def trainers(tiny_model_dir):
    """The same weights with the padded (False) and the packed (True) forward."""
    return {packing: TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=2, packing=packing)
            for packing in (False, True)}


def test_token_outputs_hand_worked():
    # two positions of a [1, 3] batch (columns 1 and 2), vocabulary of 3:
    # column 1: p = (0.5, 0.3, 0.2), token 0 → top1 1 (0.5 is the largest), logprob ln 0.5
    # column 2: p = (0.1, 0.6, 0.3), token 2 → top1 0 (0.6 at id 1 is larger), logprob ln 0.3
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    vocab = VocabLogprobs(probs.log(), (torch.tensor([0, 0]), torch.tensor([1, 2])), torch.tensor([0, 2]), (1, 3))
    gather_ids = torch.tensor([[[0, 0], [2, 1], [1, 2]]])  # [1, 3, 2]; column 0 is not a position
    out = token_outputs(vocab, {"top1", "vocab_logprobs", "gathered_logprobs"}, gather_ids=gather_ids)
    assert out["top1_correct"].tolist() == [[0.0, 1.0, 0.0]]
    assert torch.allclose(out["logprobs"], torch.tensor([[0.0, math.log(0.5), math.log(0.3)]]))
    # column 1 gathers ids (2, 1) → (ln 0.2, ln 0.3); column 2 ids (1, 2) → (ln 0.6, ln 0.3); column 0 stays 0
    expected = torch.tensor([[[0.0, 0.0], [math.log(0.2), math.log(0.3)], [math.log(0.6), math.log(0.3)]]])
    assert torch.allclose(out["gathered_logprobs"], expected)
    assert out["vocab_logprobs"].shape == (1, 3, 3) and (out["vocab_logprobs"][0, 0] == 0).all()
    with pytest.raises(ValueError, match=r"unknown forward outputs \['top2'\]; known: entropy, gathered_logprobs"):
        token_outputs(vocab, {"top2"})
    with pytest.raises(ValueError, match=r"gathered_logprobs needs gather_ids \[B, L, k\]"):
        token_outputs(vocab, {"gathered_logprobs"})


def test_padded_and_packed_extras_agree_on_answer_tokens(trainers, tiny_model_dir):
    vocab = trainers[True].model.config.vocab_size
    batch = _batch(tiny_model_dir, vocab)
    padded, packed = (_forward(trainers[p], batch) for p in (False, True))
    mask = batch.loss_mask.bool()  # [B, L]
    assert int(mask.sum()) > 10
    for key in ("logprobs", "top1_correct", "vocab_logprobs", "gathered_logprobs"):
        assert (padded[key][mask] - packed[key][mask]).abs().max() < 1e-5, key
        assert (packed[key][~mask] == 0).all(), key  # the packed forward computes answer tokens only
    assert packed["vocab_logprobs"].shape == (*batch.input_ids.shape, vocab)
    assert packed["gathered_logprobs"].shape == (*batch.input_ids.shape, 3)
    # each answer token's row is a distribution: its probabilities sum to 1
    assert (packed["vocab_logprobs"][mask].logsumexp(-1).abs() < 1e-5).all()


@pytest.mark.parametrize("packing", [False, True])
def test_top1_and_gathered_are_read_off_the_distribution(trainers, tiny_model_dir, packing):
    batch = _batch(tiny_model_dir, trainers[packing].model.config.vocab_size)
    out = _forward(trainers[packing], batch)
    mask = batch.loss_mask.bool()
    vocab_lp = out["vocab_logprobs"].detach()  # [B, L, V]
    argmax_right = (vocab_lp.argmax(-1) == batch.input_ids).float()  # [B, L]
    assert torch.equal(out["top1_correct"][mask], argmax_right[mask])
    assert not out["top1_correct"].requires_grad
    assert torch.equal(out["gathered_logprobs"].detach(), vocab_lp.gather(-1, batch.tensors["gather_ids"]))
    picked = vocab_lp.gather(-1, batch.input_ids[..., None]).squeeze(-1)
    assert torch.allclose(out["logprobs"].detach()[mask], picked[mask])


@pytest.mark.parametrize("packing", [False, True])
def test_gradients_flow_through_gathered_and_vocab_logprobs(trainers, tiny_model_dir, packing):
    """A loss on the gathered log-probs has the gradient of the same loss on the gathered vocab log-probs."""
    trainer = trainers[packing]
    batch = _batch(tiny_model_dir, trainer.model.config.vocab_size)
    weight = batch.loss_mask[..., None]  # [B, L, 1]
    grads = []
    for through in ("gathered", "vocab"):
        out = _forward(trainer, batch)
        gathered = out["gathered_logprobs"] if through == "gathered" else \
            out["vocab_logprobs"].gather(-1, batch.tensors["gather_ids"])
        trainer.model.zero_grad()
        (-(gathered * weight).sum()).backward()
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
    assert max(float(g.abs().max()) for g in grads[0]) > 1e-4  # the loss moves the weights
    assert max(float((a - b).abs().max()) for a, b in zip(*grads)) < 1e-6


def test_train_step_hands_the_objective_its_outputs(trainers, tiny_model_dir):
    """An objective declaring ``outputs`` receives them in ``train_step``; its token accuracy is the one
    read off the forward before the step (the metric is computed before the weights move)."""

    class Accuracy:
        outputs = frozenset({"top1"})
        needs_entropy_grad = False

        def __call__(self, *, logprobs, entropy, batch, top1_correct):
            mask = batch.loss_mask
            loss = -(logprobs * mask).sum() / mask.sum()
            return loss, {"acc": float((top1_correct * mask).sum() / mask.sum())}

        def micro_weight(self, micro, full):
            return float(micro.loss_mask.sum() / full.loss_mask.sum())

    batch = _batch(tiny_model_dir, trainers[True].model.config.vocab_size)
    fresh = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=4, packing=True)
    out = _forward(fresh, batch, frozenset({"top1"}))
    expected = float((out["top1_correct"] * batch.loss_mask).sum() / batch.loss_mask.sum())
    assert set(out) == {"logprobs", "entropy", "top1_correct"}
    assert fresh.train_step(batch, Accuracy())["acc"] == pytest.approx(expected)
