"""``async.mode: full`` for agentic RL (``flows/rlvr.py`` drives it): episode groups run continuously on the
environment workers, within the staleness bound of ``engines/staleness.py``, and the trainer takes a batch of
``rollout.prompts_per_step`` groups as soon as that many have finished. The Ray calls of the driver's side
live here, under ``tasks/``; the flow turns the finished groups into a batch (``to_batch``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import ray

from engines.staleness import StalenessBound, version_lag_metrics
from tasks.stream_loop import StreamLoop


@dataclass
class EpisodeGroup:
    """One group of ``rollout.group_size`` episodes on its way to a batch: number ``index`` in admission
    order (its environment and sampling seeds are functions of it), run by environment worker ``worker``
    in a ``collect`` call that holds other groups too, its rows ``rows`` of that call's batch."""

    index: int
    worker: int = 0
    version: int = 0  # the rollout engines' weights when its call was sent; its actions' are this or newer
    call: tuple = ()  # Ray refs of the call: (rollouts, returns, summaries)
    rows: tuple[int, ...] = ()
    summaries: list | None = None  # its episodes', once the call finished


def groups_per_call(cfg, workers: int) -> int:
    """Episode groups per ``collect`` call: ``async.groups_per_call``, by default a batch's groups split over
    the workers."""
    return cfg.async_.groups_per_call or -(-cfg.rollout.prompts_per_step // workers)


class EpisodeStream:
    """``async.mode: full`` with environments: a thread of the flow's process keeps two ``collect`` calls
    queued on each environment worker (one running, the next waiting), each of ``groups_per_call`` groups,
    admitted by ``StalenessBound`` with the rollout engines' version when the call is sent. Weight syncs land
    between turns (each turn is its own generation call), so an episode's actions may come from several
    versions: a group counts from its oldest action's, and groups too old to train are dropped (their
    group numbers are not run again: the next groups have new seeds).

    Not deterministic: which groups form a batch depends on timing. A checkpoint saves the next group
    number; the groups admitted and not trained then are lost on a resume, and counted
    (``untrained_groups``). A rollout engine or environment worker that dies fails the run (RLVR's stream
    replaces rollout engines; this one does not)."""

    def __init__(self, cfg, engines, next_group: int, engine_version: int, specs_for: Callable[[int], list],
                 to_batch: Callable) -> None:
        self.cfg, self.engines, self.specs_for, self.to_batch = cfg, engines, specs_for, to_batch
        self.next_group, self.engine_version = next_group, engine_version
        self.per_call = groups_per_call(cfg, len(engines.env_workers))
        self.in_flight = 2
        self.bound = StalenessBound(cfg.rollout.prompts_per_step, cfg.async_.max_staleness)
        self.running: list[EpisodeGroup] = []
        self._lock = threading.Lock()
        self._loop = StreamLoop("episode stream", self._round)
        self._loop.start()

    # -- the flow's side ---------------------------------------------------------------------------------
    def next_batch(self, step: int, trainer_version: int, replace_dead: Callable | None = None) -> tuple[object, list]:
        """``(batch, [])``: step ``step``'s batch (``to_batch(rollouts_ref, returns_ref, summaries, positions,
        metrics, step)``) once ``prompts_per_step`` groups within the bound have finished (no reward-failure
        stats: environments give the rewards; no dead engines to replace: ``replace_dead`` is not called)."""
        start = time.perf_counter()
        with self._loop.changed:
            while True:
                self._loop.raise_if_failed()
                with self._lock:
                    batch = self.bound.form_batch()
                if batch is not None:
                    break
                self._loop.changed.wait(timeout=0.5)
        waited = time.perf_counter() - start
        groups = [group for group, _ in batch]
        with self._lock:  # still running with weights older than the next batch may take: never trained
            oldest = self.bound.oldest_trainable()
            for group in [g for g in self.running if g.version < oldest]:
                self.running.remove(group)
                self.bound.abort()
            self.bound.dropped_units = []
        summaries = []
        for position, group in enumerate(groups):  # the batch's group ids: positions in it
            summaries += [{**s, "group": position} for s in group.summaries]
        parts = [ref for group in groups for ref in group.call[:2]]
        rollouts_ref, returns_ref = self.engines.reward_worker.join.options(num_returns=2).remote(
            [list(group.rows) for group in groups], *parts)
        positions, untrained = self.snapshot()
        lags = [trainer_version - version for _, version in batch]
        metrics = version_lag_metrics(lags, self.cfg.async_.max_staleness)
        metrics.update({"async/wait_s": waited, "async/untrained_groups": float(untrained),
                        "async/dropped_groups": float(self.bound.dropped), "async/aborted_groups": float(self.bound.aborted)})
        return self.to_batch(rollouts_ref, returns_ref, summaries, positions, metrics, step), []

    def sync(self, sync: Callable[[list, int], None], version: int, replace_dead: Callable | None = None) -> None:
        """``sync(engines, version)`` to every rollout engine; calls sent from then on start with ``version``."""
        sync(self.engines.rollouts, version)
        self.weights_synced(version)

    def weights_synced(self, version: int) -> None:
        """The rollout engines hold ``version`` from now on: later calls start with it."""
        with self._lock:
            self.engine_version = version

    def snapshot(self) -> tuple[dict[str, int], int]:
        """``{"episode_groups": next group number}`` (a resume starts there) and how many groups admitted
        before it are not trained yet (a resume from a checkpoint taken now loses them)."""
        with self._lock:
            return {"episode_groups": self.next_group}, len(self.running) + len(self.bound.finished)

    def close(self) -> None:
        self._loop.close()

    # -- the rollout thread ------------------------------------------------------------------------------
    def _round(self) -> None:
        self._start_calls()
        self._collect(timeout=0.05)

    def _start_calls(self) -> None:
        workers, size = self.engines.env_workers, self.cfg.rollout.group_size
        with self._lock:
            while True:
                calls = [{g.call for g in self.running if g.worker == i} for i in range(len(workers))]
                free = [i for i in range(len(workers)) if len(calls[i]) < self.in_flight]
                groups = []
                while free and len(groups) < self.per_call and self.bound.can_start(self.engine_version):
                    self.bound.start(self.engine_version)
                    groups.append(EpisodeGroup(self.next_group, version=self.engine_version))
                    self.next_group += 1
                if not groups:
                    return
                worker = min(free, key=lambda i: len(calls[i]))
                specs = [spec for group in groups for spec in self.specs_for(group.index)]
                engine = self.engines.rollouts[worker % len(self.engines.rollouts)]
                collect = workers[worker].collect.options(num_returns=3)
                call = tuple(collect.remote(specs, engine, self.cfg.agentic.runner))
                for offset, group in enumerate(groups):
                    group.worker, group.call = worker, call
                    group.rows = tuple(range(offset * size, (offset + 1) * size))
                self.running += groups

    def _collect(self, timeout: float) -> None:
        with self._lock:
            pending = {group.call[2]: [g for g in self.running if g.call[2] is group.call[2]] for group in self.running}
        if not pending:
            time.sleep(timeout)
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout, fetch_local=True)
        for ref in ready:
            summaries = ray.get(ref)
            with self._lock:
                for group in pending[ref]:
                    if group not in self.running:
                        continue  # too stale by now: aborted, never trained
                    self.running.remove(group)
                    group.summaries = [summaries[row] for row in group.rows]
                    started = [s["weights_version"] for s in group.summaries if s["weights_version"] is not None]
                    self.bound.finish(group, min(started, default=group.version))
        if ready:
            self._loop.notify()
