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

``full``: rollout never waits for the trainer, within a staleness bound (``RolloutStream``)."""

from __future__ import annotations

import contextvars
import dataclasses
import io
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import ray
import torch

PENDING_FILE = "pending_batch.pt"
"""The checkpoint file holding the batch generated ahead of the checkpoint's step."""


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
    """The checkpoint files of the batch generated ahead (``{PENDING_FILE: bytes}``), or none."""
    pending = ahead.pending() if ahead is not None else None
    if pending is None:
        return {}
    step, scored = pending
    rollouts, rewards = ray.get([scored.rollouts_ref, scored.rewards_ref])
    fields = {f.name: getattr(scored, f.name) for f in dataclasses.fields(scored)
              if f.name not in ("rollouts_ref", "rewards_ref")}
    buffer = io.BytesIO()
    torch.save({"step": step, "rollouts": dataclasses.asdict(rollouts), "rewards": rewards, "fields": fields}, buffer)
    return {PENDING_FILE: buffer.getvalue()}


def load_pending(data: bytes):
    """``(step, ScoredBatch)`` from ``pending_files``' bytes; its rollouts and rewards go back into Ray."""
    from engines.types import Rollouts
    from flows.sampling import ScoredBatch

    saved = torch.load(io.BytesIO(data), weights_only=True)
    rollouts = Rollouts(**saved["rollouts"])
    return saved["step"], ScoredBatch(ray.put(rollouts), ray.put(saved["rewards"]), **saved["fields"])


# -- async.mode: full ---------------------------------------------------------------------------------------


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


class RolloutStream:
    """``async.mode: full``: rollout runs continuously, one generation call per prompt group, and the trainer
    takes a batch of ``rollout.prompts_per_step`` groups as soon as that many have finished.

    A thread of the flow's process keeps at most ``in_flight`` generation calls per rollout replica queued,
    each of up to ``groups_per_call`` groups (half a batch: one call generates while the next waits, and a
    weight sync waits behind one call at most); each group is scored by a reward worker as soon as its call
    returns. With ``async.partial_rollout`` keep or abort, generation runs in the engine's ``generate``
    concurrency group, so a weight sync lands between two of its decoding steps (``SamplingParams.on_weight_update``);
    an aborted group is drawn again. ``engines.staleness.StalenessBound`` admits groups and forms batches within
    ``async.max_staleness`` versions; groups too old to train are dropped and their prompts drawn again. A
    replica whose actor dies is marked; its groups go back to the queue and the flow replaces it
    (``replace_dead``) while the trainer is idle, so the new engine gets exactly the trainer's weights.

    Not deterministic: which groups form a batch depends on timing. A checkpoint saves the data position
    after every group drawn; the groups drawn and not yet trained then are lost on a resume, and counted
    (``untrained_groups``)."""

    def __init__(self, cfg, engines, domains: list, positions: dict[str, int], engine_version: int,
                 sampling_for: Callable[[int], object], score_spec_for: Callable, in_flight: int = 2,
                 groups_per_call: int | None = None) -> None:
        from engines.staleness import StalenessBound

        self.cfg, self.engines, self.domains = cfg, engines, domains
        self.positions, self.engine_version = dict(positions), engine_version
        self.sampling_for, self.score_spec_for, self.in_flight = sampling_for, score_spec_for, in_flight
        self.groups_per_call = groups_per_call or cfg.rollout.prompts_per_step
        self.partial = cfg.async_.partial_rollout
        self.aborted = 0  # groups a weight update stopped (partial_rollout: abort), drawn again
        self._calls = 0
        self.bound = StalenessBound(cfg.rollout.prompts_per_step, cfg.async_.max_staleness)
        self.queue: list[Unit] = []  # drawn, not started (requeued ones first)
        self.running: list[Unit] = []
        self.dead: set[int] = set()  # replicas whose actor died
        self.restarts = 0
        self._units = 0
        self._lock, self._changed = threading.Lock(), threading.Condition()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)
        self._thread.start()

    # -- the flow's side ---------------------------------------------------------------------------------
    def next_batch(self, step: int, trainer_version: int, replace_dead: Callable[[int], None]):
        """Step ``step``'s ``ScoredBatch``, once ``prompts_per_step`` groups within the bound have finished;
        replaces dead replicas while waiting (the trainer is idle: the weights it syncs are its version)."""
        from flows.sampling import ScoredBatch

        start = time.perf_counter()
        while True:
            with self._changed:
                self._raise_if_failed()
                with self._lock:
                    batch = self.bound.form_batch()
                    dead = set(self.dead)
                if batch is None and not dead:
                    self._changed.wait(timeout=0.5)
                    continue
            if dead:
                self.replace(dead, replace_dead)
            if batch is not None:
                break
        waited = time.perf_counter() - start
        units = [unit for unit, _ in batch]
        with self._lock:
            self._abort_stale()
        positions, queued = self.snapshot()
        stats = ray.get([unit.stats for unit in units])
        group = self.cfg.rollout.group_size
        rollouts_ref, rewards_ref = self.engines.reward_worker.join.options(num_returns=2).remote(
            [None] * len(units), *[ref for unit in units for ref in (unit.generated, unit.rewards)])
        from engines.scoring import summarize

        metrics = summarize(stats)
        lags = [trainer_version - s["weights_version"] for s in stats]
        metrics.update({"async/wait_s": waited, "async/version_lag_mean": sum(lags) / len(lags),
                        "async/version_lag_max": float(max(lags)), "async/untrained_groups": float(queued),
                        "async/dropped_groups": float(self.bound.dropped), "async/engine_restarts": float(self.restarts),
                        "async/aborted_groups": float(self.aborted),
                        "async/partial_groups": float(sum(s["partial"] for s in stats))})
        metrics.update({f"async/version_lag_{lag}": float(lags.count(lag)) for lag in range(self.cfg.async_.max_staleness + 1)})
        prompts = [unit.row["prompt"] for unit in units for _ in range(group)]
        keys = sorted({k for unit in units for k in unit.row} - {"prompt"})
        columns = {k: [unit.row.get(k) for unit in units for _ in range(group)] for k in keys}
        columns["domain"] = [unit.domain.name for unit in units for _ in range(group)]
        return ScoredBatch(rollouts_ref, rewards_ref, [j for j in range(len(units)) for _ in range(group)], prompts,
                           columns, positions, metrics)

    def weights_synced(self, version: int) -> None:
        """The rollout engines hold ``version`` from now on: later groups start with it."""
        with self._lock:
            self.engine_version = version

    def replace(self, replicas: set[int], replace_dead: Callable[[int], None]) -> None:
        """Start a new engine for each dead replica (``replace_dead(i)``: start it and give it the trainer's
        weights)."""
        for replica in sorted(replicas):
            replace_dead(replica)
            with self._lock:
                self.dead.discard(replica)
                self.restarts += 1
        with self._changed:
            self._changed.notify_all()

    def dead_replicas(self) -> set[int]:
        with self._lock:
            return set(self.dead)

    def snapshot(self) -> tuple[dict[str, int], int]:
        """The data position after every group drawn, and how many of those groups are not trained yet (a
        resume from a checkpoint taken now loses them)."""
        with self._lock:
            return dict(self.positions), len(self.queue) + len(self.running) + len(self.bound.finished)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    # -- the rollout thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._start_groups()
                self._collect(timeout=0.05)
        except BaseException as error:  # noqa: BLE001 (handed to the flow's thread, which raises it)
            self._error = error
            with self._changed:
                self._changed.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout stream failed: {self._error}") from self._error

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
                        call, list(range(offset * group, (offset + 1) * group)), prompts[:group], columns,
                        self.score_spec_for(unit.domain))
                self.running += units

    def _draw(self) -> None:
        from engines.data.domains import draw

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
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
                if not self._engine_died(unit, error):
                    raise
                continue
            with self._lock:
                self.running.remove(unit)
                if stats["aborted"]:  # a weight update stopped its rows: the group is drawn again
                    self.bound.abort()
                    self.aborted += 1
                    self.queue.insert(0, Unit(unit.index, unit.domain, unit.row))
                else:
                    self.bound.finish(unit, stats["weights_version"])
        if ready:
            with self._changed:
                self._changed.notify_all()

    def _engine_died(self, unit: Unit, error: Exception) -> bool:
        """Whether ``error`` is the death of ``unit``'s rollout engine; if so its groups go back to the queue."""
        try:
            ray.get(unit.call, timeout=0)
            return False  # the generation is fine: scoring failed, which is the run's failure
        except ray.exceptions.RayActorError:
            pass
        except Exception:  # noqa: BLE001
            return False
        self._lost(unit.engine)
        return True

    def _lost(self, engine) -> None:
        """``engine`` died: its groups go back to the queue, and its replica waits for a new engine (unless
        it has one already: a late report of an engine replaced before)."""
        with self._lock:
            for replica, current in enumerate(self.engines.rollouts):
                if current is engine:
                    self.dead.add(replica)
            lost = [u for u in self.running if u.engine is engine]
            for u in lost:
                self.running.remove(u)
                self.bound.abort()
            self.queue[:0] = [Unit(u.index, u.domain, u.row) for u in lost]
        with self._changed:
            self._changed.notify_all()

    def sync(self, sync: Callable[[list, int], None], version: int, replace_dead: Callable[[int], None]) -> None:
        """``sync(engines, version)`` to every rollout engine; an engine that dies before or during it is
        replaced (``replace_dead``) and the sync done again, so the run goes on with a new engine."""
        for _ in range(2 * len(self.engines.rollouts) + 1):
            self.replace(self.dead_replicas(), replace_dead)
            try:
                sync(self.engines.rollouts, version)
                break
            except ray.exceptions.RayActorError as error:
                died = [e for e in self.engines.rollouts if e._actor_id.hex() == error.actor_id]
                if not died:
                    raise
                self._lost(died[0])
        else:
            raise RuntimeError(f"rollout engines kept dying during the weight sync of v{version}")
        self.weights_synced(version)

    def _abort_stale(self) -> None:
        """Groups still generating with weights older than the next batch may take: their prompts are drawn
        again (their results, when they come, are not waited for). Requeued prompts of dropped groups too."""
        oldest = self.bound.abort_before()
        stale = [u for u in self.running if u.version < oldest]
        for unit in stale:
            self.running.remove(unit)
            self.bound.abort()
        stale += self.bound.dropped_units
        self.bound.dropped_units = []
        self.queue[:0] = [Unit(u.index, u.domain, u.row) for u in stale]
