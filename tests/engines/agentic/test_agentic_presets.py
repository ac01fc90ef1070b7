"""Every ``configs/agentic/*.yaml`` preset runs: its tiny model's tokenizer (trained on the environment's
own text) covers the observations, its limits leave room for the episodes, its env worker collects a
batch, and the warm start's rows encode with loss on the actions only."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs.loader import PRESETS_DIR, load_config

PRESETS = sorted((PRESETS_DIR / "agentic").glob("*.yaml"))


def test_the_issue_presets_exist():
    assert {"corridor.yaml", "frozenlake.yaml", "sokoban.yaml", "calculator.yaml"} <= {p.name for p in PRESETS}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_collects_episodes_with_its_own_tiny_model(path: Path, tmp_path):
    from engines.agentic.rollout import EpisodeSpec
    from engines.agentic.worker import EnvWorker
    from engines.data.chat import encode_sft, plain_render
    from engines.inference.hf import HFInferenceEngine
    from engines.models import TinyModelSpec, build_tiny_model, load_tokenizer
    from flows.agentic import rollout_settings, training_specs
    from flows.pipeline import tokenizer_texts
    from flows.supervised import stage_rows

    config = load_config(path, [f"run.dir={tmp_path}"])
    shape = {**config.model.tiny.model_dump(), "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
             "intermediate_size": 64}
    model = build_tiny_model(tmp_path / "model", tokenizer_texts(config), TinyModelSpec(**shape), seed=0)
    tokenizer = load_tokenizer(str(model))
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in tokenizer.encode(
        " ".join(tokenizer_texts(config)[:50]), add_special_tokens=False)

    train, heldout = stage_rows(config, "sft")
    encoded, rejected = encode_sft(tokenizer, train + heldout, max_length=config.sft.data.max_length, loss_on="completion")
    assert rejected.total == 0 and len(encoded) == len(train) + len(heldout)
    first = len(tokenizer.encode(plain_render(train[0]["prompt"], tokenizer.eos_token, True), add_special_tokens=False))
    header = len(tokenizer.encode("assistant:\n", add_special_tokens=False))
    turns = sum(m["role"] == "assistant" for m in train[0]["completion"])
    # trained: every token after the first prompt (actions, observations) but the later turns' "assistant:" headers
    assert encoded[0].loss_mask[:first] == [0] * first
    assert len(encoded[0].loss_mask) - first - sum(encoded[0].loss_mask) == (turns - 1) * header

    section = config.agentic
    worker = EnvWorker(str(model), section.env, dict(section.env_options),
                       rollout_settings(config, config.model.tiny.max_position_embeddings))
    specs = [s for s in training_specs(config, step=1) if s.group < 2][:4]
    rollouts, returns, summaries = worker.collect(specs, HFInferenceEngine(str(model), torch_threads=1), section.runner)
    assert [s["ending"] for s in summaries if s["ending"] == "error"] == []
    assert len(returns) == len(specs) == rollouts.response_ids.shape[0]
    for i, prompt in enumerate(rollouts.prompt_ids):
        assert len(prompt) + int(rollouts.response_lengths[i]) <= config.model.tiny.max_position_embeddings
