"""LoRA (engines.training.lora) on the tiny model: what trains, the adapter-only sync into the HF engine,
the frozen base as the KL reference, checkpoints and the merged export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import tasks.sync
from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.inference.hf import HFInferenceEngine
from engines.training.torch import OptimSpec, ReferenceEngine, TorchTrainEngine
from engines.types import SamplingParams, build_train_batch

PROMPTS = ["12+3=", "1+1=", "29+30=", "7+8="]
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
# The tiny model (tests/conftest.py): hidden 64, two layers, two heads of 32 (one KV head), MLP 128. r·(in + out)
# per block: q 4·(64+64) + k 4·(64+32) + v 4·(64+32) + o 4·(64+64) + gate, up, down 3 · 4·(64+128) = 4096
# numbers; two blocks, fp32: 2 · 4096 · 4 bytes.
ADAPTER_BYTES = 2 * 4096 * 4


def _batch(model_dir):
    return sft_batch(model_dir, ["1+2=", "10+20=", "3+4=", "21+9="], ["3", "30", "7", "30"])


def _lora_trainer(model_dir, **kwargs) -> TorchTrainEngine:
    return TorchTrainEngine(model_dir, OptimSpec(lr=1e-2), lora=LORA, **kwargs)


def _adapter(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" in n}


def _perturb_adapter(trainer, seed=0):
    """B starts at zero (the adapter adds nothing); random A and B make it change the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def test_only_the_adapter_trains(tiny_model_dir):
    trainer = _lora_trainer(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n}
    assert len(optimized) == 2 * 7 * 2  # A and B of 7 layers in each of 2 blocks
    for _ in range(2):  # B starts at 0, so A's first gradient is 0: the second step moves A
        trainer.train_step(_batch(tiny_model_dir), SFTObjective())
    for name, param in trainer.model.named_parameters():
        changed = not torch.equal(param, before[name])
        assert changed == (".lora_" in name), name


def test_adapter_sync_sends_the_base_once_then_only_the_adapter(tiny_model_dir):
    trainer = _lora_trainer(tiny_model_dir)
    rollout = HFInferenceEngine(tiny_model_dir)
    assert rollout.update_adapter(trainer.export_adapter(1)) is None  # no base held yet: send it first
    base = rollout.update_weights(1, trainer.export_weights())
    assert base == trainer.exported_checksum()
    for version, seed in ((2, 0), (3, 1)):
        _perturb_adapter(trainer, seed)
        update = trainer.export_adapter(version, bucket_bytes=1 << 12)
        report = rollout.update_adapter(update)
        assert update.nbytes == report.nbytes == ADAPTER_BYTES  # the adapter alone, every sync after the first
        assert report.tensors == 28
        assert report.checksum == trainer.weights_checksum() == rollout.weights_checksum()
        assert rollout.weights_version() == version
    assert trainer.weights_checksum() != base
    out = rollout.generate(PROMPTS * 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1))
    batch = build_train_batch(out, rollout.tokenizer.pad_token_id)
    diff = (trainer.logprobs(batch) - batch.tensors["rollout_logprobs"]) * batch.loss_mask
    assert batch.loss_mask.sum() > 12
    assert diff.abs().max() < 1e-5
    with torch.no_grad():  # the adapter changes the log-probs: the merge is what makes them equal
        trainer.model.get_submodule("model.layers.0.self_attn.q_proj").lora_B["default"].weight.zero_()
    assert ((trainer.logprobs(batch) - batch.tensors["rollout_logprobs"]) * batch.loss_mask).abs().max() > 1e-3


def test_a_new_base_resets_the_merged_adapter(tiny_model_dir):
    """A whole update replaces what was merged; the next adapter goes onto the new base."""
    trainer = _lora_trainer(tiny_model_dir)
    rollout = HFInferenceEngine(tiny_model_dir)
    rollout.update_weights(1, trainer.export_weights())
    _perturb_adapter(trainer)
    rollout.update_adapter(trainer.export_adapter(2))
    base = rollout.update_weights(3, trainer.export_weights())
    assert rollout.weights_checksum() == base == trainer.exported_checksum()
    assert rollout.update_adapter(trainer.export_adapter(4)).checksum == trainer.weights_checksum()


class _Local:
    """An engine called like a Ray actor handle (``handle.method.remote(...)`` runs it here) that counts calls."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        def remote(*args, **kwargs):
            self.calls.append(name)
            return getattr(self.engine, name)(*args, **kwargs)

        return type("Method", (), {"remote": staticmethod(remote)})


def test_sync_task_sends_the_base_once_then_the_adapter(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(tasks.sync.ray, "get", lambda refs: refs)  # the results are values already
    trainer, rollout = _Local(_lora_trainer(tiny_model_dir)), _Local(HFInferenceEngine(tiny_model_dir))
    sent = []
    update_adapter = rollout.engine.update_adapter
    rollout.engine.update_adapter = lambda update: sent.append(update.nbytes) or update_adapter(update)
    first = tasks.sync.sync_weights.fn(trainer, [rollout], 0, 1, adapter=True)
    whole = {"update_weights_shared", "update_weights", "update_weights_cuda_ipc"}
    assert whole & set(rollout.calls) and first == trainer.engine.weights_checksum()
    rollout.calls.clear()
    _perturb_adapter(trainer.engine)
    second = tasks.sync.sync_weights.fn(trainer, [rollout], 1, 1, adapter=True)
    assert rollout.calls == ["update_adapter"]  # no whole update after the first sync
    assert sent[-1] == ADAPTER_BYTES and second == trainer.engine.weights_checksum() != first
    assert rollout.engine.weights_checksum() == second and rollout.engine.weights_version() == 1
    trainer.engine.close()


def test_reference_logprobs_are_the_base_models(tiny_model_dir):
    trainer = _lora_trainer(tiny_model_dir)
    _perturb_adapter(trainer)
    batch = _batch(tiny_model_dir)
    reference = ReferenceEngine(tiny_model_dir).logprobs(batch)
    assert torch.allclose(trainer.reference_logprobs(batch), reference, atol=1e-6)
    assert (trainer.logprobs(batch) - reference).abs().max() > 1e-3  # the adapter is back on after it
    with pytest.raises(RuntimeError, match="LoRA"):
        TorchTrainEngine(tiny_model_dir, OptimSpec()).reference_logprobs(batch)


def test_checkpoint_holds_the_adapter_and_resume_is_exact(tiny_model_dir, tmp_path):
    batch = _batch(tiny_model_dir)
    a = _lora_trainer(tiny_model_dir)
    a.train_step(batch, SFTObjective())
    a.save(str(tmp_path / "ckpt"))
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert set(saved) == set(_adapter(a))  # the adapter only, not the base
    b = _lora_trainer(tiny_model_dir, seed=1)  # another initial adapter: load must replace it
    assert b.weights_checksum() != a.weights_checksum()
    assert b.load(str(tmp_path / "ckpt")) == a.weights_checksum()
    a.train_step(batch, SFTObjective())
    b.train_step(batch, SFTObjective())
    assert all(torch.equal(p, _adapter(b)[n]) for n, p in _adapter(a).items())  # Adam moments restored too


def test_final_model_is_saved_merged_and_as_the_adapter(tiny_model_dir, tmp_path):
    trainer = _lora_trainer(tiny_model_dir)
    _perturb_adapter(trainer)
    files = trainer.save_pretrained(str(tmp_path / "final"))
    assert "model.safetensors" in files and "adapter/adapter_model.safetensors" in files
    base, merged = load_file(f"{tiny_model_dir}/model.safetensors"), load_file(str(tmp_path / "final/model.safetensors"))
    adapter = load_file(str(tmp_path / "final/adapter/adapter_model.safetensors"))
    assert set(merged) == set(base)
    scaling = LORA["alpha"] / LORA["r"]
    for name, weight in merged.items():
        layer = name.removesuffix(".weight")
        a_key, b_key = f"base_model.model.{layer}.lora_A.weight", f"base_model.model.{layer}.lora_B.weight"
        if a_key in adapter:  # an adapted layer: W_base + (alpha / r) · B @ A, by hand
            assert torch.allclose(weight, base[name] + scaling * adapter[b_key] @ adapter[a_key], atol=1e-6)
        else:
            assert torch.equal(weight, base[name]), name
    assert sum(".lora_A." in k for k in adapter) == 14
    reloaded = HFInferenceEngine(str(tmp_path / "final"))  # an HF model as any other
    batch = _batch(tiny_model_dir)
    assert torch.allclose(ReferenceEngine(str(tmp_path / "final")).logprobs(batch), trainer.logprobs(batch), atol=1e-5)
    assert reloaded.weights_checksum() != HFInferenceEngine(tiny_model_dir).weights_checksum()


def test_lora_is_for_the_policy_only(tiny_model_dir):
    with pytest.raises(ValueError, match="critic"):
        TorchTrainEngine(tiny_model_dir, OptimSpec(), head="value", lora=LORA)
    with pytest.raises(ValueError, match="target_modules"):
        TorchTrainEngine(tiny_model_dir, OptimSpec(), lora={**LORA, "target_modules": ["no_such_layer"]})
