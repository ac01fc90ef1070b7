"""bf16 training keeps fp32 master weights (engines/training/precision.py): a small update survives the
bf16 rounding, matches the fp32 engine's update, and a checkpoint resumes from the masters."""

from __future__ import annotations

import torch

from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.training.torch import OptimSpec, TorchTrainEngine

PROMPTS, TARGETS = ["12+3=", "1+1=", "29+30=", "7+8="], ["15", "2", "59", "15"]


def _engine(model_dir: str, dtype: str) -> TorchTrainEngine:
    torch.manual_seed(0)
    return TorchTrainEngine(model_dir, OptimSpec(lr=1e-5), dtype=dtype, micro_batch_size=2, packing=False)


def _fp32(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    weights = engine.master.state_dict() if engine.master is not None else dict(engine.model.named_parameters())
    return {name: w.detach().float().clone() for name, w in weights.items()}


def test_bf16_step_moves_fp32_masters_like_the_fp32_step(tiny_model_dir):
    batch = sft_batch(tiny_model_dir, PROMPTS, TARGETS)
    fp32, bf16 = _engine(tiny_model_dir, "float32"), _engine(tiny_model_dir, "bfloat16")
    assert fp32.master is None and bf16.master is not None
    before32, before16 = _fp32(fp32), _fp32(bf16)
    bf16_params = {n: p.detach().clone() for n, p in bf16.model.named_parameters()}
    fp32.train_step(batch, SFTObjective())
    bf16.train_step(batch, SFTObjective())
    after32, after16 = _fp32(fp32), _fp32(bf16)
    delta32 = torch.cat([(after32[n] - before32[n]).flatten() for n in before32])
    delta16 = torch.cat([(after16[n] - before16[n]).flatten() for n in before16])
    # AdamW's first step moves each weight by ~lr = 1e-5 in the direction of its gradient's sign; the
    # bf16 forward changes the gradients slightly, not their signs (almost everywhere) or the step size.
    assert delta16.abs().mean() > 5e-6
    assert (delta16.abs().mean() / delta32.abs().mean() - 1).abs() < 0.1
    moved = (delta32 != 0) & (delta16 != 0)
    assert (torch.sign(delta32[moved]) == torch.sign(delta16[moved])).float().mean() > 0.9
    # Most bf16 parameters cannot represent a 1e-5 move: stepped in place (no masters) they would stay put.
    same = [torch.equal(bf16_params[n], p) for n, p in bf16.model.named_parameters()]
    unchanged = sum(int((bf16_params[n] == p).sum()) for n, p in bf16.model.named_parameters())
    assert unchanged / delta16.numel() > 0.5 and not all(same)
    # the model's bf16 parameters are the masters rounded
    assert all(torch.equal(p, after16[n].to(torch.bfloat16)) for n, p in bf16.model.named_parameters())


def test_bf16_checkpoint_resumes_from_the_masters(tiny_model_dir, tmp_path):
    batch = sft_batch(tiny_model_dir, PROMPTS, TARGETS)
    first = _engine(tiny_model_dir, "bfloat16")
    first.train_step(batch, SFTObjective())
    first.save(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "master.safetensors").exists()
    second = _engine(tiny_model_dir, "bfloat16")
    second.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(_fp32(first).values(), _fp32(second).values()))
    first.train_step(batch, SFTObjective())
    second.train_step(batch, SFTObjective())
    assert all(torch.equal(a, b) for a, b in zip(_fp32(first).values(), _fp32(second).values()))
