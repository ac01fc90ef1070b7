"""GRPO advantages: hand-worked groups, a plain-loop reference, masking and errors."""

import math

import pytest
import torch

from engines.algorithms import advantages


def _outcome_batch(rewards: list[float], lengths: list[int], seq_len: int = 5):
    """Rewards on the last response token of rows whose responses fill the first ``lengths`` positions."""
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).float()  # [B, L]
    token_rewards = torch.zeros(len(rewards), seq_len)  # [B, L]
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        token_rewards[i, n - 1] = r
    return token_rewards, mask


def test_names():
    assert "grpo" in advantages.names()


def test_one_group_hand_worked():
    # r = [1, 0, 0, 1]: mean 0.5, deviations [+.5, -.5, -.5, +.5], sum of squares 4 * 0.25 = 1,
    # unbiased var = 1 / (4 - 1) = 0.3333, std = 0.57735 -> A = +-0.5 / 0.57735 = +-0.86603.
    R, M = _outcome_batch([1.0, 0.0, 0.0, 1.0], lengths=[2, 5, 3, 1])
    adv, ret = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=torch.zeros(4, dtype=torch.long))
    expected_seq = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254])
    torch.testing.assert_close(adv, expected_seq[:, None] * M, atol=1e-5, rtol=0)
    assert ret is adv or torch.equal(ret, adv)


def test_unsorted_noncontiguous_groups_hand_worked():
    # G = [7, 3, 7, 3, 3], r = [2, 1, 0, 4, 1].
    # group 7: r = [2, 0], mean 1, dev [+1, -1], var = 2 / 1 = 2, std 1.41421 -> A = [+0.70711, -0.70711]
    # group 3: r = [1, 4, 1], mean 2, dev [-1, +2, -1], var = 6 / 2 = 3, std 1.73205
    #          -> A = [-0.57735, +1.15470, -0.57735]
    R, M = _outcome_batch([2.0, 1.0, 0.0, 4.0, 1.0], lengths=[5, 4, 3, 2, 1])
    G = torch.tensor([7, 3, 7, 3, 3])
    adv, _ = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=G)
    expected_seq = torch.tensor([0.7071068, -0.5773503, -0.7071068, 1.1547005, -0.5773503])
    torch.testing.assert_close(adv, expected_seq[:, None] * M, atol=1e-5, rtol=0)


def test_without_std_is_mean_baseline():
    # Same batch, norm_by_std=False: r - mean = group 7: [2-1, 0-1]; group 3: [1-2, 4-2, 1-2].
    R, M = _outcome_batch([2.0, 1.0, 0.0, 4.0, 1.0], lengths=[5, 4, 3, 2, 1])
    G = torch.tensor([7, 3, 7, 3, 3])
    adv, _ = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=G, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 2.0, -1.0])[:, None] * M)


def test_singleton_and_constant_groups_give_zero_not_nan():
    # group 0 = [5] alone: std defined as 1, A = (5 - 5) / (1 + eps) = 0.
    # group 1 = [1, 0]: mean 0.5, var = 0.5 / 1, std 0.70711 -> A = +-0.70711.
    # group 2 = [3, 3]: std 0 -> A = 0 / eps = 0.
    R, M = _outcome_batch([5.0, 1.0, 0.0, 3.0, 3.0], lengths=[1, 2, 3, 4, 5])
    G = torch.tensor([0, 1, 1, 2, 2])
    adv, _ = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=G)
    assert torch.isfinite(adv).all()
    expected_seq = torch.tensor([0.0, 0.7071068, -0.7071068, 0.0, 0.0])
    torch.testing.assert_close(adv, expected_seq[:, None] * M, atol=1e-5, rtol=0)


def test_singleton_std_is_one_even_without_eps():
    # With eps = 0 a singleton's 0 / std would be 0 / 0 = NaN if its std were 0; defined as 1 it is 0.
    # group 1 = [1, 0] as above -> +-0.70711 exactly (no eps).
    R, M = _outcome_batch([5.0, 1.0, 0.0], lengths=[1, 2, 3])
    adv, _ = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=torch.tensor([0, 1, 1]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.7071068, -0.7071068])[:, None] * M)


def test_sequence_reward_is_masked_token_sum():
    # Row 0 has token rewards 0.25 + 0.75 = 1 inside the mask and a 100 on a prompt position (outside
    # the mask, ignored); row 1 has 0. So r = [1, 0], mean 0.5, std sqrt(0.5) -> A = +-0.70711.
    R = torch.tensor([[100.0, 0.25, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0]])
    M = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    adv, _ = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=torch.tensor([4, 4]))
    torch.testing.assert_close(adv, torch.tensor([0.7071068, -0.7071068])[:, None] * M, atol=1e-5, rtol=0)


def _loop_reference(rewards, mask, group_ids, norm_by_std=True, eps=1e-6):
    """GRPO one group at a time in plain python, the way the paper states it."""
    scores = [sum(r * m for r, m in zip(rr, mr)) for rr, mr in zip(rewards, mask)]
    out = []
    for i, g in enumerate(group_ids):
        members = [scores[j] for j, h in enumerate(group_ids) if h == g]
        mean = sum(members) / len(members)
        if len(members) > 1:
            std = math.sqrt(sum((s - mean) ** 2 for s in members) / (len(members) - 1))
        else:
            std = 1.0
        a = scores[i] - mean
        if norm_by_std:
            a = a / (std + eps)
        out.append([a * m for m in mask[i]])
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_loop_reference(norm_by_std):
    gen = torch.Generator().manual_seed(0)
    B, L = 24, 7
    G = torch.randint(0, 9, (B,), generator=gen) * 11 - 30  # unsorted, gaps, negatives, some singletons
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    M = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float64)
    R = torch.randn(B, L, generator=gen, dtype=torch.float64)  # dense rewards, also outside the mask
    adv, _ = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=G, norm_by_std=norm_by_std)
    expected = torch.tensor(_loop_reference(R.tolist(), M.tolist(), G.tolist(), norm_by_std), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)


def test_zero_outside_mask_and_no_grad():
    R, M = _outcome_batch([1.0, 0.0, 3.0], lengths=[2, 3, 1])
    R.requires_grad_(True)
    values = torch.randn(3, 5)  # GRPO ignores the critic
    G = torch.zeros(3, dtype=torch.long)
    adv, ret = advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=G, values=values)
    assert (adv[M == 0] == 0).all() and (ret[M == 0] == 0).all()
    assert (adv[M == 1] != 0).all()
    assert not adv.requires_grad


def test_unknown_name_lists_names():
    R, M = _outcome_batch([1.0, 0.0], lengths=[1, 1])
    with pytest.raises(KeyError, match="grpo"):
        advantages.compute("gea", token_rewards=R, response_mask=M, group_ids=torch.zeros(2, dtype=torch.long))


def test_unknown_option_is_type_error():
    R, M = _outcome_batch([1.0, 0.0], lengths=[1, 1])
    G = torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="gamma"):
        advantages.compute("grpo", token_rewards=R, response_mask=M, group_ids=G, gamma=0.99)
