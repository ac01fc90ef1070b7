"""RLVR with GRPO: sample G completions per prompt, reward them with a verifiable checker, normalise the
rewards within each group, and take one clipped-ratio policy-gradient step per batch.

Variant: outcome-reward GRPO (Shao et al. 2024, arXiv:2402.03300) with token-mean aggregation, optional
k3 KL to a frozen reference, old logprobs from the rollout engine (on-policy: one optimizer step per
batch). Every step: generate → score → compute_advantages → train → sync_weights (→ evaluate) (→ checkpoint).

Launch: ``rollflow run configs/tiny.yaml`` (RL only) or ``rollflow run configs/quickstart.yaml`` (SFT + RL).
Rerunning the same command resumes from the newest complete checkpoint in ``run.dir``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from prefect import flow

from configs.schema import Config
from flows.setup import final_dir, load_rows
from engines import checkpoint_store as store
from engines.actors import start_engine, stop_engine
from engines.algorithms.objective import PolicyObjective
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
    reward_worker: object
    pad_token_id: int
    stop_token_ids: tuple[int, ...]

    def stop(self) -> None:
        for handle in (self.rollout, self.trainer, self.reference, self.reward_worker):
            if handle is not None:
                stop_engine(handle)


def start_rl_engines(config: Config, model_path: str) -> RLEngines:
    """Rollout engine, trainer, reward worker and (when ``kl_coef > 0``) a frozen reference, as named Ray actors."""
    from engines.models import load_tokenizer, stop_token_ids

    common = dict(run_name=config.run.name, model_path=model_path, dtype=config.model.dtype,
                  torch_threads=config.run.torch_threads)
    temperature = config.rollout.temperature
    optim = OptimSpec(**config.train.optim.model_dump(), total_steps=config.train.steps)
    rollout = start_engine(f"rollout/{config.rollout.engine}", role="rollout", **common)
    trainer = start_engine(f"train/{config.train.engine}", role="trainer", optim=optim, seed=config.run.seed,
                           micro_batch_size=config.train.micro_batch_size, temperature=temperature, **common)
    reference = None
    if config.algorithm.kl_coef > 0:
        reference = start_engine("reference/torch", role="reference", micro_batch_size=config.train.micro_batch_size,
                                 temperature=temperature, **common)
    reward_worker = start_engine("reward/worker", run_name=config.run.name, role="reward")
    tokenizer = load_tokenizer(model_path)
    return RLEngines(rollout, trainer, reference, reward_worker, tokenizer.pad_token_id,
                     stop_token_ids(tokenizer, config.rollout.stop))


def heldout_eval(config: Config, engines: RLEngines, heldout_rows: list[dict]):
    rows = heldout_rows[: config.eval.num_prompts] if config.eval.num_prompts else heldout_rows
    sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, temperature=config.eval.temperature,
                              stop_token_ids=engines.stop_token_ids, seed=config.run.seed)
    return evaluate(engines.rollout, engines.reward_worker, rows, sampling, config.reward.name)


@flow(name="rlvr", persist_result=False)
def rlvr_flow(config: Config, model_path: str, tracking_uri: str, mlflow_run_id: str) -> dict:
    """GRPO from ``model_path``; returns the final state (step, data position, held-out accuracies)."""
    cfg, run_dir = config, config.run.resolved_dir
    train_rows, heldout_rows = load_rows(cfg)
    tracker = RunTracker(tracking_uri, mlflow_run_id)
    engines = start_rl_engines(cfg, model_path)
    objective = PolicyObjective(policy_loss=cfg.algorithm.policy_loss, agg=cfg.algorithm.agg,
                                loss_options=dict(cfg.algorithm.loss_options), kl_coef=cfg.algorithm.kl_coef,
                                kl_estimator=cfg.algorithm.kl_estimator, entropy_coef=cfg.algorithm.entropy_coef)
    advantage_spec = AdvantageSpec(cfg.algorithm.advantage, engines.pad_token_id, dict(cfg.algorithm.advantage_options))
    prompts_per_step, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size

    state = {"step": 0, "data_position": 0, "heldout_accuracy": {}, "mlflow_run_id": mlflow_run_id}
    latest = store.latest_checkpoint(run_dir)
    if latest is not None:
        state = restore(engines.trainer, latest[1])
    sync_weights(engines.trainer, [engines.rollout], state["step"], cfg.sync.bucket_mb)
    if state["step"] == 0:
        accuracy, samples = heldout_eval(cfg, engines, heldout_rows)
        state["heldout_accuracy"]["0"] = accuracy
        tracker.log_step("eval", 0, {"eval/heldout_accuracy": accuracy})
        tracker.log_samples("eval_step_000000", samples[: cfg.tracking.num_samples])

    progress = StageProgress("rl", cfg.train.steps, start=state["step"],
                             keys=("reward/mean", "eval/heldout_accuracy", "time/step"))
    for step in range(state["step"] + 1, cfg.train.steps + 1):
        metrics: dict[str, float] = {}
        step_start = time.perf_counter()
        indices, position = take(len(train_rows), state["data_position"], prompts_per_step, seed=cfg.run.seed)
        rows = [train_rows[i] for i in indices]
        prompts = [row["prompt"] for row in rows for _ in range(group)]
        columns = {key: [row[key] for row in rows for _ in range(group)] for key in rows[0] if key != "prompt"}
        group_ids = [j for j in range(prompts_per_step) for _ in range(group)]
        sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                  stop_token_ids=engines.stop_token_ids, seed=cfg.run.seed * 1_000_003 + step)

        with timed(metrics, "time/generate"):
            rollouts_ref = generate(engines.rollout, prompts, sampling)
        with timed(metrics, "time/score"):
            rewards_ref, score_metrics = score(engines.reward_worker, rollouts_ref, prompts, columns, cfg.reward.name)
        with timed(metrics, "time/advantages"):
            batch_ref, advantage_metrics = compute_advantages(engines.reward_worker, rollouts_ref, rewards_ref, group_ids,
                                                              advantage_spec, engines.reference)
        with timed(metrics, "time/train"):
            train_metrics = train(engines.trainer, batch_ref, objective)
        with timed(metrics, "time/sync_weights"):
            sync_weights(engines.trainer, [engines.rollout], step, cfg.sync.bucket_mb)
        state["step"], state["data_position"] = step, position
        metrics.update(score_metrics, **advantage_metrics, **train_metrics)

        if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            with timed(metrics, "time/evaluate"):
                accuracy, samples = heldout_eval(cfg, engines, heldout_rows)
            state["heldout_accuracy"][str(step)] = accuracy
            metrics["eval/heldout_accuracy"] = accuracy
            tracker.log_samples(f"eval_step_{step:06d}", samples[: cfg.tracking.num_samples])
        if cfg.tracking.sample_every and step % cfg.tracking.sample_every == 0:
            tracker.log_samples(f"rollouts_step_{step:06d}", rollout_samples(ray.get(rollouts_ref), prompts, columns,
                                                                            ray.get(rewards_ref), cfg.tracking.num_samples))
        metrics["time/step"] = time.perf_counter() - step_start
        metrics["perf/tokens_per_s"] = score_metrics["rollout/tokens"] / max(metrics["time/generate"], 1e-9)
        tracker.log_step("rl", step, metrics)  # flushed before any checkpoint can claim this step
        progress.update(step, metrics)

        if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
            checkpoint(engines.trainer, run_dir, step, state, cfg.checkpoint.keep)
    progress.close()
    tracker.flush()
    final = save_model(engines.trainer, final_dir(cfg), state["step"], state)
    if cfg.tracking.log_model:
        tracker.log_dir(final, "final_model")
    engines.stop()
    return state


def rollout_samples(rollouts, prompts: list[str], columns: dict[str, list], rewards, limit: int) -> list[dict]:
    answers = columns.get("answer", [""] * len(prompts))
    return [
        {"prompt": prompts[i], "completion": rollouts.completions[i], "answer": str(answers[i]),
         "reward": float(rewards[i]), "finish_reason": rollouts.finish_reasons[i]}
        for i in range(min(limit, len(prompts)))
    ]
