"""Config section ``algorithm:`` of the RL stages: the advantage estimator, the policy loss and its
aggregation, the KL to a reference, reward shaping, dynamic sampling, the critic and the off-policy
correction. Every choice is a registered name, checked at load (``docs/algorithms.md``)."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, model_validator

from configs.checks import CheckError, check_options, keyword_options
from configs.sections import OptimConfig, Section


class CriticOptimConfig(OptimConfig):
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate of the critic's AdamW (a fresh value head learns faster than the policy)."""


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    """KL weight (beta); > 0 starts a frozen reference model, 0 runs without one."""
    estimator: str = "k3"
    """KL estimator (engines.algorithms.kl): k1, k2 or k3."""
    mode: Literal["loss", "reward"] = "loss"
    """loss: add coef * KL to the policy loss (GRPO); reward: subtract coef * KL_t from each token's reward (PPO, REINFORCE++)."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """fixed: coef stays; adaptive: Ziegler et al.'s controller moves coef toward `target` (state is checkpointed)."""
    target: float = Field(0.1, gt=0)
    """Target per-sequence KL of the adaptive controller."""
    horizon: int = Field(10000, gt=0)
    """Samples over which the adaptive controller moves coef by about e^0.2."""

    @model_validator(mode="after")
    def _valid(self):
        from engines.algorithms import kl

        if self.estimator not in kl.names():
            raise ValueError(f"unknown KL estimator {self.estimator!r}; registered: {', '.join(kl.names())}")
        if self.mode == "reward" and self.estimator != "k1":
            # A reward's gradient is the score function times the reward; only with k1 = log(pi/pi_ref) is that
            # the KL's gradient (Tang & Munos 2025, arXiv:2506.09477). k2/k3 are for mode 'loss'.
            raise CheckError(("estimator", "mode"), f"{self.estimator} as a per-token reward penalty (mode 'reward') "
                             "gives a biased KL gradient; use k1 there: set algorithm.kl.estimator=k1 (or mode=loss)")
        if self.controller == "adaptive" and self.coef == 0:
            raise ValueError("controller 'adaptive' needs a starting coef > 0 (it multiplies coef)")
        return self


class ShapingConfig(Section):
    reward_norm: str = "none"
    """Sequence reward normalisation before the estimator: none, batch, group or running (std of every reward so far)."""
    reward_clip: float = Field(0.0, ge=0)
    """Clip sequence rewards to [-reward_clip, reward_clip]; 0 = off."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong penalty: ramp from 0 to -overlong_penalty_factor over the last N tokens before max_new_tokens; 0 = off."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Scale of the overlong penalty."""
    length_penalty: float = Field(0.0, ge=0)
    """Subtract length_penalty * response_length / max_new_tokens from each reward; 0 = off."""
    overlong_filter: bool = False
    """DAPO overlong filtering: truncated responses (hit max_new_tokens) are left out of the loss."""
    whiten_advantages: bool = False
    """Normalise advantages to zero mean, unit variance over the batch's response tokens."""
    advantage_clip: float = Field(0.0, ge=0)
    """Clip advantages to [-advantage_clip, advantage_clip]; 0 = off."""

    @model_validator(mode="after")
    def _known(self):
        from engines.algorithms.shaping import REWARD_NORMS

        if self.reward_norm not in REWARD_NORMS.names():
            raise ValueError(f"unknown reward_norm {self.reward_norm!r}; registered: {', '.join(REWARD_NORMS.names())}")
        return self


class DynamicSamplingConfig(Section):
    enabled: bool = False
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal, sample more prompts to refill the batch."""
    max_rounds: int = Field(3, ge=1)
    """Generation rounds per step at most (each draws prompts_per_step prompts). A batch still short after them trains on
    the groups kept so far; only when no group was kept does it fall back to the last round, unfiltered."""


class CriticConfig(Section):
    warmup_steps: int = Field(0, ge=0)
    """Steps that train only the critic before the policy starts to move."""
    clip_range: float = Field(0.2, ge=0)
    """Clip of the value update around the scoring-time values (0 = unclipped MSE)."""
    mini_batches: int = Field(1, gt=0)
    """The critic's optimizer steps per pass over the rollout batch (rows shuffled, as for the policy)."""
    ppo_epochs: int = Field(1, gt=0)
    """The critic's passes over each rollout batch."""
    optim: CriticOptimConfig = CriticOptimConfig()
    """Optimizer of the critic."""


class AlgorithmConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator (engines.algorithms.advantages); gae starts a critic engine."""
    advantage_options: dict[str, float | bool | int] = {}
    """Keyword options of the estimator, e.g. {norm_by_std: true, eps: 1e-6}; see docs/algorithms.md."""
    policy_loss: str = "ppo_clip"
    """Policy loss (engines.algorithms.losses)."""
    loss_options: dict[str, float | bool | int] = {}
    """Keyword options of the loss, e.g. {clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0}; tis_cap: 2.0 also needs old_logprobs: trainer."""
    agg: str = "token-mean"
    """Loss aggregation mode (engines.algorithms.aggregation)."""
    agg_norm: int | None = Field(None, gt=0)
    """Constant normaliser of seq-mean-token-sum-norm (Dr.GRPO); None = rollout.max_new_tokens."""
    old_logprobs: Literal["rollout", "trainer"] = "rollout"
    """Old logprobs of the ratio: the rollout engine's, or recomputed by the trainer (then tis_cap can correct the mismatch)."""
    correction: str | None = None
    """Off-policy correction of the sampler/trainer mismatch (engines.algorithms.corrections): tis, icepop,
    seq_tis, seq_mis, geo_mask, decoupled_ppo; needs old_logprobs: trainer."""
    correction_options: dict[str, float] = {}
    """Keyword options of the correction, e.g. {cap: 2.0} or {low: 0.5, high: 5.0}; see docs/algorithms.md."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    kl: KLConfig = KLConfig()
    """KL to a frozen reference: estimator, weight, loss term or reward penalty, fixed or adaptive."""
    shaping: ShapingConfig = ShapingConfig()
    """Reward and advantage shaping around the estimator."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """DAPO dynamic sampling."""
    critic: CriticConfig = CriticConfig()
    """The value model of PPO (advantage: gae only)."""

    @model_validator(mode="after")
    def _registered(self):
        from engines.algorithms import advantages, aggregation, losses

        for module, name, what in ((advantages, self.advantage, "advantage estimator"), (losses, self.policy_loss, "policy loss"),
                                   (aggregation, self.agg, "aggregation mode")):
            if name not in module.names():
                close = difflib.get_close_matches(name, module.names(), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"unknown {what} {name!r}; {hint}registered: {', '.join(module.names())}")
        check_options(keyword_options(advantages.ADV_ESTIMATORS.get(self.advantage), {"values"}), self.advantage,
                       self.advantage_options, "advantage estimator")
        check_options(losses.option_names(self.policy_loss) - {"agg_options"}, self.policy_loss, self.loss_options,
                       "policy loss")
        if self.loss_options.get("tis_cap") and self.old_logprobs == "rollout":
            raise ValueError("loss_options.tis_cap corrects the trainer/rollout mismatch, but with old_logprobs 'rollout' "
                             "both are the same; set algorithm.old_logprobs=trainer")
        self._check_correction()
        if "critic" in self.model_fields_set and self.advantage != "gae":
            raise ValueError(f"algorithm.critic is only used by advantage 'gae', not {self.advantage!r}; remove it")
        if self.agg_norm is not None and self.agg != "seq-mean-token-sum-norm":
            raise ValueError(f"agg_norm is the normaliser of seq-mean-token-sum-norm; agg is {self.agg!r}")
        if self.policy_loss == "gspo" and self.agg != "seq-mean-token-mean":
            raise CheckError(("agg", "policy_loss"), f"policy loss 'gspo' averages per-sequence losses over sequences "
                             f"(Zheng et al. 2025, arXiv:2507.18071, eq. 5), not {self.agg!r}; set "
                             "algorithm.agg=seq-mean-token-mean")
        return self


    def _check_correction(self) -> None:
        from engines.algorithms import corrections

        if self.correction is None:
            if self.correction_options:
                raise CheckError(("correction_options",), "correction_options without a correction; set algorithm.correction")
            return
        if self.correction not in corrections.names():
            close = difflib.get_close_matches(self.correction, corrections.names(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise CheckError(("correction",), f"unknown off-policy correction {self.correction!r}; {hint}registered: "
                             f"{', '.join(corrections.names())}")
        try:
            corrections.check(self.correction, self.correction_options)
        except ValueError as error:
            raise CheckError(("correction_options",), str(error)) from None
        if self.old_logprobs == "rollout":
            raise CheckError(("correction", "old_logprobs"), f"correction {self.correction!r} weighs by π_prox/μ, but with "
                             "old_logprobs 'rollout' π_prox is μ (every weight 1); set algorithm.old_logprobs=trainer")
