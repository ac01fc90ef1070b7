"""Every shipped YAML validates; bad keys, types and values fail in one line naming key and source."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs.loader import PRESETS_DIR, ConfigError, flat_params, load_config, parse_override

PRESETS = sorted(PRESETS_DIR.rglob("*.yaml"))


def test_presets_exist():
    names = {p.name for p in PRESETS}
    assert {"quickstart.yaml", "tiny.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(PRESETS_DIR)))
def test_every_preset_validates(path: Path):
    config = load_config(path)
    assert config.run.name
    assert config.train.steps > 0


def test_overrides_are_typed_yaml_values():
    config = load_config(PRESETS_DIR / "tiny.yaml", ["run.seed=7", "train.optim.lr=3e-4", "rollout.stop=['+']"])
    assert config.run.seed == 7
    assert config.train.optim.lr == pytest.approx(3e-4)
    assert config.rollout.stop == ["+"]
    assert parse_override("a.b=1") == (["a", "b"], 1)


def _error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message  # one line
    return message


def test_typo_in_file_names_file_key_and_closest_match(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_sise: 4\n")
    message = _error(bad)
    assert message.startswith(f"{bad}: rollout.group_sise: unknown key")
    assert "did you mean 'group_size'?" in message


def test_typo_in_override_names_the_override():
    message = _error(PRESETS_DIR / "tiny.yaml", ["train.optim.lrr=1"])
    assert message.startswith("override 'train.optim.lrr=1': train.optim.lrr: unknown key; did you mean 'lr'?")


def test_wrong_type_and_bad_value():
    assert "train.optim.lr: Input should be a valid number" in _error(PRESETS_DIR / "tiny.yaml", ["train.optim.lr=abc"])
    assert "rollout.top_p: Input should be less than or equal to 1" in _error(PRESETS_DIR / "tiny.yaml", ["rollout.top_p=2"])
    assert "rollout.engine: Input should be 'hf'" in _error(PRESETS_DIR / "tiny.yaml", ["rollout.engine=vllm2"])


def test_unknown_registry_names_and_options_are_rejected():
    assert "unknown advantage estimator 'gea'; registered: grpo" in _error(None, ["algorithm.advantage=gea"])
    assert "no option 'clip_hgh'; did you mean 'clip_high'?" in _error(None, ["algorithm.loss_options.clip_hgh=0.3"])
    assert "unknown reward 'maths'" in _error(None, ["reward.name=maths"])


def test_cross_field_checks_say_what_to_change():
    assert "needs model.path" in _error(None, ["model.source=hf"])
    assert "only 36 distinct problems" in _error(None, ["data.arithmetic.max_operand=5"])


def test_missing_file():
    assert "no such config file" in _error("nope/missing.yaml")


def test_flat_params_cover_every_leaf():
    params = flat_params(load_config(PRESETS_DIR / "tiny.yaml"))
    assert params["rollout.group_size"] == "8"
    assert params["algorithm.kl_estimator"] == "k3"
