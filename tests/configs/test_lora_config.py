"""model.lora: an override of the absent section, and the rollout engines that take adapters."""

from __future__ import annotations

import pytest

from configs.loader import ConfigError, load_config


def test_lora_override_fills_an_absent_section_with_the_schema_defaults():
    assert load_config("configs/tiny.yaml").model.lora is None  # full fine-tuning
    lora = load_config("configs/tiny.yaml", ["model.lora.r=8"]).model.lora
    assert (lora.r, lora.alpha, lora.dropout) == (8, 16.0, 0.0) and "q_proj" in lora.target_modules
    preset = load_config("configs/rlvr/quickstart_lora.yaml", ["model.lora.r=4"]).model.lora
    assert (preset.r, preset.alpha) == (4, 16.0)  # one key overridden, the preset's others kept


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=my_pkg.engines:MyEngine", "hf and vllm rollout engines only"),
    ("model.lora.rank=8", "model.lora.rank: unknown key; valid keys: r, alpha"),
    ("model.lora.r=0", "model.lora.r: Input should be greater than 0"),
])
def test_lora_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", ["model.lora.r=8", override])


def test_a_vllm_rollout_engine_is_started_for_the_adapters_rank():
    from flows.rlvr import rollout_engine_options

    config = load_config("configs/tiny.yaml", ["model.lora.r=4", "rollout.engine=vllm"])
    assert rollout_engine_options(config, {})["max_lora_rank"] == 4
    assert "max_lora_rank" not in rollout_engine_options(load_config("configs/tiny.yaml", ["rollout.engine=vllm"]), {})
