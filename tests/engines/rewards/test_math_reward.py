import doctest
import threading
import time

import pytest

import engines.rewards.math as math_module
from engines.rewards import REWARDS, get_reward, reward_names
from engines.rewards.math import math_reward

# (completion, answer, expected reward) — the comment says why.
TABLE = [
    ("4", "4", 1.0),  # plain integers, equal: fast path
    ("5", "4", 0.0),  # plain integers, different: fast path
    (" 4\n", "4", 1.0),  # surrounding whitespace is stripped before the fast path
    ("007", "7", 1.0),  # leading zeros: the same integer
    ("-0", "0", 1.0),  # minus zero is zero
    ("-3", "-3", 1.0),  # negative integers compare by value
    ("3", "-3", 0.0),  # the sign matters
    ("The answer is 12", "12", 1.0),  # math-verify finds 12 in prose
    ("The answer is 12.", "12", 1.0),  # a sentence-final period is not a decimal point
    ("\\boxed{12}", "12", 1.0),  # boxed answer
    ("so \\boxed{12} and later 13", "12", 1.0),  # the boxed answer wins over a later number
    ("12.0", "12", 1.0),  # 12.0 equals 12 numerically
    ("12.5", "12", 0.0),  # 12.5 is not 12
    ("$\\frac{1}{2}$", "0.5", 1.0),  # a fraction equals its decimal
    ("0.5", "\\frac{1}{2}", 1.0),  # and the other way round
    ("I think 11, no, 12", "12", 1.0),  # the last number is the answer
    ("12 or 13", "12", 0.0),  # the last number, 13, is wrong
    ("3+4=7", "7", 1.0),  # an equation's right-hand side is the answer
    ("1,000", "1000", 1.0),  # thousands separator
    ("garbage", "12", 0.0),  # nothing to parse and no integer for the fallback
    ("", "12", 0.0),  # empty completion
    ("twelve", "12", 0.0),  # number words are not parsed
    ("9^9^9", "9", 0.0),  # 9^(9^9) has ~3.7e8 digits: refused before verify, no credit for the trailing 9
    ("2**2**2**2**2**2", "12", 0.0),  # a power tower: refused rather than evaluated
    ("1" * 5000, "1" * 5000, 1.0),  # 5000-digit integers: past int()'s 4300-digit limit, compared as digits
]


@pytest.mark.parametrize(("completion", "answer", "expected"), TABLE)
def test_reward_table(completion, answer, expected):
    assert math_reward(["Q"], [completion], answer=[answer]) == [expected]


def test_batch_keeps_order_and_ignores_extra_columns():
    completions = [row[0] for row in TABLE]
    answers = [row[1] for row in TABLE]
    got = math_reward(["Q"] * len(TABLE), completions, answer=answers, level=[1] * len(TABLE))
    assert got == [row[2] for row in TABLE]


def test_runs_off_the_main_thread():
    # math-verify's default timeouts call signal.alarm, which raises ValueError off the main thread;
    # these completions all go through math-verify (not the integer fast path).
    results, errors = [], []

    def work():
        try:
            results.append(
                math_reward(
                    ["Q"] * 4,
                    ["The answer is 12", "\\boxed{12}", "12.0", "The answer is 13"],
                    answer=["12"] * 4,
                )
            )
        except BaseException as exc:  # surfaced below: a thread's exception is otherwise lost
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert errors == []
    assert results == [[1.0, 1.0, 1.0, 0.0]]


def test_power_tower_does_not_hang():
    # Without the size guard verify(9^9^9^9) never returns; run it in a thread so a regression fails
    # this test instead of hanging the suite.
    results = []
    thread = threading.Thread(target=lambda: results.append(math_reward(["Q"], ["9^9^9^9"], answer=["12"])))
    start = time.perf_counter()
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "math_reward hung on a power tower"
    assert results == [[0.0]]
    assert time.perf_counter() - start < 5


def test_fallback_when_math_verify_raises(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("parser broke")

    monkeypatch.setattr(math_module.math_verify, "parse", broken)
    # The last integer in each completion against int(answer): 12 == 12, 13 != 12, none found, and a
    # non-integer reference cannot be compared.
    got = math_reward(
        ["Q"] * 4,
        ["The answer is 12", "12 or 13", "no digits", "The answer is 1/2"],
        answer=["12", "12", "12", "\\frac{1}{2}"],
    )
    assert got == [1.0, 0.0, 0.0, 0.0]


def test_fallback_when_math_verify_finds_nothing(monkeypatch):
    monkeypatch.setattr(math_module.math_verify, "parse", lambda *args, **kwargs: [])
    assert math_reward(["Q", "Q"], ["The answer is -5", "-6"], answer=["-5", "-5"]) == [1.0, 0.0]


def test_misaligned_lists():
    with pytest.raises(ValueError, match="1 prompts, 2 completions and 1 answers"):
        math_reward(["Q"], ["1", "2"], answer=["1"])


def test_registry():
    assert "math" in reward_names()
    assert get_reward("math") is math_reward
    with pytest.raises(KeyError, match="unknown reward function 'nope'; registered: .*math"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        REWARDS.register("math")(lambda prompts, completions, **columns: [0.0] * len(prompts))


def test_docstring_examples():
    result = doctest.testmod(math_module)
    assert result.attempted > 0 and result.failed == 0


def test_warm_up_scores_each_first_use_path_once():
    """Rows: answers 12, 0.5, \\frac{1}{2}; in each, WARM_UP_COMPLETIONS in order (``12+3`` is 15, not 12;
    ``12 =`` ends in 12; a fraction and its decimal are equal both ways)."""
    assert math_module.WARM_UP_COMPLETIONS == ("12+3", "\\frac{1}{2}", "\\boxed{4}", "3/4", "1 + 2 = 3", "x^2", "0.5", "12 =")
    assert math_module.warm_up() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0,
                                     0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0,
                                     0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_warm_up_runs_each_named_reward_that_has_one(monkeypatch):
    from engines.rewards import WARM_UPS, warm_up

    calls = []
    monkeypatch.setitem(WARM_UPS, "math", lambda: calls.append("math"))
    assert warm_up(["think_answer_format", "math", "math"]) == ["math"]  # the format reward has none; a name twice runs once
    assert calls == ["math"]
    with pytest.raises(KeyError, match="unknown reward function 'maths'; registered: .*math"):
        warm_up(["maths"])
