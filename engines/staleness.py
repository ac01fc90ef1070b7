"""The staleness bound of fully asynchronous RL: which samples may start, and which may still be trained.

Rollout runs ahead of training and the trainer takes batches of ``batch_size`` units (prompt groups) as
they fill; batch ``j`` is trained by weights version ``j`` (the trainer's updates so far). A unit started
while the rollout engines held version ``w`` and trained in batch ``j`` is ``j - w`` versions stale; the
bound is ``j - w <= η`` (``max_staleness``).

* Admission (AReaL, Fu et al. 2025, arXiv:2505.24298, §5.1): a new unit may start only while
  ``started + 1 <= (w + η + 1) · batch_size``, ``started`` counting every unit started and not aborted.
  Were units to finish in the order they started, each would then land in a batch within the bound.
* They may finish in any order: a slow unit is overtaken and lands in a later batch. So when batch ``j``
  forms, finished units older than ``j - η`` are dropped and running ones aborted (their prompts go back
  to the queue) instead of being trained beyond the bound (``form_batch``, ``oldest_trainable``).

A unit of a partial rollout that continued with newer weights (``keep``) counts from the version of its
first token. Pure bookkeeping over integers; the flow does the generating (``flows/asynchrony.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StalenessBound:
    """Admission and batch forming under staleness bound ``max_staleness`` (η) for batches of ``batch_size``."""

    batch_size: int
    max_staleness: int
    started: int = 0  # units started and not aborted: running, finished, or trained
    trained_batches: int = 0  # batches formed: the trainer's version when it takes the next one
    finished: list[tuple[object, int]] = field(default_factory=list)  # (unit, version it started with), in finishing order
    dropped: int = 0  # finished units too stale to train
    dropped_units: list = field(default_factory=list)  # those units, for the caller to take (and requeue)
    aborted: int = 0  # running units stopped because no batch within the bound could take them

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_staleness < 0:
            raise ValueError(f"batch_size must be >= 1 and max_staleness >= 0, got {self.batch_size}, {self.max_staleness}")

    def can_start(self, engine_version: int) -> bool:
        """Whether a unit may start now, generated with the rollout engines' weights ``engine_version``."""
        return self.started + 1 <= (engine_version + self.max_staleness + 1) * self.batch_size

    def start(self, engine_version: int) -> None:
        """Count a unit that starts; raises when ``can_start`` says no."""
        if not self.can_start(engine_version):
            raise RuntimeError(f"admission refused: {self.started} units started, engines at v{engine_version}, "
                               f"η {self.max_staleness}, batches of {self.batch_size}")
        self.started += 1

    def finish(self, unit: object, version: int) -> None:
        """A unit finished; ``version`` is the weights version it started with (its oldest token's)."""
        self.finished.append((unit, version))

    def abort(self) -> None:
        """A running unit was stopped because no batch within the bound could take it: it no longer counts as
        started, and counts as aborted."""
        self.release()
        self.aborted += 1

    def release(self) -> None:
        """A running unit stopped for another reason (its engine died, a weight update aborted it) and will
        run again: it no longer counts as started."""
        self.started -= 1

    def oldest_trainable(self) -> int:
        """The oldest start version the next batch may take: ``j - η`` for batch ``j``."""
        return self.trained_batches - self.max_staleness

    def form_batch(self) -> list[tuple[object, int]] | None:
        """The next batch, ``batch_size`` finished units in finishing order, once there are enough within the
        bound (older ones are dropped first, counted in ``dropped``); None while there are not. The caller
        aborts running units started before ``oldest_trainable()`` after each batch."""
        oldest = self.oldest_trainable()
        fresh = [(unit, version) for unit, version in self.finished if version >= oldest]
        self.dropped_units += [unit for unit, version in self.finished if version < oldest]
        self.dropped += len(self.finished) - len(fresh)
        self.started -= len(self.finished) - len(fresh)
        self.finished = fresh
        if len(fresh) < self.batch_size:
            return None
        batch, self.finished = fresh[: self.batch_size], fresh[self.batch_size:]
        self.trained_batches += 1
        return batch


def version_lag_metrics(lags: list[int], max_staleness: int) -> dict[str, float]:
    """A batch's version lags (trainer version minus each unit's start version) as metrics: their mean and
    maximum, and how many units lag by each of ``0..max_staleness`` versions."""
    metrics = {"async/version_lag_mean": sum(lags) / len(lags), "async/version_lag_max": float(max(lags))}
    metrics.update({f"async/version_lag_{lag}": float(lags.count(lag)) for lag in range(max_staleness + 1)})
    return metrics
