"""Config section ``async:`` (the field ``Config.async_``): whether rollout runs ahead of training.

``off``: each step generates with the weights the trainer has just produced, then trains on that batch.
``one_step``: the rollout engines generate step k+1's batch while the trainer trains on step k's, with the
weights from before step k's update; each batch is one weight version behind the trainer (the first none),
on a fixed schedule, so a run is as deterministic as a synchronous one and resumes bit-exactly (the batch
generated ahead is saved with each checkpoint)."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from configs.sections import Section


class AsyncConfig(Section):
    mode: Literal["off", "one_step"] = "off"
    """off: generate, then train, every step; one_step: generate the next step's batch while training on this
    one, one weight version behind (flows/asynchrony.py)."""

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML reads a bare ``off`` as false
