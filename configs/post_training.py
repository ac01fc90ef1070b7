"""Config sections of the supervised stages: SFT, DPO, offline and on-policy distillation, and the stage
list of a ``pipeline`` run. ``configs/schema.py`` puts them into the one ``Config``; every default lives here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from configs.checks import CheckError, check_data_files, check_options
from configs.sections import Section, SFTOptimConfig


class StageDataConfig(Section):
    source: Literal["rl", "files", "synthetic", "env"] = "rl"
    """rl: the run's RL rows (``data:``) as plain ``prompt ++ answer`` text, the RLVR warm start; files: rows
    from train_path / heldout_path (SFT: ``messages`` or ``prompt``/``completion``; DPO: ``prompt``/``chosen``/
    ``rejected``, TRL's forms); synthetic: the built-in generated task of the stage (engines.data.synthetic);
    env: episodes of random valid moves in the agentic: environment, as multi-turn conversations (SFT only)."""
    train_path: str | None = None
    """jsonl, json, parquet or a saved dataset folder (local or s3://) (source: files)."""
    heldout_path: str | None = None
    """Same form, for the held-out loss and accuracy (source: files)."""
    num_train: int = Field(512, gt=0)
    """Generated training rows (source: synthetic)."""
    num_heldout: int = Field(64, gt=0)
    """Generated held-out rows (source: synthetic)."""
    max_length: int = Field(256, gt=1)
    """Tokens of a row (prompt and answer); longer rows are rejected, counted and logged."""

    @model_validator(mode="after")
    def _paths_for_files(self):
        if self.source == "files" and not (self.train_path and self.heldout_path):
            raise CheckError(("train_path",), "source 'files' needs train_path and heldout_path")
        check_data_files(self, "")
        return self


class SupervisedConfig(Section):
    """What every supervised stage (SFT, DPO, offline distillation) shares: its data, batches and optimizer."""

    data: StageDataConfig = StageDataConfig()
    """The stage's rows."""
    steps: int = Field(100, gt=0)
    """Optimizer steps."""
    batch_size: int = Field(32, gt=0)
    """Rows (DPO: preference pairs) per optimizer step; the loss is the mean over the step's loss tokens (DPO:
    pairs), so micro_batch_size does not change it."""
    micro_batch_size: int = Field(32, gt=0)
    """Rows (DPO: pairs) per forward/backward; gradients accumulate over the step."""
    optim: SFTOptimConfig = SFTOptimConfig()
    """Optimizer of the stage."""
    eval_every: int = Field(0, ge=0)
    """Held-out metrics every N steps (and always after the last); 0 = only after the last."""
    checkpoint_every: int = Field(50, gt=0)
    """Checkpoint (model, optimizer, data position, RNG) every N steps; a killed stage resumes from the newest."""


class SFTConfig(SupervisedConfig):
    """Supervised fine-tuning: next-token cross-entropy on assistant (answer) tokens only."""


class DPOConfig(SupervisedConfig):
    loss: str = "sigmoid"
    """Preference loss (engines.algorithms.preference): sigmoid, cdpo, robust, hinge, ipo, sigmoid_norm,
    sppo_hard, nca_pair, bco_pair, apo_zero, apo_down."""
    beta: float = Field(0.1, gt=0)
    """β: the strength of the implicit KL to the reference (rewards are β · (log π − log π_ref))."""
    options: dict[str, float | bool] = {}
    """The loss's own options: label_smoothing (cdpo, robust), length_normalize (ipo), delta (bco_pair)."""
    sft_weight: float = Field(0.0, ge=0)
    """Weight of an added SFT term: the token-mean NLL of the chosen answers (RPO); 0 = none."""
    reference: str | None = None
    """Reference model (path or hub id); None = the stage's input model."""
    optim: SFTOptimConfig = SFTOptimConfig(lr=1e-4)
    """Optimizer of the stage."""

    @model_validator(mode="after")
    def _registered_loss(self):
        from engines.algorithms import preference

        if self.loss not in preference.names():
            raise CheckError(("loss",), f"unknown preference loss {self.loss!r}; known: {', '.join(preference.names())}")
        check_options(preference.option_names(self.loss), self.loss, self.options, "preference loss")
        return self


class TeacherConfig(Section):
    path: str
    """Teacher model: HF folder or hub id, with the student's tokenizer (vocab sizes may differ by padding rows)."""
    temperature: float = Field(1.0, gt=0)
    """Temperature of the teacher's (and the student's) distribution in the divergence."""
    top_k: int = Field(32, ge=0)
    """Teacher tokens kept per position in the cache (with the tail mass as one more bucket); 0 = the whole
    vocabulary."""


class DistillConfig(SupervisedConfig):
    teacher: TeacherConfig
    """The teacher that scores the data once; its top-k log-probs are cached under the run directory."""
    divergence: str = "forward_kl"
    """Divergence (engines.algorithms.distillation): forward_kl, reverse_kl, js, gkd_jsd, skewed_forward_kl,
    skewed_reverse_kl, adaptive_kl, mixed."""
    options: dict[str, float] = {}
    """The divergence's own options: beta (gkd_jsd), lam (skewed_*), alpha (adaptive_kl), weight (mixed)."""
    weight: float = Field(1.0, ge=0, le=1)
    """loss = weight · divergence + (1 − weight) · cross-entropy on the data's answer tokens."""
    temperature_squared: bool = True
    """Multiply the divergence by T² (Hinton et al. 2015) so its gradients keep their scale across temperatures."""

    @model_validator(mode="after")
    def _registered_divergence(self):
        from engines.algorithms import distillation

        if self.divergence not in distillation.names():
            raise CheckError(("divergence",), f"unknown divergence {self.divergence!r}; known: "
                             f"{', '.join(distillation.names())}")
        check_options(distillation.option_names(self.divergence), self.divergence, self.options, "divergence")
        return self


class TeacherRoute(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Names the teacher's engine and its metrics (``teacher_kl/<name>``)."""
    path: str
    """Teacher model: HF folder or hub id with the student's tokenizer."""
    values: list[str] = []
    """Rows whose route column holds one of these go to this teacher; [] = every row no other teacher takes."""


class OnPolicyDistillConfig(Section):
    teachers: list[TeacherRoute] = Field(min_length=1)
    """Teachers, each scoring the rows routed to it; exactly one may leave ``values`` empty (the default)."""
    route_key: str = "domain"
    """Data column that routes a row to its teacher (``domain`` is the row's domain name)."""
    coef: float = Field(1.0, gt=0)
    """λ in the per-token advantage −λ (log q_student − log p_teacher) on the sampled completion tokens."""
    rewards: bool = False
    """Add the verifiable-reward advantage of ``algorithm``: A = A_RL − λ k; false = the teacher's signal only."""

    @model_validator(mode="after")
    def _one_default(self):
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise CheckError(("teachers",), f"teacher names repeat: {names}")
        defaults = [t.name for t in self.teachers if not t.values]
        if len(self.teachers) > 1 and len(defaults) > 1:
            raise CheckError(("teachers",), f"teachers {defaults} both take every row; give all but one `values`")
        return self


StageName = Literal["sft", "rlvr", "dpo", "distill", "onpolicy_distill", "agentic", "eval"]


class PipelineConfig(Section):
    stages: list[StageName] = Field(min_length=1)
    """Stages in order, each training the previous one's output model with its section of this config
    (sft:, rlvr = algorithm/train/rollout, dpo:, distill:, onpolicy_distill:, eval = held-out accuracy)."""

    @field_validator("stages")
    @classmethod
    def _once_each(cls, stages: list[str]) -> list[str]:
        repeated = sorted({s for s in stages if stages.count(s) > 1})
        if repeated:
            raise ValueError(f"stage {repeated[0]!r} appears twice; each stage runs once per pipeline")
        if "eval" in stages and stages[-1] != "eval":
            raise ValueError("eval evaluates the pipeline's final model; put it last")
        return stages
