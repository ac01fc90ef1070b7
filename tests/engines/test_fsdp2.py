"""The FSDP2 train engine on 2 ranks (Ray actors, gloo) against the single-process torch engine on the same
data: weights, metrics, weight sync into an HF rollout engine, checkpoints across rank counts, offload."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms.objective import PolicyObjective
from engines.inference.hf import HFInferenceEngine
from engines.training.torch import OptimSpec, TorchTrainEngine
from engines.types import SamplingParams, build_train_batch
from engines.weight_sync import unpack_bucket

pytestmark = pytest.mark.ray

PROMPTS = ["12+3=", "1+1=", "29+30=", "7+8=", "3+4="]
OPTIM = OptimSpec(lr=1e-2, warmup_steps=2, schedule="cosine", total_steps=10)
OBJECTIVE = PolicyObjective(entropy_coef=0.01)
METRICS = ("train/loss", "actor/pg_loss", "train/grad_norm", "train/lr")


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    """5 sampled rows with advantages of both signs: a policy-gradient batch."""
    rollout = HFInferenceEngine(tiny_model_dir)
    out = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    built = build_train_batch(out, rollout.tokenizer.pad_token_id)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7])[:, None] * built.loss_mask
    return built.with_tensors(advantages=advantages, old_logprobs=built.tensors["rollout_logprobs"])


def _group(ray_cluster, tiny_model_dir, role: str, world_size: int = 2, micro_batch_size: int = 2, env=None,
           **kwargs):
    from engines.rank_group import start_rank_group

    where = {"runtime_env": {"env_vars": env}} if env else {}
    return start_rank_group("train/fsdp2", run_name="t-fsdp2", role=role, world_size=world_size, reuse=False,
                            model_path=tiny_model_dir, optim=OPTIM, micro_batch_size=micro_batch_size,
                            torch_threads=1, **where, **kwargs)


def _stop(group) -> None:
    import ray

    for handle in group.ranks:
        ray.kill(handle, no_restart=True)


def _exported(group) -> dict[str, torch.Tensor]:
    import ray

    return {name: t.clone() for b in ray.get(group.export_weights.remote(1 << 14)) for name, t in unpack_bucket(b)}


def _assert_same_step(metrics: dict, weights: dict, expected_metrics: dict, expected_weights: dict) -> None:
    """The same step up to float rounding: metrics within 1e-6 relative, every weight within 1e-6."""
    assert [metrics[k] for k in METRICS] == pytest.approx([expected_metrics[k] for k in METRICS], rel=1e-6)
    assert max((weights[name] - t).abs().max() for name, t in expected_weights.items()) < 1e-6


@pytest.mark.parametrize(("micro_batch_size", "gradient_checkpointing"), [(2, False), (8, True)])
def test_two_ranks_train_as_the_torch_engine_and_sync_into_a_rollout_engine(ray_cluster, tiny_model_dir, batch,
                                                                            micro_batch_size, gradient_checkpointing):
    """5 rows in micro-batches of 2: 3 micro-batches, rank 0 computes two and rank 1 one (plus a zero-weight
    one); of 8: one micro-batch, rank 1 computes only the zero-weight one. Either way the step is the batch's:
    the same loss, gradient norm (summed over ranks, not averaged: Adam alone would hide a factor of 2) and
    weights as one process, also when the blocks recompute their activations in the backward pass."""
    ray = ray_cluster
    reference = TorchTrainEngine(tiny_model_dir, OPTIM, micro_batch_size=micro_batch_size)
    group = _group(ray_cluster, tiny_model_dir, "trainer", micro_batch_size=micro_batch_size,
                   gradient_checkpointing=gradient_checkpointing)
    try:
        for _ in range(3):
            expected = reference.train_step(batch, OBJECTIVE)
            got = ray.get(group.train_step.remote(batch, OBJECTIVE))
            for key in METRICS:
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        weights = _exported(group)
        params = dict(reference.model.named_parameters())
        assert set(weights) == set(params)
        start = TorchTrainEngine(tiny_model_dir, OPTIM)
        for name, param in start.model.named_parameters():
            assert (weights[name] - params[name]).abs().max() < 1e-5, name
            assert (weights[name] - param).abs().max() > 1e-3, name  # it trained
        if micro_batch_size != 2:
            return
        # the synced rollout engine holds the trainer's weights and scores as the trainer does
        checksum = ray.get(group.weights_checksum.remote())
        rollout = HFInferenceEngine(tiny_model_dir)
        rollout.begin_update(1)
        for bucket in ray.get(group.export_weights.remote(1 << 14)):
            rollout.receive(bucket)
        assert rollout.commit(1).checksum == checksum
        out = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))
        built = build_train_batch(out, 0)
        trainer_logprobs = ray.get(group.logprobs.remote(built))
        assert ((trainer_logprobs - built.tensors["rollout_logprobs"]) * built.loss_mask).abs().max() < 1e-4
        assert built.loss_mask.sum() > 10
        # the same weights through shared memory: rank 0 writes them, hashing as it copies
        fresh = HFInferenceEngine(tiny_model_dir)
        shared = ray.get(group.export_shared.remote(2))
        assert ray.get(group.exported_checksum.remote()) == checksum
        assert fresh.update_weights_shared(shared) == checksum
        ray.get(group.close.remote())
    finally:
        _stop(group)


def test_checkpoint_of_two_ranks_resumes_exactly_on_one_and_on_two(ray_cluster, tiny_model_dir, batch, tmp_path):
    """Save after one step, then a second step; a fresh 2-rank group loaded from the checkpoint takes the same
    second step bit for bit (weights, Adam moments, LR schedule in warmup, RNG restored), a 1-rank group the
    same up to float rounding. Offload/reload keeps every weight; the HF export holds the trained weights."""
    ray = ray_cluster
    uri = str(tmp_path / "ckpt")
    group = _group(ray_cluster, tiny_model_dir, "trainer")
    try:
        ray.get(group.train_step.remote(batch, OBJECTIVE))
        files = ray.get(group.save.remote(uri))
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "engine_state.pt"]
        saved = ray.get(group.weights_checksum.remote())
        ray.get(group.offload.remote())
        ray.get(group.reload.remote())
        assert ray.get(group.weights_checksum.remote()) == saved
        second = ray.get(group.train_step.remote(batch, OBJECTIVE))
        after, continued = ray.get(group.weights_checksum.remote()), _exported(group)
        hf_files = ray.get(group.save_pretrained.remote(str(tmp_path / "hf")))
        assert "model.safetensors" in hf_files
    finally:
        _stop(group)
    exported = TorchTrainEngine(str(tmp_path / "hf"), OPTIM)  # the HF export: the trained weights, whole
    assert exported.weights_checksum() == after
    for world_size in (1, 2):
        resumed = _group(ray_cluster, tiny_model_dir, f"resumed{world_size}", world_size=world_size)
        try:
            assert ray.get(resumed.load.remote(uri)) == saved
            assert ray.get(resumed.optimizer_steps.remote()) == 1
            again = ray.get(resumed.train_step.remote(batch, OBJECTIVE))
            if world_size == 2:  # the same ranks summing in the same order: bit for bit
                assert [again[k] for k in METRICS] == [second[k] for k in METRICS]
                assert ray.get(resumed.weights_checksum.remote()) == after
            else:  # one rank sums the micro-batches' gradients in another order: float rounding apart
                _assert_same_step(again, _exported(resumed), second, continued)
        finally:
            _stop(resumed)


def test_checkpoint_of_one_rank_on_s3_resumes_on_two(ray_cluster, tiny_model_dir, batch, s3_server):
    """A 1-rank checkpoint written to S3 (fsspec) loads into 2 ranks, which take the same next step."""
    ray = ray_cluster
    client, aws = s3_server
    client.create_bucket(Bucket="fsdp2")
    uri = "s3://fsdp2/ckpt"
    single = _group(ray_cluster, tiny_model_dir, "single", world_size=1, env=aws)
    try:
        ray.get(single.train_step.remote(batch, OBJECTIVE))
        assert ray.get(single.save.remote(uri)) == [".metadata", "__0_0.distcp", "engine_state.pt"]
        saved = ray.get(single.weights_checksum.remote())
        second = ray.get(single.train_step.remote(batch, OBJECTIVE))
        continued = _exported(single)
    finally:
        _stop(single)
    resumed = _group(ray_cluster, tiny_model_dir, "from-s3", env=aws)
    try:
        assert ray.get(resumed.load.remote(uri)) == saved
        again = ray.get(resumed.train_step.remote(batch, OBJECTIVE))
        _assert_same_step(again, _exported(resumed), second, continued)
    finally:
        _stop(resumed)


def test_bf16_computes_in_bf16_and_steps_fp32_masters(ray_cluster, tiny_model_dir, batch, tmp_path):
    """dtype bfloat16: forward and backward in bf16, fp32 shards stepped (the torch engine's fp32 masters), bf16
    weights exported and saved. Gradients are summed in another order than one process's, so the bf16
    weights agree within one rounding step of the largest (|w| < 0.5: 2^-9), not bit for bit."""
    import json

    ray = ray_cluster
    reference = TorchTrainEngine(tiny_model_dir, OPTIM, micro_batch_size=2, dtype="bfloat16")
    group = _group(ray_cluster, tiny_model_dir, "bf16", dtype="bfloat16")
    try:
        for _ in range(3):
            expected = reference.train_step(batch, OBJECTIVE)
            got = ray.get(group.train_step.remote(batch, OBJECTIVE))
            assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-2)
        weights = _exported(group)
        for name, param in reference.model.named_parameters():
            assert weights[name].dtype == torch.bfloat16
            assert (weights[name].float() - param.float()).abs().max() <= 2**-9, name
        ray.get(group.save_pretrained.remote(str(tmp_path / "hf")))
    finally:
        _stop(group)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_critic_on_two_ranks_regresses_toward_the_returns(ray_cluster, tiny_model_dir, batch):
    """head="value": the value head sits in the FSDP root. Values start at 0 (zero-initialised head) and move
    toward the returns. (Not compared with the torch critic step by step: the token-classification head
    applies dropout while training, so its steps depend on each process's RNG.)"""
    from engines.algorithms.objective import ValueObjective

    ray = ray_cluster
    rollouts = HFInferenceEngine(tiny_model_dir).generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    group = _group(ray_cluster, tiny_model_dir, "critic", head="value")
    try:
        assert (ray.get(group.rollout_values.remote(rollouts)) == 0).all()
        values = batch.with_tensors(values=torch.zeros_like(batch.loss_mask), returns=batch.loss_mask * 0.5)
        losses = [ray.get(group.train_step.remote(values, ValueObjective(clip_range=0.0)))["critic/vf_loss"]
                  for _ in range(4)]
        assert losses[0] == pytest.approx(0.125, rel=1e-5)  # 0.5 * (0 - 0.5)^2 on every response token
        assert losses[-1] < 0.5 * losses[0]
        after = ray.get(group.rollout_values.remote(rollouts))
        mask = build_train_batch(rollouts, 0).loss_mask.bool()
        assert after[mask].mean() > 0.1  # from 0 toward 0.5
    finally:
        _stop(group)
