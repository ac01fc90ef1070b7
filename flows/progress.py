"""A live progress line for long stages: a rich bar on a terminal, a plain line every few steps elsewhere."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class StageProgress:
    def __init__(self, stage: str, total: int, start: int = 0, keys: tuple[str, ...] = ()) -> None:
        self.keys = keys
        self.total = total
        self.stage = stage
        self._tty = sys.stderr.isatty()
        self._last_print = 0.0
        self._progress = None
        if self._tty:
            self._progress = Progress(
                TextColumn(f"[bold]{stage}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=Console(stderr=True),
            )
            self._task = self._progress.add_task(stage, total=total, completed=start, info="")
            self._progress.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        info = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.3g}" for k in self.keys if k in metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        elif time.monotonic() - self._last_print > 5 or step == self.total:
            print(f"{self.stage} {step}/{self.total} {info}", file=sys.stderr, flush=True)
            self._last_print = time.monotonic()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
