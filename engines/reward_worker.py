"""The reward worker: a Ray actor that scores rollouts (``engines.scoring``) and builds train batches
(``engines.batches``) next to the object store, so rollouts and batches move actor to actor."""

from __future__ import annotations

import dataclasses

import torch

from engines.algorithms.shaping import refill_rows
from engines.batches import AdvantageSpec, advantage_batch, concat_rollouts, routed_logprobs
from engines.rewards import warm_up
from engines.scoring import ScoreSpec, score_rollouts
from engines.types import Rollouts


class RewardWorker:
    """Ray actor that scores rollouts and builds advantage batches next to the object store.

    An actor rather than Ray tasks: this module's imports (the reward libraries) and the warm-ups of
    ``rewards`` (``engines.rewards.warm_up``) happen once, when the actor starts in parallel with the
    model engines, and calls never hit a cold worker."""

    def __init__(self, rewards: tuple[str, ...] = ()) -> None:
        self.warmed = warm_up(rewards)

    def score(self, rollouts: Rollouts, prompts: list[str], columns: dict[str, list], spec: ScoreSpec):
        return score_rollouts(rollouts, prompts, columns, spec)

    def score_rows(self, rollouts: Rollouts, rows: list[int], prompts: list[str], columns: dict[str, list],
                   spec: ScoreSpec):
        """``(those rows' Rollouts, their rewards, stats)`` for rows ``rows`` of ``rollouts`` (one prompt group
        of a generation call that held several); ``prompts`` and ``columns`` are those rows' already."""
        part = concat_rollouts([rollouts], [rows])
        # the call's time, in these rows' share: the stats of a call's groups add up to it
        part = dataclasses.replace(part, compute_seconds=rollouts.compute_seconds * len(rows) / max(len(rollouts.completions), 1))
        rewards, stats = score_rollouts(part, prompts, columns, spec)
        return part, rewards, stats

    def advantage_batch(self, rollouts: Rollouts, rewards: torch.Tensor, group_ids: torch.Tensor | list[int],
                        spec: AdvantageSpec, *teacher_parts: torch.Tensor, teacher_rows: list[list[int]] = (),
                        **kwargs):
        """``group_ids`` may come as a list: a list of ints pickles in microseconds, a tensor argument in
        about 0.3 ms of the caller's time. ``teacher_parts``: each teacher's log-probs of its rows
        ``teacher_rows[k]`` (given flat, so Ray resolves them), joined into ``teacher_logprobs``."""
        if teacher_parts:
            kwargs["teacher_logprobs"] = routed_logprobs(list(teacher_parts), list(teacher_rows), len(rewards))
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
