"""LoRA on the DeepSpeed ZeRO engine (2 ranks, gloo) against the single-process torch engine with the same
adapter: the trained adapter, the adapter-only sync into an HF rollout engine, the frozen base as the KL
reference, adapter-only checkpoints resumed by a fresh group, and the merged + adapter export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp2_lora import LORA, OPTIM, sync_and_score, train_alike

from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.training.torch import TorchTrainEngine

pytestmark = pytest.mark.ray


@pytest.mark.slow  # kept out of the default suite: ZeRO (test_deepspeed) and LoRA on ranks (test_fsdp2_lora) are in it
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_trains_the_torch_engines_adapter_syncs_and_resumes(stage, ray_cluster, tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    """5 rows in micro-batches of 2 (rank 0 computes two, rank 1 one and a zero-weight one): 3 steps leave the
    adapter where one process leaves it. The sync task sends the base, then the adapter; the rollout engine
    then reports the trainer's checksum and scores as the trainer does. The reference log-probs are the base
    model's. The checkpoint holds the adapter and its Adam moments, not the base, and a fresh group resumes
    from it bit for bit. The final export is the torch engine's."""
    from engines.actors import stop_engine
    from engines.rank_group import start_rank_group

    ray = ray_cluster
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20=", "3+4=", "21+9=", "5+5="], ["3", "30", "7", "30", "10"])
    reference = TorchTrainEngine(tiny_model_dir, OPTIM, micro_batch_size=2, lora=LORA)
    # threshold 0: under ZeRO-3 every parameter (the adapter's too) is sharded, none kept whole on each rank
    args = dict(run_name=f"t-deepspeed{stage}-lora", role="trainer", world_size=2, reuse=False,
                model_path=tiny_model_dir, optim=OPTIM, micro_batch_size=2, torch_threads=1, zero_stage=stage,
                param_persistence_threshold=0, lora=LORA)
    group = start_rank_group("train/deepspeed", **args)
    train_alike(group, reference, batch)

    # the sync task: the base once, then the adapter; the rollout engine holds what the trainer holds
    checksum, rollout = sync_and_score(group, tiny_model_dir, monkeypatch)
    assert checksum == ray.get(group.weights_checksum.remote()) == rollout.engine.weights_checksum()

    # checkpoint: the adapter (module state: its 16 tensors, no base) and its optimizer state (the ranks' fp32
    # partitions of weights, exp_avg and exp_avg_sq: 3 × the adapter's 4,352 elements, 2 blocks of q: A [4, 64] +
    # B [64, 4], v: A [4, 64] + B [32, 4], o: A [4, 64] + B [64, 4], down: A [4, 128] + B [64, 4])
    ray.get(group.save.remote(str(tmp_path / "ckpt")))
    saved_dir = tmp_path / "ckpt" / "deepspeed" / "zero"
    module = torch.load(next(saved_dir.glob("*model_states.pt")), weights_only=False, map_location="cpu")["module"]
    assert sorted(module) == sorted(f"model.{name}" for name, _ in reference._trained_parameters())
    numel = sum(p.numel() for _, p in reference._trained_parameters())
    assert numel == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4 + 4 * 64 + 64 * 4 + 4 * 128 + 64 * 4) == 4352
    optim = [torch.load(path, weights_only=False, map_location="cpu") for path in saved_dir.glob("*optim_states.pt")]
    assert len(optim) == 2 and 3 * numel <= sum(_numel(o["optimizer_state_dict"]) for o in optim) < 3 * numel + 64
    saved = ray.get(group.weights_checksum.remote())
    ray.get(group.train_step.remote(batch, SFTObjective()))
    after = ray.get(group.weights_checksum.remote())
    files = ray.get(group.save_pretrained.remote(str(tmp_path / "final")))
    assert "model.safetensors" in files and "adapter/adapter_model.safetensors" in files
    fresh = start_rank_group("train/deepspeed", **args)  # replaces the group's actors
    assert ray.get(fresh.load.remote(str(tmp_path / "ckpt"))) == saved
    ray.get(fresh.train_step.remote(batch, SFTObjective()))
    assert ray.get(fresh.weights_checksum.remote()) == after
    stop_engine(fresh)

    # final export: merged and the adapter, as the torch engine writes them after the same 4 steps
    reference.train_step(batch, SFTObjective())
    reference.save_pretrained(str(tmp_path / "expected"))
    for path in ("model.safetensors", "adapter/adapter_model.safetensors"):
        got, expected = load_file(str(tmp_path / "final" / path)), load_file(str(tmp_path / "expected" / path))
        assert set(got) == set(expected), path
        assert max((got[k] - v).abs().max() for k, v in expected.items()) < 1e-5, path


def _numel(state) -> int:
    """Tensor elements anywhere in a (nested) optimizer state."""
    if torch.is_tensor(state):
        return state.numel()
    if isinstance(state, dict):
        return sum(_numel(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_numel(v) for v in state)
    return 0
