"""On a CUDA device: every algorithm, the batch builders and sequence packing keep their tensors on the
inputs' device (a CPU constant inside would raise), and give the CPU's values."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms import advantages, losses
from engines.training.logprobs import pack_sequences
from engines.training.updates import UpdateSpec, mini_batch_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
B, L = 6, 7


def _batch(device: str):
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(L)[None, :] >= 2).float().repeat(B, 1)  # [B, L]: 2 prompt tokens, then the response
    data = {"logprobs": -torch.rand(B, L, generator=gen), "old_logprobs": -torch.rand(B, L, generator=gen),
            "advantages": torch.randn(B, L, generator=gen) * mask, "loss_mask": mask}
    return {k: v.to(device) for k, v in data.items()}


@pytest.mark.parametrize("name", losses.names())
def test_policy_losses_on_cuda_match_the_cpu(name):
    cpu, cuda = _batch("cpu"), _batch("cuda")
    loss_cpu, metrics_cpu = losses.compute(name, **cpu)
    loss_cuda, metrics_cuda = losses.compute(name, **cuda)
    assert loss_cuda.device.type == "cuda"
    assert float(loss_cuda) == pytest.approx(float(loss_cpu), rel=1e-5, abs=1e-6)
    assert metrics_cuda == pytest.approx(metrics_cpu, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", advantages.names())
def test_advantage_estimators_on_cuda_match_the_cpu(name):
    def run(device):
        batch = _batch(device)
        rewards = torch.zeros(B, L, device=device)
        rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], device=device)
        return advantages.compute(name, token_rewards=rewards, loss_mask=batch["loss_mask"],
                                  group_ids=torch.tensor([0, 0, 0, 1, 1, 1], device=device),
                                  values=batch["old_logprobs"], outcome_rewards=rewards.sum(-1))

    (adv_cpu, ret_cpu), (adv_cuda, ret_cuda) = run("cpu"), run("cuda")
    assert adv_cuda.device.type == "cuda"
    torch.testing.assert_close(adv_cuda.cpu(), adv_cpu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret_cuda.cpu(), ret_cpu, rtol=1e-5, atol=1e-6)


def test_packing_and_mini_batches_on_cuda():
    ids = torch.randint(3, 20, (4, 9))
    ids[:2, :3] = ids[0, :3]  # two rows share a prompt
    attention = (torch.arange(9)[None, :] < torch.tensor([9, 7, 8, 5])[:, None]).long()
    needed = attention * (torch.arange(9)[None, :] >= 3)
    cpu = pack_sequences(ids, attention, needed, share_prefixes=True)
    cuda = pack_sequences(ids.cuda(), attention.cuda(), needed.cuda(), share_prefixes=True)
    assert cuda.input_ids.device.type == "cuda" and torch.equal(cuda.input_ids.cpu(), cpu.input_ids)
    assert torch.equal(cuda.position_ids.cpu(), cpu.position_ids)
    groups = torch.tensor([0, 0, 1, 1], device="cuda")
    parts = mini_batch_rows(4, groups, UpdateSpec(mini_batches=2), torch.Generator().manual_seed(0))
    assert sorted(int(r) for part in parts for r in part) == [0, 1, 2, 3]
