"""The base of every config section, and the optimizer section the training stages share."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup, in optimizer steps (an RL step takes ppo_epochs × mini_batches of them)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warmup."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final LR as a fraction of lr (linear/cosine)."""


class SFTOptimConfig(OptimConfig):
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate of a supervised stage's AdamW."""
