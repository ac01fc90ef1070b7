"""Advantage estimators: per-token rewards ``[B, L]`` → ``(advantages, returns)``, both ``[B, L]``.

Every estimator is a registered function with keyword-only arguments::

    adv, ret = advantages.compute("grpo", token_rewards=R, loss_mask=M, group_ids=G, values=None)

- ``token_rewards`` ``[B, L]``: reward per token; an outcome reward sits on the last model token
  (``outcome_token_rewards``), so a sequence's reward is ``(R * M).sum(-1)``.
- ``loss_mask`` ``[B, L]``: 1.0 on the model's tokens, 0 elsewhere. A multi-turn row (prompt, then
  several model-response / environment-observation segments) has holes at its observation tokens: they
  are skipped, not episode ends. Returns and GAE recurse from one model token to the next model token
  of the row, and discounting counts model tokens only; a single-turn row is the one-segment case.
- ``group_ids`` ``[B]`` int64: rows with the same id are completions of the same prompt; ids need not
  be contiguous or sorted.
- ``values`` ``[B, L]`` or ``None``: critic values, for estimators that use one.
- ``outcome_rewards`` ``[B]`` or ``None``: each row's outcome reward before per-token penalties (the KL
  in the reward), for estimators whose baseline is on the outcome alone; ``None`` means
  ``token_rewards`` hold the outcome only.

Outputs are 0 outside ``loss_mask`` and carry no gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engines.algorithms.shaping import masked_whiten
from engines.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
register = ADV_ESTIMATORS.register

GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "lite_ppo"})
"""Estimators whose baseline is the other completions of the same prompt: with one completion per prompt
(``rollout.group_size: 1``) every outcome advantage is 0, so the schema rejects that pairing. ``raft_pp``
is not one: a group of one keeps each correct sample."""


def compute(
    name: str,
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # [B, L]
    outcome_rewards: torch.Tensor | None = None,  # [B]
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the named estimator; returns ``(advantages, returns)``, each ``[B, L]``."""
    estimator = ADV_ESTIMATORS.get(name)
    return estimator(
        token_rewards=token_rewards,
        loss_mask=loss_mask,
        group_ids=group_ids,
        values=values,
        outcome_rewards=outcome_rewards,
        **options,
    )


def names() -> list[str]:
    """The registered advantage estimators, sorted."""
    return ADV_ESTIMATORS.names()


def group_mean_std(
    scores: torch.Tensor,  # [B]
    group_ids: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's group mean and unbiased group std, gathered back to ``[B]``; no loop over groups.

    A group of size 1 has std defined as 1 (its deviation from its own mean is 0 anyway), so the
    division in GRPO never sees ``0 / 0``.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B] in 0..K-1
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)  # [K]
    counts.index_add_(0, inverse, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, inverse, scores)  # [K]
    mean = sums / counts  # [K]
    sq_dev = (scores - mean[inverse]).square()  # [B]
    sq_dev_sums = torch.zeros_like(counts).index_add_(0, inverse, sq_dev)  # [K]
    var = sq_dev_sums / (counts - 1).clamp(min=1)  # [K], Bessel-corrected
    std = torch.where(counts > 1, var.sqrt(), torch.ones_like(var))  # [K]
    return mean[inverse], std[inverse]


def group_max(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:  # [B], [B] -> [B]
    """Each row's group maximum, gathered back to ``[B]``."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    maxima = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    maxima = maxima.scatter_reduce(0, inverse, scores, "amax")
    return maxima[inverse]


def sequence_scores(token_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``r_i = sum_t R[i, t] * M[i, t]``, ``[B, L]`` → ``[B]``: the sum over the row's model tokens."""
    return (token_rewards * loss_mask).sum(dim=-1)


def outcome_token_rewards(sequence_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's reward on its last model token: ``[B]`` → ``[B, L]`` (0 for a row without one)."""
    columns = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    last = (loss_mask * columns).argmax(-1)  # [B]
    token_rewards = torch.zeros_like(loss_mask)
    token_rewards[torch.arange(len(last), device=loss_mask.device), last] = sequence_rewards.to(loss_mask.dtype)
    return token_rewards * loss_mask


def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = R_t + gamma * G_{n(t)}`` on model tokens, ``[B, L]`` → ``[B, L]`` (0 outside the mask).

    ``n(t)`` is the row's next model token after ``t`` (``G = 0`` past the last one): observation tokens
    in a hole of the mask are skipped, so discounting counts model tokens only. Vectorised over rows;
    one reverse pass over ``L`` that carries the running return unchanged across the holes.
    """
    rewards = token_rewards * loss_mask
    is_model = loss_mask > 0
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(is_model[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * loss_mask


@register("grpo")
def grpo(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # unused: GRPO has no critic
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage, broadcast over the response tokens.

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2 (outcome supervision)::

        r_i = sum_t R[i, t] * M[i, t]                                  # [B]
        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)   if norm_by_std
        A_i =  r_i - mean_g(r)                       otherwise (Dr.GRPO, arXiv:2503.20783)
        A[i, t] = A_i * M[i, t]                                        # [B, L]

    ``mean_g`` and ``std_g`` are over the rows sharing ``group_ids[i]``; std is unbiased
    (``torch.std``'s default, as in DeepSeekMath/verl) and a group of size 1 has std 1.

    Args:
        norm_by_std: divide by the group std; ``False`` keeps only the mean baseline.
        eps: added to the std so an all-equal group gives 0, not NaN.

    Returns:
        ``(advantages, returns)``, each ``[B, L]``; for GRPO ``returns`` is ``advantages``.
    """
    with torch.no_grad():
        scores = sequence_scores(token_rewards, loss_mask)  # [B]
        mean, std = group_mean_std(scores, group_ids)  # [B], [B]
        seq_advantages = scores - mean  # [B]
        if norm_by_std:
            seq_advantages = seq_advantages / (std + eps)
        advantages = seq_advantages.unsqueeze(-1) * loss_mask  # [B, L]
    return advantages, advantages


@register("dr_grpo")
def dr_grpo(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # unused
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783, eq. 3)::

        A[i, t] = (r_i - mean_g(r)) * M[i, t]

    GRPO without the std division. The other half of the fix, no per-sequence length normalisation,
    is the loss aggregation ``seq-mean-token-sum-norm`` (set in ``configs/algorithms/dr_grpo.yaml``).
    """
    return grpo(token_rewards=token_rewards, loss_mask=loss_mask, group_ids=group_ids, norm_by_std=False)


@register("rloo")
def rloo(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # unused
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740, eq. 6; Kool et al. 2019)::

        A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)  =  n_g / (n_g - 1) * (r_i - mean_g(r))
        A[i, t] = A_i * M[i, t]

    A group of one has no other sample to compare with and gets advantage 0.
    """
    with torch.no_grad():
        scores = sequence_scores(token_rewards, loss_mask)  # [B]
        _, inverse = torch.unique(group_ids, return_inverse=True)
        counts = torch.bincount(inverse).to(scores.dtype)[inverse]  # [B] n_g
        sums = torch.zeros_like(scores).index_add_(0, inverse, scores)[inverse]  # [B]
        baseline = (sums - scores) / (counts - 1).clamp(min=1)  # [B]
        seq_advantages = torch.where(counts > 1, scores - baseline, torch.zeros_like(scores))
        advantages = seq_advantages.unsqueeze(-1) * loss_mask
    return advantages, advantages


@register("reinforce_pp")
def reinforce_pp(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B], unused: REINFORCE++ has no group baseline
    values: torch.Tensor | None = None,  # unused
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
    gamma: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, sec. 3)::

        G[i, t] = sum_{k >= t} gamma^(k - t) R[i, k]      # discounted token returns   [B, L]
        A       = whiten_batch(G)                          # over every response token of the batch

    ``R`` carries the outcome reward on the last token and, with ``algorithm.kl.mode: reward``, the
    per-token KL penalty ``-beta * KL_t`` on every token (the paper's token-level KL in the reward).

    Args:
        gamma: discount of later token rewards.
        whiten: batch-level normalisation of the returns (the paper's global advantage normalisation).

    Returns:
        ``(advantages, returns)`` with ``returns = G`` (not whitened).
    """
    with torch.no_grad():
        returns = discounted_returns(token_rewards, loss_mask, gamma)
        advantages = masked_whiten(returns, loss_mask) if whiten else returns
    return advantages, returns


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # unused
    outcome_rewards: torch.Tensor | None = None,  # [B] r_i; None: r_i = sum_t R[i, t] M[i, t]
    gamma: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262 v3+, "REINFORCE++ w/ Baseline"; OpenRLHF's
    ``reinforce_baseline``): the group mean of the outcome reward as baseline, then the token-level KL in
    the reward, then REINFORCE++'s discounted returns and global (batch) normalisation::

        r'_i    = r_i - mean_g(r)                           # baseline on the outcome reward alone   [B]
        R'[i,t] = R[i,t] - mean_g(r) * [t = last model token of i]
                = r'_i * [t = last] - beta * KL_t            # R carries r_i on the last token and,
                                                            # with kl.mode: reward, -beta * KL_t on each
        G[i,t]  = sum_{k >= t} gamma^(#model tokens in (t, k]) R'[i,k]   # discounted_returns   [B, L]
        A       = whiten_batch(G)                           # over every model token of the batch

    The group mean removes the prompt's difficulty (as GRPO does) without GRPO's per-group std; it is
    subtracted where the outcome reward sits, so it is discounted like the reward, and the KL penalties
    neither enter the mean nor are centred. ``outcome_rewards`` gives ``r`` when ``token_rewards``
    include penalties; without it ``r`` is the row's reward sum (exact when there is no KL in the reward).

    Returns:
        ``(advantages, returns)`` with ``returns = G`` (the advantage before whitening).
    """
    with torch.no_grad():
        scores = sequence_scores(token_rewards, loss_mask) if outcome_rewards is None else outcome_rewards
        mean, _ = group_mean_std(scores.to(token_rewards.dtype), group_ids)  # [B]
        centred = token_rewards - outcome_token_rewards(mean, loss_mask)  # [B, L]
        returns = discounted_returns(centred, loss_mask, gamma)
        advantages = masked_whiten(returns, loss_mask) if whiten else returns
    return advantages, returns


@register("lite_ppo")
def lite_ppo(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # unused
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lite PPO's advantage (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
    arXiv:2508.08221, sec. 5): group-level mean, batch-level std::

        A_i = (r_i - mean_g(r)) / (std_batch(r) + eps)
        A[i, t] = A_i * M[i, t]

    Paired with token-level loss aggregation (``token-mean``) in ``configs/algorithms/lite_ppo.yaml``.
    """
    with torch.no_grad():
        scores = sequence_scores(token_rewards, loss_mask)
        mean, _ = group_mean_std(scores, group_ids)
        std = scores.std() if scores.numel() > 1 else scores.new_ones(())
        advantages = ((scores - mean) / (std + eps)).unsqueeze(-1) * loss_mask
    return advantages, advantages


@register("raft_pp")
def raft_pp(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B]
    values: torch.Tensor | None = None,  # unused
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RAFT++ (Xiong et al. 2025, "A Minimalist Approach to LLM Reasoning: from Rejection Sampling to
    Reinforce", arXiv:2504.11343, sec. 2): rejection sampling — learn only from each group's best::

        A_i = 1  if r_i == max_g(r) and r_i > threshold,  else 0
        A[i, t] = A_i * M[i, t]

    With a 0/1 reward this keeps every correct sample. The "++" (importance ratio with PPO clipping)
    comes from the ``ppo_clip`` loss it is paired with in ``configs/algorithms/raft_pp.yaml``.
    """
    with torch.no_grad():
        scores = sequence_scores(token_rewards, loss_mask)
        accepted = (scores >= group_max(scores, group_ids)) & (scores > threshold)
        advantages = accepted.to(token_rewards.dtype).unsqueeze(-1) * loss_mask
    return advantages, advantages


@register("topr")
def topr(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B], unused
    values: torch.Tensor | None = None,  # unused
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
    baseline: float = 0.0,
    positive_weight: float = 1.0,
    negative_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TOPR's signed, separately weighted returns (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE",
    arXiv:2503.14286, sec. 4)::

        a_i = r_i - baseline
        A_i = positive_weight * a_i  if a_i >= 0  else  negative_weight * a_i
        A[i, t] = A_i * M[i, t]

    The baseline decides which samples count as positive (the paper, sec. 5, shows it sets the
    positive/negative balance); the weights are its dataset re-weighting. The ``topr`` loss then
    applies no importance ratio to positive samples and a ratio truncated to ``[0, 1]`` to negative ones.
    """
    with torch.no_grad():
        signed = sequence_scores(token_rewards, loss_mask) - baseline
        weighted = torch.where(signed >= 0, positive_weight * signed, negative_weight * signed)
        advantages = weighted.unsqueeze(-1) * loss_mask
    return advantages, advantages


@register("gae")
def gae(
    *,
    token_rewards: torch.Tensor,  # [B, L]
    loss_mask: torch.Tensor,  # [B, L]
    group_ids: torch.Tensor,  # [B], unused
    values: torch.Tensor | None = None,  # [B, L] critic values V(s_t), aligned with the tokens
    outcome_rewards: torch.Tensor | None = None,  # [B], unused
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16) for PPO::

        n(t)     = the row's next model token after t   # skips observation tokens (holes in M)
        V'_t     = V_{n(t)}                         # 0 after the row's last model token
        delta_t  = R_t + gamma * V'_t - V_t
        A_t      = delta_t + gamma * lam * A_{n(t)}  # (A = 0 after the last model token)
        returns  = A + V                            # the critic's regression target
        A        = whiten_batch(A)                  if whiten

    on model tokens (``M_t = 1``); 0 elsewhere. ``values[:, t]`` is the critic's value of the state before
    token ``t`` is generated (aligned like logprobs). Observation tokens are part of the environment's
    transition from one model token to the next, not episode ends. Vectorised over rows: one reverse pass
    over ``L`` that carries ``V_{n(t)}`` and ``A_{n(t)}`` across holes.

    Args:
        gamma: discount factor.
        lam: GAE's bias/variance trade-off; 1 gives Monte-Carlo returns minus V, 0 gives one-step TD.
        whiten: normalise advantages over the batch's response tokens (as in PPO implementations).
    """
    if values is None:
        raise ValueError("gae needs critic values (values=...); the flow passes them when algorithm.advantage=gae")
    with torch.no_grad():
        mask = loss_mask
        rewards, values = token_rewards * mask, values * mask
        is_model = mask > 0
        advantages = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])  # [B]: A at the next model token
        next_value = torch.zeros_like(rewards[:, 0])  # [B]: V at the next model token
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            running = torch.where(is_model[:, t], delta + gamma * lam * running, running)
            next_value = torch.where(is_model[:, t], values[:, t], next_value)
            advantages[:, t] = running
        advantages = advantages * mask
        returns = (advantages + values) * mask
        if whiten:
            advantages = masked_whiten(advantages, mask)
    return advantages, returns
