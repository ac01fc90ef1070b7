"""Steps between generation and training that run on Ray workers: scoring and advantage batches.

Plain functions over engine types; ``RewardWorker`` serves them from a Ray actor next to the object
store, and tests call them directly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from engines.algorithms import advantages, kl
from engines.algorithms.advantages import outcome_token_rewards
from engines.algorithms.shaping import RunningMoments, ShapingSpec, refill_rows, shape_advantages, shape_sequence_rewards
from engines.rewards import warm_up
from engines.rewards.runner import score_samples
from engines.types import Rollouts, build_train_batch


@dataclass(frozen=True)
class ScoreSpec:
    """How one batch of rollouts is scored: which reward with which options, in what chunks."""

    reward: str
    options: dict = field(default_factory=dict)
    domain: str = "default"
    chunk_size: int = 8
    concurrency: int = 4
    timeout_s: float = 30.0


def score_rollouts(rollouts: Rollouts, prompts: list[str], columns: dict[str, list], spec: ScoreSpec):
    """Reward each completion; returns ``(rewards [B], stats)``. Inputs are per-row (already repeated).

    A reward is a function of its sample, so identical samples (one prompt, completion and columns: a
    GRPO group's repeats) are scored once; event counts (``timeout``, ``error``, …) are of distinct samples.
    ``stats`` are sums (``summarize`` turns the stats of several chunks and domains into metrics), plus the
    ``reward`` name and, of the ``distinct`` samples, the ``failed`` ones and the ``first_failure`` text
    (``engines.rewards.failures.failures_by_domain`` reads those)."""
    start = time.perf_counter()
    first: dict[str, int] = {}  # a sample's key -> its index among the distinct samples
    unique, row_to_unique = [], []  # the first row of each distinct sample; each row's distinct sample
    for i, completion in enumerate(rollouts.completions):
        key = repr((prompts[i], completion, [values[i] for values in columns.values()]))
        if key not in first:
            first[key] = len(unique)
            unique.append(i)
        row_to_unique.append(first[key])
    scoring = score_samples(spec.reward, [prompts[i] for i in unique], [rollouts.completions[i] for i in unique],
                            {k: [v[i] for i in unique] for k, v in columns.items()}, spec.options,
                            chunk_size=spec.chunk_size, concurrency=spec.concurrency, timeout_s=spec.timeout_s)
    rewards = torch.tensor(scoring.rewards, dtype=torch.float32)[torch.tensor(row_to_unique, dtype=torch.long)]
    lengths = rollouts.response_lengths.float()
    stats = {
        "domain": spec.domain, "n": len(rewards), "reward_sum": float(rewards.sum()),
        "reward_sq_sum": float((rewards ** 2).sum()), "correct": int((rewards >= 1.0).sum()),
        "length_sum": float(lengths.sum()), "length_max": float(lengths.max()) if len(lengths) else 0.0,
        "truncated": sum(r == "length" for r in rollouts.finish_reasons), "events": scoring.events,
        "generate_s": rollouts.compute_seconds, "score_s": time.perf_counter() - start,
        "reward": spec.reward, "distinct": len(unique), "failed": scoring.failed,
        "first_failure": scoring.first_failure,
    }
    return rewards, stats


def summarize(stats: list[dict], every_round: list[dict] | None = None) -> dict[str, float]:
    """Metrics of a step from the ``score_rollouts`` stats of its chunks: overall ``reward/…``,
    ``response/…`` and, per domain, ``domain/<name>/{reward_mean,accuracy,response_length,<event>}``
    (events such as ``timeout``, ``error``, ``violation`` are counts, 0 when none happened).

    With dynamic sampling ``stats`` are the first round's (an unfiltered sample of the policy) and
    ``every_round`` the stats of all rounds: the work done, ``rollout/tokens``, ``perf/generate_compute_s``,
    ``perf/score_compute_s`` and their ratio ``perf/tokens_per_s``, counts every round."""
    def block(items: list[dict]) -> dict[str, float]:
        n = sum(s["n"] for s in items)
        mean = sum(s["reward_sum"] for s in items) / max(n, 1)
        var = (sum(s["reward_sq_sum"] for s in items) - n * mean * mean) / max(n - 1, 1)
        return {"n": n, "mean": mean, "std": math.sqrt(max(var, 0.0)),
                "accuracy": sum(s["correct"] for s in items) / max(n, 1),
                "length": sum(s["length_sum"] for s in items) / max(n, 1),
                "events": sum((Counter(s["events"]) for s in items), Counter())}

    overall = block(stats)
    metrics = {
        "reward/mean": overall["mean"], "reward/std": overall["std"], "reward/accuracy": overall["accuracy"],
        "response/length_mean": overall["length"],
        "response/length_max": max((s["length_max"] for s in stats), default=0.0),
        "response/truncated_frac": sum(s["truncated"] for s in stats) / max(overall["n"], 1),
        **throughput(stats if every_round is None else every_round),
        "reward/failed": float(sum(s["failed"] for s in stats)),  # distinct samples the reward failed on
    }
    domains = sorted({s["domain"] for s in stats})
    if domains != ["default"]:
        for name in domains:
            d = block([s for s in stats if s["domain"] == name])
            prefix = f"domain/{name}/"
            metrics.update({prefix + "reward_mean": d["mean"], prefix + "accuracy": d["accuracy"],
                            prefix + "response_length": d["length"], prefix + "samples": float(d["n"])})
            for event in sorted(set(COUNTED_EVENTS) | set(d["events"])):
                metrics[prefix + event] = float(d["events"][event])
    return metrics


def throughput(stats: list[dict]) -> dict[str, float]:
    """Tokens generated, generation and scoring compute seconds, and tokens per generation second, over
    the ``score_rollouts`` stats given."""
    tokens, seconds = sum(s["length_sum"] for s in stats), sum(s["generate_s"] for s in stats)
    return {"rollout/tokens": tokens, "perf/generate_compute_s": seconds,
            "perf/score_compute_s": sum(s["score_s"] for s in stats), "perf/tokens_per_s": tokens / max(seconds, 1e-9)}


COUNTED_EVENTS = ("error", "timeout", "nan")
"""Runner events every domain reports (as 0 when none), so a failure shows as a step in the MLflow chart."""


@dataclass(frozen=True)
class AdvantageSpec:
    """Which estimator to run with which options, the shaping around it, and how KL enters.

    ``pad_token_id`` pads the train batch; ``kl_in_reward`` subtracts ``kl_coef * KL_t`` from the token
    rewards (KL measured between the policy's old logprobs and the reference's)."""

    estimator: str
    pad_token_id: int
    options: dict = field(default_factory=dict)
    shaping: ShapingSpec = ShapingSpec()
    kl_estimator: str = "k3"
    kl_in_reward: bool = False


def advantage_batch(rollouts: Rollouts, rewards: torch.Tensor, group_ids: torch.Tensor, spec: AdvantageSpec, *,
                    ref_logprobs: torch.Tensor | None = None, old_logprobs: torch.Tensor | None = None,
                    values: torch.Tensor | None = None, kl_coef: float = 0.0,
                    moments: RunningMoments | None = None):
    """Shape rewards, run the estimator, build the TrainBatch; returns ``(batch, summary, moments)``.

    The batch carries ``advantages``, ``returns``, ``old_logprobs`` (the trainer's when given, else the
    rollout engine's), ``rollout_logprobs``, and ``ref_logprobs`` / ``values`` when given. ``moments``
    are the running reward statistics, updated when ``shaping.reward_norm == "running"``.
    """
    batch = build_train_batch(rollouts, spec.pad_token_id)
    width, mask = batch.input_ids.shape[1], batch.loss_mask  # [B, L]
    old = old_logprobs[:, :width] if old_logprobs is not None else batch.tensors["rollout_logprobs"]
    shaped, moments = shape_sequence_rewards(rewards, rollouts.response_lengths, group_ids, spec.shaping, moments)
    token_rewards = outcome_token_rewards(shaped, mask)
    tensors = {"old_logprobs": old}
    summary = {"reward/shaped_mean": float(shaped.mean())}
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
    if spec.shaping.overlong_filter:  # DAPO: truncated samples carry no learning signal, drop them from the loss
        kept = torch.tensor([reason != "length" for reason in rollouts.finish_reasons], dtype=mask.dtype, device=mask.device)
        mask = mask * kept.unsqueeze(-1)
        summary["shaping/overlong_filtered_frac"] = 1.0 - float(kept.mean())
    batch = dataclasses.replace(batch, loss_mask=mask, group_ids=group_ids,
                                tensors={**batch.tensors, **tensors, "advantages": adv * mask, "returns": returns * mask})
    is_response = mask.bool()
    summary["advantage/mean"] = float(adv[is_response].mean()) if is_response.any() else 0.0
    summary["advantage/abs_mean"] = float(adv[is_response].abs().mean()) if is_response.any() else 0.0
    summary["advantage/returns_mean"] = float(returns[is_response].mean()) if is_response.any() else 0.0
    return batch, summary, moments


def concat_rollouts(parts: list[Rollouts], rows: list[list[int]]) -> Rollouts:
    """Rows ``rows[k]`` of ``parts[k]``, concatenated in order (dynamic sampling's refilled batch).

    The multi-turn masks stay ``None`` when every part has none; else a part without them gets its defaults."""
    width = max(part.response_ids.shape[1] for part in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    pick = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    multi_turn = any(part.response_loss_mask is not None or part.response_turn_index is not None for part in parts)
    joined = lambda per_part: torch.cat([pad(per_part(part))[idx] for part, idx in zip(parts, rows)])  # noqa: E731
    return Rollouts(
        prompt_ids=[p for part, idx in zip(parts, rows) for p in pick(part.prompt_ids, idx)],
        response_ids=torch.cat([pad(part.response_ids)[idx] for part, idx in zip(parts, rows)]),
        logprobs=torch.cat([pad(part.logprobs)[idx] for part, idx in zip(parts, rows)]),
        response_lengths=torch.cat([part.response_lengths[idx] for part, idx in zip(parts, rows)]),
        finish_reasons=[r for part, idx in zip(parts, rows) for r in pick(part.finish_reasons, idx)],
        completions=[c for part, idx in zip(parts, rows) for c in pick(part.completions, idx)],
        weights_version=parts[0].weights_version,
        compute_seconds=sum(part.compute_seconds for part in parts),
        response_loss_mask=joined(Rollouts.model_token_mask) if multi_turn else None,
        response_turn_index=joined(Rollouts.turn_index) if multi_turn else None,
    )


class RewardWorker:
    """Ray actor that scores rollouts and builds advantage batches next to the object store.

    An actor rather than Ray tasks: this module's imports (the reward libraries) and the warm-ups of
    ``rewards`` (``engines.rewards.warm_up``) happen once, when the actor starts in parallel with the
    model engines, and calls never hit a cold worker."""

    def __init__(self, rewards: tuple[str, ...] = ()) -> None:
        self.warmed = warm_up(rewards)

    def score(self, rollouts: Rollouts, prompts: list[str], columns: dict[str, list], spec: ScoreSpec):
        return score_rollouts(rollouts, prompts, columns, spec)

    def advantage_batch(self, rollouts: Rollouts, rewards: torch.Tensor, group_ids: torch.Tensor | list[int],
                        spec: AdvantageSpec, **kwargs):
        """``group_ids`` may come as a list: a list of ints pickles in microseconds, a tensor argument in
        about 0.3 ms of the caller's time."""
        return advantage_batch(rollouts, rewards, torch.as_tensor(group_ids), spec, **kwargs)

    def join(self, rows: list[list[int] | None], *parts):
        """One batch from several generation calls or dynamic-sampling rounds: rows ``rows[k]`` (all when
        None) of the k-th ``(Rollouts, rewards [B_k])`` pair, the pairs given flat in ``parts`` (rollouts,
        rewards, rollouts, rewards, …, so Ray resolves them). Returns ``(rollouts, rewards)``."""
        rollouts, rewards = list(parts[0::2]), list(parts[1::2])
        rows = [list(range(len(r))) if idx is None else idx for r, idx in zip(rewards, rows)]
        return concat_rollouts(rollouts, rows), torch.cat([r[idx] for r, idx in zip(rewards, rows)])

    def informative_rows(self, rewards: torch.Tensor, group_size: int, room: int) -> list[int]:
        """Rows of the first ``room`` groups whose rewards are not all equal (dynamic sampling)."""
        return refill_rows(rewards, group_size, room)

    def samples(self, rollouts: Rollouts, rewards: torch.Tensor, prompts: list[str], columns: dict[str, list],
                limit: int) -> list[dict]:
        """The first ``limit`` rows as a table of samples for tracking: prompt, completion, answer, reward,
        finish reason and domain."""
        answers = columns.get("answer", [""] * len(prompts))
        return [{"prompt": prompts[i], "completion": rollouts.completions[i], "answer": str(answers[i]),
                 "reward": float(rewards[i]), "finish_reason": rollouts.finish_reasons[i],
                 "domain": columns["domain"][i]} for i in range(min(limit, len(prompts)))]
