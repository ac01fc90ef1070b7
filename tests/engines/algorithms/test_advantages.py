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
    adv, ret = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=torch.zeros(4, dtype=torch.long))
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
    adv, _ = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=G)
    expected_seq = torch.tensor([0.7071068, -0.5773503, -0.7071068, 1.1547005, -0.5773503])
    torch.testing.assert_close(adv, expected_seq[:, None] * M, atol=1e-5, rtol=0)


def test_without_std_is_mean_baseline():
    # Same batch, norm_by_std=False: r - mean = group 7: [2-1, 0-1]; group 3: [1-2, 4-2, 1-2].
    R, M = _outcome_batch([2.0, 1.0, 0.0, 4.0, 1.0], lengths=[5, 4, 3, 2, 1])
    G = torch.tensor([7, 3, 7, 3, 3])
    adv, _ = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=G, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 2.0, -1.0])[:, None] * M)


def test_singleton_and_constant_groups_give_zero_not_nan():
    # group 0 = [5] alone: std defined as 1, A = (5 - 5) / (1 + eps) = 0.
    # group 1 = [1, 0]: mean 0.5, var = 0.5 / 1, std 0.70711 -> A = +-0.70711.
    # group 2 = [3, 3]: std 0 -> A = 0 / eps = 0.
    R, M = _outcome_batch([5.0, 1.0, 0.0, 3.0, 3.0], lengths=[1, 2, 3, 4, 5])
    G = torch.tensor([0, 1, 1, 2, 2])
    adv, _ = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=G)
    assert torch.isfinite(adv).all()
    expected_seq = torch.tensor([0.0, 0.7071068, -0.7071068, 0.0, 0.0])
    torch.testing.assert_close(adv, expected_seq[:, None] * M, atol=1e-5, rtol=0)


def test_singleton_std_is_one_even_without_eps():
    # With eps = 0 a singleton's 0 / std would be 0 / 0 = NaN if its std were 0; defined as 1 it is 0.
    # group 1 = [1, 0] as above -> +-0.70711 exactly (no eps).
    R, M = _outcome_batch([5.0, 1.0, 0.0], lengths=[1, 2, 3])
    adv, _ = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=torch.tensor([0, 1, 1]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.7071068, -0.7071068])[:, None] * M)


def test_sequence_reward_is_masked_token_sum():
    # Row 0 has token rewards 0.25 + 0.75 = 1 inside the mask and a 100 on a prompt position (outside
    # the mask, ignored); row 1 has 0. So r = [1, 0], mean 0.5, std sqrt(0.5) -> A = +-0.70711.
    R = torch.tensor([[100.0, 0.25, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0]])
    M = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    adv, _ = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=torch.tensor([4, 4]))
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


@pytest.mark.invariant
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_loop_reference(norm_by_std):
    gen = torch.Generator().manual_seed(0)
    B, L = 24, 7
    G = torch.randint(0, 9, (B,), generator=gen) * 11 - 30  # unsorted, gaps, negatives, some singletons
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    M = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float64)
    R = torch.randn(B, L, generator=gen, dtype=torch.float64)  # dense rewards, also outside the mask
    adv, _ = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=G, norm_by_std=norm_by_std)
    expected = torch.tensor(_loop_reference(R.tolist(), M.tolist(), G.tolist(), norm_by_std), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)


def test_zero_outside_mask_and_no_grad():
    R, M = _outcome_batch([1.0, 0.0, 3.0], lengths=[2, 3, 1])
    R.requires_grad_(True)
    values = torch.randn(3, 5)  # GRPO ignores the critic
    G = torch.zeros(3, dtype=torch.long)
    adv, ret = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=G, values=values)
    assert (adv[M == 0] == 0).all() and (ret[M == 0] == 0).all()
    assert (adv[M == 1] != 0).all()
    assert not adv.requires_grad


def test_unknown_name_lists_names():
    R, M = _outcome_batch([1.0, 0.0], lengths=[1, 1])
    with pytest.raises(KeyError, match="grpo"):
        advantages.compute("gea", token_rewards=R, loss_mask=M, group_ids=torch.zeros(2, dtype=torch.long))


def test_unknown_option_is_type_error():
    R, M = _outcome_batch([1.0, 0.0], lengths=[1, 1])
    G = torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="gamma"):
        advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=G, gamma=0.99)


# -- every estimator: shared helpers ------------------------------------------------------------------


def _prompted_batch(rewards: list[float], starts: list[int], lengths: list[int], seq_len: int = 5):
    """Rows whose response fills ``[start, start + length)``: prompt tokens before it, right padding after.

    The outcome reward sits on the last response token; every other position of ``R`` is 0.
    """
    pos = torch.arange(seq_len)[None, :]
    start, end = torch.tensor(starts)[:, None], torch.tensor(starts)[:, None] + torch.tensor(lengths)[:, None]
    mask = ((pos >= start) & (pos < end)).float()  # [B, L]
    token_rewards = torch.zeros(len(rewards), seq_len)  # [B, L]
    for i, (r, s, n) in enumerate(zip(rewards, starts, lengths)):
        token_rewards[i, s + n - 1] = r
    return token_rewards, mask


def _random_batch(seed: int, *, B: int = 26, L: int = 10, outcome_levels: int = 0):
    """Random float64 batch: 0-2 prompt tokens, then a response of 1..L-2 tokens, then right padding
    (a response may also run to the end of the row, as a truncated one does).

    ``R`` is dense noise everywhere (also outside the mask, where it must be ignored) unless
    ``outcome_levels`` > 0, then only the last response token holds a reward in {0, 1/k, ..., 1}
    (ties inside groups). Group ids are unsorted, with gaps, negatives, uneven sizes and a singleton.
    """
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 3, (B,), generator=gen)
    lengths = torch.randint(1, L - 1, (B,), generator=gen)
    pos = torch.arange(L)[None, :]
    M = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).to(torch.float64)  # [B, L]
    R = torch.randn(B, L, generator=gen, dtype=torch.float64)  # [B, L]
    if outcome_levels:
        levels = torch.randint(0, outcome_levels + 1, (B,), generator=gen).to(torch.float64) / outcome_levels
        R = torch.zeros(B, L, dtype=torch.float64)
        R[torch.arange(B), starts + lengths - 1] = levels
    V = torch.randn(B, L, generator=gen, dtype=torch.float64)  # [B, L], also noise outside the mask
    G = torch.randint(0, 7, (B,), generator=gen) * 13 - 40  # [B]
    G[-1] = 999  # a singleton group
    assert (M[:, 0] == 0).any() and (M[:, -1] == 0).any()  # some prompts, some right padding
    return R, M, G, V


def _plain(R, M, G, V=None):
    return R.tolist(), M.tolist(), G.tolist(), (V.tolist() if V is not None else None)


def _scores(R, M):
    """r_i = sum_t R[i, t] M[i, t], plain python."""
    return [sum(r * m for r, m in zip(rr, mr)) for rr, mr in zip(R, M)]


def _members(G, i):
    return [j for j, g in enumerate(G) if g == G[i]]


def _broadcast(seq_values, M):
    """A[i, t] = A_i * M[i, t]."""
    return [[a * m for m in mr] for a, mr in zip(seq_values, M)]


def _whiten(rows, M, eps=1e-8):
    """(X - mean) / sqrt(var + eps) over the masked entries, unbiased var; 0 outside the mask."""
    flat = [x for xr, mr in zip(rows, M) for x, m in zip(xr, mr) if m]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + eps) if m else 0.0 for x, m in zip(xr, mr)] for xr, mr in zip(rows, M)]


def _returns(R, M, gamma):
    """G[i, t] = sum_{k >= t, k in the response} gamma^(k - t) R[i, k] on the response, 0 elsewhere."""
    out = []
    for rr, mr in zip(R, M):
        L = len(rr)
        out.append([sum(gamma ** (k - t) * rr[k] for k in range(t, L) if mr[k]) if mr[t] else 0.0 for t in range(L)])
    return out


def _compute(name, R, M, G, V=None, **options):
    return advantages.compute(name, token_rewards=R, loss_mask=M, group_ids=G, values=V, **options)


def _as_tensor(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_all_estimators_registered():
    assert advantages.names() == sorted(
        ["dr_grpo", "gae", "grpo", "lite_ppo", "raft_pp", "reinforce_pp", "reinforce_pp_baseline", "rloo", "topr"]
    )


@pytest.mark.invariant
@pytest.mark.parametrize("name", advantages.names())
def test_every_estimator_zero_outside_mask_finite_and_no_grad(name):
    R, M, G, V = _random_batch(1)
    R.requires_grad_(True)
    V.requires_grad_(True)
    adv, ret = _compute(name, R, M, G, V)
    assert adv.shape == ret.shape == M.shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[M == 0] == 0).all() and (ret[M == 0] == 0).all()
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.invariant
@pytest.mark.parametrize("name", advantages.names())
def test_every_estimator_ignores_everything_outside_mask(name):
    # Rewards and values on prompt/padding positions (here +-1e3) must not change any output.
    R, M, G, V = _random_batch(2)
    noise = torch.where(M > 0, torch.zeros_like(R), torch.full_like(R, 1e3))
    adv_a, ret_a = _compute(name, R, M, G, V)
    adv_b, ret_b = _compute(name, R + noise, M, G, V - noise)
    torch.testing.assert_close(adv_b, adv_a, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret_b, ret_a, rtol=1e-10, atol=1e-10)


# -- helpers: group_mean_std, group_max, discounted_returns --------------------------------------------


def test_group_mean_std_and_max_hand_worked():
    # G = [5, -2, 5, 5, 8], s = [1, 4, 2, 6, 3]
    # group 5: s = [1, 2, 6], mean 3, dev [-2, -1, 3], var = (4 + 1 + 9) / 2 = 7, std 2.64575, max 6
    # group -2: s = [4] alone: mean 4, std defined as 1, max 4; group 8: s = [3]: mean 3, std 1, max 3
    s = torch.tensor([1.0, 4.0, 2.0, 6.0, 3.0])
    G = torch.tensor([5, -2, 5, 5, 8])
    mean, std = advantages.group_mean_std(s, G)
    torch.testing.assert_close(mean, torch.tensor([3.0, 4.0, 3.0, 3.0, 3.0]))
    torch.testing.assert_close(std, torch.tensor([math.sqrt(7), 1.0, math.sqrt(7), math.sqrt(7), 1.0]))
    torch.testing.assert_close(advantages.group_max(s, G), torch.tensor([6.0, 4.0, 6.0, 6.0, 3.0]))


@pytest.mark.invariant
def test_group_helpers_match_loop_reference():
    gen = torch.Generator().manual_seed(3)
    G = torch.randint(0, 6, (30,), generator=gen) * 7 - 11
    G[0] = 1000
    s = torch.randn(30, generator=gen, dtype=torch.float64)
    mean, std = advantages.group_mean_std(s, G)
    top = advantages.group_max(s, G)
    sl, gl = s.tolist(), G.tolist()
    for i in range(len(sl)):
        xs = [sl[j] for j in _members(gl, i)]
        mu = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 1.0
        assert mean[i].item() == pytest.approx(mu, rel=1e-12, abs=1e-12)
        assert std[i].item() == pytest.approx(sd, rel=1e-12)
        assert top[i].item() == max(xs)


def test_discounted_returns_hand_worked():
    # Row 0: prompt t0 (reward 100 there is ignored), response t1..t3 with R = [1, 0, 2], pad t4.
    # gamma = 0.5: G3 = 2, G2 = 0 + 0.5 * 2 = 1, G1 = 1 + 0.5 * 1 = 1.5; 0 on t0 and t4.
    R = torch.tensor([[100.0, 1.0, 0.0, 2.0, 7.0]])
    M = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(advantages.discounted_returns(R, M, 0.5), torch.tensor([[0.0, 1.5, 1.0, 2.0, 0.0]]))


@pytest.mark.invariant
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_match_loop_reference(gamma):
    R, M, _, _ = _random_batch(4)
    got = advantages.discounted_returns(R, M, gamma)
    torch.testing.assert_close(got, _as_tensor(_returns(R.tolist(), M.tolist(), gamma)), rtol=1e-12, atol=1e-12)


# -- dr_grpo --------------------------------------------------------------------------------------------


def test_dr_grpo_hand_worked():
    # G = [2, 9, 2, 9, 2], r = [3, 1, 0, 5, 0]; no std division.
    # group 2: r = [3, 0, 0], mean 1 -> A = [3 - 1, 0 - 1, 0 - 1] = [2, -1, -1]
    # group 9: r = [1, 5], mean 3 -> A = [1 - 3, 5 - 3] = [-2, 2]
    R, M = _prompted_batch([3.0, 1.0, 0.0, 5.0, 0.0], starts=[0, 1, 2, 0, 1], lengths=[5, 3, 2, 1, 4])
    G = torch.tensor([2, 9, 2, 9, 2])
    adv, ret = _compute("dr_grpo", R, M, G)
    torch.testing.assert_close(adv, torch.tensor([2.0, -2.0, -1.0, 2.0, -1.0])[:, None] * M)
    torch.testing.assert_close(ret, adv)
    # The same as GRPO without the std division.
    torch.testing.assert_close(adv, _compute("grpo", R, M, G, norm_by_std=False)[0])


@pytest.mark.invariant
def test_dr_grpo_matches_loop_reference():
    R, M, G, _ = _random_batch(5)
    Rl, Ml, Gl, _ = _plain(R, M, G)
    s = _scores(Rl, Ml)
    expected = [s[i] - sum(s[j] for j in _members(Gl, i)) / len(_members(Gl, i)) for i in range(len(s))]
    adv, _ = _compute("dr_grpo", R, M, G)
    torch.testing.assert_close(adv, _as_tensor(_broadcast(expected, Ml)), rtol=1e-10, atol=1e-12)


# -- rloo -----------------------------------------------------------------------------------------------


def test_rloo_hand_worked():
    # G = [0, 0, 0, 1, 1, 2], r = [1, 0, 2, 4, 1, 7]
    # group 0 (n = 3): A_0 = 1 - (0 + 2) / 2 = 0, A_1 = 0 - (1 + 2) / 2 = -1.5, A_2 = 2 - (1 + 0) / 2 = 1.5
    #   check: n / (n - 1) * (r - mean) = 1.5 * ([1, 0, 2] - 1) = [0, -1.5, 1.5]
    # group 1 (n = 2): A = [4 - 1, 1 - 4] = [3, -3];  group 2 (n = 1): nobody to compare with -> 0
    R, M = _prompted_batch([1.0, 0.0, 2.0, 4.0, 1.0, 7.0], starts=[0, 1, 2, 0, 3, 1], lengths=[2, 4, 3, 1, 2, 3])
    G = torch.tensor([0, 0, 0, 1, 1, 2])
    adv, ret = _compute("rloo", R, M, G)
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 3.0, -3.0, 0.0])[:, None] * M)
    torch.testing.assert_close(ret, adv)


@pytest.mark.invariant
def test_rloo_matches_loop_reference():
    R, M, G, _ = _random_batch(6)
    Rl, Ml, Gl, _ = _plain(R, M, G)
    s = _scores(Rl, Ml)
    expected = []
    for i in range(len(s)):
        others = [s[j] for j in _members(Gl, i) if j != i]
        expected.append(s[i] - sum(others) / len(others) if others else 0.0)
    adv, _ = _compute("rloo", R, M, G)
    torch.testing.assert_close(adv, _as_tensor(_broadcast(expected, Ml)), rtol=1e-10, atol=1e-12)


# -- reinforce_pp ---------------------------------------------------------------------------------------


def test_reinforce_pp_hand_worked():
    # gamma = 0.5. Row 0: prompt t0 (its 100 is ignored), response t1..t2 with R = [0, 1], pad t3.
    #   G = [_, 0 + 0.5 * 1, 1, _] = [_, 0.5, 1, _]
    # Row 1: response t0..t2 with R = [1, 0, 2], pad t3: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5
    # Whiten over the 5 response tokens {0.5, 1, 1.5, 1, 2}: mean 6 / 5 = 1.2,
    #   dev [-0.7, -0.2, 0.3, -0.2, 0.8], sum sq 0.49 + 0.04 + 0.09 + 0.04 + 0.64 = 1.3,
    #   unbiased var 1.3 / 4 = 0.325, std 0.5700877 -> A = dev / std
    R = torch.tensor([[100.0, 0.0, 1.0, 0.0], [1.0, 0.0, 2.0, 0.0]])
    M = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    adv, ret = _compute("reinforce_pp", R, M, torch.tensor([0, 1]), gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.5, 1.0, 0.0], [1.5, 1.0, 2.0, 0.0]]))
    std = math.sqrt(0.325)
    expected = torch.tensor([[0.0, -0.7, -0.2, 0.0], [0.3, -0.2, 0.8, 0.0]]) / std
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    # whiten=False: the advantages are the returns themselves.
    adv, ret = _compute("reinforce_pp", R, M, torch.tensor([0, 1]), gamma=0.5, whiten=False)
    torch.testing.assert_close(adv, ret)


@pytest.mark.invariant
@pytest.mark.parametrize("gamma, whiten", [(1.0, True), (0.9, True), (0.7, False)])
def test_reinforce_pp_matches_loop_reference(gamma, whiten):
    R, M, G, _ = _random_batch(7)
    Rl, Ml, _, _ = _plain(R, M, G)
    returns = _returns(Rl, Ml, gamma)
    expected = _whiten(returns, Ml) if whiten else returns
    adv, ret = _compute("reinforce_pp", R, M, G, gamma=gamma, whiten=whiten)
    torch.testing.assert_close(ret, _as_tensor(returns), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv, _as_tensor(expected), rtol=1e-9, atol=1e-10)


# -- reinforce_pp_baseline ------------------------------------------------------------------------------


def test_reinforce_pp_baseline_hand_worked():
    # One group, gamma = 0.5, a KL penalty in the token rewards (kl.mode: reward):
    # row 0: prompt t0, response t1..t3, outcome r0 = 1, penalty -0.1 per token -> R = [_, -0.1, -0.1, 0.9, _]
    # row 1: response t0..t1, outcome r1 = 0, penalty -0.2 per token            -> R = [-0.2, -0.2, _, _, _]
    # The baseline is the group mean of the outcomes alone, (1 + 0) / 2 = 0.5 (the reward sums with the
    # penalties, 0.7 and -0.4, would give 0.15), taken off where the outcome sits (the last model token):
    #   R' = [_, -0.1, -0.1, 0.4, _] and [-0.2, -0.7, _, _, _]
    # G (discounted with 0.5): row 0: G3 = 0.4, G2 = -0.1 + 0.2 = 0.1, G1 = -0.1 + 0.05 = -0.05
    #                          row 1: G1 = -0.7, G0 = -0.2 - 0.35 = -0.55
    R = torch.tensor([[0.0, -0.1, -0.1, 0.9, 0.0], [-0.2, -0.2, 0.0, 0.0, 0.0]], dtype=torch.float64)
    M = torch.tensor([[0.0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    G, r = torch.tensor([3, 3]), torch.tensor([1.0, 0.0], dtype=torch.float64)
    adv, ret = _compute("reinforce_pp_baseline", R, M, G, outcome_rewards=r, gamma=0.5, whiten=False)
    expected = torch.tensor([[0.0, -0.05, 0.1, 0.4, 0.0], [-0.55, -0.7, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(ret, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    # Whitened over the 5 model tokens {-0.05, 0.1, 0.4, -0.55, -0.7}: mean -0.8 / 5 = -0.16,
    #   dev [0.11, 0.26, 0.56, -0.39, -0.54], sum sq 0.0121 + 0.0676 + 0.3136 + 0.1521 + 0.2916 = 0.837,
    #   unbiased var 0.837 / 4 = 0.20925 -> A = dev / sqrt(0.20925 + 1e-8); returns stay G.
    adv, ret = _compute("reinforce_pp_baseline", R, M, G, outcome_rewards=r, gamma=0.5)
    dev = torch.tensor([[0.0, 0.11, 0.26, 0.56, 0.0], [-0.39, -0.54, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, dev / math.sqrt(0.20925 + 1e-8), rtol=0, atol=1e-9)
    torch.testing.assert_close(ret, expected, rtol=0, atol=1e-12)
    # Without outcome_rewards (no KL in the reward) r_i is the row's reward sum: here 0.7 and -0.4, mean 0.15.
    # gamma 1: row 0 R' = [_, -0.1, -0.1, 0.75, _] -> G = [_, 0.55, 0.65, 0.75, _]; row 1 R' = [-0.2, -0.35] -> [-0.55, -0.35]
    adv, _ = _compute("reinforce_pp_baseline", R, M, G, gamma=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.55, 0.65, 0.75, 0.0], [-0.55, -0.35, 0.0, 0.0, 0.0]],
                                                 dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.invariant
@pytest.mark.parametrize("gamma, whiten", [(1.0, True), (0.8, True), (0.9, False)])
def test_reinforce_pp_baseline_matches_loop_reference(gamma, whiten):
    R, M, G, _ = _random_batch(8)  # R: dense per-token rewards (penalties), outcomes apart
    outcomes = torch.randn(len(G), generator=torch.Generator().manual_seed(80), dtype=torch.float64)
    Rl, Ml, Gl, _ = _plain(R, M, G)
    r = outcomes.tolist()
    centred_rewards = []
    for i, (rr, mr) in enumerate(zip(Rl, Ml)):
        last = max(t for t, m in enumerate(mr) if m)  # the outcome's token
        mean = sum(r[j] for j in _members(Gl, i)) / len(_members(Gl, i))
        centred_rewards.append([x * m - (mean if t == last else 0.0) for t, (x, m) in enumerate(zip(rr, mr))])
    returns = _returns(centred_rewards, Ml, gamma)
    expected = _whiten(returns, Ml) if whiten else returns
    adv, ret = _compute("reinforce_pp_baseline", R, M, G, outcome_rewards=outcomes, gamma=gamma, whiten=whiten)
    torch.testing.assert_close(ret, _as_tensor(returns), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv, _as_tensor(expected), rtol=1e-9, atol=1e-10)


# -- lite_ppo -------------------------------------------------------------------------------------------


def test_lite_ppo_hand_worked():
    # G = [1, 1, 2, 2], r = [1, 0, 1, 1]. Group means [0.5, 0.5, 1, 1] -> r - mean = [0.5, -0.5, 0, 0].
    # Batch std of [1, 0, 1, 1]: mean 0.75, dev [.25, -.75, .25, .25], sum sq 0.75, var 0.75 / 3 = 0.25, std 0.5
    # -> A = [1, -1, 0, 0] (up to eps = 1e-6). GRPO's group std would give +-0.70711 for group 1 instead.
    R, M = _prompted_batch([1.0, 0.0, 1.0, 1.0], starts=[0, 2, 1, 0], lengths=[3, 2, 1, 5])
    G = torch.tensor([1, 1, 2, 2])
    adv, ret = _compute("lite_ppo", R, M, G)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None] * M, rtol=0, atol=1e-5)
    torch.testing.assert_close(ret, adv)


@pytest.mark.invariant
@pytest.mark.parametrize("eps", [1e-6, 0.3])
def test_lite_ppo_matches_loop_reference(eps):
    R, M, G, _ = _random_batch(9)
    Rl, Ml, Gl, _ = _plain(R, M, G)
    s = _scores(Rl, Ml)
    mu_b = sum(s) / len(s)
    std_b = math.sqrt(sum((x - mu_b) ** 2 for x in s) / (len(s) - 1))
    expected = [(s[i] - sum(s[j] for j in _members(Gl, i)) / len(_members(Gl, i))) / (std_b + eps) for i in range(len(s))]
    adv, _ = _compute("lite_ppo", R, M, G, eps=eps)
    torch.testing.assert_close(adv, _as_tensor(_broadcast(expected, Ml)), rtol=1e-10, atol=1e-12)


# -- raft_pp --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "threshold, expected",
    [
        # G = [0, 0, 0, 1, 1, 2, 2], r = [1, 0, 1, 0.3, 0.7, 0, 0]
        # threshold 0: group 0 max 1 -> rows 0 and 2 (ties both kept); group 1 max 0.7 -> row 4;
        #   group 2 max 0, but 0 > 0 is false -> nobody.
        (0.0, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]),
        # threshold 0.8: group 1's best (0.7) is no longer good enough.
        (0.8, [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
        # threshold -1: group 2's all-zero rows are each the max and above -1 -> both kept.
        (-1.0, [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
    ],
)
def test_raft_pp_hand_worked(threshold, expected):
    R, M = _prompted_batch([1.0, 0.0, 1.0, 0.3, 0.7, 0.0, 0.0], starts=[0, 1, 2, 0, 1, 2, 0], lengths=[2, 3, 1, 4, 2, 3, 5])
    G = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    adv, ret = _compute("raft_pp", R, M, G, threshold=threshold)
    torch.testing.assert_close(adv, torch.tensor(expected)[:, None] * M)
    torch.testing.assert_close(ret, adv)


@pytest.mark.invariant
@pytest.mark.parametrize("threshold", [0.0, 0.4])
def test_raft_pp_matches_loop_reference(threshold):
    R, M, G, _ = _random_batch(10, outcome_levels=2)  # rewards in {0, 0.5, 1}: ties and all-zero groups
    Rl, Ml, Gl, _ = _plain(R, M, G)
    s = _scores(Rl, Ml)
    expected = [1.0 if s[i] == max(s[j] for j in _members(Gl, i)) and s[i] > threshold else 0.0 for i in range(len(s))]
    assert 0 < sum(expected) < len(expected)
    adv, _ = _compute("raft_pp", R, M, G, threshold=threshold)
    torch.testing.assert_close(adv, _as_tensor(_broadcast(expected, Ml)), rtol=0, atol=0)


# -- topr (advantage) -----------------------------------------------------------------------------------


def test_topr_advantage_hand_worked():
    # baseline 0.5, positive_weight 2, negative_weight 0.5; r = [1, 0, -1, 0.5]
    # a = r - 0.5 = [0.5, -0.5, -1.5, 0]; A = [2 * 0.5, 0.5 * -0.5, 0.5 * -1.5, 2 * 0] = [1, -0.25, -0.75, 0]
    R, M = _prompted_batch([1.0, 0.0, -1.0, 0.5], starts=[1, 0, 2, 0], lengths=[3, 1, 2, 4])
    G = torch.tensor([3, 3, 1, 1])  # ignored
    adv, ret = _compute("topr", R, M, G, baseline=0.5, positive_weight=2.0, negative_weight=0.5)
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.25, -0.75, 0.0])[:, None] * M)
    torch.testing.assert_close(ret, adv)
    # Defaults (baseline 0, weights 1): the raw sequence rewards.
    adv, _ = _compute("topr", R, M, G)
    torch.testing.assert_close(adv, torch.tensor([1.0, 0.0, -1.0, 0.5])[:, None] * M)


@pytest.mark.invariant
@pytest.mark.parametrize("baseline, pos, neg", [(0.0, 1.0, 1.0), (0.3, 1.5, 0.25)])
def test_topr_advantage_matches_loop_reference(baseline, pos, neg):
    R, M, G, _ = _random_batch(11)
    Rl, Ml, _, _ = _plain(R, M, G)
    expected = []
    for r in _scores(Rl, Ml):
        a = r - baseline
        expected.append(pos * a if a >= 0 else neg * a)
    adv, _ = _compute("topr", R, M, G, baseline=baseline, positive_weight=pos, negative_weight=neg)
    torch.testing.assert_close(adv, _as_tensor(_broadcast(expected, Ml)), rtol=1e-12, atol=1e-12)


# -- gae ------------------------------------------------------------------------------------------------

# One row: prompt t0, response t1..t3, pad t4. The 9/7 values and 5/3 rewards outside the mask are ignored.
GAE_R = torch.tensor([[5.0, 0.0, 0.0, 1.0, 3.0]], dtype=torch.float64)
GAE_V = torch.tensor([[9.0, 0.5, 0.2, 0.4, 7.0]], dtype=torch.float64)
GAE_M = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    "gamma, lam, expected_adv",
    [
        # gamma 0.9, lam 0.5 (gamma * lam = 0.45):
        #   t3: V' = 0 (t4 is padding), delta = 1 - 0.4 = 0.6, A3 = 0.6
        #   t2: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16,  A2 = 0.16 + 0.45 * 0.6 = 0.43
        #   t1: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32, A1 = -0.32 + 0.45 * 0.43 = -0.1265
        (0.9, 0.5, [0.0, -0.1265, 0.43, 0.6, 0.0]),
        # lam = 1, gamma = 1: Monte-Carlo return minus V: sum of rewards = 1 -> A = 1 - [0.5, 0.2, 0.4]
        (1.0, 1.0, [0.0, 0.5, 0.8, 0.6, 0.0]),
        # lam = 0, gamma = 1: one-step TD: A = [0.2 - 0.5, 0.4 - 0.2, 1 - 0.4] = [-0.3, 0.2, 0.6]
        (1.0, 0.0, [0.0, -0.3, 0.2, 0.6, 0.0]),
    ],
)
def test_gae_hand_worked(gamma, lam, expected_adv):
    adv, ret = _compute("gae", GAE_R, GAE_M, torch.tensor([0]), GAE_V, gamma=gamma, lam=lam, whiten=False)
    expected = torch.tensor([expected_adv], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    # returns = A + V on the response: e.g. gamma 0.9: [-0.1265 + 0.5, 0.43 + 0.2, 0.6 + 0.4] = [0.3735, 0.63, 1.0]
    torch.testing.assert_close(ret, (expected + GAE_V) * GAE_M, rtol=0, atol=1e-12)


def test_gae_whitened_hand_worked():
    # gamma 0.9, lam 0.5 -> A = [-0.1265, 0.43, 0.6] (above); mean = 0.9035 / 3 = 0.3011667
    # dev = [-0.4276667, 0.1288333, 0.2988333], sum sq = 0.1828988 + 0.0165980 + 0.0893014 = 0.2887982
    # var = 0.2887982 / 2 = 0.1443991, std = 0.3799988 -> A = dev / std = [-1.1254421, 0.3390362, 0.7864060]
    adv, ret = _compute("gae", GAE_R, GAE_M, torch.tensor([0]), GAE_V, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.1254421, 0.3390362, 0.7864060, 0.0]], dtype=torch.float64),
                               rtol=0, atol=1e-6)
    # Returns come from the un-whitened advantages.
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.3735, 0.63, 1.0, 0.0]], dtype=torch.float64), rtol=0, atol=1e-12)


def _gae_loop(R, M, V, gamma, lam):
    """The docstring's recursion, one row and one token at a time, from the end of the row."""
    adv, ret = [], []
    for rr, mr, vr in zip(R, M, V):
        L = len(rr)
        a = [0.0] * L
        for t in reversed(range(L)):
            if not mr[t]:
                continue
            nxt_on = t + 1 < L and mr[t + 1] == 1
            next_v = vr[t + 1] if nxt_on else 0.0
            next_a = a[t + 1] if nxt_on else 0.0
            delta = rr[t] + gamma * next_v - vr[t]
            a[t] = delta + gamma * lam * next_a
        adv.append(a)
        ret.append([(x + v) if m else 0.0 for x, v, m in zip(a, vr, mr)])
    return adv, ret


@pytest.mark.invariant
@pytest.mark.parametrize("gamma, lam, whiten", [(1.0, 0.95, True), (0.9, 0.5, False), (0.99, 1.0, True), (0.8, 0.0, False)])
def test_gae_matches_loop_reference(gamma, lam, whiten):
    R, M, G, V = _random_batch(12)
    Rl, Ml, _, Vl = _plain(R, M, G, V)
    exp_adv, exp_ret = _gae_loop(Rl, Ml, Vl, gamma, lam)
    if whiten:
        exp_adv = _whiten(exp_adv, Ml)
    adv, ret = _compute("gae", R, M, G, V, gamma=gamma, lam=lam, whiten=whiten)
    torch.testing.assert_close(ret, _as_tensor(exp_ret), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv, _as_tensor(exp_adv), rtol=1e-9, atol=1e-10)


def test_gae_without_values_raises():
    with pytest.raises(ValueError, match="critic values"):
        _compute("gae", GAE_R, GAE_M, torch.tensor([0]), None)
