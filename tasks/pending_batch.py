"""The batch ``async.mode: one_step`` generated ahead of a checkpoint, as a checkpoint file and back: it was
sampled with weights the checkpoint no longer holds, so a resumed run takes it instead of sampling again."""

from __future__ import annotations

import dataclasses
import io

import ray
import torch

from engines.types import Rollouts
from tasks.score import ScoredBatch

PENDING_FILE = "pending_batch.pt"
"""The checkpoint file holding the batch generated ahead of the checkpoint's step."""


def pending_files(pending) -> dict[str, bytes]:
    """The checkpoint files of ``pending``, ``(step, ScoredBatch)`` of the batch generated ahead
    (``{PENDING_FILE: bytes}``), or none when it is None."""
    if pending is None:
        return {}
    step, scored = pending
    rollouts, rewards = ray.get([scored.rollouts_ref, scored.rewards_ref])
    fields = {f.name: getattr(scored, f.name) for f in dataclasses.fields(scored)
              if f.name not in ("rollouts_ref", "rewards_ref")}
    buffer = io.BytesIO()
    torch.save({"step": step, "rollouts": dataclasses.asdict(rollouts), "rewards": rewards, "fields": fields}, buffer)
    return {PENDING_FILE: buffer.getvalue()}


def load_pending(data: bytes) -> tuple[int, ScoredBatch]:
    """``(step, ScoredBatch)`` from ``pending_files``' bytes; its rollouts and rewards go back into Ray."""
    saved = torch.load(io.BytesIO(data), weights_only=True)
    rollouts_ref, rewards_ref = ray.put(Rollouts(**saved["rollouts"])), ray.put(saved["rewards"])
    return saved["step"], ScoredBatch(rollouts_ref, rewards_ref, **saved["fields"])
