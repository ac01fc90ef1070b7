"""The background thread of ``async.mode: full``'s streams (``tasks/rollout_stream.py``,
``tasks/episode_stream.py``): it repeats one round of their work until closed; an exception stops it and is
raised on the flow's thread, which waits on ``changed`` for what the rounds finish."""

from __future__ import annotations

import threading
from typing import Callable


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
