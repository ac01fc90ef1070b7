"""Multi-turn batches: a row is a prompt, then (model response, environment observation) segments.

The loss mask has holes at the observation tokens; returns, GAE, the outcome reward's placement, group
scores and the train batch skip them. Single-turn is the one-segment case, with the results it had."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms import advantages
from engines.algorithms.advantages import discounted_returns, outcome_token_rewards
from engines.batches import AdvantageSpec, advantage_batch, concat_rollouts
from engines.types import Rollouts, build_train_batch


def _holed_batch(seed: int, B: int = 12, L: int = 14, dtype=torch.float64):
    """Rows of 0-2 prompt tokens, a model segment (1-3), an observation (0-3), a model segment (1-3), an
    observation (0-2), then padding. ``R`` and ``V`` are noise everywhere, also where they must be ignored."""
    gen = torch.Generator().manual_seed(seed)
    M = torch.zeros(B, L, dtype=dtype)
    for i in range(B):
        lengths = [int(torch.randint(lo, hi + 1, (1,), generator=gen)) for lo, hi in [(0, 2), (1, 3), (0, 3), (1, 3), (0, 2)]]
        t = 0
        for k, n in enumerate(lengths):
            M[i, t : t + n] = 1.0 if k in (1, 3) else 0.0
            t += n
    R = torch.randn(B, L, generator=gen, dtype=dtype)
    V = torch.randn(B, L, generator=gen, dtype=dtype)
    return R, M, V


def _model_positions(mask_row):
    return [t for t, m in enumerate(mask_row) if m]


def _returns_reference(R, M, gamma):
    """G at the j-th model token = sum_{j' >= j} gamma^(j' - j) R at the j'-th model token (observations skipped)."""
    out = []
    for rr, mr in zip(R.tolist(), M.tolist()):
        pos, row = _model_positions(mr), [0.0] * len(mr)
        for j, t in enumerate(pos):
            row[t] = sum(gamma ** (k - j) * rr[pos[k]] for k in range(j, len(pos)))
        out.append(row)
    return torch.tensor(out, dtype=R.dtype)


def _gae_reference(R, M, V, gamma, lam):
    """GAE over the row's model tokens in order: delta_j = R_j + gamma V_{j+1} - V_j (V past the last = 0),
    A_j = sum_l (gamma lam)^l delta_{j+l}; returns A + V. Observation tokens are not steps."""
    adv, ret = [], []
    for rr, mr, vr in zip(R.tolist(), M.tolist(), V.tolist()):
        pos = _model_positions(mr)
        v = [vr[t] for t in pos] + [0.0]
        deltas = [rr[t] + gamma * v[j + 1] - v[j] for j, t in enumerate(pos)]
        a_row, r_row = [0.0] * len(mr), [0.0] * len(mr)
        for j, t in enumerate(pos):
            a_row[t] = sum((gamma * lam) ** l * deltas[j + l] for l in range(len(pos) - j))
            r_row[t] = a_row[t] + v[j]
        adv.append(a_row)
        ret.append(r_row)
    return torch.tensor(adv, dtype=R.dtype), torch.tensor(ret, dtype=R.dtype)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_discounted_returns_skip_observation_tokens(gamma):
    R, M, _ = _holed_batch(0)
    spans = [(p[-1] - p[0] + 1, len(p)) for p in map(_model_positions, M.tolist())]
    assert sum(span > n for span, n in spans) >= 3  # rows with an observation between their model tokens
    torch.testing.assert_close(discounted_returns(R, M, gamma), _returns_reference(R, M, gamma), rtol=1e-12, atol=1e-12)


def test_discounted_returns_hand_worked_hole():
    # Model tokens t1, t2, t5 (observations t3, t4): gamma 0.5, R = [_, 1, 0, 9, 9, 2] ->
    # G5 = 2, G2 = 0 + 0.5 * 2 = 1 (one model step back, not three), G1 = 1 + 0.5 * 1 = 1.5
    R = torch.tensor([[7.0, 1.0, 0.0, 9.0, 9.0, 2.0]])
    M = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]])
    assert discounted_returns(R, M, 0.5).tolist() == [[0.0, 1.5, 1.0, 0.0, 0.0, 2.0]]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0), (0.8, 0.0)])
def test_gae_over_holes_matches_the_plain_loop(gamma, lam):
    R, M, V = _holed_batch(1)
    exp_adv, exp_ret = _gae_reference(R, M, V, gamma, lam)
    adv, ret = advantages.compute("gae", token_rewards=R, loss_mask=M, group_ids=torch.zeros(len(M), dtype=torch.long),
                                  values=V, gamma=gamma, lam=lam, whiten=False)
    torch.testing.assert_close(adv, exp_adv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ret, exp_ret, rtol=1e-10, atol=1e-12)


def test_outcome_reward_and_group_scores_use_model_tokens_only():
    # Row 0 ends on an observation (t4): its reward goes to the last model token, t2. Row 1 has no hole.
    M = torch.tensor([[0.0, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    R = outcome_token_rewards(torch.tensor([1.0, 0.0]), M)
    assert R.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    # GRPO: scores (1, 0), mean 0.5, std 0.7071 -> +-0.7071 on the model tokens, 0 on the observations.
    adv, _ = advantages.compute("grpo", token_rewards=R + 5.0 * (1 - M), loss_mask=M, group_ids=torch.tensor([0, 0]))
    torch.testing.assert_close(adv, torch.tensor([0.70710, -0.70710])[:, None] * M, atol=1e-4, rtol=0)


def _single_turn_batch(seed: int, B: int = 16, L: int = 12):
    """float32 rows: prompt, one contiguous response, padding (the single-turn layout)."""
    gen = torch.Generator().manual_seed(seed)
    starts, lengths = torch.randint(0, 3, (B,), generator=gen), torch.randint(1, L - 2, (B,), generator=gen)
    pos = torch.arange(L)[None, :]
    M = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).float()
    return torch.randn(B, L, generator=gen), M, torch.randn(B, L, generator=gen)


def _previous_returns(R, M, gamma):
    """The single-turn formula before holes were allowed: G_t = R_t + gamma G_{t+1} over every position."""
    rewards, returns, running = R * M, torch.zeros_like(R), torch.zeros_like(R[:, 0])
    for t in reversed(range(R.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * M


def _previous_gae(R, M, V, gamma, lam):
    """The single-turn GAE before holes were allowed: V' and the recursion gated by M_{t+1}."""
    rewards, values = R * M, V * M
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    next_mask = torch.nn.functional.pad(M[:, 1:], (0, 1))
    deltas = rewards + gamma * next_values - values
    adv, running = torch.zeros_like(R), torch.zeros_like(R[:, 0])
    for t in reversed(range(R.shape[1])):
        running = deltas[:, t] + gamma * lam * running * next_mask[:, t]
        adv[:, t] = running
    adv = adv * M
    return adv, (adv + values) * M


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0)])
def test_single_turn_results_are_bit_identical_to_the_previous_formulas(gamma, lam):
    R, M, V = _single_turn_batch(2)
    G = torch.zeros(len(M), dtype=torch.long)
    assert torch.equal(discounted_returns(R, M, gamma), _previous_returns(R, M, gamma))
    adv, ret = advantages.compute("reinforce_pp", token_rewards=R, loss_mask=M, group_ids=G, gamma=gamma, whiten=False)
    assert torch.equal(adv, _previous_returns(R, M, gamma)) and torch.equal(ret, adv)
    adv, ret = advantages.compute("gae", token_rewards=R, loss_mask=M, group_ids=G, values=V, gamma=gamma, lam=lam,
                                  whiten=False)
    prev_adv, prev_ret = _previous_gae(R, M, V, gamma, lam)
    assert torch.equal(adv, prev_adv) and torch.equal(ret, prev_ret)
    # The outcome reward's token: argmax of M * t, as before.
    rewards = torch.randn(len(M), generator=torch.Generator().manual_seed(3))
    previous = torch.zeros_like(M)
    previous[torch.arange(len(M)), (M * torch.arange(M.shape[1])).argmax(-1)] = rewards
    assert torch.equal(outcome_token_rewards(rewards, M), previous * M)


def _two_segment_rollouts(turns=None) -> Rollouts:
    # row 0: model [11, 12], observation [31, 32], model [13], observation [33]
    # row 1: model [14], observation [34], model [15, 16], then 2 pads
    return Rollouts(prompt_ids=[[5, 6], [7]], response_ids=torch.tensor([[11, 12, 31, 32, 13, 33], [14, 34, 15, 16, 0, 0]]),
                    logprobs=-torch.tensor([[0.1, 0.2, 0, 0, 0.3, 0], [0.4, 0, 0.5, 0.6, 0, 0]]),
                    response_lengths=torch.tensor([6, 4]), finish_reasons=["stop", "stop"], completions=["", ""],
                    weights_version=0,
                    response_loss_mask=torch.tensor([[1.0, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]]),
                    response_turn_index=turns)


@pytest.mark.parametrize("turns", [None, torch.tensor([[1, 1, 1, 1, 2, 2], [1, 1, 2, 2, 0, 0]])])
def test_build_train_batch_two_segments(turns):
    # Width = max(2 + 6, 1 + 4) = 8. Row 0: prompt [5, 6] at t0-1, then 11 12 | 31 32 | 13 | 33 at t2-7:
    #   loss_mask 1 on 11, 12, 13 (t2, t3, t6); turn 1 on 11 12 31 32 (t2-5), 2 on 13 33 (t6-7), 0 on the prompt.
    # Row 1: prompt [7] at t0, then 14 | 34 | 15 16 at t1-4, pads t5-7:
    #   loss_mask 1 on t1, t3, t4; turn 1 on 14 34 (t1-2), 2 on 15 16 (t3-4), 0 on the prompt and the pads.
    # Without turns given, they come from the mask: a segment starts at a model token after an observation.
    batch = build_train_batch(_two_segment_rollouts(turns), pad_token_id=9)
    assert batch.input_ids.tolist() == [[5, 6, 11, 12, 31, 32, 13, 33], [7, 14, 34, 15, 16, 9, 9, 9]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1, 0], [0, 1, 0, 1, 1, 0, 0, 0]]
    assert batch.turn_index.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 2, 2, 0, 0, 0]]
    assert batch.turn_index.dtype == torch.long
    assert batch.select(slice(1, 2)).turn_index.tolist() == [[0, 1, 1, 2, 2]]  # trimmed with the rows


def test_advantage_batch_on_two_segments_trains_only_model_tokens():
    # GRPO, rewards (1, 0) in one group: +-0.7071 on the model tokens (loss_mask above), 0 on observations.
    # Row 0's outcome sits on its last model token (t6), not on the final observation (t7).
    batch, _, _ = advantage_batch(_two_segment_rollouts(), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                  AdvantageSpec("grpo", pad_token_id=9))
    torch.testing.assert_close(batch.tensors["advantages"], torch.tensor([0.70710, -0.70710])[:, None] * batch.loss_mask,
                               atol=1e-4, rtol=0)
    assert batch.turn_index.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 2, 2, 0, 0, 0]]
    reinforce, _, _ = advantage_batch(_two_segment_rollouts(), torch.tensor([1.0, 0.0]), torch.tensor([0, 1]),
                                      AdvantageSpec("reinforce_pp", pad_token_id=9, options={"gamma": 0.5, "whiten": False}))
    # gamma 0.5 over model tokens only: row 0 t6 = 1, t3 = 0.5, t2 = 0.25 (the observations t4, t5 are not steps)
    assert reinforce.tensors["advantages"][0].tolist() == [0, 0, 0.25, 0.5, 0, 0, 1.0, 0]


def test_concat_rollouts_keeps_the_multi_turn_masks():
    multi = _two_segment_rollouts()
    single = Rollouts(prompt_ids=[[1]], response_ids=torch.tensor([[21, 22]]), logprobs=torch.zeros(1, 2),
                      response_lengths=torch.tensor([2]), finish_reasons=["stop"], completions=[""], weights_version=0)
    joined = concat_rollouts([multi, single], [[1], [0]])
    assert joined.response_loss_mask.tolist() == [[1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert joined.response_turn_index.tolist() == [[1, 1, 2, 2, 2, 2], [1, 1, 0, 0, 0, 0]]  # widened with 0s
    assert concat_rollouts([single, single], [[0], [0]]).response_loss_mask is None
