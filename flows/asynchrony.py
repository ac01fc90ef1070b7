"""Rollout ahead of training: ``async.mode: one_step`` (``OneStepAhead``) and ``full`` (``RolloutStream``),
set in ``configs/asynchrony.py``.

``one_step``: step k's batch is generated while the trainer trains on step k-1's, so generation and training overlap
instead of waiting for each other. The schedule is fixed::

    take(k):  wait for batch k  →  sync the trainer's weights (version k-1) to the rollout engines
              →  start generating batch k+1 with them  →  (the flow) train on batch k  →  version k

Batch k was generated with version k-2 and is trained by version k-1: one version behind (batch 1 none).
Sampling seeds depend on the step only, so the batches, and the weights after them, are the same on every
run with the same seed. An evaluation first waits for the batch in flight and syncs the newest weights
(``settle``); the next ``take`` would have synced the same version, so evaluating changes no batch. Each
checkpoint stores the batch generated ahead (``pending_files``): it was sampled with weights the
checkpoint no longer holds, and a resumed run takes it instead of sampling it again, so it resumes
bit-exactly.

The batch in flight is sampled on a thread of the flow's process in a copy of its context, so its tasks
are tasks of the flow run; the sampling itself runs in the rollout engines and reward workers (Ray).

``full``: rollout never waits for the trainer, within a staleness bound (``tasks/rollout_stream.py``'s
``RolloutStream``; for agentic RL ``tasks/episode_stream.py``'s ``EpisodeStream``)."""

from __future__ import annotations

import contextvars
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from tasks import pending_batch


class OneStepAhead:
    """The batches of an RL run, each generated while the trainer trains on the one before.

    ``sample(step, positions)`` generates and scores step ``step``'s batch from data positions ``positions``
    (a ``ScoredBatch``); ``sync(version)`` puts the trainer's current weights, labelled ``version``, on the
    rollout engines. ``engine_version`` is the version the rollout engines hold now; ``last_step`` the
    run's last step (nothing is generated beyond it)."""

    def __init__(self, sample: Callable, sync: Callable[[int], None], engine_version: int, last_step: int) -> None:
        self._sample, self._sync = sample, sync
        self.engine_version, self.last_step = engine_version, last_step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self._pending: tuple[int, Future] | None = None

    def take(self, step: int, positions: dict, trainer_version: int):
        """Step ``step``'s batch (generated ahead, or now when none is), after which the trainer's weights
        ``trainer_version`` go to the rollout engines and step ``step + 1``'s batch starts generating."""
        if self._pending is None:
            scored = self._sample(step, positions)
        else:
            pending_step, future = self._pending
            if pending_step != step:
                raise RuntimeError(f"the batch generated ahead is step {pending_step}'s, but step {step} asks for one")
            scored, self._pending = future.result(), None
        self._bring_engines_to(trainer_version)
        if step < self.last_step:
            context = contextvars.copy_context()  # the flow run's context: its tasks stay the flow's
            self._pending = (step + 1, self._pool.submit(context.run, self._sample, step + 1, scored.positions))
        return scored

    def settle(self, trainer_version: int) -> None:
        """Wait for the batch in flight, then give the rollout engines the trainer's weights (an evaluation
        uses them); the next ``take`` then has nothing to sync."""
        self.pending()
        self._bring_engines_to(trainer_version)

    def pending(self):
        """``(step, ScoredBatch)`` of the batch generated ahead, once complete; None when there is none."""
        if self._pending is None:
            return None
        step, future = self._pending
        return step, future.result()

    def restore(self, step: int, scored) -> None:
        """Take ``scored`` (a checkpoint's batch generated ahead) as step ``step``'s batch."""
        future: Future = Future()
        future.set_result(scored)
        self._pending = (step, future)

    def close(self) -> None:
        """Stop sampling ahead; a batch in flight is left to finish on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _bring_engines_to(self, version: int) -> None:
        if version != self.engine_version:
            self._sync(version)
            self.engine_version = version


def pending_files(ahead: OneStepAhead | None) -> dict[str, bytes]:
    """The checkpoint files of the batch ``ahead`` generated (waiting for it), or none."""
    return pending_batch.pending_files(ahead.pending() if ahead is not None else None)
