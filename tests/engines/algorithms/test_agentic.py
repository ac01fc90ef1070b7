"""StarPO and GiGPO advantages: hand-worked episodes, a plain-loop reference, GRPO equivalence, errors."""

import math
import random
from collections import defaultdict

import pytest
import torch

from engines.algorithms import advantages
from engines.algorithms.agentic import spread_over_turns, starpo_s_filter, step_advantages, trajectory_advantages

# Five episodes in two episode groups, gamma = 0.5 (letters are state keys):
#   ep0 (group 0): states A B A, rewards 0 0 1 -> R = 1, G = [0.25, 0.5, 1]   (A visited twice)
#   ep1 (group 0): states A C,   rewards 0 1   -> R = 1, G = [0.5, 1]
#   ep2 (group 0): states A,     rewards 0     -> R = 0, G = [0]
#   ep3 (group 1): states A B,   rewards 1 1   -> R = 2, G = [1.5, 1]
#   ep4 (group 1): states A D,   rewards 0 0   -> R = 0, G = [0, 0]
# Anchor groups: (0, A) = {ep0 t0: 0.25, ep0 t2: 1, ep1 t0: 0.5, ep2 t0: 0}; (1, A) = {ep3 t0: 1.5, ep4 t0: 0};
# (0, B), (0, C), (1, B), (1, D) are singletons (B in group 1 is not pooled with B in group 0).
REWARDS = [[0.0, 0.0, 1.0], [0.0, 1.0], [0.0], [1.0, 1.0], [0.0, 0.0]]
KEYS = [list("ABA"), list("AC"), list("A"), list("AB"), list("AD")]
GROUPS = [0, 0, 0, 1, 1]
GAMMA = 0.5


def _gigpo(**options):
    return step_advantages(step_rewards=REWARDS, state_keys=KEYS, group_ids=GROUPS, gamma=GAMMA, **options)


def _assert_ragged_close(actual, expected, atol=1e-5):
    assert [len(row) for row in actual] == [len(row) for row in expected]
    for got, want in zip(actual, expected):
        assert got == pytest.approx(want, abs=atol)


def test_mean_std_per_trajectory_hand_worked():
    # A^E, group 0: R = [1, 1, 0], mean 2/3, squared deviations 1/9 + 1/9 + 4/9 = 2/3, unbiased var = 1/3,
    #   std = 0.57735 -> A^E = [1/3, 1/3, -2/3] / 0.57735 = [0.57735, 0.57735, -1.15470].
    # A^E, group 1: R = [2, 0], mean 1, var = 2 / 1 = 2, std 1.41421 -> A^E = [0.70711, -0.70711].
    # A^S, anchor (0, A): G = [0.25, 1, 0.5, 0], mean 0.4375, deviations [-0.1875, 0.5625, 0.0625, -0.4375],
    #   squares sum 0.546875, var = 0.546875 / 3 = 0.182292, std 0.426956
    #   -> A^S = [-0.439155, 1.317465, 0.146385, -1.024695].
    # A^S, anchor (1, A): G = [1.5, 0], mean 0.75, var = 2 * 0.5625 / 1 = 1.125, std 1.06066 -> [0.70711, -0.70711].
    # Singleton anchors: A^S = 0.  A = A^E + 0.5 * A^S.
    ae0, ae2, ae3 = 1 / 3 / math.sqrt(1 / 3), -2 / 3 / math.sqrt(1 / 3), 1 / math.sqrt(2)
    s = math.sqrt(0.546875 / 3)
    as_a0 = [-0.1875 / s, 0.5625 / s, 0.0625 / s, -0.4375 / s]
    expected = [
        [ae0 + 0.5 * as_a0[0], ae0, ae0 + 0.5 * as_a0[1]],
        [ae0 + 0.5 * as_a0[2], ae0],
        [ae2 + 0.5 * as_a0[3]],
        [ae3 + 0.5 * ae3, ae3],
        [-ae3 - 0.5 * ae3, -ae3],
    ]
    _assert_ragged_close(_gigpo(omega=0.5), expected)


def test_mean_norm_per_trajectory_hand_worked():
    # norm="mean": no std division at either level.
    # A^E = R - mean_g(R): group 0 [1/3, 1/3, -2/3], group 1 [1, -1].
    # A^S = G - mean_a(G): anchor (0, A) [-0.1875, 0.5625, 0.0625, -0.4375]; anchor (1, A) [0.75, -0.75].
    # omega = 2.
    expected = [
        [1 / 3 - 0.375, 1 / 3, 1 / 3 + 1.125],
        [1 / 3 + 0.125, 1 / 3],
        [-2 / 3 - 0.875],
        [1 + 1.5, 1],
        [-1 - 1.5, -1],
    ]
    _assert_ragged_close(_gigpo(omega=2.0, norm="mean"), expected, atol=1e-12)


def test_per_step_row_episode_stats_hand_worked():
    # Each episode's return counts once per step. Group 0 rows: R = 1 (x3, ep0), 1 (x2, ep1), 0 (x1, ep2):
    #   mean 5/6, squared deviations 5 * (1/6)^2 + (5/6)^2 = 30/36, var = (30/36) / 5 = 1/6, std 0.408248
    #   -> A^E = [(1/6) / 0.408248, (1/6) / 0.408248, (-5/6) / 0.408248] = [0.408248, 0.408248, -2.041241].
    # Group 1 rows: R = 2 (x2), 0 (x2): mean 1, var = 4 / 3, std 1.154701 -> A^E = [0.866025, -0.866025].
    # (Per trajectory these are 0.57735, -1.15470 and 0.70711: the modes differ.)
    a0, a2, a3 = (1 / 6) / math.sqrt(1 / 6), (-5 / 6) / math.sqrt(1 / 6), 1 / math.sqrt(4 / 3)
    expected = [[a0] * 3, [a0] * 2, [a2], [a3] * 2, [-a3] * 2]
    _assert_ragged_close(_gigpo(omega=0.0, episode_stats="per_step_row"), expected)
    # norm="mean": group 0 [1 - 5/6, 1 - 5/6, 0 - 5/6]; group 1 [2 - 1, 0 - 1] (same as per trajectory).
    expected = [[1 / 6] * 3, [1 / 6] * 2, [-5 / 6], [1.0] * 2, [-1.0] * 2]
    _assert_ragged_close(_gigpo(omega=0.0, norm="mean", episode_stats="per_step_row"), expected, atol=1e-12)


def test_singleton_anchor_is_exactly_zero_and_groups_are_not_pooled():
    # Key "X" appears once in each of two episode groups: each is a singleton anchor group, so A^S = 0.0
    # exactly and A = A^E bit for bit. Pooled across groups, G = [1, 3] would give A^S = -+0.70711.
    # Key "S" (each episode's first state) forms one anchor per group: G = [1 + 1, 0 + 0] in group 0
    # (gamma = 1), and [0 + 3, 0 + 0] in group 1.
    rewards = [[1.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 0.0]]
    keys = [["S", "X"], ["S", "Y"], ["S", "X"], ["S", "Z"]]
    groups = [4, 4, 9, 9]
    for norm in ("mean_std", "mean"):
        kwargs = dict(step_rewards=rewards, state_keys=keys, group_ids=groups, gamma=1.0, norm=norm)
        with_step = step_advantages(omega=1.0, **kwargs)
        episode = trajectory_advantages(returns=[2.0, 0.0, 3.0, 0.0], group_ids=groups, norm=norm)
        assert [row[1] for row in with_step] == episode  # every second state is a singleton in its group
        assert with_step[0][0] == pytest.approx(2 * episode[0])  # anchor S = the episode group here
    # The same four episodes with one episode group do pool X: G = [1, 3], mean 2, std 1.41421.
    pooled = step_advantages(step_rewards=rewards, state_keys=keys, group_ids=[0] * 4, gamma=1.0, omega=1.0,
                             norm="mean")
    episode = trajectory_advantages(returns=[2.0, 0.0, 3.0, 0.0], group_ids=[0] * 4, norm="mean")
    assert [pooled[0][1] - episode[0], pooled[2][1] - episode[2]] == [-1.0, 1.0]


@pytest.mark.parametrize("norm", ["mean_std", "mean"])
@pytest.mark.parametrize("episode_stats", ["per_trajectory", "per_step_row"])
def test_omega_zero_is_starpo_bitwise(norm, episode_stats):
    steps = step_advantages(step_rewards=REWARDS, state_keys=KEYS, group_ids=GROUPS, gamma=0.9, omega=0.0,
                            norm=norm, episode_stats=episode_stats)
    weights = [len(row) for row in REWARDS] if episode_stats == "per_step_row" else None
    starpo = trajectory_advantages(returns=[sum(row) for row in REWARDS], group_ids=GROUPS, norm=norm,
                                   episode_stats_weights=weights)
    assert steps == [[a] * len(row) for a, row in zip(starpo, REWARDS)]


def test_one_turn_bandit_equals_grpo():
    # One step per episode: A^E is GRPO's outcome advantage on the same rewards and groups.
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 1.0, 4.0, 1.0, 5.0]
    groups = [7, 3, 7, 3, 3, 7, 5, 5, 2]
    steps = step_advantages(step_rewards=[[r] for r in rewards], state_keys=[["start"]] * len(rewards),
                            group_ids=groups, gamma=1.0, omega=0.0)
    mask = (torch.arange(6)[None, :] < torch.tensor([2, 6, 3, 1, 4, 5, 6, 2, 3])[:, None]).float()  # [B, L]
    token_rewards = advantages.outcome_token_rewards(torch.tensor(rewards), mask)
    grpo, _ = advantages.compute("grpo", token_rewards=token_rewards, loss_mask=mask, group_ids=torch.tensor(groups))
    for b, row in enumerate(steps):
        assert len(row) == 1
        torch.testing.assert_close(grpo[b], torch.full_like(mask[b], row[0]) * mask[b], atol=1e-6, rtol=0)
    # With omega = 1 every step shares its group's one anchor state, so A^S = A^E and A = 2 A^E.
    doubled = step_advantages(step_rewards=[[r] for r in rewards], state_keys=[["start"]] * len(rewards),
                              group_ids=groups, gamma=1.0, omega=1.0)
    assert [row[0] for row in doubled] == pytest.approx([2 * row[0] for row in steps], abs=1e-12)


def _reference(step_rewards, state_keys, group_ids, gamma, omega, norm, episode_stats, eps=1e-6):
    """Plain-loop GiGPO, written from the formulas."""

    def normalise(x, population):
        n = len(population)
        mean = sum(population) / n
        std = math.sqrt(sum((p - mean) ** 2 for p in population) / (n - 1)) if n > 1 else 1.0
        return (x - mean) / (std + eps) if norm == "mean_std" else x - mean

    returns = [sum(r) for r in step_rewards]
    episode_rows = defaultdict(list)
    for i, g in enumerate(group_ids):
        episode_rows[g] += [returns[i]] * (len(step_rewards[i]) if episode_stats == "per_step_row" else 1)
    disc = []
    for r in step_rewards:
        disc.append([sum(gamma ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))])
    anchors = defaultdict(list)
    for i, g in enumerate(group_ids):
        for t, key in enumerate(state_keys[i]):
            anchors[(g, key)].append(disc[i][t])
    out = []
    for i, g in enumerate(group_ids):
        a_e = normalise(returns[i], episode_rows[g])
        out.append([a_e + omega * normalise(disc[i][t], anchors[(g, key)]) for t, key in enumerate(state_keys[i])])
    return out


@pytest.mark.parametrize("norm", ["mean_std", "mean"])
@pytest.mark.parametrize("episode_stats", ["per_trajectory", "per_step_row"])
def test_matches_loop_reference(norm, episode_stats):
    rng = random.Random(0)
    lengths = [rng.randint(1, 5) for _ in range(12)]
    step_rewards = [[rng.choice([0.0, 0.0, 1.0, -0.5]) for _ in range(n)] for n in lengths]
    state_keys = [[rng.choice("abcd") for _ in range(n)] for n in lengths]
    group_ids = [rng.choice([3, 8, 1]) for _ in lengths]
    options = dict(gamma=0.8, omega=0.7, norm=norm, episode_stats=episode_stats)
    actual = step_advantages(step_rewards=step_rewards, state_keys=state_keys, group_ids=group_ids, **options)
    _assert_ragged_close(actual, _reference(step_rewards, state_keys, group_ids, **options), atol=1e-9)


def test_trajectory_advantages_hand_worked():
    # G = [5, 2, 5, 5, 2], R = [3, 1, 1, 2, 1].
    # group 5: R = [3, 1, 2], mean 2, var = 2 / 2 = 1, std 1 -> A = [1, -1, 0] / (1 + 1e-6).
    # group 2: R = [1, 1], std 0 -> A = 0 / 1e-6 = 0.
    returns, groups = [3.0, 1.0, 1.0, 2.0, 1.0], [5, 2, 5, 5, 2]
    assert trajectory_advantages(returns=returns, group_ids=groups) == pytest.approx([1, 0, -1, 0, 0], abs=1e-5)
    # Weights [1, 1, 3, 1, 1]: group 5 rows 3, 1, 1, 1, 2: mean 8/5, squared deviations
    # 1.96 + 3 * 0.36 + 0.16 = 3.2, var = 3.2 / 4 = 0.8, std 0.894427 -> A = [1.4, -0.6, 0.4] / 0.894427.
    weighted = trajectory_advantages(returns=returns, group_ids=groups, episode_stats_weights=[1, 1, 3, 1, 1])
    s = math.sqrt(0.8)
    assert weighted == pytest.approx([1.4 / s, 0, -0.6 / s, 0.4 / s, 0], abs=1e-5)
    # A group of one: std 1, A = 0.
    assert trajectory_advantages(returns=[7.0], group_ids=[0]) == [0.0]
    assert trajectory_advantages(returns=[], group_ids=[]) == []


def test_starpo_s_filter_keeps_highest_std_groups_in_first_seen_order():
    # Unbiased stds: group 5 [1, 1, 1] -> 0; group 2 [0, 1, 0, 1] -> sqrt(1/3) = 0.577;
    # group 7 [1, 0] -> 0.707; group 9 [0, 2] -> 1.414. First seen: 5, 7, 2, 9.
    groups = [5, 7, 5, 2, 9, 2, 7, 2, 9, 2, 5]
    returns = [1, 1, 1, 0, 0, 1, 0, 0, 2, 1, 1]
    assert starpo_s_filter(returns=returns, group_ids=groups, keep_fraction=0.5) == [7, 9]  # top 2 of 4
    assert starpo_s_filter(returns=returns, group_ids=groups, keep_fraction=0.6) == [7, 9]  # floor(2.4) = 2
    assert starpo_s_filter(returns=returns, group_ids=groups, keep_fraction=0.75) == [7, 2, 9]
    assert starpo_s_filter(returns=returns, group_ids=groups, keep_fraction=0.1) == [9]  # floor(0.4) -> at least 1
    assert starpo_s_filter(returns=returns, group_ids=groups, keep_fraction=1.0) == [5, 7, 2, 9]


def test_starpo_s_filter_std_convention_ties_and_singletons():
    # a = [0, 1]: unbiased std 0.707 (population 0.5); b = [0, 1.1, 0, 1.1]: unbiased 0.635 (population 0.55).
    # The unbiased std keeps a; a population std would keep b.
    assert starpo_s_filter(returns=[0, 1.1, 0, 1.1, 0, 1], group_ids=[1, 1, 1, 1, 0, 0], keep_fraction=0.5) == [0]
    # Equal stds: the first-seen group wins.
    assert starpo_s_filter(returns=[0, 1, 5, 6], group_ids=[3, 3, 1, 1], keep_fraction=0.5) == [3]
    assert starpo_s_filter(returns=[5, 6, 0, 1], group_ids=[1, 1, 3, 3], keep_fraction=0.5) == [1]
    # A group of one counts as std 0 (with group_mean_std's std 1 it would win): [0, 0.5] has std 0.354.
    assert starpo_s_filter(returns=[9, 0, 0.5], group_ids=[4, 6, 6], keep_fraction=0.5) == [6]


def test_spread_over_turns_on_a_holed_mask():
    # Row 0: prompt x2 | turn 1: model x2, observation x2 | turn 2: model x3 | pad.
    # Row 1: prompt | turn 1: model, observation | turn 2: model, observation x2 | turn 3: model x2 | pad x2.
    turn_index = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2, 0], [0, 1, 1, 2, 2, 2, 3, 3, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0], [0, 1, 0, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.float32)
    out = spread_over_turns([[0.5, -1.0], [2.0, 3.0, 4.0, 99.0]], turn_index, loss_mask)
    expected = torch.tensor([[0, 0, 0.5, 0.5, 0, 0, -1, -1, -1, 0], [0, 2, 0, 3, 0, 0, 4, 4, 0, 0]])
    assert out.dtype == torch.float32
    assert torch.equal(out, expected.float())
    with pytest.raises(ValueError, match="row 1 has 3 turns but 2 step values"):
        spread_over_turns([[0.5, -1.0], [2.0, 3.0]], turn_index, loss_mask)
    with pytest.raises(ValueError, match="one list per row"):
        spread_over_turns([[0.5, -1.0]], turn_index, loss_mask)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(state_keys=[*KEYS[:4], list("A")]), "episode 4 has 2 step rewards but 1 state keys"),
        (dict(group_ids=[0, 0, 1]), "one entry per episode"),
        (dict(norm="std"), "norm must be one of"),
        (dict(episode_stats="per_token"), "episode_stats must be one of"),
        (dict(gamma=1.5), r"gamma must be in \[0, 1\]"),
        (dict(gamma=-0.1), r"gamma must be in \[0, 1\]"),
        (dict(omega=-1.0), "omega must be"),
        (dict(eps=0.0), "eps must be > 0"),
        (dict(step_rewards=[[], *REWARDS[1:]], state_keys=[[], *KEYS[1:]]), "episode 0 has no steps"),
        (dict(state_keys=[[["A"]], *KEYS[1:]], step_rewards=[[1.0], *REWARDS[1:]]), "state_keys must be hashable"),
    ],
)
def test_step_advantages_rejects_bad_inputs(change, message):
    kwargs = dict(step_rewards=REWARDS, state_keys=KEYS, group_ids=GROUPS, gamma=GAMMA, omega=1.0) | change
    with pytest.raises(ValueError, match=message):
        step_advantages(**kwargs)


def test_trajectory_and_filter_reject_bad_inputs():
    with pytest.raises(ValueError, match="one entry per episode"):
        trajectory_advantages(returns=[1.0, 2.0], group_ids=[0])
    with pytest.raises(ValueError, match="integers >= 1"):
        trajectory_advantages(returns=[1.0, 2.0], group_ids=[0, 0], episode_stats_weights=[1, 0])
    with pytest.raises(ValueError, match="keep_fraction must be in"):
        starpo_s_filter(returns=[1.0], group_ids=[0], keep_fraction=0.0)
