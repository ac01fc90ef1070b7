"""Reward and advantage shaping: masked moments, DAPO overlong and length penalties, running moments,
reward normalisation modes, dynamic-sampling filter and the two shaping pipelines. Hand-worked values
and plain-loop references on random inputs."""

import math

import pytest
import torch

from engines.algorithms import shaping
from engines.algorithms.shaping import RunningMoments, ShapingSpec

# Two rows: row 0 has a prompt token and right padding, row 1 only right padding. Values outside the
# mask (the 9s) must never count. Response tokens {1, 3, -2, 2}: mean 1, dev [0, 2, -3, 1],
# sum sq 0 + 4 + 9 + 1 = 14, unbiased var 14 / 3 = 4.6666667, std 2.1602469.
X = torch.tensor([[9.0, 1.0, 3.0, 9.0], [-2.0, 2.0, 9.0, 9.0]], dtype=torch.float64)
M = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
STD = math.sqrt(14 / 3)


def _mean(xs):
    return sum(xs) / len(xs)


def _var(xs):
    """Unbiased variance, plain python."""
    mu = _mean(xs)
    return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)


def _groups(G):
    """Group id -> member indices, plain python."""
    out = {}
    for i, g in enumerate(G):
        out.setdefault(g, []).append(i)
    return out


def _random_rewards(seed, B=25):
    """Sequence rewards [B], lengths [B] and unsorted, gappy, uneven group ids with a singleton."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, generator=gen, dtype=torch.float64) * 2
    lengths = torch.randint(0, 31, (B,), generator=gen)
    G = torch.randint(0, 6, (B,), generator=gen) * 5 - 12
    G[-1] = 77
    return rewards, lengths, G


# -- masked moments and whitening -----------------------------------------------------------------------


def test_masked_mean_var_whiten_hand_worked():
    assert shaping.masked_mean(X, M).item() == pytest.approx(1.0)
    assert shaping.masked_var(X, M).item() == pytest.approx(14 / 3)
    # (X - 1) / 2.1602469 on the response: [0, 0.9258201], [-1.3887301, 0.4629100]; exactly 0 elsewhere.
    expected = torch.tensor([[0.0, 0.0, 2.0, 0.0], [-3.0, 1.0, 0.0, 0.0]], dtype=torch.float64) / STD
    out = shaping.masked_whiten(X, M)
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=1e-12)
    assert (out[M == 0] == 0).all()


@pytest.mark.invariant
def test_masked_whiten_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 9, generator=gen, dtype=torch.float64) * 3 + 1
    starts = torch.randint(0, 3, (7,), generator=gen)
    ends = starts + torch.randint(1, 7, (7,), generator=gen)
    pos = torch.arange(9)[None, :]
    mask = ((pos >= starts[:, None]) & (pos < ends[:, None])).to(torch.float64)
    flat = [v for vr, mr in zip(x.tolist(), mask.tolist()) for v, m in zip(vr, mr) if m]
    mu, var = _mean(flat), _var(flat)
    expected = [[(v - mu) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(vr, mr)]
                for vr, mr in zip(x.tolist(), mask.tolist())]
    assert shaping.masked_mean(x, mask).item() == pytest.approx(mu, rel=1e-12)
    assert shaping.masked_var(x, mask).item() == pytest.approx(var, rel=1e-12)
    torch.testing.assert_close(shaping.masked_whiten(x, mask), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-10, atol=1e-12)


# -- DAPO overlong penalty and the linear length penalty -------------------------------------------------


@pytest.mark.parametrize(
    "factor, expected",
    [
        # L_max 10, L_cache 4 -> the ramp starts after 10 - 4 = 6 tokens:
        #   |y| = 3, 6 -> 0;  7 -> (6 - 7) / 4 = -0.25;  8 -> -0.5;  10 -> (6 - 10) / 4 = -1;  11, 20 -> -1
        (1.0, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]),
        # factor 0.5 halves every penalty
        (0.5, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5]),
    ],
)
def test_overlong_penalty_hand_worked(factor, expected):
    lengths = torch.tensor([3, 6, 7, 8, 10, 11, 20])
    out = shaping.overlong_penalty(lengths, max_length=10, buffer=4, factor=factor)
    assert out.tolist() == pytest.approx(expected, abs=1e-7)


def test_overlong_penalty_buffer_zero_disables():
    assert shaping.overlong_penalty(torch.tensor([1, 50, 500]), max_length=10, buffer=0).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.invariant
def test_overlong_penalty_matches_loop_reference():
    _, lengths, _ = _random_rewards(1, B=40)
    L_max, L_cache, factor = 20, 6, 0.7
    expected = []
    for y in lengths.tolist():  # DAPO eq. 13, case by case
        if y <= L_max - L_cache:
            r = 0.0
        elif y <= L_max:
            r = ((L_max - L_cache) - y) / L_cache
        else:
            r = -1.0
        expected.append(factor * r)
    assert len({e for e in expected}) > 3  # all three cases and several ramp values
    out = shaping.overlong_penalty(lengths, max_length=L_max, buffer=L_cache, factor=factor)
    assert out.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)


@pytest.mark.invariant
def test_length_penalty_hand_worked_and_loop_reference():
    # coef 0.1, max_length 20: -0.1 * [0, 5, 20, 30] / 20 = [0, -0.025, -0.1, -0.15]
    out = shaping.length_penalty(torch.tensor([0, 5, 20, 30]), coef=0.1, max_length=20)
    assert out.tolist() == pytest.approx([0.0, -0.025, -0.1, -0.15], rel=1e-6)
    _, lengths, _ = _random_rewards(2)
    out = shaping.length_penalty(lengths, coef=0.3, max_length=25)
    assert out.tolist() == pytest.approx([-0.3 * y / 25 for y in lengths.tolist()], rel=1e-6)


# -- running moments ------------------------------------------------------------------------------------


def test_running_moments_hand_worked():
    # [1, 2, 3]: count 3, mean 2, m2 = 1 + 0 + 1 = 2, std = sqrt(2 / 2) = 1
    m = RunningMoments().update(torch.tensor([1.0, 2.0, 3.0]))
    assert (m.count, m.mean, m.m2, m.std) == pytest.approx((3.0, 2.0, 2.0, 1.0))
    # + [4, 5]: batch mean 4.5, batch m2 0.5, delta = 4.5 - 2 = 2.5, total 5
    #   mean = 2 + 2.5 * 2 / 5 = 3;  m2 = 2 + 0.5 + 2.5^2 * 3 * 2 / 5 = 2.5 + 7.5 = 10
    #   std = sqrt(10 / 4) = 1.5811388, the unbiased std of [1, 2, 3, 4, 5]
    m = m.update(torch.tensor([4.0, 5.0]))
    assert (m.count, m.mean, m.m2, m.std) == pytest.approx((5.0, 3.0, 10.0, math.sqrt(2.5)))


def test_running_moments_edge_cases():
    assert RunningMoments().std == 1.0  # nothing seen yet
    one = RunningMoments().update(torch.tensor([4.0]))
    assert (one.count, one.mean, one.m2, one.std) == (1.0, 4.0, 0.0, 1.0)  # one sample: std defined as 1
    assert one.update(torch.tensor([])) is one  # an empty batch changes nothing


@pytest.mark.invariant
def test_running_moments_match_loop_reference():
    # Chan et al.'s merge over uneven chunks equals the two-pass mean / variance of everything seen.
    gen = torch.Generator().manual_seed(3)
    seen, m = [], RunningMoments()
    for size in [1, 7, 2, 16, 1, 5]:
        chunk = torch.randn(size, generator=gen, dtype=torch.float64) * 4 + 2
        m = m.update(chunk)
        seen += chunk.tolist()
        assert m.count == len(seen)
        assert m.mean == pytest.approx(_mean(seen), rel=1e-12)
        if len(seen) > 1:
            assert m.std == pytest.approx(math.sqrt(_var(seen)), rel=1e-12)


# -- reward normalisation modes -------------------------------------------------------------------------


def test_reward_norm_names():
    assert shaping.REWARD_NORMS.names() == ["batch", "group", "none", "running"]


def test_norm_none_hand_worked():
    r = torch.tensor([1.0, -2.0, 3.0])
    moments = RunningMoments(2.0, 1.0, 0.5)
    out, m = shaping.normalize_rewards("none", rewards=r, group_ids=torch.tensor([0, 0, 1]), moments=moments)
    assert out.tolist() == [1.0, -2.0, 3.0] and m == moments


def test_norm_batch_hand_worked():
    # r = [1, 2, 3, 6]: mean 3, dev [-2, -1, 0, 3], sum sq 14, var 14 / 3, std 2.1602469
    # -> [-0.9258201, -0.4629100, 0, 1.3887301] (eps 1e-6 in the denominator)
    out, _ = shaping.normalize_rewards("batch", rewards=torch.tensor([1.0, 2.0, 3.0, 6.0]), group_ids=torch.zeros(4))
    assert out.tolist() == pytest.approx([-2 / STD, -1 / STD, 0.0, 3 / STD], rel=1e-5)
    # A batch of one: r - mean = 0, never NaN.
    out, _ = shaping.normalize_rewards("batch", rewards=torch.tensor([5.0]), group_ids=torch.zeros(1))
    assert out.tolist() == [0.0]


def test_norm_group_hand_worked():
    # G = [5, 1, 5, 1, 1], r = [2, 1, 0, 4, 1]
    # group 5: [2, 0], mean 1, std sqrt(2) -> [+0.7071068, -0.7071068]
    # group 1: [1, 4, 1], mean 2, dev [-1, 2, -1], var 6 / 2 = 3, std 1.7320508 -> [-0.5773503, 1.1547005, -0.5773503]
    out, _ = shaping.normalize_rewards("group", rewards=torch.tensor([2.0, 1.0, 0.0, 4.0, 1.0]),
                                       group_ids=torch.tensor([5, 1, 5, 1, 1]))
    assert out.tolist() == pytest.approx([0.7071068, -0.5773503, -0.7071068, 1.1547005, -0.5773503], rel=1e-5)


def test_norm_running_hand_worked():
    # Moments of [1, 2, 3] (count 3, mean 2, m2 2); this batch [4, 5] is included first:
    # count 5, mean 3, m2 10, std sqrt(10 / 4) = 1.5811388 -> r / std = [2.5298221, 3.1622777]
    before = RunningMoments(3.0, 2.0, 2.0)
    out, after = shaping.normalize_rewards("running", rewards=torch.tensor([4.0, 5.0]), group_ids=torch.zeros(2),
                                           moments=before)
    assert out.tolist() == pytest.approx([4 / math.sqrt(2.5), 5 / math.sqrt(2.5)], rel=1e-5)
    assert (after.count, after.mean, after.m2) == pytest.approx((5.0, 3.0, 10.0))
    assert before == RunningMoments(3.0, 2.0, 2.0)  # frozen: the caller's moments are not mutated
    # Scale only, no mean shift: from scratch, r = [-2, 2] has mean 0, m2 8, std sqrt(8) = 2.8284271
    # -> [-0.7071068, 0.7071068], signs kept.
    out, _ = shaping.normalize_rewards("running", rewards=torch.tensor([-2.0, 2.0]), group_ids=torch.zeros(2))
    assert out.tolist() == pytest.approx([-0.7071068, 0.7071068], rel=1e-5)


@pytest.mark.invariant
@pytest.mark.parametrize("mode", ["none", "batch", "group", "running"])
def test_reward_norms_match_loop_reference(mode):
    rewards, _, G = _random_rewards(4)
    r, g = rewards.tolist(), G.tolist()
    prior = [0.5, -1.0, 3.0, 2.5]  # rewards of earlier steps, for "running"
    eps = 1e-6
    if mode == "none":
        expected = r
    elif mode == "batch":
        expected = [(x - _mean(r)) / (math.sqrt(_var(r)) + eps) for x in r]
    elif mode == "group":
        expected = [0.0] * len(r)
        for members in _groups(g).values():
            xs = [r[i] for i in members]
            std = math.sqrt(_var(xs)) if len(xs) > 1 else 1.0
            for i in members:
                expected[i] = (r[i] - _mean(xs)) / (std + eps)
    else:
        expected = [x / (math.sqrt(_var(prior + r)) + eps) for x in r]
    moments = RunningMoments().update(torch.tensor(prior, dtype=torch.float64))
    out, _ = shaping.normalize_rewards(mode, rewards=rewards, group_ids=G, moments=moments)
    assert out.tolist() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_unknown_norm_lists_names():
    with pytest.raises(KeyError) as info:
        shaping.normalize_rewards("z-score", rewards=torch.ones(2), group_ids=torch.zeros(2))
    for name in shaping.REWARD_NORMS.names():
        assert name in str(info.value)


# -- dynamic sampling -----------------------------------------------------------------------------------


def test_informative_groups_hand_worked():
    # G = [3, 3, 8, 8, 8, 1], r = [1, 1, 0, 1, 0, 5]
    # group 3: all 1 -> dropped; group 8: {0, 1} -> kept; group 1: a single sample -> nothing to compare, dropped
    keep = shaping.informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 5.0]), torch.tensor([3, 3, 8, 8, 8, 1]))
    assert keep.tolist() == [False, False, True, True, True, False]


@pytest.mark.invariant
def test_informative_groups_match_loop_reference():
    gen = torch.Generator().manual_seed(5)
    G = torch.randint(0, 8, (30,), generator=gen) * 3 - 4
    rewards = torch.randint(0, 2, (30,), generator=gen).to(torch.float64)  # 0/1 rewards: many constant groups
    expected = [len({rewards.tolist()[j] for j in _groups(G.tolist())[gi]}) > 1 for gi in G.tolist()]
    assert any(expected) and not all(expected)
    assert shaping.informative_groups(rewards, G).tolist() == expected


def test_refill_rows_takes_the_first_informative_groups_up_to_room():
    # group_size 2, four groups: [1, 1] constant, [0, 1] kept, [0, 0] constant, [1, 0] kept
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert shaping.refill_rows(rewards, 2, room=4) == [2, 3, 6, 7]  # both informative groups, all their rows
    assert shaping.refill_rows(rewards, 2, room=1) == [2, 3]  # room for one group: the first informative one
    assert shaping.refill_rows(rewards, 2, room=0) == []
    assert shaping.refill_rows(torch.zeros(8), 2, room=4) == []  # all constant: nothing to keep


# -- the shaping pipelines ------------------------------------------------------------------------------


def test_shape_sequence_rewards_hand_worked():
    # rewards [1, 1, 0, 2], lengths [2, 8, 10, 12], L_max 10, L_cache 4, length_penalty 0.1, clip 1:
    #   overlong  [0, (6 - 8) / 4 = -0.5, -1, -1]
    #   length    -0.1 * [2, 8, 10, 12] / 10 = [-0.02, -0.08, -0.1, -0.12]
    #   sum       [0.98, 0.42, -1.1, 0.88] -> clip to [-1, 1] -> [0.98, 0.42, -1.0, 0.88]
    spec = ShapingSpec(overlong_buffer=4, max_length=10, length_penalty=0.1, reward_clip=1.0)
    rewards, lengths, G = torch.tensor([1.0, 1.0, 0.0, 2.0]), torch.tensor([2, 8, 10, 12]), torch.tensor([0, 0, 1, 1])
    out, _ = shaping.shape_sequence_rewards(rewards, lengths, G, spec)
    assert out.tolist() == pytest.approx([0.98, 0.42, -1.0, 0.88], rel=1e-6)
    # Then group norm: every two-sample group becomes +-1/sqrt(2): [0.98, 0.42] -> [+, -]; [-1, 0.88] -> [-, +]
    spec = ShapingSpec(overlong_buffer=4, max_length=10, length_penalty=0.1, reward_clip=1.0, reward_norm="group")
    out, _ = shaping.shape_sequence_rewards(rewards, lengths, G, spec)
    assert out.tolist() == pytest.approx([0.7071068, -0.7071068, -0.7071068, 0.7071068], rel=1e-5)
    # The default spec changes nothing.
    out, _ = shaping.shape_sequence_rewards(rewards, lengths, G, ShapingSpec())
    assert out.tolist() == [1.0, 1.0, 0.0, 2.0]


@pytest.mark.invariant
@pytest.mark.parametrize("mode", ["none", "batch", "group", "running"])
def test_shape_sequence_rewards_matches_loop_reference(mode):
    rewards, lengths, G = _random_rewards(6)
    L_max, L_cache, factor, coef, clip = 24, 8, 0.5, 0.2, 1.5
    spec = ShapingSpec(reward_norm=mode, reward_clip=clip, overlong_buffer=L_cache, overlong_penalty_factor=factor,
                       length_penalty=coef, max_length=L_max)
    shaped = []
    for r, y in zip(rewards.tolist(), lengths.tolist()):  # the module docstring's order, one row at a time
        if y <= L_max - L_cache:
            over = 0.0
        elif y <= L_max:
            over = ((L_max - L_cache) - y) / L_cache
        else:
            over = -1.0
        r = r + factor * over - coef * y / L_max
        shaped.append(min(max(r, -clip), clip))
    assert any(abs(x) == clip for x in shaped)
    expected, _ = shaping.normalize_rewards(mode, rewards=torch.tensor(shaped), group_ids=G)  # checked above
    out, moments = shaping.shape_sequence_rewards(rewards, lengths, G, spec)
    # The pipeline works in float32 (rewards.float()), so compare at float32 precision.
    assert out.tolist() == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-6)
    if mode == "none":
        assert out.tolist() == pytest.approx(shaped, rel=1e-5, abs=1e-6)
    assert moments.count == (len(shaped) if mode == "running" else 0.0)


def test_shape_advantages_hand_worked():
    # Whiten (X above): [0, 0.9258201], [-1.3887301, 0.4629100]; then clip to [-1, 1]: -1.3887 -> -1.
    spec = ShapingSpec(whiten_advantages=True, advantage_clip=1.0)
    out = shaping.shape_advantages(X, M, spec)
    expected = torch.tensor([[0.0, 0.0, 2 / STD, 0.0], [-1.0, 1 / STD, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=1e-12)
    # Clip only (no whitening), 1.5: [_, 1, 1.5, _], [-1.5, 1.5, _, _]; 0 outside the mask.
    out = shaping.shape_advantages(X, M, ShapingSpec(advantage_clip=1.5))
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 1.5, 0.0], [-1.5, 1.5, 0.0, 0.0]], dtype=torch.float64))
    # Neither: unchanged.
    assert shaping.shape_advantages(X, M, ShapingSpec()) is X


@pytest.mark.invariant
def test_shape_advantages_matches_loop_reference():
    gen = torch.Generator().manual_seed(7)
    adv = torch.randn(6, 8, generator=gen, dtype=torch.float64) * 2 + 0.5
    starts = torch.randint(0, 3, (6,), generator=gen)
    ends = starts + torch.randint(1, 6, (6,), generator=gen)
    pos = torch.arange(8)[None, :]
    mask = ((pos >= starts[:, None]) & (pos < ends[:, None])).to(torch.float64)
    flat = [a for ar, mr in zip(adv.tolist(), mask.tolist()) for a, m in zip(ar, mr) if m]
    mu, sd = _mean(flat), math.sqrt(_var(flat) + 1e-8)
    expected = [[min(max((a - mu) / sd, -1.2), 1.2) if m else 0.0 for a, m in zip(ar, mr)]
                for ar, mr in zip(adv.tolist(), mask.tolist())]
    assert any(abs(e) == 1.2 for row in expected for e in row)
    out = shaping.shape_advantages(adv, mask, ShapingSpec(whiten_advantages=True, advantage_clip=1.2))
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert (out[mask == 0] == 0).all()
