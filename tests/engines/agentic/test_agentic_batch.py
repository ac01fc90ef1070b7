"""From episodes to the train batch: StarPO / GiGPO advantages on each turn's tokens, the one-turn case
equal to GRPO, nothing trained at observation tokens, masked rows out of the loss."""

from __future__ import annotations

import pytest
import torch

from configs.loader import load_config
from engines import environments
from engines.agentic.chat import TurnRenderer
from engines.agentic.policies import random_policy
from engines.agentic.rollout import EnginePolicy, EpisodeSpec, RolloutSettings, Runner, to_rollouts
from engines.agentic.worker import summarize_episode
from engines.algorithms.objective import PolicyObjective
from engines.batches import AdvantageSpec, advantage_batch
from engines.models import load_tokenizer
from flows.agentic import agentic_advantages


@pytest.fixture(scope="module")
def rollout(agentic_model_dir):
    """``run(env_id, groups, group_size, **settings) -> (episodes, rollouts, summaries)`` on the tiny model."""
    from engines.inference.hf import HFInferenceEngine

    engine, tokenizer = HFInferenceEngine(agentic_model_dir, torch_threads=1), load_tokenizer(agentic_model_dir)

    def run(env_id, groups, group_size, policy=None, **settings):
        settings = RolloutSettings(**{"max_tokens_per_turn": 3, "max_context": 256, **settings})
        runner = Runner(policy or EnginePolicy(engine, settings), TurnRenderer(tokenizer), settings,
                        lambda spec: environments.make(spec.env_id), environments.state_key)
        specs = [EpisodeSpec(env_id, 40 + i // group_size, i // group_size, i, 900 + i) for i in range(groups * group_size)]
        episodes = runner.run(specs, "async")
        return episodes, to_rollouts(episodes, tokenizer.pad_token_id), [summarize_episode(e) for e in episodes]

    run.tokenizer = tokenizer
    return run


def _config(*overrides):
    return load_config("configs/agentic/corridor.yaml", list(overrides))


def test_a_one_turn_bandit_batch_gets_grpo_advantages(rollout):
    """Bandit-v0 is one action per episode: StarPO's trajectory advantage on its tokens is GRPO's."""
    # random valid picks (the untrained model's text is no arm): rewards differ within groups
    episodes, rollouts, summaries = rollout("Bandit-v0", groups=4, group_size=4, max_turns=1,
                                            policy=random_policy(rollout.tokenizer))
    returns = torch.tensor([e.episode_return for e in episodes])
    assert len(set(returns.tolist())) > 1  # some groups have something to compare
    group_ids = torch.tensor([s["group"] for s in summaries])
    spec = AdvantageSpec("grpo", pad_token_id=0)
    grpo_batch, _, _ = advantage_batch(rollouts, returns, group_ids, spec)
    steps, masked, _ = agentic_advantages(_config("agentic.env=Bandit-v0", "agentic.max_turns=1"), summaries)
    assert masked == []
    agentic_batch, _, _ = advantage_batch(rollouts, returns, group_ids, spec, step_advantages=steps)
    torch.testing.assert_close(agentic_batch.tensors["advantages"], grpo_batch.tensors["advantages"], rtol=1e-6, atol=1e-6)
    assert grpo_batch.tensors["advantages"].abs().sum() > 0


def test_gigpo_puts_each_step_advantage_on_its_turn_and_trains_nothing_at_observations(rollout):
    episodes, rollouts, summaries = rollout("Corridor-v0", groups=2, group_size=4, max_turns=4,
                                            policy=random_policy(rollout.tokenizer))
    steps, _, _ = agentic_advantages(_config("agentic.mode=step", "agentic.gamma=0.9"), summaries)
    assert len({round(v, 6) for row in steps for v in row}) > 3  # step advantages differ within episodes
    returns = torch.tensor([e.episode_return for e in episodes])
    group_ids = torch.tensor([s["group"] for s in summaries])
    batch, _, _ = advantage_batch(rollouts, returns, group_ids, AdvantageSpec("grpo", pad_token_id=0),
                                  step_advantages=steps, ref_logprobs=torch.zeros(rollouts.response_ids.shape[0], 300))
    adv, mask, turns = batch.tensors["advantages"], batch.loss_mask, batch.turn_index
    for b, row in enumerate(steps):
        for k, value in enumerate(row, start=1):
            on_turn = (turns[b] == k) & (mask[b] > 0)
            assert on_turn.any() and torch.all(adv[b][on_turn] == torch.tensor(value, dtype=adv.dtype))
    assert (adv[mask == 0] == 0).all()

    # d loss / d logprob is exactly 0 at every observation (and prompt) token, for every term of the loss
    logprobs = (batch.tensors["old_logprobs"] + 0.01).requires_grad_()
    entropy = torch.full_like(logprobs, 0.5).requires_grad_()
    loss, _ = PolicyObjective(kl_coef=0.1, entropy_coef=0.01)(logprobs=logprobs, entropy=entropy, batch=batch)
    loss.backward()
    observation = (mask == 0) & (batch.attention_mask > 0) & (turns > 0)
    assert observation.sum() > 10
    assert (logprobs.grad[observation] == 0).all() and (entropy.grad[observation] == 0).all()
    assert (logprobs.grad[mask > 0] != 0).float().mean() > 0.5


def test_errors_and_masked_truncations_leave_the_loss(rollout):
    _, rollouts, summaries = rollout("Corridor-v0", groups=2, group_size=4, max_turns=2)
    summaries[1] = {**summaries[1], "ending": "error", "error": "boom"}
    truncated = [i for i, s in enumerate(summaries) if s["ending"] == "max_turns"]
    assert truncated  # two moves rarely reach the goal
    steps, masked, _ = agentic_advantages(_config("agentic.on_truncation=mask"), summaries)
    assert set(masked) == {1, *truncated}
    assert steps[1] == [0.0] * len(steps[1])
    batch, _, _ = advantage_batch(rollouts, torch.zeros(len(summaries)), torch.tensor([s["group"] for s in summaries]),
                                  AdvantageSpec("grpo", pad_token_id=0), step_advantages=steps, masked_rows=masked)
    assert batch.loss_mask[masked].sum() == 0 and batch.loss_mask.sum() > 0 or len(masked) == len(summaries)


def test_penalized_truncations_lower_the_return_of_their_last_step():
    summaries = [{"group": 0, "step_rewards": [0.0, 0.0], "state_keys": ["a", "b"], "ending": "max_turns", "turns": 2},
                 {"group": 0, "step_rewards": [0.0, 1.0], "state_keys": ["a", "c"], "ending": "terminated", "turns": 2}]
    # returns -1 and 1 in one group: mean 0, unbiased std sqrt(2) -> -1/sqrt(2) and 1/sqrt(2) on every step
    steps, masked, _ = agentic_advantages(_config("agentic.on_truncation=penalize", "agentic.truncation_penalty=-1"),
                                          summaries)
    assert masked == []
    assert steps[0] == pytest.approx([-2 ** -0.5] * 2, rel=1e-5) and steps[1] == pytest.approx([2 ** -0.5] * 2, rel=1e-5)
    # keep: returns 0 and 1 -> -1/sqrt(2)·(1/(1/sqrt(2)))... i.e. (0 - 0.5)/0.7071 = -0.7071 and +0.7071
    kept, _, _ = agentic_advantages(_config(), summaries)
    assert kept[0] == pytest.approx([-2 ** -0.5] * 2, rel=1e-5)


def test_starpo_s_masks_the_groups_with_the_lowest_return_spread():
    rows = lambda group, returns: [{"group": group, "step_rewards": [r], "state_keys": ["s"], "ending": "terminated",  # noqa: E731
                                    "turns": 1} for r in returns]
    summaries = rows(0, [1, 1]) + rows(1, [0, 1]) + rows(2, [0, 0]) + rows(3, [1, 0])
    _, masked, metrics = agentic_advantages(_config("agentic.keep_fraction=0.5"), summaries)
    assert masked == [0, 1, 4, 5]  # groups 0 and 2 (std 0) leave; groups 1 and 3 (std 0.71) stay
    assert metrics["agentic/kept_group_frac"] == 0.5


def test_each_action_keeps_the_version_of_the_weights_that_sampled_it(rollout):
    """Weights updated between turns (async.mode full): each action's tokens carry the version that sampled
    them; the batch and each episode count from their oldest (the staleness bound's)."""
    import dataclasses

    random_moves = random_policy(rollout.tokenizer)
    calls = []

    class VersionPerCall:  # the engine's weights move on after every generation call
        def generate(self, requests):
            calls.append(len(requests))
            return [dataclasses.replace(g, weights_version=len(calls) + 4) for g in random_moves.generate(requests)]

    episodes, rollouts, summaries = rollout("Corridor-v0", groups=2, group_size=2, max_turns=4, policy=VersionPerCall())
    versions = [[t.weights_version for t in e.turns] for e in episodes]
    assert len({v for episode in versions for v in episode}) > 1 and min(min(v) for v in versions) == 5
    assert rollouts.weights_version == 5
    for i, episode in enumerate(versions):
        assert summaries[i]["weights_version"] == min(episode)
        for k, version in enumerate(episode, start=1):
            action = (rollouts.turn_index()[i] == k) & (rollouts.model_token_mask()[i] > 0)
            assert action.sum() > 0 and set(rollouts.token_versions[i][action].tolist()) == {version}
