"""Where engines run (engines.models.engine_device and the ``device`` argument), the attention kernel and
gradient checkpointing options, and the CUDA IPC weight path's answers off CUDA. The same paths run on a
GPU in tests/gpu/."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import engines.models as models
from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.inference.hf import HFInferenceEngine
from engines.training.torch import OptimSpec, ReferenceEngine, TorchTrainEngine
from engines.types import SamplingParams, build_train_batch
from engines.weight_sync_cuda import CudaWeights

PROMPTS, TARGETS = ["12+3=", "1+1=", "29+30=", "7+8="], ["15", "2", "59", "15"]


def _fake_ray(monkeypatch, gpu_ids, initialized=True):
    """A ``ray`` module as an actor sees it: initialized, with ``gpu_ids`` assigned."""
    fake = types.SimpleNamespace(is_initialized=lambda: initialized, get_gpu_ids=lambda: list(gpu_ids))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(models, "_warned_no_cuda", False)


def test_engine_device_is_cpu_without_ray_or_without_assigned_gpus(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert models.engine_device() == torch.device("cpu")  # no Ray in this process: a plain object
    _fake_ray(monkeypatch, [0], initialized=False)
    assert models.engine_device() == torch.device("cpu")  # Ray imported but not started here
    _fake_ray(monkeypatch, [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.engine_device() == torch.device("cpu")  # an actor with num_gpus=0, on a GPU node


def test_engine_device_is_the_first_visible_gpu_when_ray_assigned_one(monkeypatch):
    _fake_ray(monkeypatch, [3])  # Ray's GPU 3 is this actor's CUDA_VISIBLE_DEVICES, so cuda:0 here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.engine_device() == torch.device("cuda", 0)


def test_assigned_gpus_without_cuda_stay_on_cpu_and_warn_once(monkeypatch):
    _fake_ray(monkeypatch, [0, 1])  # GPUs declared to a CPU-only Ray (the placement tests)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert models.engine_device() == torch.device("cpu")
        assert models.engine_device() == torch.device("cpu")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "[0, 1]" in messages[0]


def test_every_engine_puts_its_model_and_master_weights_on_its_device(tiny_model_dir):
    """``meta`` stands for a device other than the CPU: anything left behind would show as ``cpu``."""
    engines = [HFInferenceEngine(tiny_model_dir, device="meta"), ReferenceEngine(tiny_model_dir, device="meta"),
               TorchTrainEngine(tiny_model_dir, OptimSpec(), dtype="bfloat16", device="meta"),
               TorchTrainEngine(tiny_model_dir, OptimSpec(), head="value", device="meta")]
    for engine in engines:
        assert engine.device == torch.device("meta")
        assert {t.device.type for t in [*engine.model.parameters(), *engine.model.buffers()]} == {"meta"}
    trainer = engines[2]
    assert trainer.master is not None and {m.device.type for m in trainer.master.params} == {"meta"}


def test_batches_move_whole_to_a_device(tiny_model_dir):
    batch = sft_batch(tiny_model_dir, PROMPTS, TARGETS)
    batch = batch.to("cpu").with_tensors(advantages=torch.ones(batch.input_ids.shape))
    batch = dataclasses.replace(batch, group_ids=torch.tensor([0, 0, 1, 1]))
    moved = batch.to("meta")
    tensors = [moved.input_ids, moved.attention_mask, moved.loss_mask, moved.turn_index, moved.group_ids,
               *moved.tensors.values()]
    assert {t.device.type for t in tensors} == {"meta"} and len(tensors) == 6


def _generate_and_score(model_dir, attn):
    rollout = HFInferenceEngine(model_dir, attn_implementation=attn)
    trainer = TorchTrainEngine(model_dir, OptimSpec(), attn_implementation=attn, micro_batch_size=4)
    out = rollout.generate(PROMPTS * 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=2))
    batch = build_train_batch(out, rollout.tokenizer.pad_token_id)
    return rollout, trainer, out, trainer.logprobs(batch) * batch.loss_mask


def test_attn_implementation_reaches_every_model_and_keeps_the_logprobs(tiny_model_dir):
    eager = _generate_and_score(tiny_model_dir, "eager")
    sdpa = _generate_and_score(tiny_model_dir, "sdpa")
    for engine in eager[:2]:
        assert engine.model.config._attn_implementation == "eager"
    assert sdpa[0].model.config._attn_implementation == "sdpa"
    assert ReferenceEngine(tiny_model_dir, attn_implementation="eager").model.config._attn_implementation == "eager"
    # the same sampling seed draws the same tokens when the two kernels' probabilities agree to ~1e-7
    assert torch.equal(eager[2].response_ids, sdpa[2].response_ids)
    assert (eager[2].logprobs - sdpa[2].logprobs).abs().max() < 1e-5  # rollout engine (KV-cache decoding)
    assert (eager[3] - sdpa[3]).abs().max() < 1e-5  # trainer (packed rows, shared prompts: a 4-D mask)
    assert eager[3].abs().sum() > 0


def _checkpointed_step(model_dir, enabled):
    """One SFT step; returns the loss, each parameter's gradient and weights, and how often layer 0's MLP ran."""
    trainer = TorchTrainEngine(model_dir, OptimSpec(lr=1e-3), micro_batch_size=2, gradient_checkpointing=enabled)
    calls, mlp = [], trainer.model.model.layers[0].mlp
    forward = mlp.forward  # counted by wrapping: module hooks do not fire when a checkpoint recomputes
    mlp.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    metrics = trainer.train_step(sft_batch(model_dir, PROMPTS, TARGETS), SFTObjective())
    named = list(trainer.model.named_parameters())
    return (metrics["train/loss"], {n: p.grad.clone() for n, p in named}, {n: p.detach().clone() for n, p in named},
            len(calls), trainer.model)


def test_gradient_checkpointing_recomputes_and_gives_the_same_step(tiny_model_dir):
    loss, grads, weights, calls, _ = _checkpointed_step(tiny_model_dir, False)
    loss_ckpt, grads_ckpt, weights_ckpt, calls_ckpt, model = _checkpointed_step(tiny_model_dir, True)
    # 4 rows in micro-batches of 2: layer 0 runs twice; checkpointed, once more in each backward
    assert (calls, calls_ckpt) == (2, 4)
    assert model.config.use_cache is False
    assert abs(loss - loss_ckpt) < 1e-6
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(weights_ckpt[name], weights[name], rtol=0, atol=1e-6)


def test_cuda_ipc_sync_answers_none_off_cuda(tiny_model_dir):
    """On CPU the trainer exports no handles, and a rollout engine not on CUDA declines any, so the caller
    falls back to shared memory or buckets; the engine's weights and version stay as they were."""
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec())
    rollout = HFInferenceEngine(tiny_model_dir)
    assert trainer.export_cuda_ipc(1) is None
    before = rollout.weights_checksum()
    assert rollout.update_weights_cuda_ipc(None) is None
    handles = CudaWeights(1, "local", "GPU-0", 0, "token", (), "checksum", (None, ()))
    assert rollout.update_weights_cuda_ipc(handles) is None
    assert rollout.weights_version() == 0 and rollout.weights_checksum() == before


def test_weight_sync_runs_without_xxhash_and_ray():
    """The bare GPU host of tests/gpu/run.sh may lack both: checksums fall back to BLAKE2b-128 through the
    same calls, marked so they are never taken for XXH3 ones, and the node is "local"."""
    script = """
import sys
sys.modules["xxhash"] = None  # an import of either raises ImportError
sys.modules["ray"] = None
import torch
from engines.weight_sync import node_id, tensors_checksum
print(node_id(), tensors_checksum([("w", torch.arange(4, dtype=torch.int32))]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2]).stdout.split()
    # by hand: the combined digest hashes "name:dtype:shape:" then the tensor's own 16-byte digest
    data = torch.arange(4, dtype=torch.int32).numpy().tobytes()
    inner = hashlib.blake2b(data, digest_size=16).digest()
    expected = "blake2b:" + hashlib.blake2b(b"w:torch.int32:(4,):" + inner, digest_size=16).hexdigest()
    assert out == ["local", expected]
