"""Advantage batches on the reward worker: shaping in order, KL in the reward, old logprobs, critic
values, overlong filtering, running moments; and dynamic sampling's refilled batch."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms.shaping import RunningMoments, ShapingSpec
from engines.batches import AdvantageSpec, advantage_batch, concat_rollouts, outcome_token_rewards
from engines.types import Rollouts


def _rollouts(lengths, reasons=None, prompt_len=2, width=4, logprob=-1.0) -> Rollouts:
    """Rows with ``prompt_len`` prompt tokens and responses of ``lengths`` tokens (ids 10+i), right-padded."""
    rows = len(lengths)
    response_ids = torch.zeros(rows, width, dtype=torch.long)
    logprobs = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        response_ids[i, :n] = 10 + i
        logprobs[i, :n] = logprob
    return Rollouts(prompt_ids=[[1] * prompt_len for _ in range(rows)], response_ids=response_ids, logprobs=logprobs,
                    response_lengths=torch.tensor(lengths), finish_reasons=reasons or ["stop"] * rows,
                    completions=[f"c{i}" for i in range(rows)], weights_version=0)


def test_outcome_reward_sits_on_the_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.float32)
    assert outcome_token_rewards(torch.tensor([2.0, 3.0]), mask).tolist() == [[0, 0, 2, 0], [0, 3, 0, 0]]


def test_grpo_batch_layout_and_old_logprobs_default_to_the_rollout_engine():
    rollouts = _rollouts([2, 1, 3, 3])
    batch, summary, _ = advantage_batch(rollouts, torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                                        AdvantageSpec("grpo", pad_token_id=0))
    # Row 0: prompt [0, 2), response [2, 4). Group 0 rewards (1, 0): mean 0.5, std 0.7071 -> A = ±0.7071.
    # Group 1 rewards (1, 1): A = 0.
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0]
    torch.testing.assert_close(batch.tensors["advantages"][:, 2], torch.tensor([0.70710, -0.70710, 0.0, 0.0]), atol=1e-4, rtol=0)
    assert (batch.tensors["old_logprobs"] == batch.tensors["rollout_logprobs"]).all()
    assert batch.tensors["old_logprobs"][0].tolist() == [0, 0, -1, -1, 0]
    assert summary["reward/shaped_mean"] == pytest.approx(0.75)


def test_kl_penalty_in_the_reward_uses_old_logprobs_against_the_reference():
    rollouts = _rollouts([2, 2])
    old = torch.full((2, 4), -1.0)
    ref = torch.full((2, 4), -1.5)
    # k1 = LP - RLP = -1 - (-1.5) = 0.5 per token; coef 0.2 -> -0.1 per response token.
    # Row rewards (1, 0) on the last token; reinforce_pp without whitening, gamma 1: G_t = sum of later rewards.
    #   row 0 tokens: [-0.1 + (-0.1 + 1)] = 0.8 at t=2, 0.9 at t=3; row 1: -0.2 at t=2, -0.1 at t=3.
    spec = AdvantageSpec("reinforce_pp", pad_token_id=0, options={"whiten": False}, kl_estimator="k1", kl_in_reward=True)
    batch, summary, _ = advantage_batch(rollouts, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), spec,
                                        ref_logprobs=ref, old_logprobs=old, kl_coef=0.2)
    torch.testing.assert_close(batch.tensors["advantages"][:, 2:4], torch.tensor([[0.8, 0.9], [-0.2, -0.1]]))
    assert summary["kl/seq_mean"] == pytest.approx(1.0)  # 2 tokens x 0.5
    assert summary["kl/token_mean"] == pytest.approx(0.5)
    assert (batch.tensors["old_logprobs"][:, 2:4] == -1.0).all() and "ref_logprobs" in batch.tensors
    # Same batch with the KL as a loss term instead: rewards untouched.
    loss_mode = AdvantageSpec("reinforce_pp", pad_token_id=0, options={"whiten": False}, kl_estimator="k1")
    batch, _, _ = advantage_batch(rollouts, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), loss_mode,
                                  ref_logprobs=ref, old_logprobs=old, kl_coef=0.2)
    torch.testing.assert_close(batch.tensors["advantages"][:, 2:4], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_overlong_penalty_then_group_norm_then_filter():
    # max_length 4, buffer 2: lengths 2 -> 0, 3 -> -0.5, 4 -> -1.0 (DAPO eq. 13).
    shaping = ShapingSpec(overlong_buffer=2, max_length=4, overlong_filter=True)
    rollouts = _rollouts([2, 3, 4, 4], reasons=["stop", "stop", "length", "stop"])
    batch, summary, _ = advantage_batch(rollouts, torch.ones(4), torch.tensor([0, 0, 0, 0]),
                                        AdvantageSpec("dr_grpo", pad_token_id=0, shaping=shaping))
    # Shaped rewards 1, 0.5, 0, 0: mean 0.375 -> A = 0.625, 0.125, -0.375, -0.375; row 2 is truncated: masked out.
    assert summary["reward/shaped_mean"] == pytest.approx(0.375)
    assert batch.tensors["advantages"][:, 2].tolist() == pytest.approx([0.625, 0.125, 0.0, -0.375])
    assert batch.loss_mask[2].sum() == 0 and summary["shaping/overlong_filtered_frac"] == pytest.approx(0.25)


def test_running_norm_moments_carry_across_calls():
    spec = AdvantageSpec("dr_grpo", pad_token_id=0, shaping=ShapingSpec(reward_norm="running"))
    _, _, moments = advantage_batch(_rollouts([1, 1]), torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), spec)
    assert (moments.count, moments.mean, moments.m2) == (2.0, 1.0, 2.0)
    _, _, moments = advantage_batch(_rollouts([1, 1]), torch.tensor([4.0, 6.0]), torch.tensor([0, 0]), spec, moments=moments)
    # All four rewards 0, 2, 4, 6: mean 3, sum of squared deviations 9 + 1 + 1 + 9 = 20.
    assert (moments.count, moments.mean, moments.m2) == (4.0, 3.0, 20.0)
    assert isinstance(moments, RunningMoments)


def test_values_enter_gae_and_the_batch():
    rollouts = _rollouts([2])
    values = torch.tensor([[9.0, 9.0, 0.5, 0.25, 9.0]])  # [1, 5]: wider than the batch, and 9s outside the response
    batch, _, _ = advantage_batch(rollouts, torch.tensor([1.0]), torch.tensor([0]),
                                  AdvantageSpec("gae", pad_token_id=0, options={"gamma": 1.0, "lam": 1.0, "whiten": False}),
                                  values=values)
    # lam = gamma = 1: A_t = (sum of later rewards) - V_t = 1 - 0.5, 1 - 0.25; returns = 1, 1.
    assert batch.tensors["advantages"][0].tolist() == [0, 0, 0.5, 0.75]
    assert batch.tensors["returns"][0].tolist() == [0, 0, 1, 1]
    assert batch.tensors["values"][0].tolist() == [0, 0, 0.5, 0.25]


def test_concat_rollouts_takes_the_kept_rows_in_order():
    a, b = _rollouts([1, 2], width=2), _rollouts([3, 1, 4], width=4)
    merged = concat_rollouts([a, b], [[1], [0, 2]])
    assert merged.response_lengths.tolist() == [2, 3, 4]
    assert merged.response_ids.shape == (3, 4)
    assert merged.response_ids[0].tolist() == [11, 11, 0, 0]  # a's row 1, padded to the wider part
    assert merged.completions == ["c1", "c0", "c2"]


def test_identical_samples_are_scored_once_and_every_row_gets_its_reward():
    from engines.rewards import REWARDS
    from engines.scoring import ScoreSpec, score_rollouts

    seen: list[tuple[str, str, str]] = []

    @REWARDS.register("t_counting")
    def counting(prompts, completions, answer, **_):
        seen.extend(zip(prompts, completions, answer))
        return [float(c == a) + 0.1 * len(p) for p, c, a in zip(prompts, completions, answer)]

    try:
        rollouts = _rollouts([1, 1, 1, 1, 1, 1])
        rollouts.completions[:] = ["4", "4", "5", "4", "4", "4"]
        prompts = ["2+2=", "2+2=", "2+2=", "2+2=", "1+3=", "1+3="]
        answers = ["4", "4", "4", "4", "4", "5"]  # the last row: same prompt and completion, another answer
        rewards, stats = score_rollouts(rollouts, prompts, {"answer": answers}, ScoreSpec("t_counting", chunk_size=2))
        assert sorted(seen) == sorted({("2+2=", "4", "4"), ("2+2=", "5", "4"), ("1+3=", "4", "4"), ("1+3=", "4", "5")})
        assert torch.allclose(rewards, torch.tensor([1.4, 1.4, 0.4, 1.4, 1.4, 0.4]))
        assert stats["n"] == 6 and stats["correct"] == 4
    finally:
        REWARDS._entries.pop("t_counting")


def test_reward_worker_warms_up_the_rewards_it_is_given():
    from engines.reward_worker import RewardWorker

    assert RewardWorker(rewards=("think_answer_format", "math")).warmed == ["math"]
    assert RewardWorker().warmed == []
    with pytest.raises(KeyError, match="'nope'"):
        RewardWorker(rewards=("nope",))


def test_reward_failed_counts_the_runner_s_failures_not_the_reward_s_own_events():
    from engines.scoring import summarize

    base = {"n": 4, "reward_sum": 1.0, "reward_sq_sum": 1.0, "correct": 1, "length_sum": 8.0, "length_max": 2.0,
            "truncated": 0, "generate_s": 0.0, "score_s": 0.0, "reward": "code", "distinct": 4}
    stats = [{**base, "domain": "a", "events": {"error": 3, "timeout": 1}, "failed": 1, "first_failure": "X: y"},
             {**base, "domain": "b", "events": {"error": 2}, "failed": 0, "first_failure": None}]
    # events merge the runner's failures with the reward's own (a code sample's error): 6 events, 1 failure
    metrics = summarize(stats)
    assert metrics["reward/failed"] == 1.0 and metrics["domain/a/error"] == 3.0


def test_throughput_counts_every_dynamic_sampling_round_and_rewards_only_the_first():
    from engines.scoring import summarize

    base = {"n": 4, "reward_sq_sum": 1.0, "correct": 1, "length_max": 2.0, "truncated": 0, "score_s": 0.5,
            "reward": "math", "distinct": 4, "domain": "default", "events": {}, "failed": 0, "first_failure": None}
    first = [{**base, "reward_sum": 1.0, "length_sum": 8.0, "generate_s": 2.0}]
    refill = [{**base, "reward_sum": 3.0, "length_sum": 24.0, "generate_s": 6.0}]
    metrics = summarize(first, first + refill)
    # reward metrics: the first round alone (1 of 4); work: both rounds, 32 tokens in 8 s of generation
    assert metrics["reward/mean"] == 0.25
    assert (metrics["rollout/tokens"], metrics["perf/generate_compute_s"], metrics["perf/score_compute_s"]) == (32.0, 8.0, 1.0)
    assert metrics["perf/tokens_per_s"] == 4.0
    assert summarize(first)["perf/tokens_per_s"] == 4.0  # one round: its own tokens and time
