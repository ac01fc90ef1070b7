"""The engine contract: what every rollout engine, training engine, reward function and environment does.

Each backend is a plain class with these methods; nothing inherits from the Protocols. A backend is
reached through the registry in ``engines.backends`` (a short name or ``package.module:Class``) and
must pass ``tests/engines/test_conformance.py``, where adding it is one entry in a list.

Weight updates are versioned and verified. The trainer's ``export_weights`` gives its full, HF-named
parameters as byte buckets; a rollout engine takes them in three calls::

    engine.begin_update(version)       # opens version `version`; generation is refused until commit
    for bucket in trainer.export_weights(bucket_bytes):
        engine.receive(bucket)         # loads the bucket's tensors
    report = engine.commit(version)    # all parameters received: holds `version` now
    assert report.checksum == trainer.weights_checksum()

A call out of that order (``receive`` or ``commit`` without ``begin_update``, ``commit`` of another
version, ``begin_update`` while another version is open, ``generate`` while one is open) is a
``RuntimeError`` that says which call was expected; ``commit`` before every parameter arrived is a
``ValueError`` and leaves the update open. Versions need not increase: a resumed run may send older
weights to an engine that outlived the crash.

``offload``/``reload`` (and a rollout engine's ``sleep``/``wake``) free the accelerator's memory between
phases when roles share a device; the weights (and a trainer's optimizer state) come back bit-identical.
On a CPU-only engine they keep the values and cost nothing. A rollout engine refuses ``generate`` while
offloaded or asleep (``RuntimeError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from engines.rewards import Scored
    from engines.training.updates import UpdateSpec
    from engines.types import Rollouts, SamplingParams, TrainBatch
    from engines.weight_sync import Bucket


@dataclass(frozen=True)
class UpdateReport:
    """What a rollout engine's ``commit`` returns: the version it now holds and what it received."""

    version: int
    checksum: str  # engines.weight_sync.weights_checksum of the weights now held
    tensors: int  # tensors received since begin_update
    nbytes: int  # bytes received since begin_update


@runtime_checkable
class Offloadable(Protocol):
    """An engine whose accelerator memory can be freed between phases and restored."""

    def offload(self) -> None:
        """Move the weights (and optimizer state) to CPU memory, freeing the accelerator's; idempotent."""

    def reload(self) -> None:
        """Move back what ``offload`` moved, bit-identical; a no-op when nothing is offloaded."""


@runtime_checkable
class RolloutEngine(Offloadable, Protocol):
    """Samples completions and takes versioned weight updates from a trainer."""

    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams) -> Rollouts:
        """Sample one completion per prompt (text or token ids): ``Rollouts`` with token ids, logprobs, finish reasons."""

    def begin_update(self, version: int) -> None:
        """Open weight update ``version`` (re-opening the open version restarts it); error if another is open."""

    def receive(self, bucket: Bucket) -> int:
        """Load one bucket of HF-named tensors into the open update; returns the tensors loaded."""

    def commit(self, version: int) -> UpdateReport:
        """Close update ``version`` once every parameter arrived, reset prefix caches; returns the report."""

    def weights_version(self) -> int:
        """The version of the last committed update (0 before any)."""

    def weights_checksum(self) -> str:
        """``engines.weight_sync.weights_checksum`` of the weights held now."""

    def sleep(self) -> None:
        """Free the accelerator memory this engine holds (weights, caches) until ``wake``; generation is refused."""

    def wake(self) -> None:
        """Undo ``sleep``: the weights held before are back, bit-identical."""


@runtime_checkable
class ScoringEngine(Offloadable, Protocol):
    """Scores sequences under fixed weights: the reference policy (and later a teacher)."""

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probability of each token of ``batch.input_ids`` given the ones before it, ``[B, L]`` (entry 0 is 0)."""

    def rollout_logprobs(self, rollouts: Rollouts) -> torch.Tensor:
        """``logprobs`` of ``prompt ++ response`` rows, aligned like ``build_train_batch(rollouts)``, ``[B, L]``."""


@runtime_checkable
class TrainEngine(ScoringEngine, Protocol):
    """A trainable policy (or critic) with its optimizer; the loss is passed in, so it knows no algorithm."""

    def train_step(self, batch: TrainBatch, loss_fn: Callable, update: UpdateSpec) -> dict[str, float]:
        """``update``'s epochs x mini-batches of optimizer steps on ``batch`` with ``loss_fn``; returns metrics."""

    def export_weights(self, bucket_bytes: int) -> list[Bucket]:
        """Every parameter under its HF name, packed into byte buckets of at most ``bucket_bytes`` each."""

    def weights_checksum(self) -> str:
        """``engines.weight_sync.weights_checksum`` of the current weights."""

    def save(self, uri: str) -> list[str]:
        """Write model, optimizer, scheduler and RNG state under folder ``uri``; returns the file names."""

    def load(self, uri: str) -> str:
        """Restore what ``save`` wrote under ``uri``; returns the loaded weights' checksum."""


@runtime_checkable
class RewardFn(Protocol):
    """A batched reward (it may be ``async def``); see ``engines.rewards`` for columns and options."""

    def __call__(self, prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float] | Scored:
        """One reward per completion, as floats or a ``Scored`` that also counts events."""


@runtime_checkable
class Env(Protocol):
    """A text environment for agentic RL (gymnasium's reset/step, with text actions and observations).

    ``info`` holds ``action_is_valid``, ``success`` and ``metrics``. An env may also define ``state_key()
    -> str``, the anchor state for GiGPO (default: the last observation; ``engines.environments.state_key``).
    """

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode from ``seed``; returns ``(observation, info)``."""

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the model's action; returns ``(observation, reward, terminated, truncated, info)``."""

    def close(self) -> None:
        """Release what the env holds (processes, files); the env is not used after."""
