"""What a synchronous RL step samples: each domain's prompts in generation calls (groups kept whole), scored
as they are generated, refilled by dynamic sampling; or an agentic step's episodes. ``tasks.score.ScoredBatch`` is
what the step body (``flows/rlvr.py``) trains on, whichever way it was sampled (``flows/asynchrony.py`` too)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from prefect.utilities.annotations import quote  # large task arguments: Prefect need not walk them (no futures inside)

from configs.schema import Config
from engines.actors import run_actor_names
from engines.data.domains import draw
from engines.rewards.failures import RewardFailureMonitor, failures_by_domain
from engines.scoring import ScoreSpec, summarize
from engines.types import SamplingParams
from flows.agentic import agentic_batch
from tasks.common import timed
from tasks.score import Chunk, ScoredBatch, generate_and_score, join_rounds

if TYPE_CHECKING:  # flows.rlvr imports this module
    from flows.rlvr import RLEngines


def score_spec(cfg: Config, domain, engines: RLEngines) -> ScoreSpec:
    options = dict(domain.reward_options)
    if domain.reward == "judge" and engines.judge is not None:
        [options["engine_actor"]] = run_actor_names(cfg.run.name, "judge")
    return ScoreSpec(domain.reward, options, domain.name, cfg.reward.chunk_size, cfg.reward.concurrency,
                     domain.timeout_s)


def build_chunks(cfg: Config, engines: RLEngines, drawn: list, seed: int) -> list[Chunk]:
    """The step's generation calls: each domain's prompts (groups kept whole) in up to
    ``reward.generation_chunks`` pieces, and at least one per rollout replica where there are prompts
    enough, each with the domain's scoring. Chunk ``i`` generates on replica ``i % replicas``."""
    group, chunks = cfg.rollout.group_size, []
    for domain, rows in drawn:
        pieces = min(max(cfg.reward.generation_chunks, len(engines.rollouts)), len(rows))
        bounds = [round(i * len(rows) / pieces) for i in range(pieces + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            part = rows[lo:hi]
            keys = sorted({k for row in part for k in row} - {"prompt"})
            sampling = rollout_sampling(cfg, engines, seed + 7919 * len(chunks))
            chunks.append(Chunk([row["prompt"] for row in part for _ in range(group)],
                                {k: [row.get(k) for row in part for _ in range(group)] for k in keys},
                                sampling, score_spec(cfg, domain, engines)))
    return chunks


def sample_batch(cfg: Config, engines: RLEngines, domains: list, positions: dict[str, int], step: int,
                 reward_failures: RewardFailureMonitor) -> ScoredBatch:
    """Generate and score ``prompts_per_step × group_size`` rollouts, each domain's share of them.

    With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and more prompts are
    drawn, up to ``max_rounds`` rounds; ``dynamic/fill_ratio`` is the share of the batch filled. Reward
    metrics are those of the first round (an unfiltered sample of the policy); the work metrics
    (``rollout/tokens``, ``perf/tokens_per_s``, …) count every round."""
    prompts_per_step, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    dynamic = cfg.algorithm.dynamic_sampling
    metrics, rounds, prompts, columns = {}, [], [], []
    room = prompts_per_step
    for round_index in range(dynamic.max_rounds if dynamic.enabled else 1):
        drawn, positions = draw(domains, positions)
        chunks = build_chunks(cfg, engines, drawn, seed=(cfg.run.seed * 1_000_003 + step) * 101 + round_index)
        with timed(metrics, "time/generate_and_score"):
            scored = generate_and_score(engines.rollouts, engines.reward_workers, quote(chunks), cfg.reward.async_scoring,
                                        keep_groups=(group, room) if dynamic.enabled else None,
                                        timeout_s=cfg.rollout.timeout_s)
        if round_index == 0:
            reward_failures.update(step, failures_by_domain(scored.stats))  # warns; raises past reward.failure_patience
        rounds.append(scored)
        prompts.append([p for c in chunks for p in c.prompts])
        keys = sorted({k for c in chunks for k in c.columns})
        columns.append({**{k: [v for c in chunks for v in c.columns.get(k, [None] * len(c.prompts))] for k in keys},
                        "domain": [c.score.domain for c in chunks for _ in c.prompts]})
        room -= len(scored.kept_rows or []) // group
        if room == 0 or not dynamic.enabled:
            break
    metrics.update(summarize(rounds[0].stats, [s for r in rounds for s in r.stats]))
    if dynamic.enabled:
        kept_groups = prompts_per_step - room
        metrics["dynamic/fill_ratio"] = kept_groups / prompts_per_step
        metrics["dynamic/rounds"] = float(len(rounds))
        if kept_groups == 0:  # nothing informative: train on the last round as drawn (its group advantages are 0)
            rounds, prompts, columns = [dataclasses.replace(rounds[-1], kept_rows=None)], prompts[-1:], columns[-1:]
            kept_groups = prompts_per_step
        rollouts_ref, rewards_ref = join_rounds(engines.reward_worker, quote(rounds))
        rows = [r.kept_rows if r.kept_rows is not None else range(len(p)) for r, p in zip(rounds, prompts)]
        prompts = [[p[i] for i in idx] for p, idx in zip(prompts, rows)]
        columns = [{k: [v[i] for i in idx] for k, v in c.items()} for c, idx in zip(columns, rows)]
    else:
        [scored], kept_groups = rounds, prompts_per_step
        rollouts_ref, rewards_ref = scored.rollouts_ref, scored.rewards_ref
    group_ids = [j for j in range(kept_groups) for _ in range(group)]
    return ScoredBatch(rollouts_ref, rewards_ref, group_ids, [p for part in prompts for p in part],
                       {k: [v for c in columns for v in c[k]] for k in columns[0]}, positions, metrics)


def sample_step(cfg: Config, engines: RLEngines, domains: list, positions: dict[str, int], step: int,
                reward_failures: RewardFailureMonitor) -> ScoredBatch:
    """Step ``step``'s scored batch from data positions ``positions``: episodes for agentic RL, else prompts."""
    if engines.env_workers:
        return agentic_batch(cfg, engines, positions, step)
    return sample_batch(cfg, engines, domains, positions, step, reward_failures)


def rollout_sampling(cfg: Config, engines: RLEngines, seed: int) -> SamplingParams:
    """``rollout:``'s sampling with the stop tokens and ``seed``."""
    return SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                          top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, stop_token_ids=engines.stop_token_ids,
                          seed=seed)


def call_sampling(cfg: Config, engines: RLEngines, call: int) -> SamplingParams:
    """Sampling of ``async.mode: full``'s generation call number ``call`` (seeded by the run seed and it)."""
    return rollout_sampling(cfg, engines, (cfg.run.seed * 1_000_003 + call) * 101 + 7)
