"""Scoring rollouts with a registered reward, on Ray workers: one reward per distinct sample, the step's
metrics from the scoring stats (rewards, lengths, failures, throughput)."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from engines.rewards.runner import score_samples
from engines.types import Rollouts


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
        "first_failure": scoring.first_failure, "weights_version": rollouts.weights_version,
        "aborted": sum(r == "abort" for r in rollouts.finish_reasons), "partial": rollouts.token_versions is not None,
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
