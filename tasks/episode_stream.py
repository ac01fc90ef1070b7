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
from tasks.stream_loop import ReplacesDeadEngines, StreamLoop


@dataclass
class EpisodeGroup:
    """One group of ``rollout.group_size`` episodes on its way to a batch: number ``index`` in admission
    order (its environment and sampling seeds are functions of it), run by environment worker ``worker``
    in a ``collect`` call that holds other groups too, its rows ``rows`` of that call's batch."""

    index: int
    worker: int = 0
    version: int = 0  # the rollout engines' weights when its call was sent; its actions' are this or newer
    call: tuple = ()  # Ray refs of the call: (rollouts, returns, summaries)
    engine: object = None  # the rollout engine the call generates with
    rows: tuple[int, ...] = ()
    summaries: list | None = None  # its episodes', once the call finished


def groups_per_call(cfg, workers: int) -> int:
    """Episode groups per ``collect`` call: ``async.groups_per_call``, by default a batch's groups split over
    the workers."""
    return cfg.async_.groups_per_call or -(-cfg.rollout.prompts_per_step // workers)


class EpisodeStream(ReplacesDeadEngines):
    """``async.mode: full`` with environments: a thread of the flow's process keeps two ``collect`` calls
    queued on each environment worker (one running, the next waiting), each of ``groups_per_call`` groups,
    admitted by ``StalenessBound`` with the rollout engines' version when the call is sent. Weight syncs land
    between turns (each turn is its own generation call), so an episode's actions may come from several
    versions: a group counts from its oldest action's, and groups too old to train are dropped (their
    group numbers are not run again: the next groups have new seeds).

    A rollout engine that dies is replaced (``ReplacesDeadEngines``): the groups of the calls that used it
    run again, under the same group numbers; calls meanwhile go to the other replicas. An environment
    worker that dies fails the run.

    Not deterministic: which groups form a batch depends on timing. A checkpoint saves the next group
    number; the groups admitted and not trained then are lost on a resume, and counted
    (``untrained_groups``)."""

    def __init__(self, cfg, engines, next_group: int, engine_version: int, specs_for: Callable[[int], list],
                 to_batch: Callable) -> None:
        self.cfg, self.engines, self.specs_for, self.to_batch = cfg, engines, specs_for, to_batch
        self.next_group, self.engine_version = next_group, engine_version
        self.per_call = groups_per_call(cfg, len(engines.env_workers))
        self.in_flight = 2
        self.bound = StalenessBound(cfg.rollout.prompts_per_step, cfg.async_.max_staleness)
        self.running: list[EpisodeGroup] = []
        self.rerun: list[int] = []  # group numbers whose engine died before they finished: run again first
        self._init_replacement()
        self._lock = threading.Lock()
        self._loop = StreamLoop("episode stream", self._round)
        self._loop.start()

    # -- the flow's side ---------------------------------------------------------------------------------
    def next_batch(self, step: int, trainer_version: int, replace_dead: Callable[[int], None] | None = None
                   ) -> tuple[object, list]:
        """``(batch, [])``: step ``step``'s batch (``to_batch(rollouts_ref, returns_ref, summaries, positions,
        metrics, step)``) once ``prompts_per_step`` groups within the bound have finished (no reward-failure
        stats: environments give the rewards); replaces dead rollout replicas while waiting."""
        start = time.perf_counter()
        batch = self._form_batch(replace_dead)
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
                        "async/dropped_groups": float(self.bound.dropped), "async/aborted_groups": float(self.bound.aborted),
                        "async/engine_restarts": float(self.restarts)})
        return self.to_batch(rollouts_ref, returns_ref, summaries, positions, metrics, step), []

    def snapshot(self) -> tuple[dict[str, int], int]:
        """``{"episode_groups": next group number}`` (a resume starts there) and how many groups admitted
        before it are not trained yet (a resume from a checkpoint taken now loses them)."""
        with self._lock:
            return {"episode_groups": self.next_group}, len(self.rerun) + len(self.running) + len(self.bound.finished)

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
                replicas = [r for r in range(len(self.engines.rollouts)) if r not in self.dead]
                groups = []
                while free and replicas and len(groups) < self.per_call and self.bound.can_start(self.engine_version):
                    self.bound.start(self.engine_version)
                    index = self.rerun.pop(0) if self.rerun else self._new_group()
                    groups.append(EpisodeGroup(index, version=self.engine_version))
                if not groups:
                    return
                worker = min(free, key=lambda i: len(calls[i]))
                specs = [spec for group in groups for spec in self.specs_for(group.index)]
                # the worker's own replica, or another while its own waits for a new engine
                engine = self.engines.rollouts[min(replicas, key=lambda r: (r != worker % len(self.engines.rollouts), r))]
                collect = workers[worker].collect.options(num_returns=3)
                call = tuple(collect.remote(specs, engine, self.cfg.agentic.runner))
                for offset, group in enumerate(groups):
                    group.worker, group.call, group.engine = worker, call, engine
                    group.rows = tuple(range(offset * size, (offset + 1) * size))
                self.running += groups

    def _new_group(self) -> int:
        self.next_group += 1
        return self.next_group - 1

    def _collect(self, timeout: float) -> None:
        with self._lock:
            pending = {group.call[2]: [g for g in self.running if g.call[2] is group.call[2]] for group in self.running}
        if not pending:
            time.sleep(timeout)
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout, fetch_local=True)
        for ref in ready:
            try:
                summaries = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
                engine = self._dead_engine(error, pending[ref][0].engine)
                if engine is None:
                    raise
                self._lost(engine)
                continue
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

    def _dead_engine(self, error: Exception, engine):
        """``engine`` when the failure of a call that used it is its actor's death (reported by the
        environment worker's call to it), else None: the failure is the run's."""
        cause = error
        while cause is not None and not isinstance(cause, ray.exceptions.RayActorError):
            cause = getattr(cause, "cause", None) or cause.__cause__
        if cause is None or getattr(cause, "actor_id", None) != engine._actor_id.hex():
            return None
        return engine

    def _take_back(self, groups: list[EpisodeGroup]) -> None:
        """Groups whose engine died run again first, under the same group numbers (so the same seeds)."""
        self.rerun = sorted(self.rerun + [g.index for g in groups])
