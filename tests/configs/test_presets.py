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
    assert "rollout.engine: unknown rollout engine 'vllm2'; registered: hf" in _error(PRESETS_DIR / "tiny.yaml",
                                                                                    ["rollout.engine=vllm2"])


def test_unknown_registry_names_and_options_are_rejected():
    assert "unknown advantage estimator 'gea'; did you mean 'gae'? registered: dr_grpo, gae" in _error(
        None, ["algorithm.advantage=gea"])
    assert "no option 'clip_hgh'; did you mean 'clip_high'?" in _error(None, ["algorithm.loss_options.clip_hgh=0.3"])
    assert "unknown reward 'maths'" in _error(None, ["reward.name=maths"])
    assert "reward 'no_such_module:fn' does not import (ModuleNotFoundError" in _error(None, ["reward.name=no_such_module:fn"])
    assert "reward 'engines.rewards:no_such_fn' does not import (AttributeError" in _error(
        None, ["reward.name=engines.rewards:no_such_fn"])
    assert "reward 'engines.rewards:REWARDS' is not a function" in _error(None, ["reward.name=engines.rewards:REWARDS"])
    assert "reward ':score' is not 'package.module:function'" in _error(None, ["reward.name=:score"])


def test_a_reward_by_import_path_loads_and_its_options_are_checked():
    from engines.rewards import get_reward

    path = "tests.flows.prompt_rewards:prompt_holds_its_answer"
    assert load_config(None, [f"reward.name={path}"]).reward.name == path
    assert get_reward(path)(["12+7=", "3+4="], ["x", "y"], answer=["19", "8"]) == [1.0, 0.0]


def test_cross_field_checks_say_what_to_change():
    assert "needs model.path" in _error(None, ["model.source=hf"])
    assert "only 36 distinct problems" in _error(None, ["data.arithmetic.max_operand=5"])


# ROLL's pitfalls, each rejected here with the fix in the message.
@pytest.mark.parametrize("overrides, expected", [
    # An option the chosen loss does not take would be silently ignored (ROLL's TOPR recipe: zero RL loss).
    (["algorithm.policy_loss=topr", "algorithm.loss_options.clip_low=0.2"], "policy loss 'topr' has no option 'clip_low'"),
    (["algorithm.advantage=rloo", "algorithm.advantage_options.norm_by_std=false"],
     "advantage estimator 'rloo' has no option 'norm_by_std'"),
    # Tensor arguments are not options.
    (["algorithm.advantage_options.values=1"], "advantage estimator 'grpo' has no option 'values'"),
    # Critic settings without a critic would do nothing.
    (["algorithm.critic.warmup_steps=3"], "algorithm.critic is only used by advantage 'gae'"),
    # Truncated IS between two copies of the same logprobs corrects nothing.
    (["algorithm.loss_options.tis_cap=2"], "set algorithm.old_logprobs=trainer"),
    (["algorithm.agg_norm=100"], "agg_norm is the normaliser of seq-mean-token-sum-norm"),
    (["algorithm.kl.controller=adaptive"], "needs a starting coef > 0"),
    (["algorithm.kl.estimator=k4"], "unknown KL estimator 'k4'"),
    (["algorithm.shaping.reward_norm=runing"], "unknown reward_norm 'runing'"),
    (["algorithm.shaping.overlong_buffer=8"], "overlong_buffer (8) must be below rollout.max_new_tokens (8)"),
    (["algorithm.dynamic_sampling.enabled=true", "rollout.group_size=1"], "group_size must be >= 2"),
])
def test_algorithm_options_that_would_do_nothing_are_rejected(overrides, expected):
    assert expected in _error(None, overrides)


def test_defaults_start_no_reference_and_no_critic():
    # A KL default that quietly turns on a reference model is a ROLL pitfall: here kl.coef defaults to 0.
    config = load_config(None)
    assert config.algorithm.kl.coef == 0.0
    assert config.algorithm.advantage != "gae"


def test_overriding_one_optim_field_keeps_the_sections_own_lr_default():
    # The critic's and the warm start's optimizers default to their own lr (1e-4, 1e-3), not the policy's 1e-5;
    # setting another of their fields must not reset lr to the policy's default.
    config = load_config("algorithms/ppo", ["algorithm.critic.optim.weight_decay=0.1", "sft.optim.grad_clip=0.5"])
    assert (config.algorithm.critic.optim.lr, config.algorithm.critic.optim.weight_decay) == (1e-4, 0.1)
    assert (config.sft.optim.lr, config.sft.optim.grad_clip) == (1e-3, 0.5)
    assert config.train.optim.lr == load_config("algorithms/ppo").train.optim.lr


def test_base_chain_merges_mappings_and_replaces_the_rest(tmp_path):
    (tmp_path / "parent.yaml").write_text("run: {name: parent, seed: 3}\nrollout: {group_size: 4, stop: ['+']}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nrun: {name: child}\nrollout: {stop: []}\n")
    config = load_config(tmp_path / "child.yaml")
    assert (config.run.name, config.run.seed, config.rollout.group_size, config.rollout.stop) == ("child", 3, 4, [])
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    assert "loop" in _error(tmp_path / "loop.yaml")


ALGORITHM_PRESETS = {
    # preset: (advantage, policy loss, agg, needs a reference, needs a critic)
    "ppo": ("gae", "ppo_clip", "token-mean", True, True),
    "grpo": ("grpo", "ppo_clip", "seq-mean-token-mean", True, False),
    "dr_grpo": ("dr_grpo", "ppo_clip", "seq-mean-token-sum-norm", False, False),
    "dapo": ("grpo", "ppo_clip", "token-mean", False, False),
    "gspo": ("grpo", "gspo", "seq-mean-token-mean", False, False),
    "reinforce_pp": ("reinforce_pp", "ppo_clip", "token-mean", True, False),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "ppo_clip", "token-mean", True, False),
    "rloo": ("rloo", "ppo_clip", "seq-mean-token-mean", False, False),
    "lite_ppo": ("lite_ppo", "ppo_clip", "token-mean", False, False),
    "raft_pp": ("raft_pp", "ppo_clip", "token-mean", False, False),
    "topr": ("topr", "topr", "seq-mean-token-sum", False, False),
}


@pytest.mark.parametrize("name", sorted(ALGORITHM_PRESETS))
def test_algorithm_presets_select_what_they_say(name):
    config = load_config(f"algorithms/{name}")
    alg = config.algorithm
    advantage, loss, agg, reference, critic = ALGORITHM_PRESETS[name]
    assert (alg.advantage, alg.policy_loss, alg.agg) == (advantage, loss, agg)
    assert (alg.kl.coef > 0, alg.advantage == "gae") == (reference, critic)
    assert config.run.name == name and config.model.source == "tiny"  # the tiny task, via base: ../tiny.yaml
    if name == "dapo":
        assert alg.dynamic_sampling.enabled and alg.loss_options["clip_high"] > alg.loss_options["clip_low"]
        assert alg.shaping.overlong_buffer > 0


def test_missing_file():
    assert "no such config file" in _error("nope/missing.yaml")


def test_flat_params_cover_every_leaf():
    params = flat_params(load_config(PRESETS_DIR / "tiny.yaml"))
    assert params["rollout.group_size"] == "8"
    assert params["algorithm.kl.estimator"] == "k3"


def test_quickstart_vllm_is_the_quickstart_with_vllm_rollouts():
    # The two quickstarts are compared run for run (bench/RESULTS.md): only the engine and the run name differ.
    vllm, hf = (flat_params(load_config(PRESETS_DIR / p)) for p in ("rlvr/quickstart_vllm.yaml", "quickstart.yaml"))
    assert {key: vllm[key] for key in vllm.keys() | hf.keys() if vllm.get(key) != hf.get(key)} == {
        "run.name": "quickstart-vllm", "rollout.engine": "vllm"}
