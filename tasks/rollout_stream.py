"""``async.mode: full``'s rollout stream (``flows/asynchrony.py`` and ``flows/rlvr.py`` drive it): generation
calls kept queued on the rollout engines, each group scored as it is generated, batches formed within the
staleness bound of ``engines/staleness.py``, dead engines replaced. The Ray calls of the driver's side live
here, under ``tasks/``: the flow only asks for the next batch and says when weights were synced."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Callable

import ray

from engines.data.domains import draw
from engines.scoring import summarize
from engines.staleness import StalenessBound, version_lag_metrics
from tasks.score import ScoredBatch
from tasks.stream_loop import ReplacesDeadEngines, StreamLoop
from tasks.sync import QueuedWeightSync


@dataclass
class Unit:
    """One prompt group on its way to a batch: drawn, generated on replica ``replica`` with weights
    ``version`` (the engines' when it started; its stats give the exact one), scored."""

    index: int  # admission order
    domain: object  # engines.data.domains.Domain
    row: dict
    replica: int = 0
    version: int = 0
    call: object = None  # Ray ref of the generation call that holds it (with other groups)
    engine: object = None  # the actor handle the call went to
    generated: object = None  # Ray refs of its own rows: Rollouts, rewards, stats
    rewards: object = None
    stats: object = None
    scored: dict | None = None  # its scoring stats, fetched once it finished


def calls_share_batches(cfg) -> bool:
    """vLLM with partial rollouts runs each generation call on a thread of its own and steps one engine for
    all of them: concurrent calls share its batches (the HF engine batches within a call only)."""
    return cfg.rollout.engine == "vllm" and cfg.async_.partial_rollouts


def stream_calls(cfg) -> tuple[int, int]:
    """(generation calls in flight per replica, groups per call) of the stream: ``async.groups_per_call``,
    by default one where calls share batches (``calls_share_batches``), so each group returns, and is scored,
    as soon as its own rows finish; otherwise a batch of groups per call. Calls in flight: two batches'
    worth, so one generates while the next waits."""
    shared_batches = calls_share_batches(cfg)
    per_call = cfg.async_.groups_per_call or (1 if shared_batches else cfg.rollout.prompts_per_step)
    in_flight = max(2, -(-2 * cfg.rollout.prompts_per_step // per_call)) if shared_batches else 2
    return in_flight, per_call


class RolloutStream(ReplacesDeadEngines):
    """``async.mode: full``: rollout runs continuously and the trainer takes a batch of
    ``rollout.prompts_per_step`` prompt groups as soon as that many have finished.

    A thread of the flow's process keeps at most ``in_flight`` generation calls per rollout replica queued,
    each of up to ``groups_per_call`` groups (``stream_calls``: a batch, one call generating while the next
    waits; or one group per call, calls sharing vLLM's batches); each group is scored by a reward worker as
    soon as its call returns. With ``async.partial_rollout: wait`` a weight sync is queued behind the calls
    sent before it and not waited for (``tasks.sync.QueuedWeightSync``). With keep or abort, generation runs
    in the engine's ``generate`` concurrency group, so a weight sync lands between two of its decoding steps
    (``SamplingParams.on_weight_update``); an aborted group is drawn again. ``engines.staleness.StalenessBound``
    admits groups and forms batches within ``async.max_staleness`` versions; groups too old to train are
    dropped and their prompts drawn again. A replica whose actor dies is marked; its groups go back to the
    queue and the flow replaces it (``replace_dead``) while the trainer is idle, so the new engine gets
    exactly the trainer's weights.

    Not deterministic: which groups form a batch depends on timing. A checkpoint saves the data position
    after every group drawn; the groups drawn and not yet trained then are lost on a resume, and counted
    (``untrained_groups``)."""

    def __init__(self, cfg, engines, domains: list, positions: dict[str, int], engine_version: int,
                 sampling_for: Callable[[int], object], score_spec_for: Callable) -> None:
        self.cfg, self.engines, self.domains = cfg, engines, domains
        self.positions, self.engine_version = dict(positions), engine_version
        self.sampling_for, self.score_spec_for = sampling_for, score_spec_for
        self.in_flight, self.groups_per_call = stream_calls(cfg)
        self.partial = cfg.async_.partial_rollout
        self.aborted = 0  # groups a weight update stopped (partial_rollout: abort), drawn again
        self._calls = 0
        self.bound = StalenessBound(cfg.rollout.prompts_per_step, cfg.async_.max_staleness)
        self.queue: list[Unit] = []  # drawn, not started (requeued ones first)
        self.running: list[Unit] = []
        self._init_replacement()
        if self.partial == "wait" and cfg.model.lora is None:  # an engine runs its calls one at a time, in order
            self.queued_sync = QueuedWeightSync(engines.trainer, cfg.sync.bucket_mb)
        self._units = 0
        self._lock = threading.Lock()
        self._loop = StreamLoop("rollout stream", self._round)
        self._loop.start()

    # -- the flow's side ---------------------------------------------------------------------------------
    def next_batch(self, step: int, trainer_version: int,
                   replace_dead: Callable[[int], None]) -> tuple[ScoredBatch, list[dict]]:
        """Step ``step``'s batch and its groups' scoring stats, once ``prompts_per_step`` groups within the
        bound have finished; replaces dead replicas while waiting (the trainer is idle: the weights it syncs
        are its version)."""
        start = time.perf_counter()
        batch = self._form_batch(replace_dead)
        waited = time.perf_counter() - start
        units = [unit for unit, _ in batch]
        with self._lock:
            self._abort_stale()
        positions, queued = self.snapshot()
        stats = [unit.scored for unit in units]
        group = self.cfg.rollout.group_size
        rollouts_ref, rewards_ref = self.engines.reward_worker.join.options(num_returns=2).remote(
            [None] * len(units), *[ref for unit in units for ref in (unit.generated, unit.rewards)])
        metrics = summarize(stats)
        lags = [trainer_version - s["weights_version"] for s in stats]
        metrics.update(version_lag_metrics(lags, self.cfg.async_.max_staleness))
        metrics.update({"async/wait_s": waited, "async/untrained_groups": float(queued),
                        "async/dropped_groups": float(self.bound.dropped), "async/engine_restarts": float(self.restarts),
                        "async/aborted_groups": float(self.aborted),
                        "async/partial_groups": float(sum(s["partial"] for s in stats))})
        prompts = [unit.row["prompt"] for unit in units for _ in range(group)]
        keys = sorted({k for unit in units for k in unit.row} - {"prompt"})
        columns = {k: [unit.row.get(k) for unit in units for _ in range(group)] for k in keys}
        columns["domain"] = [unit.domain.name for unit in units for _ in range(group)]
        return ScoredBatch(rollouts_ref, rewards_ref, [j for j in range(len(units)) for _ in range(group)], prompts,
                           columns, positions, metrics), stats

    def snapshot(self) -> tuple[dict[str, int], int]:
        """The data position after every group drawn, and how many of those groups are not trained yet (a
        resume from a checkpoint taken now loses them)."""
        with self._lock:
            return dict(self.positions), len(self.queue) + len(self.running) + len(self.bound.finished)

    def close(self) -> None:
        """Stop the rollout thread; the last weight sync, if queued, is confirmed."""
        self._loop.close()
        self.confirm_sync()

    # -- the rollout thread ------------------------------------------------------------------------------
    def _round(self) -> None:
        self._start_groups()
        self._collect(timeout=0.05)

    def _start_groups(self) -> None:
        replicas, group = len(self.engines.rollouts), self.cfg.rollout.group_size
        with self._lock:
            while True:
                calls = [{u.call for u in self.running if u.replica == i} for i in range(replicas)]
                free = [i for i in range(replicas) if i not in self.dead and len(calls[i]) < self.in_flight]
                units = []
                while free and len(units) < self.groups_per_call and self.bound.can_start(self.engine_version):
                    if not self.queue:
                        self._draw()
                    units.append(self.queue.pop(0))
                    self.bound.start(self.engine_version)
                if not units:
                    return
                replica = min(free, key=lambda i: len(calls[i]))
                prompts = [unit.row["prompt"] for unit in units for _ in range(group)]
                generate = self.engines.rollouts[replica].generate
                if self.partial != "wait":  # its own thread: weight updates land between its decoding steps
                    generate = generate.options(concurrency_group="generate")
                sampling = dataclasses.replace(self.sampling_for(self._calls),
                                               on_weight_update="abort" if self.partial == "abort" else "keep")
                call = generate.remote(prompts, sampling)
                self._calls += 1
                for offset, unit in enumerate(units):
                    unit.replica, unit.version, unit.call = replica, self.engine_version, call
                    unit.engine = self.engines.rollouts[replica]
                    columns = {k: [v] * group for k, v in unit.row.items() if k != "prompt"}
                    worker = self.engines.reward_workers[unit.index % len(self.engines.reward_workers)]
                    unit.generated, unit.rewards, unit.stats = worker.score_rows.options(num_returns=3).remote(
                        call, list(range(offset * group, (offset + 1) * group)), [unit.row["prompt"]] * group, columns,
                        self.score_spec_for(unit.domain))
                self.running += units

    def _draw(self) -> None:
        drawn, self.positions = draw(self.domains, self.positions)
        for domain, rows in drawn:
            for row in rows:
                self.queue.append(Unit(self._units, domain, row))
                self._units += 1

    def _collect(self, timeout: float) -> None:
        with self._lock:
            pending = {unit.stats: unit for unit in self.running}
        if not pending:
            time.sleep(timeout)
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout, fetch_local=False)
        for ref in ready:
            unit = pending[ref]
            if unit not in self.running:
                continue  # requeued meanwhile (its engine died, or it became too stale to train)
            try:
                stats = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                if not self._engine_died(unit):
                    raise
                continue
            with self._lock:
                self.running.remove(unit)
                if stats["aborted"]:  # a weight update stopped its rows: the group is drawn again
                    self.bound.release()
                    self.aborted += 1
                    self.queue.insert(0, Unit(unit.index, unit.domain, unit.row))
                else:
                    unit.scored = stats
                    self.bound.finish(unit, stats["weights_version"])
        if ready:
            self._loop.notify()

    def _engine_died(self, unit: Unit) -> bool:
        """Whether the failure of ``unit``'s scoring is the death of its rollout engine; if so its groups go
        back to the queue."""
        try:
            ray.get(unit.call, timeout=0)
            return False  # the generation is fine: scoring failed, which is the run's failure
        except ray.exceptions.RayActorError:
            pass
        except Exception:  # noqa: BLE001
            return False
        self._lost(unit.engine)
        return True

    def _take_back(self, units: list[Unit]) -> None:
        """Groups whose engine died go back to the front of the queue."""
        self.queue[:0] = [Unit(u.index, u.domain, u.row) for u in units]

    def _abort_stale(self) -> None:
        """Groups still generating with weights older than the next batch may take: their prompts are drawn
        again (their results, when they come, are not waited for). Requeued prompts of dropped groups too."""
        oldest = self.bound.oldest_trainable()
        stale = [u for u in self.running if u.version < oldest]
        for unit in stale:
            self.running.remove(unit)
            self.bound.abort()
        stale += self.bound.dropped_units
        self.bound.dropped_units = []
        self.queue[:0] = [Unit(u.index, u.domain, u.row) for u in stale]
