"""The RL step of ``flows/rlvr.py`` in one process, without Ray or Prefect.

Same engines, estimators, objectives, shaping, dynamic sampling and KL handling as the flow (built by
the same ``build_*`` functions), called directly. For learning tests, algorithm comparisons
(``bench/algorithms.py``) and debugging an algorithm under a profiler; runs that must survive a crash
go through the flow.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from configs.schema import Config
from engines.algorithms.kl import adaptive_kl_coef
from engines.algorithms.objective import ValueObjective
from engines.algorithms.shaping import RunningMoments, refill_rows
from engines.data.sampler import take
from engines.inference.hf import HFInferenceEngine
from engines.models import stop_token_ids
from engines.rollout_ops import advantage_batch, concat_rollouts
from engines.training.torch import OptimSpec, ReferenceEngine, TorchTrainEngine
from engines.types import SamplingParams
from flows.rlvr import build_advantage_spec, build_objective

RewardFn = Callable[..., list[float]]


def run_inprocess(cfg: Config, model_path: str, rows: list[dict], reward_fn: RewardFn,
                  on_step: Callable[[int, dict], None] | None = None) -> list[dict[str, float]]:
    """``cfg.train.steps`` RL steps from ``model_path`` on ``rows``; returns each step's metrics.

    ``reward_fn(prompts, completions, **columns) -> list[float]`` replaces the registered reward, so a
    test can use a task the tiny model can learn in a few steps."""
    alg, rollout_cfg = cfg.algorithm, cfg.rollout
    common = dict(dtype=cfg.model.dtype, torch_threads=cfg.run.torch_threads)
    rollout = HFInferenceEngine(model_path, **common)
    optim = OptimSpec(**cfg.train.optim.model_dump(), total_steps=cfg.train.steps)
    trainer = TorchTrainEngine(model_path, optim, seed=cfg.run.seed, micro_batch_size=cfg.train.micro_batch_size,
                               temperature=rollout_cfg.temperature, packing=cfg.train.packing, share_prompts=cfg.train.share_prompts, **common)
    reference = (ReferenceEngine(model_path, micro_batch_size=cfg.train.micro_batch_size, temperature=rollout_cfg.temperature,
                                 packing=cfg.train.packing, share_prompts=cfg.train.share_prompts, **common) if alg.kl.coef > 0 else None)
    critic = None
    if alg.advantage == "gae":
        critic_optim = OptimSpec(**alg.critic.optim.model_dump(), total_steps=cfg.train.steps)
        critic = TorchTrainEngine(model_path, critic_optim, seed=cfg.run.seed, head="value",
                                  micro_batch_size=cfg.train.micro_batch_size, **common)
    objective, spec = build_objective(cfg), build_advantage_spec(cfg, trainer.tokenizer.pad_token_id)
    value_objective = ValueObjective(clip_range=alg.critic.clip_range)
    stops = stop_token_ids(trainer.tokenizer, rollout_cfg.stop)
    rollout.update_weights(0, trainer.export_weights())

    kl_coef, moments, position, history = alg.kl.coef, RunningMoments(), 0, []
    prompts_per_step, group = rollout_cfg.prompts_per_step, rollout_cfg.group_size
    for step in range(1, cfg.train.steps + 1):
        metrics: dict[str, float] = {}
        parts, kept_total = [], 0
        for round_index in range(alg.dynamic_sampling.max_rounds if alg.dynamic_sampling.enabled else 1):
            indices, position = take(len(rows), position, prompts_per_step, seed=cfg.run.seed)
            prompts = [rows[i]["prompt"] for i in indices for _ in range(group)]
            columns = {k: [rows[i][k] for i in indices for _ in range(group)] for k in rows[0] if k != "prompt"}
            sampling = SamplingParams(max_new_tokens=rollout_cfg.max_new_tokens, temperature=rollout_cfg.temperature,
                                      top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k, stop_token_ids=stops,
                                      seed=(cfg.run.seed * 1_000_003 + step) * 101 + round_index)
            rollouts = rollout.generate(prompts, sampling)
            rewards = torch.tensor(reward_fn(prompts, rollouts.completions, **columns), dtype=torch.float32)
            if round_index == 0:
                metrics["reward/mean"] = float(rewards.mean())
            if alg.dynamic_sampling.enabled:
                kept_rows = refill_rows(rewards, group, prompts_per_step - kept_total)
            else:
                kept_rows = list(range(len(rewards)))
            parts.append((rollouts, rewards, kept_rows))
            kept_total += len(kept_rows) // group
            if kept_total == prompts_per_step:
                break
        if kept_total:
            rollouts = concat_rollouts([p[0] for p in parts], [p[2] for p in parts])
            rewards = torch.cat([p[1][p[2]] for p in parts])
        group_ids = torch.arange(kept_total or prompts_per_step).repeat_interleave(group)  # none kept: the last round as drawn
        metrics["dynamic/fill_ratio"] = kept_total / prompts_per_step
        metrics["dynamic/rounds"] = float(len(parts))

        batch, summary, moments = advantage_batch(
            rollouts, rewards, group_ids, spec, kl_coef=kl_coef, moments=moments,
            ref_logprobs=reference.rollout_logprobs(rollouts) if reference else None,
            old_logprobs=trainer.rollout_logprobs(rollouts) if alg.old_logprobs == "trainer" else None,
            values=critic.rollout_values(rollouts) if critic else None,
        )
        metrics.update(summary)
        if critic is not None:
            metrics.update(critic.train_step(batch, value_objective))
        if critic is None or step > alg.critic.warmup_steps:
            step_objective = dataclasses.replace(objective, kl_coef=kl_coef) if objective.kl_coef else objective
            metrics.update(trainer.train_step(batch, step_objective))
            rollout.update_weights(step, trainer.export_weights())
        if alg.kl.controller == "adaptive":
            kl_coef = adaptive_kl_coef(coef=kl_coef, observed_kl=summary["kl/seq_mean"], target_kl=alg.kl.target,
                                       horizon=alg.kl.horizon, num_samples=len(group_ids))
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history
