"""Config section ``async:`` (the field ``Config.async_``): whether rollout runs ahead of training.

``off``: each step generates with the weights the trainer has just produced, then trains on that batch.
``one_step``: the rollout engines generate step k+1's batch while the trainer trains on step k's, with the
weights from before step k's update; each batch is one weight version behind the trainer (the first none),
on a fixed schedule, so a run is as deterministic as a synchronous one and resumes bit-exactly (the batch
generated ahead is saved with each checkpoint; ``flows/asynchrony.py``).
``full``: rollout never waits for the trainer, within ``max_staleness`` versions (``tasks/rollout_stream.py``;
for agentic RL ``tasks/episode_stream.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from configs.checks import CheckError
from configs.sections import Section


class AsyncConfig(Section):
    mode: Literal["off", "one_step", "full"] = "off"
    """off: generate, then train, every step; one_step: generate the next step's batch while training on this
    one, one weight version behind; full: rollout runs continuously, a batch trains as soon as enough
    groups have finished, within max_staleness versions (flows/asynchrony.py)."""
    max_staleness: int = Field(1, ge=0)
    """full: the most weight versions a trained group may be behind the trainer (η); new groups start only
    while that holds for every group that could still be trained (AReaL's admission rule)."""
    partial_rollout: Literal["wait", "keep", "abort"] = "wait"
    """full: what a weight update does to the groups generating when it arrives. wait: it waits for the
    generation call in flight (no partial rollouts); keep: the rows decode on with the new weights, each token
    recording its version (Rollouts.token_versions); abort: the rows stop and their groups are drawn again.
    keep and abort need an engine that takes updates between decoding steps (rollout.engine hf or vllm)."""
    groups_per_call: int | None = Field(None, gt=0)
    """full: prompt groups per generation call. None: one for vLLM with keep or abort (each call on a thread
    of the engine's, all sharing vLLM's batches, so a group is scored as soon as its own rows finish), else
    rollout.prompts_per_step (the HF engine batches within a call only). Agentic RL: episode groups per
    environment worker call; None: a batch's groups split over agentic.workers."""

    @property
    def partial_rollouts(self) -> bool:
        """Weight updates land during generation (keep or abort; only async.mode full takes either)."""
        return self.partial_rollout != "wait"

    @model_validator(mode="after")
    def _options_only_for_full(self):
        for key in ("max_staleness", "partial_rollout", "groups_per_call"):
            if key in self.model_fields_set and self.mode != "full":
                raise CheckError((key,), f"async.{key} is an option of async.mode full, not {self.mode!r}; "
                                 "remove it or set async.mode=full")
        return self

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML reads a bare ``off`` as false
