"""Dialog environments: ``GuessTheNumber-v0``, a one-turn ``Bandit-v0`` and the ``Calculator-v0`` tool env."""

from __future__ import annotations

import ast
import operator
import random
import re
import string
from fractions import Fraction
from typing import Any

from engines.environments.common import check_running, parse_choice, register, step_info

INTEGER = re.compile(r"-?[0-9]{1,18}")
"""An integer action: at most 18 digits, so a 10 kB digit string is invalid text, not a slow ``int``."""


@register("GuessTheNumber-v0")
class GuessTheNumber:
    """Guess a secret integer in ``[low, high]``; the state lives in the dialog history.

    Observation: ``1-16?`` at reset; after a guess only ``higher`` (the secret is larger), ``lower`` or
    ``correct``, or with ``echo`` the guess and its answer, ``8 higher`` (as TextArena's "Your guess of 8 is
    lower"): either way the bounds are for the policy to gather from the dialog. Action: an integer in
    range, e.g. ``8``; anything else (out of range, ``8.0``, ``eight``) is invalid and answered ``invalid``.
    ``reset(seed)`` draws the secret. ``correct``: reward 1.0, terminated, success; other guesses: reward
    0.0. ``state_key`` is what the guesses told, order and repeats aside: ``1-16?`` then ``guess:feedback``
    pairs sorted by guess, e.g. ``1-16? 4:higher 8:lower``. The oracle bisects what is still possible: at
    most ``ceil(log2(high - low + 2))`` guesses (5 for 1-16). ``metrics``: ``guesses`` (valid guesses so far).
    """

    instructions = "Guess the number. Answer an integer."

    def __init__(self, *, low: int = 1, high: int = 16, echo: bool = False, format_penalty: float = -0.1) -> None:
        if low > high:
            raise ValueError(f"GuessTheNumber-v0: low must be at most high, got low={low}, high={high}")
        self.low, self.high, self.echo, self.format_penalty = low, high, echo, format_penalty
        self._secret: int | None = None
        self._history: list[tuple[int, str]] = []
        self._done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._secret = random.Random(seed).randint(self.low, self.high)
        self._history, self._done = [], False
        return f"{self.low}-{self.high}?", step_info(guesses=0)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_running(self, self._done, started=self._secret is not None)
        guess = self._parse(action_text)
        if guess is None:
            return "invalid", self.format_penalty, False, False, step_info(valid=False, guesses=len(self._history))
        feedback = "higher" if guess < self._secret else "lower" if guess > self._secret else "correct"
        self._history.append((guess, feedback))
        self._done = feedback == "correct"
        observation = f"{guess} {feedback}" if self.echo else feedback
        info = step_info(success=self._done, guesses=len(self._history))
        return observation, float(self._done), self._done, False, info

    def close(self) -> None:
        """Nothing to release."""

    def state_key(self) -> str:
        return " ".join([f"{self.low}-{self.high}?"] + [f"{g}:{fb}" for g, fb in sorted(set(self._history))])

    def valid_actions(self) -> list[str]:
        return [str(n) for n in range(self.low, self.high + 1)]

    def scripted_action(self) -> str:
        low, high = self.low, self.high
        for guess, feedback in self._history:
            if feedback == "higher":
                low = max(low, guess + 1)
            elif feedback == "lower":
                high = min(high, guess - 1)
        return str((low + high) // 2)

    def _parse(self, action_text: Any) -> int | None:
        text = action_text.strip() if isinstance(action_text, str) else ""
        if not INTEGER.fullmatch(text):
            return None
        guess = int(text)
        return guess if self.low <= guess <= self.high else None


@register("Bandit-v0")
class Bandit:
    """A one-turn bandit: pick one of ``arms`` arms labelled ``A``, ``B``, ...; the episode ends on any valid pick.

    Observation: the labels and ``?``, e.g. ``A B C D?``. ``reset(seed)`` draws the one arm that pays 1.0;
    every other arm pays 0.0, so the reward depends only on the pick and a batch of one-turn episodes is
    single-turn GRPO with the reward "picked the paying arm". A pick is answered ``correct`` (it paid,
    success) or ``wrong``. Invalid text (reward ``format_penalty``) gets the question back and the episode
    goes on. The oracle picks the paying arm (one step).
    """

    instructions = "Pick one arm. Answer its letter."

    def __init__(self, *, arms: int = 4, format_penalty: float = -0.1) -> None:
        if not 2 <= arms <= 26:
            raise ValueError(f"Bandit-v0: arms must be in [2, 26], got {arms}")
        self.arms, self.format_penalty = arms, format_penalty
        self.labels = tuple(string.ascii_uppercase[:arms])
        self._paying: str | None = None
        self._done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._paying = random.Random(seed).choice(self.labels)
        self._done = False
        return self._question(), step_info()

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_running(self, self._done, started=self._paying is not None)
        pick = parse_choice(action_text, self.labels)
        if pick is None:
            return self._question(), self.format_penalty, False, False, step_info(valid=False)
        self._done = True
        paid = pick == self._paying
        return ("correct" if paid else "wrong"), float(paid), True, False, step_info(success=paid)

    def close(self) -> None:
        """Nothing to release."""

    def state_key(self) -> str:
        return self._question() if not self._done else "done"

    def valid_actions(self) -> list[str]:
        return list(self.labels)

    def scripted_action(self) -> str:
        return self._paying or self.labels[0]

    def _question(self) -> str:
        return " ".join(self.labels) + "?"


CALC = re.compile(r"<calc>(.*)</calc>", re.IGNORECASE | re.DOTALL)
ANSWER = re.compile(r"<answer>(.*)</answer>", re.IGNORECASE | re.DOTALL)
MAX_EXPRESSION_CHARS = 64
"""A longer ``<calc>`` expression is invalid: it bounds the parser's work and the numbers' size."""
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> Fraction | None:
    """The exact value of ``expression`` (numbers, ``+ - * /``, unary ``-``/``+``, parentheses), else ``None``.

    Parsed with ``ast`` and walked node by node (never ``eval``): names, calls, ``**`` and the rest are
    refused, as are division by zero and expressions over ``MAX_EXPRESSION_CHARS``.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        return _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
        return None


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))  # from the text, so 0.1 is exactly 1/10
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
    raise ValueError(f"not allowed in a calculation: {type(node).__name__}")


def format_value(value: Fraction) -> str:
    """An integer as itself (``91``), anything else rounded half-even to 4 decimals (``7/3`` → ``2.3333``)."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10_000)
    sign, digits = "-" if scaled < 0 else "", f"{abs(scaled):05d}"
    return f"{sign}{digits[:-4]}.{digits[-4:]}".rstrip("0").rstrip(".")


@register("Calculator-v0")
class Calculator:
    """Answer an arithmetic question, with a calculator tool for up to ``max_tool_uses`` calls.

    Observation at reset: the question ``a*b+c=?`` or ``a*b-c=?`` (operands drawn in ``[1,
    max_operand]``, then the sign), e.g. ``7*13+4=?``. Actions: ``<calc>EXPR</calc>`` answers with EXPR's
    value (``calculate``, shown by ``format_value``, e.g. ``95``), reward 0.0; ``<answer>N</answer>`` (an
    integer) ends the episode with ``correct`` and reward 1.0 (success) or ``wrong`` and reward 0.0.
    Invalid (reward ``format_penalty``, observation ``invalid``): other text, a calc that does not
    evaluate; a calc past ``max_tool_uses`` is invalid too, observed as ``limit reached``. ``metrics``:
    ``tool_uses``. The oracle calls the tool on the question, then answers: 2 steps (1 with no tool).
    """

    instructions = "Answer <answer>N</answer>. <calc>EXPR</calc> computes EXPR."

    def __init__(self, *, max_tool_uses: int = 3, max_operand: int = 20, format_penalty: float = -0.1) -> None:
        if max_tool_uses < 0 or max_operand < 1:
            raise ValueError(
                f"Calculator-v0: needs max_tool_uses >= 0 and max_operand >= 1, got {max_tool_uses}, {max_operand}"
            )
        self.max_tool_uses, self.max_operand, self.format_penalty = max_tool_uses, max_operand, format_penalty
        self._expression = ""
        self._answer = 0
        self._tool_uses = 0
        self._done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        a, b, c = (rng.randint(1, self.max_operand) for _ in range(3))
        sign = rng.choice("+-")
        self._expression = f"{a}*{b}{sign}{c}"
        self._answer = a * b + c if sign == "+" else a * b - c
        self._tool_uses, self._done = 0, False
        return f"{self._expression}=?", step_info(tool_uses=0)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_running(self, self._done, started=bool(self._expression))
        text = action_text.strip() if isinstance(action_text, str) else ""
        if (call := CALC.fullmatch(text)) is not None:
            if self._tool_uses >= self.max_tool_uses:
                return self._invalid("limit reached")
            value = calculate(call.group(1))
            if value is None:
                return self._invalid("invalid")
            self._tool_uses += 1
            return format_value(value), 0.0, False, False, step_info(tool_uses=self._tool_uses)
        answer = ANSWER.fullmatch(text)
        if answer is None or not INTEGER.fullmatch(answer.group(1).strip()):
            return self._invalid("invalid")
        self._done = True
        correct = int(answer.group(1)) == self._answer
        info = step_info(success=correct, tool_uses=self._tool_uses)
        return ("correct" if correct else "wrong"), float(correct), True, False, info

    def close(self) -> None:
        """Nothing to release."""

    def state_key(self) -> str:
        """The question and the tool calls made (the values they showed change nothing the env holds)."""
        return f"{self._expression}=? {self._tool_uses}" + (" done" if self._done else "")

    def valid_actions(self) -> list[str]:
        """A finite sample: the calc of the question while calls remain, and every answer a question can have."""
        calls = [f"<calc>{self._expression}</calc>"] if self._tool_uses < self.max_tool_uses else []
        top = self.max_operand
        return calls + [f"<answer>{n}</answer>" for n in range(1 - top, top * top + top + 1)]

    def scripted_action(self) -> str:
        if self._tool_uses == 0 and self.max_tool_uses > 0:
            return f"<calc>{self._expression}</calc>"
        return f"<answer>{self._answer}</answer>"

    def _invalid(self, observation: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return observation, self.format_penalty, False, False, step_info(valid=False, tool_uses=self._tool_uses)
