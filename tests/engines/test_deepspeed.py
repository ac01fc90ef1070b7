"""DeepSpeed ZeRO engine (stages 1, 2, 3) on 2 CPU ranks against the single-process torch engine."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engines.algorithms.objective import PolicyObjective
from engines.training.deepspeed import zero_config
from engines.training.torch import OptimSpec, TorchTrainEngine
from engines.types import SamplingParams, build_train_batch
from engines.weight_sync import tensors_checksum, unpack_bucket

OPTIM = OptimSpec(lr=1e-3, weight_decay=0.01, grad_clip=1.0, warmup_steps=1, schedule="linear", total_steps=6)
MICRO = 5  # 12 rows: micro-batches of 5, 5, 2; rank 0 runs two, rank 1 one and a zero-weight one


def test_zero_config_from_typed_options():
    config = zero_config(zero_stage=3, micro_batch_size=4, world_size=2, grad_clip=0.5, dtype="bfloat16",
                         offload_optimizer=True, offload_params=True, param_persistence_threshold=0)
    assert config["zero_optimization"] == {
        "stage": 3, "overlap_comm": False, "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False}, "stage3_param_persistence_threshold": 0}
    assert config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 0.5
    # step() is the accumulation boundary; 4 rows per micro-batch on each of 2 ranks, one micro-batch a step
    assert config["managed_gradient_accumulation"] is False and config["train_batch_size"] == 8
    assert "offload_optimizer" not in zero_config(zero_stage=1, micro_batch_size=4, world_size=2, grad_clip=1.0,
                                                  dtype="float32")["zero_optimization"]
    with pytest.raises(ValueError, match="offload_params needs zero_stage 3"):
        zero_config(zero_stage=2, micro_batch_size=4, world_size=2, grad_clip=1.0, dtype="float32", offload_params=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        zero_config(zero_stage=1, micro_batch_size=4, world_size=2, grad_clip=1.0, dtype="float16")


@pytest.fixture(scope="module")
def policy_batch(tiny_model_dir):
    """12 sampled rows with per-row advantages and old log-probs a little off the current ones (ratios ≠ 1)."""
    from engines.inference.hf import HFInferenceEngine

    rollout = HFInferenceEngine(tiny_model_dir)
    out = rollout.generate(["12+3=", "1+1=", "29+30=", "7+8="] * 3, SamplingParams(max_new_tokens=6, seed=0))
    batch = build_train_batch(out, rollout.tokenizer.pad_token_id)
    advantages = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)) * batch.loss_mask  # [B, L]
    return batch.with_tensors(advantages=advantages, old_logprobs=batch.tensors["rollout_logprobs"] - 0.01)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, policy_batch):
    """The single-process torch engine's metrics of 4 steps and its weights after the 3rd and the 4th."""
    engine = TorchTrainEngine(tiny_model_dir, OPTIM, micro_batch_size=MICRO)
    metrics, weights = [], []
    for _ in range(4):
        metrics.append(engine.train_step(policy_batch, PolicyObjective()))
        weights.append({name: p.detach().clone() for name, p in engine.model.named_parameters()})
    return metrics, weights[2], weights[3]


def _assert_close(buckets, expected: dict[str, torch.Tensor]) -> None:
    got = {name: tensor for bucket in buckets for name, tensor in unpack_bucket(bucket)}
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert (got[name] - tensor).abs().max() < 1e-5, name


@pytest.mark.ray
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_zero_stage_trains_syncs_and_resumes_as_the_torch_engine(stage, tiny_model_dir, ray_cluster, policy_batch,
                                                                  reference, tmp_path, request):
    from engines.actors import stop_engine
    from engines.inference.hf import HFInferenceEngine
    from engines.rank_group import start_rank_group

    ray = ray_cluster
    ref_metrics, ref_after_3, ref_after_4 = reference
    # threshold 0: under ZeRO-3 every parameter is sharded, none kept whole on each rank
    args = dict(run_name=f"t-deepspeed{stage}", role="trainer", world_size=2, reuse=False, model_path=tiny_model_dir,
                optim=OPTIM, micro_batch_size=MICRO, torch_threads=1, zero_stage=stage, param_persistence_threshold=0)
    checkpoint = str(tmp_path / "ckpt")
    if stage == 1:  # one stage checkpoints to S3 (fsspec), staged through each rank's local folder
        client, aws = request.getfixturevalue("s3_server")
        client.create_bucket(Bucket="deepspeed")
        checkpoint, args["runtime_env"] = "s3://deepspeed/ckpt", {"env_vars": aws}
    group = start_rank_group("train/deepspeed", **args)
    for step in range(3):
        metrics = ray.get(group.train_step.remote(policy_batch, PolicyObjective()))
        for key in ("train/loss", "train/grad_norm", "train/lr", "actor/clipfrac"):
            assert metrics[key] == pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-7), (step, key)
    buckets = ray.get(group.export_weights.remote(1 << 14))
    assert len(buckets) > 1
    _assert_close(buckets, ref_after_3)
    checksum = ray.get(group.weights_checksum.remote())
    assert checksum == tensors_checksum(name_tensor for b in buckets for name_tensor in unpack_bucket(b))

    # a rollout engine loaded with the exported weights samples with the trainer's log-probs
    rollout = HFInferenceEngine(tiny_model_dir)
    rollout.begin_update(1)
    for bucket in buckets:
        rollout.receive(bucket)
    assert rollout.commit(1).checksum == checksum
    out = rollout.generate(["3+4=", "20+9="] * 2, SamplingParams(max_new_tokens=5, seed=1))
    sampled = build_train_batch(out, rollout.tokenizer.pad_token_id)
    trainer_logprobs = ray.get(group.logprobs.remote(sampled))
    assert ((trainer_logprobs - sampled.tensors["rollout_logprobs"]) * sampled.loss_mask).abs().max() < 1e-4
    # shared memory: rank 0 holds the whole model under ZeRO-1/2; under ZeRO-3 the sync falls back to buckets
    shared = ray.get(group.export_shared.remote(2))
    assert (shared is None) == (stage == 3)
    if shared is not None:
        assert rollout.update_weights_shared(shared) == checksum
    assert ray.get(group.exported_checksum.remote()) == checksum
    # the HF export from rank 0 holds the whole model
    assert "model.safetensors" in ray.get(group.save_pretrained.remote(str(tmp_path / "hf")))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    _assert_close(buckets, {name: exported[name] for name in ref_after_3})

    # save, one more step; a fresh group loads the checkpoint and takes the same step to the same weights
    files = ray.get(group.save.remote(checkpoint))
    assert any("zero_pp_rank_1" in name for name in files) and "rng/rank_1.pt" in files
    ray.get(group.train_step.remote(policy_batch, PolicyObjective()))
    uninterrupted = ray.get(group.weights_checksum.remote())
    _assert_close(ray.get(group.export_weights.remote(1 << 20)), ref_after_4)
    fresh = start_rank_group("train/deepspeed", **args)  # replaces the group's actors
    assert ray.get(fresh.load.remote(checkpoint)) == checksum
    assert ray.get(fresh.optimizer_steps.remote()) == 3
    resumed = ray.get(fresh.train_step.remote(policy_batch, PolicyObjective()))
    assert resumed["train/lr"] == ref_metrics[3]["train/lr"]
    assert ray.get(fresh.weights_checksum.remote()) == uninterrupted
    # the 2 ranks' checkpoint loads into 1 rank (through DeepSpeed's universal checkpoint) and goes on alike
    single = start_rank_group("train/deepspeed", **{**args, "world_size": 1})
    ray.get(single.load.remote(checkpoint))
    assert ray.get(single.optimizer_steps.remote()) == 3
    ray.get(single.train_step.remote(policy_batch, PolicyObjective()))
    _assert_close(ray.get(single.export_weights.remote(1 << 20)), ref_after_4)
    stop_engine(single)


@pytest.mark.ray
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_steps_fp32_masters_as_the_torch_engine(stage, tiny_model_dir, ray_cluster, policy_batch):
    """dtype bfloat16: DeepSpeed computes in bf16 and steps fp32 master shards, as the torch engine steps its
    fp32 masters. Gradients are computed and summed in bf16 in another order than one process's, so they
    agree to bf16 precision, not bit for bit: per step the loss and gradient norm within 1%, and after 2
    steps each bf16 weight within two rounding steps (one is at most 2^-7 of a weight: 8 significant bits)
    plus Adam's step of ±lr per step for a weight whose gradient is rounding noise, whose sign either side
    may take."""
    from engines.actors import stop_engine
    from engines.rank_group import start_rank_group

    ray = ray_cluster
    reference = TorchTrainEngine(tiny_model_dir, OPTIM, dtype="bfloat16", micro_batch_size=MICRO)
    group = start_rank_group("train/deepspeed", run_name=f"t-deepspeed-bf16-{stage}", role="trainer", world_size=2,
                             reuse=False, model_path=tiny_model_dir, optim=OPTIM, dtype="bfloat16",
                             micro_batch_size=MICRO, torch_threads=1, zero_stage=stage)
    for step in range(2):
        expected = reference.train_step(policy_batch, PolicyObjective())
        metrics = ray.get(group.train_step.remote(policy_batch, PolicyObjective()))
        for key in ("train/loss", "train/grad_norm"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-2), (step, key)
    got = {name: t for b in ray.get(group.export_weights.remote(1 << 20)) for name, t in unpack_bucket(b)}
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    for name, p in reference.model.named_parameters():
        a, b = got[name].float(), p.detach().float()
        assert ((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2**-6 + 2 * OPTIM.lr).all(), name
    stop_engine(group)
