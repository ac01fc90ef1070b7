"""Inference and training engines on a tiny model: logprob agreement, weight sync, save/load, SFT."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.inference.hf import HFInferenceEngine, filter_logits
from engines.training.torch import OptimSpec, TorchTrainEngine, lr_multiplier
from engines.types import SamplingParams, build_train_batch
from engines.weight_sync import load_buckets, pack_buckets, unpack_bucket, weights_checksum

PROMPTS = ["12+3=", "1+1=", "29+30=", "7+8="]


def _perturb(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)[0, 2:]).all()
    # top_p=0.7: 0.5 alone is < 0.7, 0.5+0.3 crosses it → keep two tokens, drop the rest
    kept = ~torch.isinf(filter_logits(logits, top_k=0, top_p=0.7))[0]
    assert kept.tolist() == [True, True, False, False]


def test_generation_respects_stop_and_length(tiny_model_dir):
    engine = HFInferenceEngine(tiny_model_dir)
    out = engine.generate(PROMPTS * 4, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3))
    eos = engine.tokenizer.eos_token_id
    assert out.response_ids.shape[0] == 16 and out.response_ids.shape[1] <= 5
    for i, reason in enumerate(out.finish_reasons):
        n = int(out.response_lengths[i])
        row = out.response_ids[i, :n].tolist()
        assert (reason == "stop") == (row[-1] == eos)
        assert eos not in row[:-1]  # nothing generated after a stop token
        assert (out.logprobs[i, n:] == 0).all() and (out.logprobs[i, :n] < 0).all()
    again = engine.generate(PROMPTS * 4, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3))
    assert torch.equal(again.response_ids, out.response_ids)  # seeded sampling is reproducible


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_rollout_logprobs_after_sync(tiny_model_dir, temperature):
    rollout = HFInferenceEngine(tiny_model_dir)
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(), temperature=temperature, micro_batch_size=5)
    _perturb(trainer.model)  # trainer now differs from the rollout engine …
    assert trainer.weights_checksum() != rollout.weights_checksum()
    checksum = rollout.update_weights(1, trainer.export_weights(bucket_bytes=1 << 14))  # … until the sync
    assert checksum == trainer.weights_checksum() and rollout.weights_version() == 1
    out = rollout.generate(PROMPTS * 3, SamplingParams(max_new_tokens=6, temperature=temperature, top_k=20, seed=1))
    batch = build_train_batch(out, rollout.tokenizer.pad_token_id)
    diff = (trainer.logprobs(batch) - batch.tensors["rollout_logprobs"]) * batch.loss_mask
    assert batch.loss_mask.sum() > 12
    assert diff.abs().max() < 1e-4


def test_build_train_batch_layout():
    """Each row: its prompt at [0, p), its first r sampled tokens (and their logprobs) at [p, p + r), pads after."""
    from engines.types import Rollouts

    rollouts = Rollouts(prompt_ids=[[5, 6, 7], [8], []], response_ids=torch.tensor([[11, 12, 0], [13, 14, 15], [16, 0, 0]]),
                        logprobs=-torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.4, 0.5], [0.6, 0.0, 0.0]]),
                        response_lengths=torch.tensor([2, 3, 1]), finish_reasons=["stop", "length", "stop"],
                        completions=["", "", ""], weights_version=0)
    batch = build_train_batch(rollouts, pad_token_id=9)
    assert batch.input_ids.tolist() == [[5, 6, 7, 11, 12], [8, 13, 14, 15, 9], [16, 9, 9, 9, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    expected = -torch.tensor([[0, 0, 0, 0.1, 0.2], [0, 0.3, 0.4, 0.5, 0], [0.6, 0, 0, 0, 0]])
    assert torch.allclose(batch.tensors["rollout_logprobs"], expected)


def test_bucketing_round_trip_and_checksum(tiny_model_dir):
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec())
    params = dict(trainer.model.named_parameters())
    buckets = pack_buckets(params.items(), bucket_bytes=4096)
    assert len(buckets) > 1
    assert all(b.data.nbytes <= 4096 or len(b.metas) == 1 for b in buckets)
    seen = {name: t for b in buckets for name, t in unpack_bucket(b)}
    assert set(seen) == set(params)
    assert all(torch.equal(seen[n], p.detach()) for n, p in params.items())
    other = TorchTrainEngine(tiny_model_dir, OptimSpec())
    _perturb(other.model)
    assert weights_checksum(other.model) != weights_checksum(trainer.model)
    load_buckets(other.model, buckets)
    assert weights_checksum(other.model) == weights_checksum(trainer.model)


def test_lr_schedule():
    spec = OptimSpec(warmup_steps=2, schedule="linear", total_steps=6, min_lr_ratio=0.0)
    # warmup: (s+1)/2 → 0.5, 1.0; then linear decay over the 4 remaining steps: 1 - (s-2)/4
    assert [lr_multiplier(s, spec) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]


def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_model_dir):
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20=", "3+4=", "21+9="], ["3", "30", "7", "30"])
    grads = []
    for micro in (4, 1):
        trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-3), micro_batch_size=micro)
        metrics = trainer.train_step(batch, SFTObjective())
        grads.append((metrics["sft/nll"], metrics["train/grad_norm"]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    assert grads[0][1] == pytest.approx(grads[1][1], rel=1e-4)


def test_save_load_restores_model_optimizer_scheduler_and_rng(tiny_model_dir, tmp_path):
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20="], ["3", "30"])
    spec = OptimSpec(lr=1e-3, warmup_steps=3, total_steps=10, schedule="cosine")
    a = TorchTrainEngine(tiny_model_dir, spec)
    a.train_step(batch, SFTObjective())
    files = a.save(str(tmp_path / "ckpt"))
    assert files == ["model.safetensors", "optimizer.pt", "rng.pt", "scheduler.pt"]
    torch.manual_seed(123)  # disturb the RNG; load must restore it
    b = TorchTrainEngine(tiny_model_dir, spec)
    assert b.load(str(tmp_path / "ckpt")) == a.weights_checksum()
    assert b.optimizer_steps() == a.optimizer_steps() == 1
    rng_b = torch.rand(3)
    a.load(str(tmp_path / "ckpt"))
    assert torch.equal(rng_b, torch.rand(3))
    ma, mb = a.train_step(batch, SFTObjective()), b.train_step(batch, SFTObjective())
    assert ma["train/lr"] == mb["train/lr"]
    assert a.weights_checksum() == b.weights_checksum()  # identical second step: Adam moments restored


def test_sft_lowers_the_loss(tiny_model_dir):
    torch.manual_seed(0)
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20=", "3+4=", "21+9="], ["3", "30", "7", "30"])
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=3e-3))
    first = trainer.train_step(batch, SFTObjective())["sft/nll"]
    for _ in range(30):
        last = trainer.train_step(batch, SFTObjective())["sft/nll"]
    assert last < 0.5 * first
    assert (batch.loss_mask.sum(-1) == torch.tensor([2, 3, 2, 3])).all()  # answer digits + EOS


@pytest.mark.ray
def test_actors_sync_and_agree_through_ray(tiny_model_dir, ray_cluster):
    from engines.actors import start_engine, stop_engine

    ray = ray_cluster
    rollout = start_engine("rollout/hf", run_name="t-engines", role="rollout", model_path=tiny_model_dir)
    trainer = start_engine("train/torch", run_name="t-engines", role="trainer", model_path=tiny_model_dir,
                           optim=OptimSpec(lr=1e-2))
    batch = sft_batch(tiny_model_dir, ["1+2=", "10+20="], ["3", "30"])
    ray.get(trainer.train_step.remote(batch, SFTObjective()))
    before = ray.get(rollout.weights_checksum.remote())
    checksum = ray.get(rollout.update_weights.remote(5, trainer.export_weights.remote(1 << 12)))
    assert checksum == ray.get(trainer.weights_checksum.remote()) != before
    rollout.begin_update.remote(6)  # the versioned calls one by one: an actor runs one caller's calls in order
    for bucket in ray.get(trainer.export_weights.remote(1 << 12)):
        rollout.receive.remote(bucket)
    report = ray.get(rollout.commit.remote(6))
    assert (report.version, report.checksum) == (6, checksum)
    out = ray.get(rollout.generate.remote(PROMPTS, SamplingParams(max_new_tokens=4, seed=0)))
    assert out.weights_version == 6
    built = build_train_batch(out, 0)
    lp = ray.get(trainer.logprobs.remote(built))
    assert ((lp - built.tensors["rollout_logprobs"]) * built.loss_mask).abs().max() < 1e-4
    # the frozen reference still scores with the initial weights, so it disagrees after training
    reference = start_engine("reference/torch", run_name="t-engines", role="reference", model_path=tiny_model_dir)
    ref_lp = ray.get(reference.rollout_logprobs.remote(out))
    assert ((ref_lp - built.tensors["rollout_logprobs"]) * built.loss_mask).abs().max() > 1e-3
    for handle in (rollout, trainer, reference):
        stop_engine(handle)


def test_entropy_bonus_is_the_only_gradient_when_advantages_are_zero(tiny_model_dir):
    from engines.algorithms.objective import PolicyObjective

    rollout = HFInferenceEngine(tiny_model_dir)
    out = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    batch = build_train_batch(out, rollout.tokenizer.pad_token_id)
    batch = batch.with_tensors(advantages=torch.zeros_like(batch.loss_mask),
                               old_logprobs=batch.tensors["rollout_logprobs"])
    norms = {}
    for coef in (0.0, 0.1):
        trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-3))
        norms[coef] = trainer.train_step(batch, PolicyObjective(entropy_coef=coef))["train/grad_norm"]
    assert norms[0.0] == 0.0 and norms[0.1] > 0.0


@pytest.mark.ray
def test_engines_reattach_only_when_built_from_the_same_arguments(tiny_model_dir, ray_cluster):
    from engines.actors import describe, run_actor_names, start_engine, stop_engine

    ray = ray_cluster
    args = dict(run_name="t-replace", role="trainer", model_path=tiny_model_dir, optim=OptimSpec(lr=1e-2))
    first = start_engine("train/torch", **args)
    ray.get(first.train_step.remote(sft_batch(tiny_model_dir, ["1+2="], ["3"]), SFTObjective()))
    # Same kind and arguments: the live actor itself, trained state and all (a checkpoint restore follows).
    again = start_engine("train/torch", **args)
    assert describe(again) == describe(first) and ray.get(again.optimizer_steps.remote()) == 1
    # reuse=False (a trainer that will not be restored): a fresh engine replaces the trained one.
    fresh = start_engine("train/torch", reuse=False, **args)
    assert ray.get(fresh.optimizer_steps.remote()) == 0
    fresh_id = describe(fresh)["actor_id"]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(first.optimizer_steps.remote())
    # Other arguments (the config changed): replaced too, and only one actor of the role is left.
    changed = start_engine("train/torch", **{**args, "optim": OptimSpec(lr=1e-3)})
    assert describe(changed)["actor_id"] != fresh_id
    assert len(run_actor_names("t-replace", "trainer")) == 1
    stop_engine(changed)


def test_critic_starts_at_zero_and_regresses_toward_the_returns(tiny_model_dir):
    from engines.algorithms.objective import ValueObjective

    critic = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), head="value", micro_batch_size=2)
    engine = HFInferenceEngine(tiny_model_dir)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    values = critic.rollout_values(rollouts)
    assert values.shape == build_train_batch(rollouts, 0).input_ids.shape
    assert (values == 0).all()  # zero-initialised head: no noise in the first advantages
    batch = build_train_batch(rollouts, 0)
    returns = batch.loss_mask * 0.5  # regress every response token toward 0.5
    batch = batch.with_tensors(values=values, returns=returns)
    objective = ValueObjective(clip_range=0.0)
    first = critic.train_step(batch, objective)
    for _ in range(20):
        last = critic.train_step(batch, objective)
    # 0.5 * (0 - 0.5)^2 = 0.125 at the start; the critic's metrics are under critic/.
    assert first["critic/vf_loss"] == pytest.approx(0.125, rel=1e-5)
    assert last["critic/vf_loss"] < 0.02 and "train/loss" not in last
    after = critic.rollout_values(rollouts)
    mask = batch.loss_mask.bool()
    assert abs(after[mask].mean() - 0.5) < 0.15  # from 0.5 away at the start


def test_value_clipping_bounds_the_update(tiny_model_dir):
    from engines.algorithms.objective import ValueObjective

    rollouts = HFInferenceEngine(tiny_model_dir).generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    moved = {}
    for clip_range in (0.0, 0.2):
        critic = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-3), head="value", micro_batch_size=4)
        batch = build_train_batch(rollouts, 0)
        batch = batch.with_tensors(values=critic.rollout_values(rollouts), returns=batch.loss_mask * 5.0)
        for _ in range(15):  # old values stay 0: with clipping, the gradient stops once |V - 0| > 0.2
            critic.train_step(batch, ValueObjective(clip_range=clip_range))
        moved[clip_range] = float(critic.rollout_values(rollouts)[batch.loss_mask.bool()].mean())
    # Measured: 0.95 unclipped vs 0.54 clipped (Adam's momentum carries the clipped critic a little past 0.2).
    assert moved[0.0] > 1.5 * moved[0.2] > 0


def test_trainer_rollout_logprobs_match_the_rollout_engine(tiny_model_dir):
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(), micro_batch_size=2)
    rollouts = HFInferenceEngine(tiny_model_dir).generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))
    batch = build_train_batch(rollouts, 0)
    recomputed = trainer.rollout_logprobs(rollouts)
    mask = batch.loss_mask.bool()
    assert (recomputed[mask] - batch.tensors["rollout_logprobs"][mask]).abs().max() < 1e-4


def test_trainer_adamw_matches_the_reference_loop(tiny_model_dir):
    """The trainer's (fused) AdamW takes the steps of torch's per-tensor AdamW loop, weight decay included
    (same gradients fed to both: real ones include pure-noise entries, e.g. k_proj biases, that Adam
    blows up to ±lr)."""
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2, weight_decay=0.1))
    assert trainer.optimizer.param_groups[0]["fused"]
    reference = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2, weight_decay=0.1))
    for group in reference.optimizer.param_groups:
        group["fused"], group["foreach"] = False, False
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(trainer.model.parameters(), reference.model.parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        trainer.optimizer.step()
        reference.optimizer.step()
    start = TorchTrainEngine(tiny_model_dir, OptimSpec())
    for (name, a), (_, b), c in zip(trainer.model.named_parameters(), reference.model.named_parameters(),
                                    start.model.parameters()):
        assert (a - b).abs().max() < 1e-6, name
        assert (a - c).abs().max() > 1e-3, name  # it moved
