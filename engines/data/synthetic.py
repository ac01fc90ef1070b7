"""Seeded toy chat tasks for the SFT and preference learning tests, built offline with a tiny vocabulary.

The task: the user turn is 3 to 5 letters from ``a``-``f`` separated by spaces (``"a c f"``), and the
assistant answers the same letters reversed (``"f c a"``); half the rows open with a system turn that
states the task. Letters are space-separated so byte-level BPE keeps one token per letter and the answer
is a copy of the question's tokens in reverse order, which a 4-layer, 128-wide model learns.
"""

from __future__ import annotations

import random

from engines.data.chat import plain_render
from engines.models import EOS_TOKEN

LETTERS = "abcdef"
SYSTEM = "Reverse the letters."


def _question(rng: random.Random) -> list[str]:
    return [rng.choice(LETTERS) for _ in range(rng.randint(3, 5))]


def _prompt(rng: random.Random, letters: list[str]) -> list[dict]:
    system = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    return system + [{"role": "user", "content": " ".join(letters)}]


def _wrong(rng: random.Random, letters: list[str]) -> list[str]:
    """A plausible wrong answer: the letters copied in their original order, or, when that is the right
    answer (a palindrome), the reversed letters with one letter changed."""
    if letters != letters[::-1]:
        return list(letters)
    answer = letters[::-1]
    k = rng.randrange(len(answer))
    return answer[:k] + [rng.choice([c for c in LETTERS if c != answer[k]])] + answer[k + 1:]


def sft_task(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"messages": [system?, user, assistant]}``, the assistant's answer the letters reversed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        letters = _question(rng)
        answer = {"role": "assistant", "content": " ".join(letters[::-1])}
        rows.append({"messages": _prompt(rng, letters) + [answer]})
    return rows


def preference_task(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt", "chosen", "rejected"}``: chosen the reversed letters, rejected a plausible wrong
    answer (``_wrong``); every fourth row in implicit-prompt form ``{"chosen", "rejected"}`` (the prompt
    messages repeated on both sides)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        letters = _question(rng)
        prompt = _prompt(rng, letters)
        chosen = [{"role": "assistant", "content": " ".join(letters[::-1])}]
        rejected = [{"role": "assistant", "content": " ".join(_wrong(rng, letters))}]
        if i % 4 == 3:
            rows.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def texts_for_tokenizer(rows: list[dict]) -> list[str]:
    """Every text the plain turn format renders for ``rows`` (SFT or preference, any form), split at the EOS
    token (a special token of the tiny tokenizer, so never part of the trained text); the generation prompt
    is in them as the head of every assistant turn."""
    texts = []
    for row in rows:
        for key in ("messages", "prompt", "completion", "chosen", "rejected"):
            value = row.get(key)
            if isinstance(value, str):
                texts.append(value)
            elif value:
                texts.extend(t for t in plain_render(value, EOS_TOKEN).split(EOS_TOKEN) if t)
    return texts
