"""What ``async.mode: full``'s two streams (``tasks/rollout_stream.py``, ``tasks/episode_stream.py``) share:
the background thread (``StreamLoop``), which repeats one round of their work until closed (an exception
stops it and is raised on the flow's thread, which waits on ``changed`` for what the rounds finish), and the
replacement of rollout engines that die (``ReplacesDeadEngines``)."""

from __future__ import annotations

import threading
from typing import Callable

import ray


class StreamLoop:
    """Calls ``round()`` on a daemon thread named ``name`` until ``close``; ``changed`` is notified when a
    round finished something (``notify``) and when the thread failed."""

    def __init__(self, name: str, round: Callable[[], None]) -> None:
        self.name, self._round = name, round
        self.changed = threading.Condition()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the {self.name} failed: {self._error}") from self._error

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._round()
        except BaseException as error:  # noqa: BLE001 (handed to the flow's thread, which raises it)
            self._error = error
            self.notify()


class ReplacesDeadEngines:
    """A stream's handling of rollout engines whose actor dies. ``_lost(engine)`` marks its replicas dead and
    hands the groups that engine was running back to the stream (``_take_back``); the flow's thread then
    replaces the dead replicas (``replace_dead(i)``: a new engine, given the trainer's weights) while it
    waits for a batch or before a sync, when the trainer is idle, so the new engine gets exactly the weights
    of the version it is labelled with. The stream has ``engines`` (``rollouts``: one handle per replica),
    ``_lock``, ``_loop`` (a ``StreamLoop``), ``bound`` (``engines.staleness.StalenessBound``), ``running``
    (units with an ``engine``), defines ``_take_back`` and calls ``_init_replacement()``."""

    def _init_replacement(self) -> None:
        self.dead: set[int] = set()  # replicas whose actor died, waiting for a new engine
        self.restarts = 0

    def _lost(self, engine) -> None:
        """``engine`` died: the stream takes back what it ran (``_take_back``) to run it again."""
        with self._lock:
            for replica, current in enumerate(self.engines.rollouts):
                if current is engine:  # none, if it was replaced already: a late report
                    self.dead.add(replica)
            lost = [unit for unit in self.running if unit.engine is engine]
            for unit in lost:
                self.running.remove(unit)
                self.bound.release()
            self._take_back(lost)
        self._loop.notify()

    def _take_back(self, units: list) -> None:
        """Units (groups) of ``running`` whose engine died, to run again; called under ``_lock``."""
        raise NotImplementedError

    def _form_batch(self, replace_dead: Callable[[int], None] | None) -> list:
        """The bound's next batch, once one has finished; dead replicas are replaced meanwhile (with
        ``replace_dead``; without it, a dead engine fails the run)."""
        while True:
            with self._loop.changed:
                self._loop.raise_if_failed()
                with self._lock:
                    batch = self.bound.form_batch()
                    dead = set(self.dead)
                if batch is None and not dead:
                    self._loop.changed.wait(timeout=0.5)
                    continue
            if dead:
                if replace_dead is None:
                    raise RuntimeError(f"rollout replicas {sorted(dead)} died and nothing replaces them")
                self.replace(dead, replace_dead)
            if batch is not None:
                return batch

    def replace(self, replicas: set[int], replace_dead: Callable[[int], None]) -> None:
        """Start a new engine for each dead replica (``replace_dead(i)``: start it and give it the trainer's
        weights)."""
        for replica in sorted(replicas):
            replace_dead(replica)
            with self._lock:
                self.dead.discard(replica)
                self.restarts += 1
        self._loop.notify()

    def dead_replicas(self) -> set[int]:
        with self._lock:
            return set(self.dead)

    queued_sync = None  # a tasks.sync.QueuedWeightSync: syncs go into the engines' call queues, not waited for

    def sync(self, sync: Callable[[list, int], None], version: int, replace_dead: Callable[[int], None]) -> None:
        """``sync(engines, version)`` to every rollout engine (with ``queued_sync``: the sync before confirmed,
        this one sent and not waited for); an engine that dies before or during it is replaced (``replace_dead``)
        and the sync done again, so the run goes on with a new engine. Calls sent from then on start with
        ``version``."""
        for _ in range(2 * len(self.engines.rollouts) + 1):
            self.confirm_sync()
            self.replace(self.dead_replicas(), replace_dead)
            try:
                if self.queued_sync is not None:
                    self.queued_sync.send(self.engines.rollouts, version)
                else:
                    sync(self.engines.rollouts, version)
                break
            except ray.exceptions.RayActorError as error:
                died = [e for e in self.engines.rollouts if e._actor_id.hex() == error.actor_id]
                if not died:
                    raise
                self._lost(died[0])
        else:
            raise RuntimeError(f"rollout engines kept dying during the weight sync of v{version}")
        with self._lock:
            self.engine_version = version

    def confirm_sync(self) -> None:
        """Wait for the queued sync, if any, and check it; engines that died before their load are marked
        dead (``_lost``), to be replaced."""
        if self.queued_sync is not None:
            for engine in self.queued_sync.confirm():
                self._lost(engine)
