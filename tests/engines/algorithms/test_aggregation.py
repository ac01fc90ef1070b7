"""Aggregation modes: hand-worked values, a plain-loop reference, masking and errors."""

import pytest
import torch

from engines.algorithms import aggregation

# Three rows: 3 response tokens, 1 response token, none. The 9s and the 4/6/7/8 outside the mask must
# never show up in any result.
X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])  # [B=3, L=4]
M = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # [3, 4]


def test_names():
    assert aggregation.names() == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
    ]


@pytest.mark.parametrize(
    "mode, options, expected",
    [
        # masked sum 1+2+3+5 = 11 over 4 response tokens -> 2.75
        ("token-mean", {}, 11 / 4),
        # row sums [6, 5, 0] -> mean over 3 rows = 11/3 = 3.6667
        ("seq-mean-token-sum", {}, 11 / 3),
        # row means [6/3 = 2, 5/1 = 5, empty row -> 0] -> (2 + 5 + 0)/3 = 2.3333
        ("seq-mean-token-mean", {}, 7 / 3),
        # Dr.GRPO, default norm = L = 4: 11 / (B * norm) = 11 / 12 = 0.9167
        ("seq-mean-token-sum-norm", {}, 11 / 12),
        # explicit norm = 10: 11 / (3 * 10) = 0.3667
        ("seq-mean-token-sum-norm", {"norm": 10}, 11 / 30),
    ],
)
def test_hand_worked(mode, options, expected):
    value = aggregation.aggregate(mode, values=X, mask=M, **options)
    assert value.shape == ()
    assert value.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", aggregation.names())
def test_ignores_values_outside_mask(mode):
    garbage = torch.where(M > 0, X, torch.full_like(X, 1e6))
    assert aggregation.aggregate(mode, values=garbage, mask=M) == pytest.approx(
        aggregation.aggregate(mode, values=X, mask=M).item()
    )


@pytest.mark.parametrize("mode", aggregation.names())
def test_empty_mask_gives_zero_not_nan(mode):
    value = aggregation.aggregate(mode, values=X, mask=torch.zeros_like(M))
    assert value.item() == 0.0


def _loop_reference(mode: str, values: list[list[float]], mask: list[list[float]]) -> float:
    """Plain-python version of every mode, row by row and token by token."""
    rows = len(values)
    seq_len = len(values[0])
    row_sums = [sum(v * m for v, m in zip(vr, mr)) for vr, mr in zip(values, mask)]
    row_lens = [sum(mr) for mr in mask]
    if mode == "token-mean":
        return sum(row_sums) / max(sum(row_lens), 1)
    if mode == "seq-mean-token-sum":
        return sum(row_sums) / rows
    if mode == "seq-mean-token-mean":
        return sum(s / n if n > 0 else 0.0 for s, n in zip(row_sums, row_lens)) / rows
    if mode == "seq-mean-token-sum-norm":
        return sum(row_sums) / (rows * seq_len)
    raise AssertionError(mode)


@pytest.mark.invariant
@pytest.mark.parametrize("mode", aggregation.names())
def test_matches_loop_reference(mode):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([0, 1, 3, 5, 9, 4])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).to(torch.float64)
    got = aggregation.aggregate(mode, values=values, mask=mask).item()
    assert got == pytest.approx(_loop_reference(mode, values.tolist(), mask.tolist()), rel=1e-12)


def test_unknown_mode_lists_names():
    with pytest.raises(KeyError, match="token-mean.*") as info:
        aggregation.aggregate("nope", values=X, mask=M)
    for name in aggregation.names():
        assert name in str(info.value)


def test_unknown_option_is_type_error():
    # `norm` belongs to seq-mean-token-sum-norm only.
    with pytest.raises(TypeError, match="norm"):
        aggregation.aggregate("token-mean", values=X, mask=M, norm=4)
