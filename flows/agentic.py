"""Agentic RL (``kind: agentic``): the RL step of ``flows/rlvr.py`` with episodes of a text environment in
place of prompts and a verifiable reward.

Each step runs ``rollout.prompts_per_step`` groups of ``rollout.group_size`` episodes; the episodes of a
group share an environment seed, a pure function of the run seed, the step and the group, so a resumed
run replays the same environments. Environment workers (Ray actors, ``engines.agentic.worker``) run the
episodes against the rollout engines, token in and token out, and hand the multi-turn batch to the reward
worker through Ray; the driver gets a small summary per episode (rewards and anchor states per step,
endings) and computes the advantages from it: StarPO's trajectory advantage or GiGPO's step advantage
(``engines.algorithms.agentic``), placed on each turn's tokens by ``advantage_batch``. Episodes that end
in error are never trained on; past ``agentic.max_error_rate`` of a step they fail it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from prefect.utilities.annotations import quote

from configs.schema import Config
from engines.actors import start_engine
from engines.agentic.rollout import ENDINGS, TRUNCATIONS, EpisodeSpec, RolloutSettings
from tasks.agentic import run_episodes
from tasks.common import timed

SEED_SPACE = 1_000_000  # training environment seeds are drawn below agentic.eval_seed_base, in this many


def rollout_settings(config: Config, positions: int | None) -> RolloutSettings:
    section, rollout = config.agentic, config.rollout
    return RolloutSettings(max_turns=section.max_turns, max_tokens_per_turn=rollout.max_new_tokens,
                           max_context=section.max_context or positions or 4096, temperature=rollout.temperature,
                           top_p=rollout.top_p, top_k=rollout.top_k, step_timeout_s=section.step_timeout_s)


def start_env_workers(config: Config, model_path: str, stop_token_ids: tuple[int, ...]) -> list:
    """``agentic.workers`` environment worker actors, each with the tokenizer of ``model_path``."""
    positions = config.model.positions()
    settings = dataclasses.replace(rollout_settings(config, positions[0] if positions else None),
                                   stop_token_ids=tuple(stop_token_ids))
    section = config.agentic
    return [start_engine("env/worker", run_name=config.run.name, role=f"env-{i}", tokenizer_path=model_path,
                         env_id=section.env, env_options=dict(section.env_options), settings=settings,
                         system_prompt=section.system_prompt)
            for i in range(section.workers)]


def training_specs(config: Config, step: int) -> list[EpisodeSpec]:
    """The episodes of RL step ``step``: group g's environment seed and each episode's sampling seed are
    pure functions of the run seed, the step and the group (and the episode)."""
    section, group_size = config.agentic, config.rollout.group_size
    specs = []
    for group in range(config.rollout.prompts_per_step):
        env_seed = ((config.run.seed * 1_000_003 + step) * 7919 + group) % min(section.eval_seed_base or SEED_SPACE,
                                                                               SEED_SPACE)
        for member in range(group_size):
            index = group * group_size + member
            specs.append(EpisodeSpec(section.env, env_seed, group, index,
                                     sample_seed=(config.run.seed * 1_000_003 + step) * 65_537 + index))
    return specs


def group_specs(config: Config, number: int) -> list[EpisodeSpec]:
    """``async.mode: full``'s episode group ``number`` (admission order, ``tasks/episode_stream.py``): its
    environment seed and its episodes' sampling seeds are pure functions of the run seed and ``number``."""
    section, group_size = config.agentic, config.rollout.group_size
    base = (config.run.seed * 1_000_003 + number) * 104_729 + 1
    env_seed = base % min(section.eval_seed_base or SEED_SPACE, SEED_SPACE)
    return [EpisodeSpec(section.env, env_seed, number, number * group_size + member, sample_seed=base * 65_537 + member)
            for member in range(group_size)]


def eval_specs(config: Config) -> list[EpisodeSpec]:
    """The held-out episodes: seeds ``eval_seed_base + i``, one episode each, sampling seed ``i``."""
    section = config.agentic
    return [EpisodeSpec(section.env, section.eval_seed_base + i, i, i, sample_seed=i) for i in range(section.eval_seeds)]


def agentic_advantages(config: Config, summaries: list[dict]) -> tuple[list[list[float]], list[int], dict[str, float]]:
    """``(step_advantages, masked_rows, metrics)`` of a batch's episodes (``summaries`` from the workers):
    StarPO or GiGPO over the episodes that did not fail, 0 on the others; ``masked_rows`` are the failed
    ones, truncated ones with ``on_truncation: mask``, and the groups StarPO-S leaves out."""
    from engines.algorithms.agentic import starpo_s_filter, step_advantages, trajectory_advantages

    section = config.agentic
    rewards = [list(s["step_rewards"]) for s in summaries]
    truncated = [s["ending"] in TRUNCATIONS for s in summaries]
    if section.on_truncation == "penalize":
        for steps, cut in zip(rewards, truncated):
            if cut and steps:
                steps[-1] += section.truncation_penalty
    failed = {i for i, s in enumerate(summaries) if s["ending"] == "error" or not s["turns"]}
    masked = set(failed) | ({i for i, cut in enumerate(truncated) if cut} if section.on_truncation == "mask" else set())
    used = [i for i in range(len(summaries)) if i not in failed]
    group_ids = [summaries[i]["group"] for i in used]
    returns = [sum(rewards[i]) for i in used]
    if section.mode == "step":
        values = step_advantages(step_rewards=[rewards[i] for i in used],
                                 state_keys=[summaries[i]["state_keys"] for i in used], group_ids=group_ids,
                                 gamma=section.gamma, omega=section.omega, norm=section.norm,
                                 episode_stats=section.episode_stats)
    else:
        weights = [len(rewards[i]) for i in used] if section.episode_stats == "per_step_row" else None
        per_episode = trajectory_advantages(returns=returns, group_ids=group_ids, norm=section.norm,
                                            episode_stats_weights=weights)
        values = [[a] * len(rewards[i]) for a, i in zip(per_episode, used)]
    advantages = [[0.0] * max(s["turns"], 1) for s in summaries]
    for i, value in zip(used, values):
        advantages[i] = value
    metrics = {}
    if section.keep_fraction < 1 and used:
        kept = set(starpo_s_filter(returns=returns, group_ids=group_ids, keep_fraction=section.keep_fraction))
        masked |= {i for i, s in enumerate(summaries) if s["group"] not in kept}
        metrics["agentic/kept_group_frac"] = len(kept) / len(set(group_ids))
    return advantages, sorted(masked), metrics


def episode_metrics(summaries: list[dict], prefix: str) -> dict[str, float]:
    """Per environment: success rate, return, turns, invalid-action rate, endings and turn finishes."""
    metrics = {}
    for env in dict.fromkeys(s["env"] for s in summaries):
        mine = [s for s in summaries if s["env"] == env]
        n, turns = len(mine), sum(s["turns"] for s in mine)
        tag = f"{prefix}/{env}"
        metrics.update({f"{tag}/success_rate": sum(s["success"] for s in mine) / n,
                        f"{tag}/return_mean": sum(sum(s["step_rewards"]) for s in mine) / n,
                        f"{tag}/turns_mean": turns / n,
                        f"{tag}/invalid_action_rate": sum(s["invalid"] for s in mine) / max(turns, 1)})
        endings = Counter(s["ending"] for s in mine)
        metrics.update({f"{tag}/ending/{name}": endings.get(name, 0) / n
                        for name in ENDINGS})
        finishes = Counter()
        for s in mine:
            finishes.update(s["finishes"])
        metrics.update({f"{tag}/turn_finish/{name}": finishes.get(name, 0) / max(turns, 1)
                        for name in ("stop", "length", "context")})
    return metrics


def check_errors(config: Config, summaries: list[dict], step: int) -> None:
    """Fail the step when more than ``agentic.max_error_rate`` of its episodes ended in error."""
    errors = [s for s in summaries if s["ending"] == "error"]
    if summaries and len(errors) / len(summaries) > config.agentic.max_error_rate:
        raise RuntimeError(f"step {step}: {len(errors)} of {len(summaries)} episodes ended in error, over "
                           f"agentic.max_error_rate {config.agentic.max_error_rate}; first: {errors[0]['error']}")


def sample_rows(summaries: list[dict]) -> list[dict]:
    """The episodes with transcripts as a sample table: one row per episode, the turns as text."""
    rows = []
    for s in summaries:
        if "transcript" in s:
            text = "\n".join(f"[{t['role']}] {t['text']}" for t in s["transcript"])
            rows.append({"env": s["env"], "env_seed": s["env_seed"], "return": sum(s["step_rewards"]),
                         "success": s["success"], "ending": s["ending"], "transcript": text})
    return rows


def episodes(config: Config, engines, specs: list[EpisodeSpec], temperature: float | None = None,
             transcripts: int = 0) -> tuple[object, object, list[dict]]:
    """``run_episodes`` of ``specs`` on the run's engines: ``(rollouts_ref, returns_ref, summaries)``."""
    return run_episodes(engines.env_workers, engines.rollouts, engines.reward_worker, quote(specs),
                        config.agentic.runner, config.rollout.timeout_s, temperature, transcripts)


def agentic_batch(config: Config, engines, positions: dict[str, int], step: int):
    """Step ``step``'s episodes as a ``ScoredBatch`` (``flows/rlvr.py``) whose ``agentic`` entry holds the
    step advantages and masked rows for ``compute_advantages``."""
    metrics: dict[str, float] = {}
    sampled = bool(config.tracking.sample_every) and step % config.tracking.sample_every == 0
    with timed(metrics, "time/rollout"):
        rollouts_ref, returns_ref, summaries = episodes(config, engines, training_specs(config, step),
                                                        transcripts=config.tracking.num_samples if sampled else 0)
    return episode_batch(config, rollouts_ref, returns_ref, summaries, positions, metrics, step)


def episode_batch(config: Config, rollouts_ref, returns_ref, summaries: list[dict], positions: dict[str, int],
                  metrics: dict[str, float], step: int):
    """The episodes ``summaries`` (their rows in ``rollouts_ref``/``returns_ref``) as step ``step``'s
    ``ScoredBatch``, advantages and episode metrics computed (added to ``metrics``)."""
    from tasks.score import ScoredBatch

    check_errors(config, summaries, step)
    advantages, masked, advantage_metrics = agentic_advantages(config, summaries)
    metrics.update(episode_metrics(summaries, "agentic"))
    metrics.update(advantage_metrics)
    returns = [sum(s["step_rewards"]) for s in summaries]
    metrics["reward/mean"] = sum(returns) / max(len(returns), 1)
    metrics["agentic/masked_frac"] = len(masked) / max(len(summaries), 1)
    return ScoredBatch(rollouts_ref, returns_ref, [s["group"] for s in summaries], [""] * len(summaries),
                       {"env": [s["env"] for s in summaries]}, dict(positions), metrics,
                       agentic={"step_advantages": advantages, "masked_rows": masked}, samples=sample_rows(summaries))


def agentic_eval(config: Config, engines) -> tuple[float, dict[str, float], list[dict]]:
    """Success rate over the held-out seeds at ``eval.temperature`` (0: greedy), the per-environment metrics,
    sample episodes."""
    _, _, summaries = episodes(config, engines, eval_specs(config), temperature=config.eval.temperature,
                               transcripts=config.tracking.num_samples)
    success = sum(s["success"] for s in summaries) / max(len(summaries), 1)
    return success, episode_metrics(summaries, "eval"), sample_rows(summaries)
