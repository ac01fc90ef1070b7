"""Config section of agentic RL (``kind: agentic``): the environment, the episode limits, the rollout
runner and the trajectory (StarPO) or step (GiGPO) advantage. ``rollout:`` still sets sampling, the
groups per step (``prompts_per_step``: environment seeds) and the episodes per seed (``group_size``), and
``rollout.max_new_tokens`` is each turn's token budget; ``algorithm:`` sets the policy loss and KL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from configs.sections import Section


class AgenticConfig(Section):
    env: str = "Corridor-v0"
    """Environment id (engines.environments: Corridor-v0, FrozenLake-v0, Sokoban-v0, GuessTheNumber-v0,
    Bandit-v0, Calculator-v0; gem:<id> and gym:<id> when those packages are installed)."""
    env_options: dict = {}
    """Keyword options of the environment (e.g. {length: 6} for Corridor-v0)."""
    system_prompt: bool = False
    """Put the environment's one-line instructions in a system message before the first observation."""
    max_turns: int = Field(8, gt=0)
    """Actions per episode; an episode still running then ends as max_turns."""
    max_context: int | None = Field(None, gt=1)
    """Tokens of a whole trajectory (prompt, actions, observations); None: the model's positions."""
    runner: Literal["async", "lockstep", "serial"] = "async"
    """async: each environment runs on its own and pending turns are batched into generation calls (a slow
    step holds no one); lockstep: every turn waits for all environments; serial: one episode at a time."""
    workers: int = Field(1, gt=0)
    """Environment worker actors; the groups of a step are split between them (whole groups each)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """An environment reset or step that takes longer ends its episode as error."""
    max_error_rate: float = Field(0.25, ge=0, le=1)
    """The step fails when more than this share of its episodes end in error (errors are never trained on)."""
    on_truncation: Literal["keep", "penalize", "mask"] = "keep"
    """Episodes ended by a limit (max_turns, context, the environment's truncation): keep them as they are,
    add truncation_penalty to their last step's reward, or leave them out of the loss."""
    truncation_penalty: float = -1.0
    """Reward added to a truncated episode's last step (on_truncation: penalize)."""
    mode: Literal["trajectory", "step"] = "trajectory"
    """trajectory: StarPO, the episode return normalised in its group on every model token; step: GiGPO,
    A = A^E + omega * A^S with step-level advantages from anchor-state groups (engines.algorithms.agentic)."""
    gamma: float = Field(0.95, ge=0, le=1)
    """Discount of GiGPO's step returns."""
    omega: float = Field(1.0, ge=0)
    """Weight of GiGPO's step-level advantage."""
    norm: Literal["mean_std", "mean"] = "mean_std"
    """Group normalisation: subtract the mean and divide by the std, or subtract the mean only."""
    episode_stats: Literal["per_trajectory", "per_step_row"] = "per_trajectory"
    """Episode-group statistics over episodes (the GiGPO paper) or over step rows (each episode counted once
    per step it has)."""
    keep_fraction: float = Field(1.0, gt=0, le=1)
    """StarPO-S: train on this share of groups, those with the highest return std; 1 keeps all."""
    eval_seeds: int = Field(32, gt=0)
    """Held-out episodes of the evaluation (eval/heldout_accuracy is their success rate; eval.temperature 0:
    greedy)."""
    eval_seed_base: int = Field(1_000_000, ge=0)
    """First held-out environment seed; training seeds are drawn below it."""
    warm_start_episodes: int = Field(256, gt=0)
    """Episodes of random valid moves that make the SFT warm start's rows (sft.data.source: env)."""

    @field_validator("env")
    @classmethod
    def _known_env(cls, env_id: str) -> str:
        if ":" in env_id:  # an adapter (gem:, gym:): its package is checked when the environment is made
            return env_id
        from engines import environments

        if env_id not in environments.names():
            raise ValueError(f"unknown environment {env_id!r}; registered: {', '.join(environments.names())}")
        return env_id
