"""Stop a run whose reward keeps failing, instead of training on the zeros its failures score.

The scoring runner (``engines.rewards.runner``) scores a sample 0.0 when its reward raises, times out or
returns a non-finite value, and keeps the first failure's text. Per step and domain,
``failures_by_domain`` adds up those counts over the step's scoring calls, and
``RewardFailureMonitor.update`` logs one warning line per domain with failures and raises
``RewardFailureError`` when a domain's failure rate

    rate = failed distinct samples / distinct samples scored

has been above ``max_failure_rate`` on ``patience`` consecutive steps; a step at or below it resets the
domain's count. The counts (``RewardFailureMonitor.state``) are a small dict the run checkpoints, so a
resumed run keeps counting.

>>> monitor = RewardFailureMonitor(max_failure_rate=0.5, patience=2)
>>> broken = {"code": DomainFailures("code", samples=8, failed=6, first="KeyError: tests")}
>>> monitor.update(1, broken)
['step 1: reward failures in domain code: 6/8 samples scored 0 (reward code); first: KeyError: tests']
>>> monitor.update(2, broken)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engines.rewards.failures.RewardFailureError: domain 'code': reward 'code' failed on 6/8 samples at step 2, ...
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


class RewardFailureError(RuntimeError):
    """A domain's reward failed on too many samples for too many steps in a row."""


@dataclass(frozen=True)
class DomainFailures:
    """One step's scoring failures of one domain."""

    reward: str
    """The reward function's registered name."""
    samples: int
    """Distinct samples scored."""
    failed: int
    """Of them, those scored 0 because the reward raised, timed out or returned NaN/inf."""
    first: str | None
    """The first failure's text, one line (``"ValueError: …"``); None without failures."""


def failures_by_domain(stats: list[dict]) -> dict[str, DomainFailures]:
    """Per domain, the sums over the ``engines.scoring.score_rollouts`` stats of one step (keys
    ``domain``, ``reward``, ``distinct``, ``failed``, ``first_failure``); the first failure is that of
    the first call in ``stats`` order that had one."""
    out: dict[str, DomainFailures] = {}
    for s in stats:
        prev = out.get(s["domain"], DomainFailures(s["reward"], 0, 0, None))
        out[s["domain"]] = DomainFailures(prev.reward, prev.samples + s["distinct"], prev.failed + s["failed"],
                                          prev.first or s["first_failure"])
    return out


class RewardFailureMonitor:
    """Counts, per domain, the consecutive steps whose reward failure rate is above ``max_failure_rate``
    and raises once a count reaches ``patience`` (see the module docstring). ``streaks`` resumes the
    counts of ``state()``."""

    def __init__(self, *, max_failure_rate: float, patience: int, streaks: dict[str, int] | None = None) -> None:
        if not 0.0 <= max_failure_rate <= 1.0 or patience < 1:
            raise ValueError(f"max_failure_rate={max_failure_rate} must be in [0, 1] and patience={patience} >= 1")
        self.max_failure_rate, self.patience = max_failure_rate, patience
        self.streaks: dict[str, int] = dict(streaks or {})

    def state(self) -> dict[str, int]:
        """Consecutive over-the-rate steps per domain (domains at 0 left out): what a checkpoint keeps."""
        return {domain: n for domain, n in sorted(self.streaks.items()) if n}

    def update(self, step: int, failures: dict[str, DomainFailures]) -> list[str]:
        """Count ``step``'s failures; returns (and logs as warnings) one line per domain that had any.
        ``RewardFailureError`` with one line naming the domain, the reward and the first failure when a
        domain has been above the rate for ``patience`` steps."""
        lines = []
        for domain, f in sorted(failures.items()):
            rate = f.failed / max(f.samples, 1)
            self.streaks[domain] = self.streaks.get(domain, 0) + 1 if rate > self.max_failure_rate else 0
            if self.streaks[domain] >= self.patience:
                raise RewardFailureError(
                    f"domain {domain!r}: reward {f.reward!r} failed on {f.failed}/{f.samples} samples at step {step}, "
                    f"above reward.max_failure_rate={self.max_failure_rate:g} for {self.streaks[domain]} steps in a "
                    f"row (reward.failure_patience={self.patience}); first failure: {f.first}")
            if f.failed:
                lines.append(f"step {step}: reward failures in domain {domain}: {f.failed}/{f.samples} samples "
                             f"scored 0 (reward {f.reward}); first: {f.first}")
                log.warning(lines[-1])
        return lines
