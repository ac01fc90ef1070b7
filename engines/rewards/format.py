"""Format rewards: ``think_answer_format`` checks the ``<think>…</think><answer>…</answer>`` layout, and
``weighted`` adds up other registered rewards with weights; ``regex_match`` checks a completion against a
regular expression.

``think_answer_format`` is the format reward of DeepSeek-R1 (arXiv:2501.12948, section 2.2.2): 1.0
when the completion is a reasoning block followed by an answer block, else 0.0. ``strict=True`` (default)
allows nothing but whitespace around and between the blocks and no repeated or nested tags; with
``strict=False`` the two blocks may sit anywhere in the text, in that order. It checks the layout only:
``<think></think><answer></answer>`` scores 1.0, so pair it with a correctness reward through
``weighted``.

``weighted`` takes its components as one string, since reward options are scalars:
``components="math:0.8,think_answer_format:0.2"`` scores ``0.8 * math + 0.2 * think_answer_format``.
Every component gets the same prompts, completions, columns and the other options (so ``strict=False``
reaches ``think_answer_format``; components ignore options they don't take through their ``**_``).
Events of components that return ``Scored`` are added up by name. Components that are ``async def``
(an LLM judge) run concurrently on one event loop inside the call.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections import Counter
from typing import Any

from engines.rewards import REWARDS, Scored, get_reward

_TAG_NAME = re.compile(r"[A-Za-z][\w-]*")


@REWARDS.register("think_answer_format")
def think_answer_format(
    prompts: list[str],
    completions: list[str],
    *,
    think_tag: str = "think",  # name of the reasoning block's tag: <think>…</think>
    answer_tag: str = "answer",  # name of the answer block's tag: <answer>…</answer>
    strict: bool = True,  # True: only whitespace outside the two blocks, no repeated or nested tags
    **_: Any,
) -> list[float]:
    """1.0 per completion laid out as ``<think>…</think>`` then ``<answer>…</answer>``, else 0.0.

    >>> completions = ["<think>2+2</think>\\n<answer>4</answer>", "4", "ok <think>x</think><answer>4</answer>"]
    >>> think_answer_format(["Q"] * 3, completions)
    [1.0, 0.0, 0.0]
    >>> think_answer_format(["Q"], ["ok <think>x</think> so <answer>4</answer>"], strict=False)
    [1.0]
    """
    if len(prompts) != len(completions):
        raise ValueError(
            f"think_answer_format needs aligned lists; got {len(prompts)} prompts and {len(completions)} completions"
        )
    for option, tag in (("think_tag", think_tag), ("answer_tag", answer_tag)):
        if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
            raise ValueError(f"think_answer_format {option} must be a tag name like 'think', got {tag!r}")
    if think_tag == answer_tag:
        raise ValueError(f"think_answer_format think_tag and answer_tag are both {think_tag!r}; they must differ")
    if not strict:
        tags = (f"<{think_tag}>", f"</{think_tag}>", f"<{answer_tag}>", f"</{answer_tag}>")
        return [float(_in_order(completion, tags)) for completion in completions]
    pattern = _strict_layout(think_tag, answer_tag)
    return [float(pattern.fullmatch(completion) is not None) for completion in completions]


def _strict_layout(think: str, answer: str) -> re.Pattern[str]:
    t, a = re.escape(think), re.escape(answer)
    # Block contents may hold any text except one of the four tags (so no repeats and no nesting); that
    # leaves the match one way to go, so it runs in linear time.
    body = rf"(?:(?!</?(?:{t}|{a})>).)*"
    return re.compile(rf"\s*<{t}>{body}</{t}>\s*<{a}>{body}</{a}>\s*", re.DOTALL)


def _in_order(text: str, tags: tuple[str, ...]) -> bool:
    """Whether ``tags`` occur in ``text`` in this order, without overlapping (earliest match each, linear)."""
    position = 0
    for tag in tags:
        found = text.find(tag, position)
        if found < 0:
            return False
        position = found + len(tag)
    return True


@REWARDS.register("regex_match")
def regex_match(
    prompts: list[str],
    completions: list[str],
    *,
    pattern: str = r".+",  # a Python regular expression the whole stripped completion must match
    **_: Any,
) -> list[float]:
    """1.0 per completion whose text, stripped of surrounding whitespace, matches ``pattern`` in full
    (``re.fullmatch``), else 0.0: a format reward such as "a bare 1-2 digit number".

    >>> regex_match(["Q"] * 3, ["42", " 7 ", "4+2"], pattern=r"\\d{1,2}")
    [1.0, 1.0, 0.0]
    """
    if len(prompts) != len(completions):
        raise ValueError(f"regex_match needs aligned lists; got {len(prompts)} prompts and {len(completions)} completions")
    compiled = re.compile(pattern)
    return [1.0 if compiled.fullmatch(c.strip()) else 0.0 for c in completions]


@REWARDS.register("weighted")
def weighted(
    prompts: list[str],
    completions: list[str],
    *,
    components: str = "",  # "name:weight,name:weight", e.g. "math:0.8,think_answer_format:0.2"
    **columns_and_options: Any,
) -> Scored:
    """Weighted sum of the registered rewards named in ``components``, with their events added up.

    >>> weighted(["2+2="] * 2, ["<think>easy</think><answer>4</answer>", "4"], answer=["4", "4"],
    ...          components="math:0.8,think_answer_format:0.2")
    Scored(rewards=[1.0, 0.8], events={})
    """
    parts = parse_components(components)
    results = [get_reward(name)(prompts, completions, **columns_and_options) for name, _ in parts]
    pending = [i for i, result in enumerate(results) if inspect.isawaitable(result)]
    if pending:
        for i, value in zip(pending, asyncio.run(_gather([results[i] for i in pending]))):
            results[i] = value
    total = [0.0] * len(completions)
    events: Counter[str] = Counter()
    for (name, weight), result in zip(parts, results):
        scored = result if isinstance(result, Scored) else Scored(list(result))
        if len(scored.rewards) != len(completions):
            raise ValueError(f"weighted component {name!r} returned {len(scored.rewards)} rewards "
                             f"for {len(completions)} completions")
        total = [acc + weight * float(value) for acc, value in zip(total, scored.rewards)]
        events.update(scored.events)
    return Scored(total, dict(events))


def parse_components(spec: str) -> list[tuple[str, float]]:
    """``"math:0.8,think_answer_format:0.2"`` as ``[("math", 0.8), ("think_answer_format", 0.2)]``.

    ``ValueError`` naming the bad part for a malformed spec, a repeated or unknown reward name.

    >>> parse_components(" math:0.8 , think_answer_format:0.2 ")
    [('math', 0.8), ('think_answer_format', 0.2)]
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"weighted needs components='name:weight,…' (e.g. 'math:0.8,think_answer_format:0.2'), got {spec!r}"
        )
    parts: list[tuple[str, float]] = []
    for part in spec.split(","):
        name, sep, weight_text = (piece.strip() for piece in part.partition(":"))
        try:
            weight = float(weight_text) if sep and name else math.nan
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ValueError(f"weighted component {part.strip()!r} in {spec!r} is not 'name:weight' with a finite "
                             "number weight, e.g. 'math:0.8'")
        if name == "weighted":
            raise ValueError(f"weighted component {name!r} in {spec!r}: weighted cannot contain itself")
        if name not in REWARDS:
            raise ValueError(f"weighted component {name!r} in {spec!r} is not a registered reward; "
                             f"registered: {', '.join(REWARDS.names())}")
        if any(name == seen for seen, _ in parts):
            raise ValueError(f"weighted component {name!r} appears twice in {spec!r}; give it one weight")
        parts.append((name, weight))
    return parts


async def _gather(awaitables: list) -> list:
    return list(await asyncio.gather(*awaitables))
