"""Train batches from scored rollouts: reward shaping, KL in the reward, the advantage estimator and the
``TrainBatch`` the training engine takes; and joining the rows of several generation calls."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engines.algorithms import advantages, corrections, kl, onpolicy
from engines.algorithms.advantages import outcome_token_rewards
from engines.algorithms.shaping import RunningMoments, ShapingSpec, shape_advantages, shape_sequence_rewards
from engines.types import Rollouts, build_train_batch


@dataclass(frozen=True)
class AdvantageSpec:
    """Which estimator to run with which options, the shaping around it, and how KL enters.

    ``pad_token_id`` pads the train batch; ``kl_in_reward`` subtracts ``kl_coef * KL_t`` from the token
    rewards (KL measured between the policy's old logprobs and the reference's). ``correction``: an off-policy
    correction (``engines.algorithms.corrections``) with its options, or None."""

    estimator: str
    pad_token_id: int
    options: dict = field(default_factory=dict)
    shaping: ShapingSpec = ShapingSpec()
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    correction: str | None = None
    correction_options: dict = field(default_factory=dict)


def advantage_batch(rollouts: Rollouts, rewards: torch.Tensor, group_ids: torch.Tensor, spec: AdvantageSpec, *,
                    ref_logprobs: torch.Tensor | None = None, old_logprobs: torch.Tensor | None = None,
                    values: torch.Tensor | None = None, kl_coef: float = 0.0,
                    moments: RunningMoments | None = None, teacher_logprobs: torch.Tensor | None = None,
                    teacher_coef: float = 1.0, distill_only: bool = False,
                    teacher_kl_groups: dict[str, list[int]] | None = None,
                    step_advantages: list[list[float]] | None = None, masked_rows: list[int] = (),
                    policy_version: int | None = None, max_version_lag: int = 0):
    """Shape rewards, run the estimator, build the TrainBatch; returns ``(batch, summary, moments)``.

    The batch carries ``advantages``, ``returns``, ``old_logprobs`` (the trainer's when given, else the
    rollout engine's), ``rollout_logprobs``, and ``ref_logprobs`` / ``values`` when given. ``moments``
    are the running reward statistics, updated when ``shaping.reward_norm == "running"``.

    On-policy distillation: ``teacher_logprobs`` [B, L] (each row scored by its teacher, aligned like the
    batch) add ``-teacher_coef · (log q_sampler - log p_teacher)`` per completion token to the estimator's
    shaped advantages, or replace them when ``distill_only`` (``onpolicy.distill_advantages``); the summary
    gains ``teacher_kl`` and ``teacher_kl/<name>`` over the rows of each of ``teacher_kl_groups``.

    Agentic RL: ``step_advantages`` (one value per turn of each row, ``engines.algorithms.agentic``) replace
    the estimator's, each on its turn's model tokens; ``masked_rows`` (errors, masked truncations, groups
    StarPO-S filters out) leave the loss.

    ``policy_version``: the trainer's weights version; the rollouts' ``weights_version`` must be at most
    ``max_version_lag`` behind it and never ahead (``StaleRolloutsError``); the lag is ``offpolicy/version_lag``.

    Off-policy correction (``spec.correction``): its weights go to the batch as ``is_weights`` (the policy
    loss multiplies its per-token term by them) and the tokens it rejects leave ``loss_mask``; its metrics
    join the summary.
    """
    summary: dict[str, float] = {}
    if policy_version is not None:
        summary["offpolicy/version_lag"] = float(check_version_lag(rollouts.weights_version, policy_version, max_version_lag))
    batch = build_train_batch(rollouts, spec.pad_token_id)
    width, mask = batch.input_ids.shape[1], batch.loss_mask  # [B, L]
    old = old_logprobs[:, :width] if old_logprobs is not None else batch.tensors["rollout_logprobs"]
    shaped, moments = shape_sequence_rewards(rewards, rollouts.response_lengths, group_ids, spec.shaping, moments)
    token_rewards = outcome_token_rewards(shaped, mask)
    tensors = {"old_logprobs": old}
    summary["reward/shaped_mean"] = float(shaped.mean())
    if ref_logprobs is not None:
        tensors["ref_logprobs"] = ref_logprobs[:, :width]
        kl_tok = kl.compute(spec.kl_estimator, logprobs=old, ref_logprobs=tensors["ref_logprobs"]) * mask  # [B, L]
        summary["kl/seq_mean"] = float(kl_tok.sum(-1).mean())
        summary["kl/token_mean"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
        if spec.kl_in_reward:
            token_rewards = token_rewards - kl_coef * kl_tok
            summary["kl/coef"] = kl_coef
    if values is not None:
        tensors["values"] = values[:, :width] * mask
    adv, returns = advantages.compute(spec.estimator, token_rewards=token_rewards, loss_mask=mask, group_ids=group_ids,
                                      values=tensors.get("values"), outcome_rewards=shaped, **spec.options)
    adv = shape_advantages(adv, mask, spec.shaping)
    if step_advantages is not None:
        from engines.algorithms.agentic import spread_over_turns

        adv = spread_over_turns(step_advantages, batch.turn_index, mask).to(adv.dtype)
        returns = adv
    if masked_rows:
        mask = mask.clone()
        mask[torch.as_tensor(list(masked_rows), dtype=torch.long)] = 0.0
    if teacher_logprobs is not None:  # after the estimator and its shaping: neither touches the teacher's term
        adv, reverse_kl = onpolicy.distill_advantages(
            student_logprobs=batch.tensors["rollout_logprobs"], teacher_logprobs=teacher_logprobs[:, :width],
            loss_mask=mask, coef=teacher_coef, rl_advantages=None if distill_only else adv)
        summary.update(onpolicy.teacher_kl_metrics(reverse_kl, mask, teacher_kl_groups))
    if spec.shaping.overlong_filter:  # DAPO: truncated samples carry no learning signal, drop them from the loss
        kept = torch.tensor([reason != "length" for reason in rollouts.finish_reasons], dtype=mask.dtype, device=mask.device)
        mask = mask * kept.unsqueeze(-1)
        summary["shaping/overlong_filtered_frac"] = 1.0 - float(kept.mean())
    if spec.correction is not None:  # last: it weighs and rejects among the tokens still in the loss
        weights, keep, correction_metrics = corrections.compute(
            spec.correction, prox_logprobs=old, rollout_logprobs=batch.tensors["rollout_logprobs"], loss_mask=mask,
            **spec.correction_options)
        mask, tensors["is_weights"] = mask * keep, weights
        summary.update(correction_metrics)
    batch = dataclasses.replace(batch, loss_mask=mask, group_ids=group_ids,
                                tensors={**batch.tensors, **tensors, "advantages": adv * mask, "returns": returns * mask})
    is_response = mask.bool()
    summary["advantage/mean"] = float(adv[is_response].mean()) if is_response.any() else 0.0
    summary["advantage/abs_mean"] = float(adv[is_response].abs().mean()) if is_response.any() else 0.0
    summary["advantage/returns_mean"] = float(returns[is_response].mean()) if is_response.any() else 0.0
    return batch, summary, moments


class StaleRolloutsError(RuntimeError):
    """Rollouts generated with weights further behind the trainer than the run allows, or ahead of it."""


def check_version_lag(rollouts_version: int, policy_version: int, max_lag: int) -> int:
    """``policy_version - rollouts_version``, the versions the rollouts' weights are behind the trainer's;
    raise ``StaleRolloutsError`` when it is negative or above ``max_lag``."""
    lag = policy_version - rollouts_version
    if not 0 <= lag <= max_lag:
        raise StaleRolloutsError(f"rollouts generated with weights v{rollouts_version} reached the trainer at "
                                 f"v{policy_version}: {lag} versions behind, the run allows 0 to {max_lag}")
    return lag


def routed_logprobs(parts: list[torch.Tensor], rows: list[list[int]], num_rows: int) -> torch.Tensor:
    """One ``[num_rows, L]`` tensor from per-teacher scores: ``parts[k]`` [len(rows[k]), L_k] holds the rows
    ``rows[k]`` of the batch (left-aligned like ``build_train_batch``, so a row keeps its positions in a
    subset); ``L`` is the widest part, rows no part covers are 0."""
    width = max((part.shape[1] for part in parts), default=0)
    out = torch.zeros((num_rows, width), dtype=torch.float32)
    for part, idx in zip(parts, rows):
        if idx:
            out[torch.as_tensor(idx, dtype=torch.long), : part.shape[1]] = part.float()
    return out


def concat_rollouts(parts: list[Rollouts], rows: list[list[int]]) -> Rollouts:
    """Rows ``rows[k]`` of ``parts[k]``, concatenated in order (dynamic sampling's refilled batch).

    The multi-turn masks stay ``None`` when every part has none; else a part without them gets its defaults."""
    width = max(part.response_ids.shape[1] for part in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    pick = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    multi_turn = any(part.response_loss_mask is not None or part.response_turn_index is not None for part in parts)
    joined = lambda per_part: torch.cat([pad(per_part(part))[idx] for part, idx in zip(parts, rows)])  # noqa: E731
    partial = any(part.token_versions is not None for part in parts)
    versions = lambda part: (part.token_versions if part.token_versions is not None else  # noqa: E731
                             torch.full(part.response_ids.shape, part.weights_version, dtype=torch.long))
    return Rollouts(
        prompt_ids=[p for part, idx in zip(parts, rows) for p in pick(part.prompt_ids, idx)],
        response_ids=torch.cat([pad(part.response_ids)[idx] for part, idx in zip(parts, rows)]),
        logprobs=torch.cat([pad(part.logprobs)[idx] for part, idx in zip(parts, rows)]),
        response_lengths=torch.cat([part.response_lengths[idx] for part, idx in zip(parts, rows)]),
        finish_reasons=[r for part, idx in zip(parts, rows) for r in pick(part.finish_reasons, idx)],
        completions=[c for part, idx in zip(parts, rows) for c in pick(part.completions, idx)],
        weights_version=min(part.weights_version for part in parts),  # the oldest weights that sampled a row
        compute_seconds=sum(part.compute_seconds for part in parts),
        response_loss_mask=joined(Rollouts.model_token_mask) if multi_turn else None,
        response_turn_index=joined(Rollouts.turn_index) if multi_turn else None,
        token_versions=joined(versions) if partial else None,
    )

