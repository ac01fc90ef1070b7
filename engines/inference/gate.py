"""The gate between generation and weight updates in a rollout engine whose actor runs calls on several
threads (partial rollouts, ``SamplingParams.on_weight_update``)."""

from __future__ import annotations

import threading
from contextlib import contextmanager


class UpdateGate:
    """Mixin of a rollout engine: ``_gate`` is held by each step of a generate call and by each weight update,
    and a step waits while an update is open (``_update``, from ``begin_update`` to ``commit``), so an update
    lands between two steps of a call, never inside one. The engine sets ``_update`` and ``_check_ready``."""

    def _init_gate(self) -> None:
        self._gate = threading.Condition(threading.RLock())

    @contextmanager
    def _step(self):
        """The gate of one step of a generate call."""
        with self._gate:
            self._gate.wait_for(lambda: self._update is None)
            self._check_ready("generate()")
            self._on_step()
            yield

    def _on_step(self) -> None:
        """What a step does first, on the calling thread (nothing by default)."""
