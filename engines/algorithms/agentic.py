"""Agentic RL advantages: StarPO (trajectory-wise) and GiGPO (step-wise), without a model.

An episode ``i`` is a list of steps (one model turn and the environment's answer to it) with rewards
``r_{i,t}`` and anchor states ``s_{i,t}`` (the environment's ``state_key()`` before turn ``t``);
``group_ids[i]`` names its episode group (the ``group_size`` episodes that share a seed). The functions
here turn those ragged lists into one advantage per episode (StarPO) or per step (GiGPO);
``spread_over_turns`` puts per-step values on the model tokens of each turn of a training row.

In RollFlow one episode is one training row (token in, token out: the prompt of turn ``k`` is the exact
token prefix of the row), so a step advantage lands on the tokens of its turn and the number of rows,
hence of optimizer steps per iteration, does not grow with the number of turns.

Statistics follow ``advantages.group_mean_std`` (the GRPO estimator's): unbiased (Bessel) std, a group
of one has std 1, ``eps`` added to the std. Everything is computed in float64 and returned as Python
floats.
"""

from __future__ import annotations

import math

import torch

from engines.algorithms.advantages import discounted_returns, group_mean_std, sequence_scores

NORMS = ("mean_std", "mean")
EPISODE_STATS = ("per_trajectory", "per_step_row")


def _normalised(values: torch.Tensor, group_ids: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    """``(x - mean_g) / (std_g + eps)`` (``mean_std``) or ``x - mean_g`` (``mean``) per group, ``[N]``."""
    mean, std = group_mean_std(values, group_ids)
    centred = values - mean
    return centred / (std + eps) if norm == "mean_std" else centred


def _check_norm(norm: str, eps: float) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {list(NORMS)}, got {norm!r}")
    if norm == "mean_std" and not eps > 0:
        raise ValueError(f"eps must be > 0 with norm='mean_std' (it keeps an all-equal group at 0), got {eps}")


def _check_episodes(returns: list[float], group_ids: list[int]) -> None:
    if len(returns) != len(group_ids):
        raise ValueError(
            f"returns and group_ids must have one entry per episode, got {len(returns)} and {len(group_ids)}"
        )


def trajectory_advantages(
    *,
    returns: list[float],
    group_ids: list[int],
    norm: str = "mean_std",
    episode_stats_weights: list[int] | None = None,
    eps: float = 1e-6,
) -> list[float]:
    """StarPO's trajectory advantage: the episode return normalised in its episode group.

    Wang et al. 2025, "RAGEN: Understanding Self-Evolution in LLM Agents via Multi-Turn RL",
    arXiv:2504.20073 (StarPO with a GRPO-style critic-free advantage)::

        A_i = (R_i - mean_g(R)) / (std_g(R) + eps)   norm="mean_std"
        A_i =  R_i - mean_g(R)                       norm="mean"

    ``mean_g``/``std_g`` are over the episodes sharing ``group_ids[i]``; the std is unbiased and a group
    of one has std 1 (so its advantage is 0), as in ``advantages.grpo``. With
    ``episode_stats_weights`` (``w_i`` >= 1, integers) episode ``i`` counts ``w_i`` times in its group's
    mean and std, as if it were ``w_i`` rows (GiGPO's ``per_step_row`` passes the steps per episode);
    the advantage is still one value per episode. The flow puts ``A_i`` on every model token of
    episode ``i``.

    Args:
        returns: ``[E]`` episode returns ``R_i = sum_t r_{i,t}``.
        group_ids: ``[E]`` episode group of each episode; any ints, not necessarily sorted.
        norm: ``"mean_std"`` or ``"mean"`` (no std division, as Dr.GRPO).
        episode_stats_weights: ``[E]`` or ``None`` (every episode counts once).
        eps: added to the std.

    Returns:
        ``[E]`` advantages.
    """
    _check_norm(norm, eps)
    _check_episodes(returns, group_ids)
    weights = [1] * len(returns) if episode_stats_weights is None else list(episode_stats_weights)
    if len(weights) != len(returns):
        raise ValueError(
            f"episode_stats_weights must have one entry per episode, got {len(weights)} for {len(returns)}"
        )
    if any(not isinstance(w, int) or w < 1 for w in weights):
        raise ValueError(f"episode_stats_weights must be integers >= 1, got {weights}")
    if not returns:
        return []
    counts = torch.tensor(weights)  # [E]
    rows = torch.tensor(returns, dtype=torch.float64).repeat_interleave(counts)  # [N], N = sum w_i
    row_groups = torch.tensor(group_ids, dtype=torch.long).repeat_interleave(counts)  # [N]
    first_row = torch.cumsum(counts, 0) - counts  # [E]: each episode's first row
    return _normalised(rows, row_groups, norm, eps)[first_row].tolist()


def step_advantages(
    *,
    step_rewards: list[list[float]],
    state_keys: list[list],
    group_ids: list[int],
    gamma: float,
    omega: float,
    norm: str = "mean_std",
    episode_stats: str = "per_trajectory",
    eps: float = 1e-6,
) -> list[list[float]]:
    """GiGPO's step advantage, one value per step of each episode (same ragged shape as ``step_rewards``).

    Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv:2505.10978,
    eq. 3-8::

        R_i      = sum_t r_{i,t}                                      # episode return
        A^E_i    = trajectory_advantages(R)_i                          # eq. 3-4, in the episode group
        G_{i,t}  = sum_{k>=t} gamma^(k-t) r_{i,k}                      # eq. 6, discounted step return
        A^S_{i,t} = (G_{i,t} - mean_a(G)) / (std_a(G) + eps)           # eq. 7 ("mean": no std division)
        A_{i,t}  = A^E_i + omega * A^S_{i,t}                           # eq. 8

    Choices pinned here (peers differ):

    - Anchor group ``a`` of step ``(i, t)``: the steps ``(j, u)`` with ``group_ids[j] == group_ids[i]``
      and ``state_keys[j][u] == state_keys[i][t]`` (dict-key equality). Anchor groups never pool
      episodes of different episode groups (their seeds differ, so the same key need not be the same
      situation); a state visited several times in one episode contributes each visit.
    - A singleton anchor group gives ``A^S = 0.0`` exactly (no other visit to compare with).
    - Std: unbiased (Bessel) for both levels, as ``advantages.group_mean_std``; a group of one has std 1.
    - ``episode_stats="per_trajectory"`` (the paper's, default): ``A^E``'s mean and std are over the
      group's episodes, each counted once. ``"per_step_row"``: each episode counted once per step, what a
      trainer that makes one row per step computes (verl-agent); longer episodes then weigh more.
    - ``norm`` applies to both levels, ``eps`` is added to both stds.

    With ``omega == 0`` every step of episode ``i`` gets exactly ``trajectory_advantages(...)[i]``
    (StarPO): ``x + 0.0 * y == x`` bit for bit for finite ``y``.

    Args:
        step_rewards: ``E`` lists, ``r_{i,t}`` for each step of episode ``i`` (at least one step each).
        state_keys: ``E`` lists of hashable anchor states, the same lengths as ``step_rewards``.
        group_ids: ``[E]`` episode group of each episode.
        gamma: discount of ``G`` in ``[0, 1]``; ``A^E`` uses the undiscounted return.
        omega: weight of the step advantage, ``>= 0``.
        norm: ``"mean_std"`` or ``"mean"``.
        episode_stats: ``"per_trajectory"`` or ``"per_step_row"``.
        eps: added to the stds.
    """
    _check_norm(norm, eps)
    if episode_stats not in EPISODE_STATS:
        raise ValueError(f"episode_stats must be one of {list(EPISODE_STATS)}, got {episode_stats!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not (math.isfinite(omega) and omega >= 0):
        raise ValueError(f"omega must be a finite number >= 0, got {omega}")
    if not len(step_rewards) == len(state_keys) == len(group_ids):
        raise ValueError(
            f"step_rewards, state_keys and group_ids must have one entry per episode, "
            f"got {len(step_rewards)}, {len(state_keys)} and {len(group_ids)}"
        )
    for i, (rewards, keys) in enumerate(zip(step_rewards, state_keys)):
        if len(rewards) != len(keys):
            raise ValueError(f"episode {i} has {len(rewards)} step rewards but {len(keys)} state keys")
        if not rewards:
            raise ValueError(f"episode {i} has no steps; every episode needs at least one")
    if not step_rewards:
        return []

    lengths = [len(rewards) for rewards in step_rewards]
    steps = torch.tensor(lengths)  # [E]
    mask = (torch.arange(max(lengths))[None, :] < steps[:, None]).to(torch.float64)  # [E, T]
    rewards = torch.zeros(mask.shape, dtype=torch.float64)  # [E, T]
    rewards[mask > 0] = torch.tensor([r for row in step_rewards for r in row], dtype=torch.float64)

    weights = lengths if episode_stats == "per_step_row" else None
    episode_adv = trajectory_advantages(
        returns=sequence_scores(rewards, mask).tolist(),
        group_ids=group_ids,
        norm=norm,
        episode_stats_weights=weights,
        eps=eps,
    )

    step_returns = discounted_returns(rewards, mask, gamma)[mask > 0]  # [N] G_{i,t}, row-major
    anchors: dict[tuple, int] = {}
    try:
        anchor_ids = [
            anchors.setdefault((group_ids[i], key), len(anchors)) for i, keys in enumerate(state_keys) for key in keys
        ]
    except TypeError as error:
        raise ValueError(f"state_keys must be hashable (str, int, tuple…): {error}") from None
    step_adv = _normalised(step_returns, torch.tensor(anchor_ids), norm, eps)  # [N]; singleton: (G - G) / (1 + eps)

    combined = (torch.tensor(episode_adv, dtype=torch.float64).repeat_interleave(steps) + omega * step_adv).tolist()
    offsets = [0, *torch.cumsum(steps, 0).tolist()]
    return [combined[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]


def starpo_s_filter(*, returns: list[float], group_ids: list[int], keep_fraction: float) -> list[int]:
    """StarPO-S's variance filter (RAGEN, arXiv:2504.20073, sec. 4): keep the most uncertain groups.

    Groups are ranked by the unbiased std of their episode returns (a group of one has std 0 here: it
    has no spread and gives every episode advantage 0); the top ``k = max(1, floor(keep_fraction * K))``
    of the ``K`` groups are kept (floor as RAGEN's ``int(ratio * num_groups)``), ties broken by
    first-seen order.

    Returns:
        The kept group ids, in the order they first appear in ``group_ids``.
    """
    _check_episodes(returns, group_ids)
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    order = list(dict.fromkeys(group_ids))  # first-seen group order
    if not order:
        return []
    ids = torch.tensor(group_ids, dtype=torch.long)
    _, std = group_mean_std(torch.tensor(returns, dtype=torch.float64), ids)  # [E]
    _, inverse = torch.unique(ids, return_inverse=True)
    sizes = torch.bincount(inverse)[inverse]  # [E] episodes in each one's group
    group_std = dict(zip(group_ids, torch.where(sizes > 1, std, torch.zeros_like(std)).tolist()))
    keep = max(1, math.floor(keep_fraction * len(order) + 1e-9))  # 1e-9: 0.3 * 10 counts as 3
    ranked = sorted(range(len(order)), key=lambda g: -group_std[order[g]])  # stable: ties keep first-seen order
    return [order[g] for g in sorted(ranked[:keep])]


def spread_over_turns(
    step_values: list[list[float]],
    turn_index: torch.Tensor,  # [B, L] int64, k >= 1 on the k-th segment, 0 on prompt/padding
    loss_mask: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``out[b, j] = step_values[b][turn_index[b, j] - 1]`` where ``loss_mask[b, j] > 0``, else 0.

    Puts each turn's value (e.g. a GiGPO step advantage) on the model tokens of its
    (response, observation) segment; observation, prompt and padding tokens get 0. Values past a row's
    last segment are unused; fewer values than segments is an error.

    Returns:
        ``[B, L]`` float32 on ``turn_index``'s device.
    """
    if turn_index.shape != loss_mask.shape or turn_index.dim() != 2:
        raise ValueError(
            f"turn_index and loss_mask must both be [B, L], got {tuple(turn_index.shape)} and {tuple(loss_mask.shape)}"
        )
    if len(step_values) != turn_index.shape[0]:
        raise ValueError(
            f"step_values must have one list per row, got {len(step_values)} for {turn_index.shape[0]} rows"
        )
    if turn_index.numel() and int(turn_index.min()) < 0:
        raise ValueError("turn_index must be >= 0 (0 on prompt and padding, k >= 1 on the k-th segment)")
    segments = turn_index.max(dim=1).values.tolist() if turn_index.numel() else [0] * len(step_values)  # [B]
    for b, (values, needed) in enumerate(zip(step_values, segments)):
        if len(values) < needed:
            raise ValueError(f"row {b} has {needed} turns but {len(values)} step values")
    width = max([len(values) for values in step_values] + [int(max(segments, default=0))]) + 1
    table = torch.zeros(len(step_values), width, dtype=torch.float32)  # [B, K+1], column 0 for index 0
    for b, values in enumerate(step_values):
        table[b, 1 : len(values) + 1] = torch.tensor(values, dtype=torch.float32)
    table = table.to(turn_index.device)
    return torch.where(loss_mask > 0, table.gather(1, turn_index.long()), torch.zeros_like(table[:, :1]))
