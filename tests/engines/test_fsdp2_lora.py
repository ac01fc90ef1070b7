"""LoRA on the FSDP2 train engine (2 ranks, gloo) against the single-process torch engine with the same adapter:
the trained adapter, the adapter-only sync into an HF rollout engine, the frozen base as the KL reference,
adapter-only checkpoints and the merged + adapter export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import tasks.sync
from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.inference.hf import HFInferenceEngine
from engines.training.lora import adapter_checksum, scalings
from engines.training.torch import OptimSpec, ReferenceEngine, TorchTrainEngine
from engines.types import SamplingParams, build_train_batch
from engines.weight_sync import unpack_bucket

pytestmark = pytest.mark.ray

OPTIM = OptimSpec(lr=1e-2)
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
PROMPTS = ["12+3=", "1+1=", "29+30=", "7+8="]


def _adapter(update) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in update.buckets for name, t in unpack_bucket(bucket)}


def _value(get, ref):
    import ray

    return get(ref) if isinstance(ref, ray.ObjectRef) else ref


def train_alike(group, reference, batch) -> dict[str, torch.Tensor]:
    """3 SFT steps of a LoRA ``group`` and of the single-process ``reference`` on ``batch``: equal grad norms
    (rel 1e-5) and adapters (within 1e-5; every B trained off 0). Returns the group's adapter."""
    import ray

    for _ in range(3):
        expected = reference.train_step(batch, SFTObjective())
        got = ray.get(group.train_step.remote(batch, SFTObjective()))
        assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    adapter, expected_adapter = _adapter(ray.get(group.export_adapter.remote(1))), dict(reference._adapter_tensors())
    assert set(adapter) == set(expected_adapter) and len(adapter) == 2 * 4 * 2  # A, B of 4 layers in 2 blocks
    for name, tensor in expected_adapter.items():
        assert (adapter[name] - tensor).abs().max() < 1e-5, name
        if ".lora_B." in name:
            assert tensor.abs().max() > 1e-3, name  # it trained (B starts at 0)
    return adapter


def sync_and_score(group, model_dir: str, monkeypatch) -> tuple[str, "_Local"]:
    """The sync task from a LoRA ``group`` into a local HF rollout engine (the base once, then the adapter), then
    checks that the engine samples tokens the trainer scores alike (within 1e-4), that the trainer's reference
    log-probs are the base model's and that its adapter is on again after them; returns the sync's checksum
    and the rollout engine."""
    import ray

    real_get = ray.get  # the local rollout engine returns values, the group refs
    monkeypatch.setattr(ray, "get", lambda r: [_value(real_get, x) for x in r] if isinstance(r, list) else _value(real_get, r))
    rollout = _Local(HFInferenceEngine(model_dir))
    checksum = tasks.sync.sync_weights.fn(group, [rollout], 1, 1, adapter=True)
    out = rollout.engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=4, seed=1))
    built = build_train_batch(out, 0)
    trainer_logprobs = ray.get(group.logprobs.remote(built))
    assert built.loss_mask.sum() > 10
    assert ((trainer_logprobs - built.tensors["rollout_logprobs"]) * built.loss_mask).abs().max() < 1e-4
    base_logprobs = ReferenceEngine(model_dir).logprobs(built)
    assert (ray.get(group.reference_logprobs.remote(built)) - base_logprobs).abs().max() < 1e-5
    assert (trainer_logprobs - base_logprobs).abs().max() > 1e-3  # the adapter is on again after it
    return checksum, rollout


class _Local:
    """A local engine behind ``tasks.sync``'s ``engine.method.remote(...)``, taking the group's refs as Ray would."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        import ray

        def remote(*args):
            return getattr(self.engine, name)(*[ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args])

        return type("Method", (), {"remote": staticmethod(remote)})


def test_two_ranks_train_the_torch_engines_adapter_and_sync_it(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    """5 rows in micro-batches of 2 (rank 0 computes two, rank 1 one and a zero-weight one): 3 steps leave the
    adapter where one process leaves it (the base untouched: the base export is the checkpoint's). The sync
    task sends the base, then the adapter; the rollout engine then reports the trainer's checksum and scores as
    the trainer does. The reference log-probs are the base model's. A checkpoint holds only the adapter and its
    optimizer state and resumes the next step bit for bit; the final export is the torch engine's."""
    from engines.rank_group import start_rank_group

    ray = ray_cluster
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20=", "3+4=", "21+9=", "5+5="], ["3", "30", "7", "30", "10"])
    reference = TorchTrainEngine(tiny_model_dir, OPTIM, micro_batch_size=2, lora=LORA)
    group = start_rank_group("train/fsdp2", run_name="t-fsdp2-lora", role="trainer", world_size=2, reuse=False,
                             model_path=tiny_model_dir, optim=OPTIM, micro_batch_size=2, torch_threads=1, lora=LORA)
    try:
        adapter = train_alike(group, reference, batch)
        base = {name: t for b in ray.get(group.export_weights.remote(1 << 14)) for name, t in unpack_bucket(b)}
        checkpoint = load_file(f"{tiny_model_dir}/model.safetensors")
        assert all(torch.equal(t, checkpoint[name].to(t.dtype)) for name, t in base.items())  # HF names, untouched
        # the sync task: the base once, then the adapter; the rollout engine holds what the trainer holds
        checksum, rollout = sync_and_score(group, tiny_model_dir, monkeypatch)
        # the torch engine's checksum of the same base (hashed once) and of the 2-rank adapter (not bit-equal to its own)
        assert checksum == adapter_checksum(reference._lora_base_checksum(), list(adapter.items()), scalings(reference.model))
        assert rollout.engine.weights_checksum() == checksum != reference.weights_checksum()
        # checkpoint: the adapter and its Adam moments, not the base; the next step resumes bit for bit
        import torch.distributed.checkpoint as dcp

        ray.get(group.save.remote(str(tmp_path / "ckpt")))
        keys = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
        model_keys = [k for k in keys if k.startswith("model.")]
        assert [k for k in model_keys if ".lora_" not in k] == [] and len(model_keys) == 16
        assert any(k.startswith("optim.state.") and ".lora_A." in k and k.endswith("exp_avg") for k in keys)
        saved = ray.get(group.weights_checksum.remote())
        ray.get(group.train_step.remote(batch, SFTObjective()))
        after = ray.get(group.weights_checksum.remote())
        assert ray.get(group.load.remote(str(tmp_path / "ckpt"))) == saved
        ray.get(group.train_step.remote(batch, SFTObjective()))
        assert ray.get(group.weights_checksum.remote()) == after
        # final export: merged and the adapter, as the torch engine writes them after the same 4 steps
        reference.train_step(batch, SFTObjective())
        files = ray.get(group.save_pretrained.remote(str(tmp_path / "final")))
        assert "model.safetensors" in files and "adapter/adapter_model.safetensors" in files
        ray.get(group.close.remote())
    finally:
        for handle in group.ranks:
            ray.kill(handle, no_restart=True)
    reference.save_pretrained(str(tmp_path / "expected"))
    for path in ("model.safetensors", "adapter/adapter_model.safetensors"):
        got, expected = load_file(str(tmp_path / "final" / path)), load_file(str(tmp_path / "expected" / path))
        assert set(got) == set(expected), path
        assert max((got[k] - v).abs().max() for k, v in expected.items()) < 1e-5, path
