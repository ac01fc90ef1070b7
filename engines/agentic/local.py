"""Local rollout debugging (``rollflow rollout``): run episodes in this process, without Ray or Prefect,
show each turn with the model's tokens and the environment's told apart, dump episodes as jsonl and
replay a dump (the recorded action tokens against fresh environments with the recorded seeds, checking
that the environment answers the same)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Callable, Iterable

from engines import environments
from engines.agentic.chat import TurnRenderer, check_append_only
from engines.agentic.policies import human_policy, random_policy, scripted_policy
from engines.agentic.rollout import EnginePolicy, Episode, EpisodeSpec, Generation, RolloutSettings, Runner

MODEL, ENV = "\033[1;32m", "\033[2m"  # bold green: the model's tokens; dim: prompt, template and observations
RESET = "\033[0m"


def build_policy(name: str, tokenizer, settings: RolloutSettings, ask: Callable[[str], str] = input):
    """``random``, ``scripted``, ``human`` or ``hf:PATH`` (a local HF model on the HF rollout engine)."""
    if name.startswith("hf:"):
        from engines.inference.hf import HFInferenceEngine

        return EnginePolicy(HFInferenceEngine(name[3:]), settings)
    policies = {"random": random_policy, "scripted": scripted_policy,
                "human": lambda tok: human_policy(tok, ask)}
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}; use random, scripted, human or hf:PATH")
    return policies[name](tokenizer)


def debug_tokenizer(env_id: str, options: dict, system_prompt: bool = False):
    """A tokenizer for text policies without a model: byte-level BPE trained on random episodes of the env
    (with its instructions when they are shown: a byte the tokenizer never saw has no token)."""
    from engines.agentic.warm_start import environment_texts
    from engines.models import train_tokenizer

    return train_tokenizer(environment_texts(env_id, options, 50, seed=0, max_turns=8, system=system_prompt), 128)


def run_local(env_id: str, options: dict, policy, tokenizer, settings: RolloutSettings, episodes: int, seed: int,
              system_prompt: bool = False) -> list[Episode]:
    """``episodes`` episodes with environment seeds ``seed``, ``seed + 1``, …, one after another."""
    system = environments.instructions(env_id, **options) if system_prompt else None
    renderer = TurnRenderer(tokenizer, system)
    check_append_only(renderer)
    runner = Runner(policy, renderer, settings, lambda spec: environments.make(spec.env_id, **options),
                    environments.state_key)
    specs = [EpisodeSpec(env_id, seed + i, i, i, sample_seed=seed + i) for i in range(episodes)]
    return runner.run_serial(specs)


def _tokens(tokenizer, ids: Iterable[int]) -> str:
    return "".join(tokenizer.decode([t]) for t in ids)


def render(episode: Episode, tokenizer, color: bool = True) -> str:
    """The episode as text: the model's tokens in green (``color``) or between ``⟦ ⟧``, the rest dim or plain;
    each turn's finish, reward and validity after it."""
    model = (lambda s: f"{MODEL}{s}{RESET}") if color else (lambda s: f"⟦{s}⟧")  # noqa: E731
    other = (lambda s: f"{ENV}{s}{RESET}") if color else (lambda s: s)  # noqa: E731
    spec = episode.spec
    lines = [f"── episode {spec.index}: {spec.env_id} seed {spec.env_seed}",
             other(_tokens(tokenizer, episode.prompt_ids).rstrip("\n"))]
    for k, turn in enumerate(episode.turns):
        lines.append(model(_tokens(tokenizer, turn.action_ids)) + other(_tokens(tokenizer, turn.next_ids).rstrip("\n")))
        lines.append(f"   turn {k}: {len(turn.action_ids)} model tokens, finish {turn.finish}, reward {turn.reward:g}"
                     f"{'' if turn.valid else ', invalid action'}; env: {turn.observation!r}")
    lines.append(f"── {episode.ending}{' (success)' if episode.success else ''}, return {episode.episode_return:g}"
                 + (f", error: {episode.error}" if episode.error else ""))
    return "\n".join(lines)


def to_record(episode: Episode) -> dict:
    """One jsonl line: the spec, the first prompt's ids, and per turn the action ids, logprobs and answers."""
    return {"spec": asdict(episode.spec), "prompt_ids": episode.prompt_ids, "first_observation": episode.first_observation,
            "turns": [asdict(turn) for turn in episode.turns], "ending": episode.ending, "success": episode.success,
            "error": episode.error}


def dump(episodes: list[Episode], path: str) -> None:
    with open(path, "w") as out:
        for episode in episodes:
            out.write(json.dumps(to_record(episode)) + "\n")


def load(path: str) -> list[dict]:
    with open(path) as src:
        return [json.loads(line) for line in src if line.strip()]


class ReplayPolicy:
    """Hands back the recorded action of each (episode, turn), found by the request's sampling seed."""

    def __init__(self, records: list[dict], tokenizer):
        self.actions: dict[int, Generation] = {}
        for record in records:
            spec = EpisodeSpec(**record["spec"])
            for k, turn in enumerate(record["turns"]):
                self.actions[spec.request_seed(k)] = Generation(turn["action_ids"], turn["logprobs"], "stop"
                                                                if turn["finish"] == "stop" else "length", turn["text"])

    def generate(self, requests) -> list[Generation]:
        return [self.actions[r.seed] for r in requests]


def replay(records: list[dict], tokenizer, settings: RolloutSettings, options: dict | None = None,
           system_prompt: bool = False) -> tuple[list[Episode], list[str]]:
    """Rerun the recorded episodes with their recorded actions; ``(episodes, differences)``, one line per
    turn whose observation, reward or tokens differ from the record (none: the dump replays exactly)."""
    specs = [EpisodeSpec(**r["spec"]) for r in records]
    env_id = specs[0].env_id if specs else ""
    system = environments.instructions(env_id, **(options or {})) if system_prompt and specs else None
    runner = Runner(ReplayPolicy(records, tokenizer), TurnRenderer(tokenizer, system), settings,
                    lambda spec: environments.make(spec.env_id, **{**(options or {}), **spec.options}),
                    environments.state_key)
    episodes = runner.run_serial(specs)
    differences = []
    for record, episode in zip(records, episodes):
        if record["prompt_ids"] != episode.prompt_ids:
            differences.append(f"episode {episode.spec.index}: first prompt tokens differ")
        for k, (old, new) in enumerate(zip(record["turns"], episode.turns)):
            for key in ("observation", "reward", "next_ids", "valid"):
                if old[key] != asdict(new)[key]:
                    differences.append(f"episode {episode.spec.index} turn {k}: {key} {old[key]!r} -> {asdict(new)[key]!r}")
        if len(record["turns"]) != len(episode.turns) or record["ending"] != episode.ending:
            differences.append(f"episode {episode.spec.index}: {len(record['turns'])} turns, {record['ending']} -> "
                               f"{len(episode.turns)} turns, {episode.ending}")
    return episodes, differences


__all__ = ["build_policy", "debug_tokenizer", "dump", "load", "render", "replay", "run_local"]
