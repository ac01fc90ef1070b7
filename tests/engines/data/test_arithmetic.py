import doctest
import random
import re

import pytest

import engines.data.arithmetic as arithmetic
from engines.data.arithmetic import arithmetic_corpus, make_arithmetic_splits

_PROMPT = re.compile(r"(\d+)([+\-*])(\d+)=")


def _key(row: dict) -> tuple[int, str, int]:
    a, op, b = _PROMPT.fullmatch(row["prompt"]).groups()
    return int(a), op, int(b)


def _all_problems(max_operand: int, ops) -> set[tuple[int, str, int]]:
    """The reference enumeration: a plain double loop per operator."""
    return {
        (a, op, b)
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if op != "-" or a >= b
    }


def test_rows_are_correct_problems():
    train, heldout = make_arithmetic_splits(
        num_train=200, num_heldout=50, max_operand=20, ops=("+", "-", "*"), seed=1
    )
    assert len(train) == 200 and len(heldout) == 50
    for row in train + heldout:
        assert set(row) == {"prompt", "answer"}
        a, op, b = _key(row)
        assert 0 <= a <= 20 and 0 <= b <= 20
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert row["answer"] == str(expected)
        if op == "-":
            assert a >= b and int(row["answer"]) >= 0
    assert {_key(r)[1] for r in train} == {"+", "-", "*"}  # 200 draws from 3 ops cover all of them


def test_hand_worked_values():
    # max_operand=1, "+": the only problems are 0+0=0, 0+1=1, 1+0=1, 1+1=2, so asking for all 4 returns them.
    train, heldout = make_arithmetic_splits(num_train=3, num_heldout=1, max_operand=1, seed=0)
    assert sorted(arithmetic_corpus(train + heldout)) == ["0+0=0", "0+1=1", "1+0=1", "1+1=2"]
    # max_operand=3, "-" with a >= b: rows a=0..3 hold 1+2+3+4 = 10 problems, each result a-b in 0..3.
    train, heldout = make_arithmetic_splits(num_train=7, num_heldout=3, max_operand=3, ops=("-",), seed=0)
    assert {_key(r) for r in train + heldout} == {(a, "-", b) for a in range(4) for b in range(a + 1)}


def test_splits_are_disjoint_and_cover_the_space_when_asked_for_all():
    # max_operand=2: "+" 3*3=9, "-" 3+2+1=6, "*" 9 → 24 distinct problems.
    ops = ("+", "-", "*")
    train, heldout = make_arithmetic_splits(num_train=20, num_heldout=4, max_operand=2, ops=ops, seed=3)
    train_keys, heldout_keys = [_key(r) for r in train], [_key(r) for r in heldout]
    assert len(set(train_keys)) == 20 and len(set(heldout_keys)) == 4  # no repeats inside a split
    assert not set(train_keys) & set(heldout_keys)
    assert set(train_keys) | set(heldout_keys) == _all_problems(2, ops)


@pytest.mark.parametrize("seed", range(5))
def test_disjoint_on_partial_draws(seed):
    train, heldout = make_arithmetic_splits(num_train=300, num_heldout=100, max_operand=30, ops=("+", "*"), seed=seed)
    assert not {_key(r) for r in train} & {_key(r) for r in heldout}
    assert len({_key(r) for r in train}) == 300


def test_deterministic_and_leaves_global_random_alone():
    state = random.getstate()
    a = make_arithmetic_splits(num_train=50, num_heldout=10, max_operand=99, ops=("+", "-"), seed=7)
    b = make_arithmetic_splits(num_train=50, num_heldout=10, max_operand=99, ops=("+", "-"), seed=7)
    c = make_arithmetic_splits(num_train=50, num_heldout=10, max_operand=99, ops=("+", "-"), seed=8)
    assert random.getstate() == state
    assert a == b
    assert a != c


def test_heldout_does_not_move_when_num_train_changes():
    _, small = make_arithmetic_splits(num_train=10, num_heldout=25, max_operand=50, seed=4)
    _, large = make_arithmetic_splits(num_train=2000, num_heldout=25, max_operand=50, seed=4)
    assert small == large


def test_huge_operand_range_is_cheap():
    # 10^18 + ... problems: sampling must not enumerate them.
    train, heldout = make_arithmetic_splits(num_train=1000, num_heldout=100, max_operand=10**9, ops=("*",), seed=0)
    assert len(train) == 1000 and len(heldout) == 100
    assert all(int(r["answer"]) == _key(r)[0] * _key(r)[2] for r in train)


def test_too_many_rows_says_how_many_exist():
    # max_operand=2 with "+" and "-": 9 + 6 = 15 problems.
    with pytest.raises(ValueError, match=r"only 15 distinct problems exist"):
        make_arithmetic_splits(num_train=10, num_heldout=6, max_operand=2, ops=("+", "-"), seed=0)
    train, heldout = make_arithmetic_splits(num_train=10, num_heldout=5, max_operand=2, ops=("+", "-"), seed=0)
    assert len(train) + len(heldout) == 15  # exactly the limit is allowed


@pytest.mark.parametrize("ops", [(), ("/",), ("+", "+"), ("+", "x")])
def test_bad_ops(ops):
    with pytest.raises(ValueError, match="ops must be distinct operators"):
        make_arithmetic_splits(num_train=1, num_heldout=1, max_operand=5, ops=ops, seed=0)


def test_bad_sizes():
    with pytest.raises(ValueError, match="max_operand"):
        make_arithmetic_splits(num_train=1, num_heldout=0, max_operand=-1, seed=0)
    with pytest.raises(ValueError, match="num_train and num_heldout"):
        make_arithmetic_splits(num_train=-1, num_heldout=0, max_operand=5, seed=0)


def test_corpus():
    rows = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "3*4=", "answer": "12"}]
    assert arithmetic_corpus(rows) == ["12+7=19", "3*4=12"]
    assert arithmetic_corpus([]) == []


def test_docstring_examples():
    result = doctest.testmod(arithmetic)
    assert result.attempted > 0 and result.failed == 0
