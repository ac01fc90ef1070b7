"""The environment worker: a Ray actor that runs many episodes against a rollout engine and returns them
as one multi-turn ``Rollouts`` batch, their returns, and a small summary per episode for the driver."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from engines import environments
from engines.agentic.chat import TurnRenderer, check_append_only
from engines.agentic.rollout import EnginePolicy, Episode, EpisodeSpec, RolloutSettings, Runner, to_rollouts


def transcript(episode: Episode, tokenizer) -> list[dict]:
    """The episode as turns for a sample table: each observation and action text, the action's token count."""
    rows = [{"role": "env", "text": episode.first_observation}]
    for turn in episode.turns:
        rows.append({"role": "model", "text": tokenizer.decode(turn.action_ids), "tokens": len(turn.action_ids),
                     "finish": turn.finish, "valid": turn.valid})
        rows.append({"role": "env", "text": turn.observation, "reward": turn.reward})
    return rows


def summarize_episode(episode: Episode) -> dict:
    """What the driver needs of an episode: rewards and anchor states per step, how it ended, counts."""
    return {"group": episode.spec.group, "env_seed": episode.spec.env_seed, "env": episode.spec.env_id,
            "step_rewards": episode.step_rewards, "state_keys": episode.state_keys, "ending": episode.ending,
            "success": episode.success, "error": episode.error, "turns": len(episode.turns),
            "invalid": sum(not t.valid for t in episode.turns),
            "finishes": dict(Counter(t.finish for t in episode.turns)), "metrics": episode.metrics,
            "weights_version": min((t.weights_version for t in episode.turns), default=None)}  # its first action's


class EnvWorker:
    """Runs episodes of environment ``env_id`` (``engines.environments``) with a rollout engine's tokens.
    The chat template (or the plain format) is checked to be append-only when the worker starts."""

    def __init__(self, tokenizer_path: str, env_id: str, env_options: dict | None = None,
                 settings: RolloutSettings = RolloutSettings(), system_prompt: bool = False) -> None:
        from engines.models import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self.env_id, self.env_options = env_id, dict(env_options or {})
        system = environments.instructions(env_id, **self.env_options) if system_prompt else None
        self.renderer = TurnRenderer(self.tokenizer, system)
        check_append_only(self.renderer)
        self.settings = dataclasses.replace(settings, stop_token_ids=settings.stop_token_ids
                                            or (self.tokenizer.eos_token_id,))

    def _make_env(self, spec: EpisodeSpec):
        return environments.make(spec.env_id, **{**self.env_options, **spec.options})

    def collect(self, specs: list[EpisodeSpec], engine, mode: str = "async", temperature: float | None = None,
                transcripts: int = 0):
        """Run ``specs`` with ``engine`` (a rollout engine or its actor handle) by runner ``mode``; greedy or
        another temperature when ``temperature`` is given. Returns ``(rollouts, returns [B], summaries)``,
        with the transcripts of the first ``transcripts`` episodes in their summaries."""
        settings = self.settings if temperature is None else dataclasses.replace(self.settings, temperature=temperature)
        policy = EnginePolicy(engine, settings)
        episodes = Runner(policy, self.renderer, settings, self._make_env, environments.state_key).run(specs, mode)
        summaries = [summarize_episode(e) for e in episodes]
        for summary, episode in zip(summaries[:transcripts], episodes):
            summary["transcript"] = transcript(episode, self.tokenizer)
        returns = torch.tensor([e.episode_return for e in episodes], dtype=torch.float32)
        return to_rollouts(episodes, self.tokenizer.pad_token_id, policy.weights_version), returns, summaries
