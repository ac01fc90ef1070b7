"""Text policies for local debugging and tests: they pick an action's text from the environment itself
(``random``: a valid action drawn with the request's seed, ``scripted``: the environment's oracle,
``human``: typed in), and hand it back as tokens the way an engine would (the text, then EOS), so the
same rollout code, masks and checks run with or without a model."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from engines.agentic.rollout import Generation, Request


@dataclass
class TextPolicy:
    """``choose(env, rng) -> action text`` as a ``Policy``; ``rng`` is seeded by the request's seed."""

    tokenizer: Any
    choose: Callable[[Any, random.Random], str]

    def generate(self, requests: list[Request]) -> list[Generation]:
        out = []
        for request in requests:
            text = self.choose(request.env, random.Random(request.seed))
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: max(request.max_new_tokens - 1, 0)]
            ids.append(self.tokenizer.eos_token_id)
            out.append(Generation(ids, [0.0] * len(ids), "stop", self.tokenizer.decode(ids[:-1])))
        return out


def random_policy(tokenizer) -> TextPolicy:
    return TextPolicy(tokenizer, lambda env, rng: rng.choice(env.valid_actions()))


def scripted_policy(tokenizer) -> TextPolicy:
    return TextPolicy(tokenizer, lambda env, rng: env.scripted_action())


def human_policy(tokenizer, ask: Callable[[str], str] = input) -> TextPolicy:
    return TextPolicy(tokenizer, lambda env, rng: ask("action> "))
