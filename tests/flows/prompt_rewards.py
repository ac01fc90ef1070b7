"""A reward of the tests' own, named by import path (``tests.flows.prompt_rewards:prompt_holds_its_answer``):
imported by the reward workers from the driver's working directory, as a user's reward would be."""

from __future__ import annotations

import re


def prompt_holds_its_answer(prompts: list[str], completions: list[str], *, answer: list[str]) -> list[float]:
    """1.0 where the sum the prompt asks for (``"12+7="``) is the row's own ``answer``, else 0.0: it ignores the
    completion, so every sample scores 1.0 exactly when it is scored with its own prompt."""
    sums = [sum(int(n) for n in re.findall(r"\d+", prompt)) for prompt in prompts]
    return [float(s == int(a)) for s, a in zip(sums, answer)]
