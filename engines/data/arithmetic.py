"""Built-in verifiable arithmetic task: ``"{a}{op}{b}="`` → ``str(result)``, with a held-out split.

Every distinct problem ``(a, op, b)`` with ``0 <= a, b <= max_operand`` gets an index in
``range(num_problems)``; the splits are a random sample of indices without replacement, so train and
held-out never share a problem. For ``"-"`` only ``a >= b`` is generated, so every answer is a
non-negative integer that ``engines.rewards.math`` checks exactly.

The held-out split is drawn first from its own sample, so for a fixed ``(seed, max_operand, ops,
num_heldout)`` the evaluation set stays the same when ``num_train`` changes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

OPS = ("+", "-", "*")


def _count(op: str, max_operand: int) -> int:
    """How many distinct problems ``op`` has with operands in ``[0, max_operand]``."""
    n = max_operand + 1
    return n * (n + 1) // 2 if op == "-" else n * n  # "-" keeps a >= b: a triangle of the n x n grid


def _decode(index: int, op: str, max_operand: int) -> tuple[int, int]:
    """Operands ``(a, b)`` of the ``index``-th problem of ``op``."""
    if op == "-":  # row a holds b = 0..a, so row a starts at a(a+1)/2
        a = (math.isqrt(8 * index + 1) - 1) // 2
        return a, index - a * (a + 1) // 2
    return divmod(index, max_operand + 1)


def _row(index: int, ops: Sequence[str], max_operand: int) -> dict:
    for op in ops:
        size = _count(op, max_operand)
        if index < size:
            a, b = _decode(index, op, max_operand)
            result = a + b if op == "+" else a - b if op == "-" else a * b
            return {"prompt": f"{a}{op}{b}=", "answer": str(result)}
        index -= size
    raise IndexError(index)


def make_arithmetic_splits(
    *,
    num_train: int,  # rows in the train split
    num_heldout: int,  # rows in the held-out split, disjoint from train by (a, op, b)
    max_operand: int,  # operands a, b are drawn from 0..max_operand inclusive
    ops: Sequence[str] = ("+",),  # distinct operators among "+", "-", "*"
    seed: int,  # seeds a private random.Random; global random state is untouched
) -> tuple[list[dict], list[dict]]:
    """Return ``(train, heldout)`` lists of ``{"prompt": "a+b=", "answer": "c"}`` rows.

    >>> train, heldout = make_arithmetic_splits(num_train=3, num_heldout=1, max_operand=1, seed=0)
    >>> sorted(r["prompt"] + r["answer"] for r in train + heldout)
    ['0+0=0', '0+1=1', '1+0=1', '1+1=2']
    """
    ops = tuple(ops)
    if not ops or any(op not in OPS for op in ops) or len(set(ops)) != len(ops):
        raise ValueError(f"ops must be distinct operators among {OPS}, got {ops}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if num_train < 0 or num_heldout < 0:
        raise ValueError(f"num_train and num_heldout must be >= 0, got {num_train} and {num_heldout}")
    total = sum(_count(op, max_operand) for op in ops)
    if num_train + num_heldout > total:
        raise ValueError(
            f"num_train + num_heldout = {num_train + num_heldout} but only {total} distinct problems exist "
            f"for max_operand={max_operand}, ops={ops}; raise max_operand, add ops, or ask for fewer rows"
        )
    rng = random.Random(seed)
    # random.sample over a range never materialises it, so a huge max_operand stays cheap.
    heldout_idx = rng.sample(range(total), num_heldout)
    excluded = set(heldout_idx)
    # A second uniform sample, minus the held-out problems, is a uniform sample of the rest; it holds
    # at least num_train of them because at most num_heldout of its entries are excluded.
    candidates = rng.sample(range(total), num_train + num_heldout)
    train_idx = [i for i in candidates if i not in excluded][:num_train]
    return [_row(i, ops, max_operand) for i in train_idx], [_row(i, ops, max_operand) for i in heldout_idx]


def arithmetic_corpus(rows: Sequence[dict]) -> list[str]:
    """Full ``prompt + answer`` texts (``"12+7=19"``), e.g. to train a tokenizer on the task's alphabet."""
    return [row["prompt"] + row["answer"] for row in rows]
