"""RLVR: sample G completions per prompt, reward them with a verifiable checker, turn rewards into
advantages with the configured estimator, and take one policy-gradient step per batch.

Variants by config (``configs/algorithms/*.yaml``): GRPO (Shao et al. 2024), Dr.GRPO, DAPO (clip-higher,
dynamic sampling, overlong shaping), GSPO, RLOO, REINFORCE++ (+baseline), Lite PPO, RAFT++, TOPR, and
PPO with a critic (``advantage: gae``). KL to a frozen reference as a loss term or a reward penalty,
fixed or adaptive. Every step: generate → score (→ refill, dynamic sampling) → compute_advantages
(reference / old-logprob / critic scoring) → train (critic, then policy) → sync_weights (→ evaluate)
(→ checkpoint).

Launch: ``rollflow run configs/tiny.yaml`` (RL only), ``rollflow run configs/algorithms/ppo.yaml``, or
``rollflow run configs/quickstart.yaml`` (SFT + RL). Rerunning the same command resumes from the newest
complete checkpoint in ``run.dir`` (policy, critic, optimizer states, data position, KL coefficient,
running reward statistics).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import ray
import torch
from prefect import flow

from configs.schema import Config
from flows.setup import final_dir, load_rows
from engines import checkpoint_store as store
from engines.actors import describe, start_engine, stop_engine
from engines.algorithms.kl import adaptive_kl_coef
from engines.algorithms.objective import PolicyObjective, ValueObjective
from engines.algorithms.shaping import RunningMoments, ShapingSpec, refill_rows
from engines.data.sampler import take
from engines.rollout_ops import AdvantageSpec
from engines.training.torch import OptimSpec
from engines.types import SamplingParams
from tasks.advantages import compute_advantages
from tasks.checkpoint import checkpoint, restore, save_model
from tasks.common import timed
from tasks.evaluate import evaluate
from tasks.generate import generate
from tasks.progress import StageProgress
from tasks.score import score
from tasks.sync import sync_weights
from tasks.tracking import RunTracker
from tasks.train import train


@dataclass
class RLEngines:
    rollout: object
    trainer: object
    reference: object | None
    critic: object | None
    reward_worker: object
    pad_token_id: int
    stop_token_ids: tuple[int, ...]

    @property
    def train_engines(self) -> dict:
        """The engines with state to checkpoint, by role."""
        return {"policy": self.trainer, **({"critic": self.critic} if self.critic is not None else {})}

    def stop(self) -> None:
        for handle in (self.rollout, self.trainer, self.reference, self.critic, self.reward_worker):
            if handle is not None:
                stop_engine(handle)


def start_rl_engines(config: Config, model_path: str, restoring: bool) -> RLEngines:
    """Rollout engine, trainer, reward worker, a frozen reference (when ``kl.coef > 0``) and a critic
    (when ``advantage: gae``), as named Ray actors; live ones of this run with the same settings are
    reattached (the trainer and critic only when ``restoring`` from a checkpoint, which resets them)."""
    from engines.models import load_tokenizer, stop_token_ids

    common = dict(run_name=config.run.name, model_path=model_path, dtype=config.model.dtype,
                  torch_threads=config.run.torch_threads)
    trainable = dict(common, reuse=restoring)
    temperature = config.rollout.temperature
    optim = OptimSpec(**config.train.optim.model_dump(), total_steps=config.train.steps)
    rollout = start_engine(f"rollout/{config.rollout.engine}", role="rollout", **common)
    trainer = start_engine(f"train/{config.train.engine}", role="trainer", optim=optim, seed=config.run.seed,
                           micro_batch_size=config.train.micro_batch_size, temperature=temperature, **trainable)
    reference = critic = None
    if config.algorithm.kl.coef > 0:
        reference = start_engine("reference/torch", role="reference", micro_batch_size=config.train.micro_batch_size,
                                 temperature=temperature, **common)
    if config.algorithm.advantage == "gae":
        critic_optim = OptimSpec(**config.algorithm.critic.optim.model_dump(), total_steps=config.train.steps)
        critic = start_engine(f"train/{config.train.engine}", role="critic", optim=critic_optim, seed=config.run.seed,
                              micro_batch_size=config.train.micro_batch_size, head="value", **trainable)
    reward_worker = start_engine("reward/worker", run_name=config.run.name, role="reward")
    tokenizer = load_tokenizer(model_path)
    return RLEngines(rollout, trainer, reference, critic, reward_worker, tokenizer.pad_token_id,
                     stop_token_ids(tokenizer, config.rollout.stop))


def record_engines(run_dir: str, engines: RLEngines) -> None:
    """``<run.dir>/engines.json``: actor id, pid and node of each engine of the current attempt."""
    roles = {"rollout": engines.rollout, "trainer": engines.trainer, "reference": engines.reference,
             "critic": engines.critic, "reward": engines.reward_worker}
    store.write_json(store.join(run_dir, "engines.json"),
                     {role: describe(handle) for role, handle in roles.items() if handle is not None})


def build_objective(config: Config) -> PolicyObjective:
    """The policy loss of ``algorithm``: loss, aggregation, KL loss term (mode ``loss``), entropy bonus."""
    alg = config.algorithm
    agg_options = {"norm": alg.agg_norm or config.rollout.max_new_tokens} if alg.agg == "seq-mean-token-sum-norm" else {}
    return PolicyObjective(policy_loss=alg.policy_loss, agg=alg.agg, loss_options=dict(alg.loss_options),
                           agg_options=agg_options, kl_coef=alg.kl.coef if alg.kl.mode == "loss" else 0.0,
                           kl_estimator=alg.kl.estimator, entropy_coef=alg.entropy_coef)


def build_advantage_spec(config: Config, pad_token_id: int) -> AdvantageSpec:
    """Estimator, shaping and reward-KL settings of ``algorithm`` for the reward worker."""
    alg = config.algorithm
    shaping = ShapingSpec(**alg.shaping.model_dump(), max_length=config.rollout.max_new_tokens)
    return AdvantageSpec(alg.advantage, pad_token_id, dict(alg.advantage_options), shaping,
                         kl_estimator=alg.kl.estimator, kl_in_reward=alg.kl.mode == "reward")


@dataclass
class ScoredBatch:
    """One step's scored rollouts (rows grouped by prompt) and what the driver keeps of them."""

    rollouts_ref: object
    rewards_ref: object
    group_ids: list[int]
    prompts: list[str]
    columns: dict[str, list]
    data_position: int
    metrics: dict[str, float]


def sample_batch(cfg: Config, engines: RLEngines, train_rows: list[dict], position: int, step: int) -> ScoredBatch:
    """Generate and score ``prompts_per_step × group_size`` rollouts.

    With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and more prompts are
    drawn, up to ``max_rounds`` rounds; ``dynamic/fill_ratio`` is the share of the batch filled. Reward
    metrics are those of the first round: an unfiltered sample of the policy."""
    prompts_per_step, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    dynamic = cfg.algorithm.dynamic_sampling
    parts, metrics = [], {}
    kept_groups = 0
    for round_index in range(dynamic.max_rounds if dynamic.enabled else 1):
        indices, position = take(len(train_rows), position, prompts_per_step, seed=cfg.run.seed)
        rows = [train_rows[i] for i in indices]
        prompts = [row["prompt"] for row in rows for _ in range(group)]
        columns = {key: [row[key] for row in rows for _ in range(group)] for key in rows[0] if key != "prompt"}
        group_ids = [j for j in range(prompts_per_step) for _ in range(group)]
        sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, stop_token_ids=engines.stop_token_ids,
                                  seed=(cfg.run.seed * 1_000_003 + step) * 101 + round_index)
        with timed(metrics, "time/generate"):
            rollouts_ref = generate(engines.rollout, prompts, sampling)
        with timed(metrics, "time/score"):
            rewards_ref, score_metrics = score(engines.reward_worker, rollouts_ref, prompts, columns, cfg.reward.name)
        if round_index == 0:
            metrics.update(score_metrics)
        else:
            metrics["rollout/tokens"] += score_metrics["rollout/tokens"]
        if not dynamic.enabled:
            return ScoredBatch(rollouts_ref, rewards_ref, group_ids, prompts, columns, position, metrics)
        kept_rows = refill_rows(ray.get(rewards_ref), group, prompts_per_step - kept_groups)
        parts.append((rollouts_ref, rewards_ref, kept_rows, prompts, columns))
        kept_groups += len(kept_rows) // group
        if kept_groups == prompts_per_step:
            break
    metrics["dynamic/fill_ratio"] = kept_groups / prompts_per_step
    metrics["dynamic/rounds"] = float(len(parts))
    if kept_groups == 0:  # nothing informative: train on the last round as drawn (its group advantages are 0)
        rollouts_ref, rewards_ref, _, prompts, columns = parts[-1]
        return ScoredBatch(rollouts_ref, rewards_ref, group_ids, prompts, columns, position, metrics)
    rows_per_part = [part[2] for part in parts]
    rollouts_ref = engines.reward_worker.concat.remote(rows_per_part, *[part[0] for part in parts])
    rewards = torch.cat([ray.get(part[1])[rows] for part, rows in zip(parts, rows_per_part)])
    prompts = [part[3][i] for part, rows in zip(parts, rows_per_part) for i in rows]
    columns = {key: [part[4][key][i] for part, rows in zip(parts, rows_per_part) for i in rows] for key in parts[0][4]}
    group_ids = [j for j in range(kept_groups) for _ in range(group)]
    return ScoredBatch(rollouts_ref, ray.put(rewards), group_ids, prompts, columns, position, metrics)


def heldout_eval(config: Config, engines: RLEngines, heldout_rows: list[dict]):
    rows = heldout_rows[: config.eval.num_prompts] if config.eval.num_prompts else heldout_rows
    sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, temperature=config.eval.temperature,
                              stop_token_ids=engines.stop_token_ids, seed=config.run.seed)
    return evaluate(engines.rollout, engines.reward_worker, rows, sampling, config.reward.name)


@flow(name="rlvr", persist_result=False)
def rlvr_flow(config: Config, model_path: str, tracking_uri: str, mlflow_run_id: str) -> dict:
    """RL from ``model_path`` with ``config.algorithm``; returns the final state (step, data position,
    held-out accuracies, KL coefficient, running reward moments, the checkpoint steps resumed from)."""
    cfg, run_dir, alg = config, config.run.resolved_dir, config.algorithm
    train_rows, heldout_rows = load_rows(cfg)
    tracker = RunTracker(tracking_uri, mlflow_run_id)
    latest = store.latest_checkpoint(run_dir)
    engines = start_rl_engines(cfg, model_path, restoring=latest is not None)
    record_engines(run_dir, engines)
    objective = build_objective(cfg)
    value_objective = ValueObjective(clip_range=alg.critic.clip_range)
    advantage_spec = build_advantage_spec(cfg, engines.pad_token_id)
    old_logprob_engine = engines.trainer if alg.old_logprobs == "trainer" else None

    state = {"step": 0, "data_position": 0, "heldout_accuracy": {}, "mlflow_run_id": mlflow_run_id,
             "kl_coef": alg.kl.coef, "reward_moments": dataclasses.asdict(RunningMoments()), "resumed_from": []}
    if latest is not None:
        state = {**state, **restore(engines.train_engines, latest[1])}
        state["resumed_from"] = [*state["resumed_from"], state["step"]]  # each attempt's starting checkpoint
    sync_weights(engines.trainer, [engines.rollout], state["step"], cfg.sync.bucket_mb)
    if state["step"] == 0:
        accuracy, samples = heldout_eval(cfg, engines, heldout_rows)
        state["heldout_accuracy"]["0"] = accuracy
        tracker.log_step("eval", 0, {"eval/heldout_accuracy": accuracy})
        tracker.log_samples("eval_step_000000", samples[: cfg.tracking.num_samples])

    progress = StageProgress("rl", cfg.train.steps, start=state["step"],
                             keys=("reward/mean", "eval/heldout_accuracy", "time/step"))
    for step in range(state["step"] + 1, cfg.train.steps + 1):
        step_start = time.perf_counter()
        scored = sample_batch(cfg, engines, train_rows, state["data_position"], step)
        metrics = scored.metrics
        with timed(metrics, "time/advantages"):
            batch_ref, advantage_metrics, moments = compute_advantages(
                engines.reward_worker, scored.rollouts_ref, scored.rewards_ref, scored.group_ids, advantage_spec,
                reference=engines.reference, trainer=old_logprob_engine, critic=engines.critic,
                kl_coef=state["kl_coef"], moments=RunningMoments(**state["reward_moments"]))
        metrics.update(advantage_metrics)
        if engines.critic is not None:
            with timed(metrics, "time/train_critic"):
                metrics.update(train(engines.critic, batch_ref, value_objective))
        if step > alg.critic.warmup_steps or engines.critic is None:
            step_objective = dataclasses.replace(objective, kl_coef=state["kl_coef"]) if objective.kl_coef else objective
            with timed(metrics, "time/train"):
                metrics.update(train(engines.trainer, batch_ref, step_objective))
            with timed(metrics, "time/sync_weights"):
                sync_weights(engines.trainer, [engines.rollout], step, cfg.sync.bucket_mb)
        if alg.kl.controller == "adaptive":
            state["kl_coef"] = adaptive_kl_coef(coef=state["kl_coef"], observed_kl=advantage_metrics["kl/seq_mean"],
                                                target_kl=alg.kl.target, horizon=alg.kl.horizon,
                                                num_samples=len(scored.group_ids))
            metrics["kl/coef"] = state["kl_coef"]
        state["step"], state["data_position"] = step, scored.data_position
        state["reward_moments"] = dataclasses.asdict(moments)

        if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            with timed(metrics, "time/evaluate"):
                accuracy, samples = heldout_eval(cfg, engines, heldout_rows)
            state["heldout_accuracy"][str(step)] = accuracy
            metrics["eval/heldout_accuracy"] = accuracy
            tracker.log_samples(f"eval_step_{step:06d}", samples[: cfg.tracking.num_samples])
        if cfg.tracking.sample_every and step % cfg.tracking.sample_every == 0:
            tracker.log_samples(f"rollouts_step_{step:06d}",
                                rollout_samples(ray.get(scored.rollouts_ref), scored.prompts, scored.columns,
                                                ray.get(scored.rewards_ref), cfg.tracking.num_samples))
        metrics["time/step"] = time.perf_counter() - step_start
        metrics["perf/tokens_per_s"] = metrics["rollout/tokens"] / max(metrics["time/generate"], 1e-9)
        tracker.log_step("rl", step, metrics)  # flushed before any checkpoint can claim this step
        progress.update(step, metrics)

        if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
            checkpoint(engines.train_engines, run_dir, step, state, cfg.checkpoint.keep)
    progress.close()
    tracker.flush()
    save_model(engines.trainer, final_dir(cfg), state["step"], state)
    engines.stop()
    return state


def rollout_samples(rollouts, prompts: list[str], columns: dict[str, list], rewards, limit: int) -> list[dict]:
    answers = columns.get("answer", [""] * len(prompts))
    return [
        {"prompt": prompts[i], "completion": rollouts.completions[i], "answer": str(answers[i]),
         "reward": float(rewards[i]), "finish_reason": rollouts.finish_reasons[i]}
        for i in range(min(limit, len(prompts)))
    ]
