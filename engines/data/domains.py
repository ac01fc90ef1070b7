"""Multi-domain batches: each RL step takes exactly each domain's share of prompts.

A domain is a dataset with its own reward (math, code, instruction following, …). Shares are counts
that sum to the step's prompt count, or ratios that sum to 1 and are rounded to counts once, the same
way every step (largest remainder), so every batch has exactly the same mix. Each domain walks its own
seeded permutation (``engines.data.sampler.take``); the positions (one integer per domain) are the
sampler's whole state, checkpointed and restored with the run.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

from engines.data.sampler import take


@dataclass(frozen=True)
class Domain:
    """One domain's rows and how it is scored."""

    name: str
    reward: str
    train_rows: list[dict]
    heldout_rows: list[dict]
    count: int  # prompts per step
    sampler_seed: int  # seeds this domain's permutation (domain_seed for named domains)
    reward_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0


def domain_counts(shares: list[float], total: int, names: list[str] | None = None) -> list[int]:
    """Prompts per step of each domain from its ``share``: counts (whole numbers summing to ``total``)
    or ratios (summing to 1; largest-remainder rounding, ties to the earlier domain).

    >>> domain_counts([2, 1, 1], 4)
    [2, 1, 1]
    >>> domain_counts([0.5, 0.3, 0.2], 8)   # 4, 2.4, 1.6 -> 4, 2, 2
    [4, 2, 2]
    """
    names = names or [str(i) for i in range(len(shares))]
    if all(float(s).is_integer() and s >= 1 for s in shares):
        counts = [int(s) for s in shares]
        if sum(counts) != total:
            raise ValueError(f"domain shares {dict(zip(names, counts))} sum to {sum(counts)}, "
                             f"not rollout.prompts_per_step={total}")
        return counts
    if not math.isclose(sum(shares), 1.0, abs_tol=1e-6) or any(s >= 1 for s in shares):
        raise ValueError(f"domain shares {dict(zip(names, shares))} mix counts and ratios or the ratios do not sum "
                         "to 1; give whole counts summing to rollout.prompts_per_step, or ratios summing to 1")
    exact = [s * total for s in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    empty = [n for n, c in zip(names, counts) if c == 0]
    if empty:
        raise ValueError(f"domains {empty} get 0 of {total} prompts per step with shares {dict(zip(names, shares))}; "
                         "raise their shares or rollout.prompts_per_step")
    return counts


def domain_seed(seed: int, name: str) -> int:
    """A per-domain sampler seed: stable across runs and Python processes (crc32, not ``hash``)."""
    return seed * 1_000_003 + zlib.crc32(name.encode())


def draw(domains: list[Domain], positions: dict[str, int]) -> tuple[list[tuple[Domain, list[dict]]], dict[str, int]]:
    """One step's prompts: ``[(domain, rows)]`` with ``domain.count`` rows each, and the new positions."""
    drawn, new_positions = [], dict(positions)
    for domain in domains:
        indices, new_positions[domain.name] = take(len(domain.train_rows), positions.get(domain.name, 0),
                                                   domain.count, seed=domain.sampler_seed)
        drawn.append((domain, [domain.train_rows[i] for i in indices]))
    return drawn, new_positions
