"""``math``: 1.0 when a completion's final answer equals the reference answer, else 0.0.

Answers are compared with math-verify (``\\boxed{12}``, ``The answer is 12``, ``12.0``, ``\\frac{1}{2}``
and ``0.5`` all work), with a plain-integer fast path in front and a last-integer fallback behind.

math-verify's own timeouts use ``signal.alarm``, which fails off the main thread, and reward functions
run inside Ray actor threads, so both timeouts are off (``parsing_timeout=None``,
``timeout_seconds=None``; math-verify logs one warning about it). The danger a timeout guarded against
is sympy evaluating a huge number: ``verify`` on ``9^9^9`` never returns. ``_too_large`` bounds the
size of every parsed number before ``verify`` runs and scores 0.0 when one may exceed
``_MAX_DIGITS`` digits.

Cost: under a millisecond per item through math-verify, microseconds on the fast path, where the
stripped completion and the answer are both plain integers (the usual case on the arithmetic task).
math-verify and sympy build their parsers and simplifiers on first use, tens of milliseconds for each
kind of expression; ``warm_up`` (run by reward workers as they start) takes those paths once, so the
first training steps do not pay for them.
"""

from __future__ import annotations

import math
import re
from typing import Any

import math_verify
import sympy

from engines.rewards import REWARDS, WARM_UPS

_INT = re.compile(r"-?\d+", re.ASCII)
_MAX_DIGITS = 10_000  # parsed numbers above this many decimal digits are not handed to sympy


@REWARDS.register("math")
def math_reward(prompts: list[str], completions: list[str], *, answer: list[str], **_: Any) -> list[float]:
    """1.0 per completion whose final answer equals ``answer`` (math-verify), else 0.0.

    When math-verify extracts nothing from the completion or the answer (or raises), the last integer
    in the completion (``-?\\d+``) is compared with ``int(answer)``.

    >>> math_reward(["2+2=", "2+2=", "2+2="], ["4", "\\\\boxed{4}", "5"], answer=["4", "4", "4"])
    [1.0, 1.0, 0.0]
    >>> math_reward(["Q"], ["The answer is 12.0"], answer=["12"])
    [1.0]
    """
    if not len(prompts) == len(completions) == len(answer):
        raise ValueError(
            f"math_reward needs aligned lists; got {len(prompts)} prompts, {len(completions)} completions "
            f"and {len(answer)} answers"
        )
    gold_cache: dict[str, list] = {}  # a group of G completions shares one answer: parse it once
    return [_score(completion, str(ref), gold_cache) for completion, ref in zip(completions, answer)]


# Completions that take math-verify's slow first-use paths, each against integer, decimal and LaTeX answers.
WARM_UP_COMPLETIONS = ("12+3", "\\frac{1}{2}", "\\boxed{4}", "3/4", "1 + 2 = 3", "x^2", "0.5", "12 =")
WARM_UP_ANSWERS = ("12", "0.5", "\\frac{1}{2}")


def warm_up() -> list[float]:
    """Score every ``WARM_UP_COMPLETIONS`` x ``WARM_UP_ANSWERS`` pair once; returns the rewards."""
    pairs = [(completion, ref) for ref in WARM_UP_ANSWERS for completion in WARM_UP_COMPLETIONS]
    return math_reward([""] * len(pairs), [c for c, _ in pairs], answer=[r for _, r in pairs])


WARM_UPS["math"] = warm_up


def _score(completion: str, ref: str, gold_cache: dict[str, list]) -> float:
    text, ref = completion.strip(), ref.strip()
    if _INT.fullmatch(text) and _INT.fullmatch(ref):  # fast path: ~1 µs instead of ~1 ms
        return float(_int_key(text) == _int_key(ref))
    try:
        if ref not in gold_cache:
            gold_cache[ref] = math_verify.parse(ref, parsing_timeout=None)
        gold = gold_cache[ref]
        pred = math_verify.parse(completion, parsing_timeout=None)
        if gold and pred:
            if _too_large(gold) or _too_large(pred):  # e.g. 9^9^9: verify would never return
                return 0.0
            return float(math_verify.verify(gold, pred, timeout_seconds=None))
    except Exception:  # math-verify failing on odd text is the fallback's case, not an error
        pass
    return _last_int_equals(completion, ref)


def _last_int_equals(completion: str, ref: str) -> float:
    found = _INT.findall(completion)
    if not found or not _INT.fullmatch(ref):
        return 0.0
    return float(_int_key(found[-1]) == _int_key(ref))


def _int_key(digits: str) -> tuple[bool, str]:
    """``int(digits)`` as (negative, digits without leading zeros): ``int()`` refuses over 4300 digits."""
    magnitude = digits.lstrip("-").lstrip("0") or "0"
    return digits.startswith("-") and magnitude != "0", magnitude


def _too_large(parsed: list) -> bool:
    """Whether any sympy expression in a math-verify parse may hold a number over ``_MAX_DIGITS`` digits."""
    return any(_log10_bound(item) > _MAX_DIGITS for item in parsed if isinstance(item, sympy.Basic))


def _log10_bound(expr: sympy.Basic) -> float:
    """An upper bound on log10 of the largest magnitude ``expr`` can produce when sympy evaluates it.

    The parse is unevaluated (``9**(9**9)`` stays a tree), so walking it is cheap; ``inf`` means too big.
    """
    if isinstance(expr, sympy.Rational):  # Integer included; bit_length, since str() stops at 4300 digits
        return (abs(int(expr.p)).bit_length() + int(expr.q).bit_length()) * math.log10(2) + 1
    if isinstance(expr, sympy.Pow):
        base, exp = _log10_bound(expr.base), _log10_bound(expr.exp)
        if exp > math.log10(_MAX_DIGITS) + 1:  # exponent beyond ~10^5: even 2**exp is too big
            return math.inf
        return (10**exp) * max(base, 1.0)
    if isinstance(expr, sympy.factorial):
        n = _log10_bound(expr.args[0])
        return math.inf if n > 6 else (10**n) * n  # log10(n!) <= n * log10(n)
    # Sums and products add digits; other nodes are bounded by their arguments.
    return sum(_log10_bound(arg) for arg in expr.args) + 1
