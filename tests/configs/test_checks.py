"""Configs that would validate, then do nothing or fail after Ray and Prefect started, fail at load instead:
one line naming the key, its source (file or override) and what to change."""

from __future__ import annotations

import inspect
import json
import typing
from pathlib import Path

import pytest
import torch
import yaml

from configs.loader import PRESETS_DIR, load_config
from engines.algorithms import advantages
from engines.rewards import REWARDS, get_reward
from test_presets import _error  # the load error, asserted to be one line

DATA = PRESETS_DIR / "data"


def _domains_file(tmp_path: Path, *domains: dict) -> Path:
    """A config with ``data.domains`` (lists are replaced, not merged, so each test spells its domains out)."""
    file = tmp_path / "domains.yaml"
    file.write_text(yaml.safe_dump({"base": str(PRESETS_DIR / "tiny.yaml"), "rollout": {"prompts_per_step": len(domains)},
                                    "data": {"source": "domains", "domains": list(domains)}}))
    return file


def _code_domain(**options) -> dict:
    return {"name": "code", "reward": "code", "reward_options": options, "share": 1,
            "train_path": str(DATA / "code/train.jsonl"), "heldout_path": str(DATA / "code/heldout.jsonl")}


# 1. Reward option values are checked against the annotations of the reward's keyword parameters.
@pytest.mark.parametrize("reward, options, expected", [
    # The example: "allpass" used to pass validation, then every code sample scored 0.
    ("code", {"mode": "allpass"}, "reward_options.mode: reward 'code': mode must be one of 'pass_fraction', 'all_pass'; "
                                  "got 'allpass'"),
    ("code", {"wall_s": "fast"}, "reward_options.wall_s: reward 'code': wall_s must be of type float; got 'fast'"),
    ("code", {"memory_mb": 1.5}, "reward_options.memory_mb: reward 'code': memory_mb must be of type int; got 1.5"),
    ("ifeval", {"mode": "any"}, "reward_options.mode: reward 'ifeval': mode must be one of 'fraction', 'all'; got 'any'"),
    # A str is no bool, a bool no number (checked strictly).
    ("think_answer_format", {"strict": "yes"}, "reward_options.strict: reward 'think_answer_format': strict must be of "
                                               "type bool; got 'yes'"),
    ("judge", {"max_score": True}, "reward_options.max_score: reward 'judge': max_score must be of type float; got True"),
])
def test_reward_option_values_are_checked(tmp_path, reward, options, expected):
    domain = {"name": "d", "reward": reward, "reward_options": options, "share": 1, "source": "arithmetic"}
    file = _domains_file(tmp_path, domain)
    assert _error(file) == f"{file}: data.domains.0.{expected}"


def test_reward_option_values_that_fit_pass(tmp_path):
    config = load_config(_domains_file(tmp_path, _code_domain(mode="all_pass", wall_s=2, memory_mb=128)))
    assert config.data.domains[0].reward_options == {"mode": "all_pass", "wall_s": 2, "memory_mb": 128}  # an int is a float


def test_the_second_domain_is_named_by_index(tmp_path):
    math = {"name": "math", "reward": "math", "share": 1, "source": "arithmetic"}
    file = _domains_file(tmp_path, math, _code_domain(mode="allpass"))
    assert _error(file).startswith(f"{file}: data.domains.1.reward_options.mode: reward 'code': mode must be one of")


@pytest.mark.parametrize("name", REWARDS.names())
def test_every_reward_option_default_fits_its_annotation(name):
    # The check reads the annotations: each must resolve, and each option's own default must pass it
    # (a Literal that forgot the default would reject a config spelling the default out).
    from configs.checks import check_option_values, keyword_options

    fn = get_reward(name)
    typing.get_type_hints(fn)
    defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values()
                if p.name in keyword_options(fn, set()) and isinstance(p.default, (bool, int, float, str))}
    check_option_values(fn, name, defaults, "reward", "reward_options")


# 2. KL as a reward penalty must be k1.
def test_kl_in_the_reward_must_be_k1():
    # tiny.yaml has estimator k3; the override that makes it a reward penalty is named as the source.
    message = _error("tiny", ["algorithm.kl.mode=reward"])
    assert message.startswith("override 'algorithm.kl.mode=reward': algorithm.kl.estimator: k3 as a per-token reward "
                              "penalty (mode 'reward') gives a biased KL gradient")
    assert "set algorithm.kl.estimator=k1" in message
    assert "k2 as a per-token reward penalty" in _error("tiny", ["algorithm.kl.mode=reward", "algorithm.kl.estimator=k2"])
    assert load_config("tiny", ["algorithm.kl.mode=reward", "algorithm.kl.estimator=k1"]).algorithm.kl.estimator == "k1"
    assert load_config("tiny", ["algorithm.kl.coef=0.1"]).algorithm.kl.estimator == "k3"  # k3 in the loss is fine


# 3. One completion per prompt with a group baseline.
def test_group_estimators_give_zero_advantages_with_groups_of_one():
    # The marker the schema relies on, checked: with every row its own group, the group estimators' advantages
    # are all 0 (each row is its own baseline) and every other estimator's are not.
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.5])  # outcome rewards on the last token
    for name in advantages.names():
        adv, _ = advantages.compute(name, token_rewards=rewards, loss_mask=torch.ones(4, 3), group_ids=torch.arange(4),
                                    values=torch.zeros(4, 3))
        assert (adv.abs().max().item() == 0.0) == (name in advantages.GROUP_ESTIMATORS), name


@pytest.mark.parametrize("estimator", sorted(advantages.GROUP_ESTIMATORS))
def test_group_size_one_with_a_group_estimator_is_rejected(estimator):
    message = _error("tiny", [f"algorithm.advantage={estimator}", "rollout.group_size=1"])
    assert message.startswith("override 'rollout.group_size=1': rollout.group_size: "
                              f"advantage {estimator!r} compares each completion with the others of its prompt")
    assert "set rollout.group_size >= 2 or another algorithm.advantage (gae, raft_pp, reinforce_pp, topr)" in message


def test_group_size_one_with_a_per_sample_estimator_passes():
    for estimator in ("reinforce_pp", "raft_pp"):
        assert load_config("tiny", [f"algorithm.advantage={estimator}", "rollout.group_size=1"]).rollout.group_size == 1


# 4. GSPO's per-sequence ratio needs the per-sequence mean.
def test_gspo_needs_seq_mean_token_mean():
    message = _error("algorithms/gspo", ["algorithm.agg=token-mean"])
    assert message.startswith("override 'algorithm.agg=token-mean': algorithm.agg: policy loss 'gspo'")
    assert "arXiv:2507.18071" in message and "set algorithm.agg=seq-mean-token-mean" in message
    assert "algorithm.agg: policy loss 'gspo'" in _error("tiny", ["algorithm.policy_loss=gspo"])  # tiny: token-mean


# 5. max_new_tokens must leave room for a prompt in the model's positions.
def test_max_new_tokens_beyond_a_tiny_models_positions():
    # tiny.yaml keeps the default 128 positions: 127 new tokens leave room for a 1-token prompt, 128 none.
    assert load_config("tiny", ["rollout.max_new_tokens=127"]).rollout.max_new_tokens == 127
    message = _error("tiny", ["rollout.max_new_tokens=128"])
    assert message.startswith("override 'rollout.max_new_tokens=128': rollout.max_new_tokens: max_new_tokens (128) "
                              "leaves no room for a prompt in the model's 128 positions")
    assert message.endswith("lower rollout.max_new_tokens or raise model.tiny.max_position_embeddings")
    assert _error("tiny", ["model.tiny.max_position_embeddings=8"]).startswith(
        "override 'model.tiny.max_position_embeddings=8': rollout.max_new_tokens:")  # tiny.yaml: 8 new tokens


@pytest.mark.parametrize("entry", ["max_position_embeddings", "n_positions", "max_seq_len"])
def test_max_new_tokens_beyond_a_local_hf_models_positions(tmp_path, entry):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", entry: 64}))
    overrides = ["model.source=hf", f"model.path={tmp_path}"]
    assert load_config("tiny", [*overrides, "rollout.max_new_tokens=63"]).rollout.max_new_tokens == 63
    message = _error("tiny", [*overrides, "rollout.max_new_tokens=64"])
    assert f"the model's 64 positions ({entry} in {tmp_path}/config.json); lower rollout.max_new_tokens" in message


def test_unknown_positions_are_not_checked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    for path in ("Qwen/Qwen2.5-0.5B", str(tmp_path), "s3://bucket/model"):  # a hub id, no entry, remote
        config = load_config("tiny", ["model.source=hf", f"model.path={path}", "rollout.max_new_tokens=100000"])
        assert config.model.positions() is None


# 6. Data files must exist (local paths; remote URIs are read at run time).
def test_missing_data_files_are_named_at_load(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    files = ["data.source=files", f"data.train_path={train}"]
    message = _error("tiny", [*files, f"data.heldout_path={tmp_path}/missing.jsonl"])
    assert message == (f"override 'data.heldout_path={tmp_path}/missing.jsonl': data.heldout_path: no such file or "
                       f"folder '{tmp_path}/missing.jsonl'; fix the path")
    relative = _error("tiny", ["data.source=files", "data.train_path=nope.jsonl", f"data.heldout_path={train}"])
    assert relative.startswith("override 'data.train_path=nope.jsonl': data.train_path: no such file or folder "
                               "'nope.jsonl' (relative to the working directory ")
    assert load_config("tiny", [*files, f"data.heldout_path={train}"]).data.heldout_path == str(train)
    assert load_config("tiny", [*files, "data.heldout_path=s3://bucket/heldout.jsonl"]).data.source == "files"
    # An unused path is not checked: source arithmetic reads no files.
    assert load_config("tiny", ["data.train_path=nope.jsonl"]).data.source == "arithmetic"


def test_a_domains_missing_data_file_names_the_domain(tmp_path):
    domain = {**_code_domain(), "train_path": str(tmp_path / "gone.jsonl")}
    file = _domains_file(tmp_path, domain)
    assert _error(file) == (f"{file}: data.domains.0.train_path: domain 'code': no such file or folder "
                            f"'{tmp_path}/gone.jsonl'; fix the path")


def test_cross_section_errors_name_the_key_and_the_override_that_set_it():
    # Before, a check over two sections was reported as "<root>" from the file even when an override caused it.
    message = _error("tiny", ["algorithm.shaping.overlong_buffer=8"])
    assert message.startswith("override 'algorithm.shaping.overlong_buffer=8': algorithm.shaping.overlong_buffer: ")
    assert "<root>" not in message
