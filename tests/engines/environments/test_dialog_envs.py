"""GuessTheNumber-v0, Bandit-v0 and Calculator-v0: hand-worked transcripts, the safe calculator."""

from __future__ import annotations

from fractions import Fraction

import pytest

from engines.environments import make
from engines.environments.dialog import calculate, format_value

PENALTY = -0.1


def outcome(step):
    obs, reward, terminated, truncated, info = step
    return obs, reward, terminated, info["action_is_valid"], info["success"]


def test_guess_the_number_transcript():
    env = make("GuessTheNumber-v0")
    obs, info = env.reset(seed=0)
    assert obs == "1-16?" and env.state_key() == "1-16?"  # seed 0's secret is 13 (pinned by the steps below)
    assert [outcome(env.step(a)) for a in ["8", " 12 ", "14", "x", "17", "0x1", "13"]] == [
        ("higher", 0.0, False, True, False),  # 8 < 13
        ("higher", 0.0, False, True, False),  # 12 < 13
        ("lower", 0.0, False, True, False),  # 14 > 13
        ("invalid", PENALTY, False, False, False),
        ("invalid", PENALTY, False, False, False),  # out of range
        ("invalid", PENALTY, False, False, False),  # not a decimal integer
        ("correct", 1.0, True, True, True),
    ]


def test_guess_echo_puts_the_guess_before_its_answer():
    env = make("GuessTheNumber-v0", echo=True)
    env.reset(seed=0)  # secret 13
    assert [env.step(a)[0] for a in ["8", " 14", "x", "13"]] == ["8 higher", "14 lower", "invalid", "13 correct"]
    assert env.state_key() == "1-16? 8:higher 13:correct 14:lower"  # the same key as without echo


def test_guess_state_key_is_what_the_guesses_told():
    first, second = make("GuessTheNumber-v0"), make("GuessTheNumber-v0")
    first.reset(seed=0)
    second.reset(seed=0)
    for action in ["8", "14", "12"]:
        first.step(action)
    for action in ["14", "12", "8", "8"]:  # another order, and a repeat
        second.step(action)
    assert first.state_key() == second.state_key() == "1-16? 8:higher 12:higher 14:lower"


def test_guess_oracle_bisects():
    env = make("GuessTheNumber-v0")
    env.reset(seed=0)  # secret 13: 8 (1-16) higher, 12 (9-16) higher, 14 (13-16) lower, 13 (13-13)
    guesses = []
    while True:
        guesses.append(env.scripted_action())
        if env.step(guesses[-1])[2]:
            break
    assert guesses == ["8", "12", "14", "13"]


def test_bandit_pays_only_the_seeded_arm():
    # seed 0 pays D (pinned); any valid pick ends the episode, invalid text asks again
    rewards = {}
    for arm in "ABCD":
        env = make("Bandit-v0")
        assert env.reset(seed=0)[0] == "A B C D?"
        assert outcome(env.step("E")) == ("A B C D?", PENALTY, False, False, False)
        rewards[arm] = outcome(env.step(f" {arm.lower()} "))
    assert rewards == {
        "A": ("wrong", 0.0, True, True, False),
        "B": ("wrong", 0.0, True, True, False),
        "C": ("wrong", 0.0, True, True, False),
        "D": ("correct", 1.0, True, True, True),
    }


def test_calculator_transcript():
    env = make("Calculator-v0")
    obs, info = env.reset(seed=0)
    assert obs == "13*14-2=?" and info["metrics"] == {"tool_uses": 0.0}  # seed 0's question; answer 182-2=180
    steps = [env.step(a) for a in [
        "<calc>13*14</calc>",
        "<CALC> 182 - 2 </CALC>",
        "<calc>1/0</calc>",  # does not evaluate: invalid, not a tool use
        "<calc>__import__('os')</calc>",  # not arithmetic: invalid
        "<calc>7/3</calc>",
        "<calc>1+1</calc>",  # a fourth call: past max_tool_uses=3
        "<answer>18O</answer>",  # letter O: not an integer
        "<answer> 180 </answer>",
    ]]
    assert [outcome(s) for s in steps] == [
        ("182", 0.0, False, True, False),
        ("180", 0.0, False, True, False),
        ("invalid", PENALTY, False, False, False),
        ("invalid", PENALTY, False, False, False),
        ("2.3333", 0.0, False, True, False),
        ("limit reached", PENALTY, False, False, False),
        ("invalid", PENALTY, False, False, False),
        ("correct", 1.0, True, True, True),
    ]
    assert [s[4]["metrics"]["tool_uses"] for s in steps] == [1, 2, 2, 2, 3, 3, 3, 3]


def test_calculator_wrong_answer_ends_the_episode():
    env = make("Calculator-v0", max_tool_uses=0)
    env.reset(seed=0)
    assert outcome(env.step("<calc>1+1</calc>")) == ("limit reached", PENALTY, False, False, False)
    assert env.scripted_action() == "<answer>180</answer>"  # no tool: answer straight away
    assert outcome(env.step("<answer>-180</answer>")) == ("wrong", 0.0, True, True, False)


@pytest.mark.parametrize("expression, value", [
    ("2+3*4", Fraction(14)),  # precedence
    ("(2+3)*4", Fraction(20)),
    ("-3--2", Fraction(-1)),  # unary minus
    ("0.1+0.2", Fraction(3, 10)),  # exact: numbers are read from their text
    ("7/2", Fraction(7, 2)),
    ("2**3", None),  # power is not allowed
    ("abs(-1)", None),  # no calls or names
    ("1/0", None),
    ("1e999", None),  # infinity
    ("(" * 40 + "1" + ")" * 20, None),  # unbalanced
    ("1+" * 32 + "1", None),  # 65 characters: over MAX_EXPRESSION_CHARS
    ("", None),
])
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("value, text", [
    (Fraction(91), "91"),
    (Fraction(-4), "-4"),
    (Fraction(7, 3), "2.3333"),  # 2.33333... to 4 decimals
    (Fraction(-2, 3), "-0.6667"),  # -0.66666... rounds to -0.6667
    (Fraction(1, 2), "0.5"),  # trailing zeros dropped
    (Fraction(1, 100_000), "0"),  # rounds to zero
])
def test_format_value(value, text):
    assert format_value(value) == text
