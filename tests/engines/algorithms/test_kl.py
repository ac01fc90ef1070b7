"""KL estimators k1/k2/k3: hand-worked values, exact expectations, a loop reference and errors."""

import math

import pytest
import torch

from engines.algorithms import kl


def test_names():
    assert kl.names() == ["k1", "k2", "k3"]


# LP and RLP for two tokens; d = RLP - LP = [-0.5, 1.0].
LP = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)  # [1, 2]
RLP = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # [1, 2]


@pytest.mark.parametrize(
    "name, expected",
    [
        # k1 = LP - RLP = [-1 + 1.5, -2 + 1] = [0.5, -1.0]
        ("k1", [0.5, -1.0]),
        # k2 = 0.5 * (LP - RLP)^2 = 0.5 * [0.25, 1.0] = [0.125, 0.5]
        ("k2", [0.125, 0.5]),
        # k3 = exp(d) - d - 1: exp(-0.5) + 0.5 - 1 = 0.60653 - 0.5 = 0.10653; exp(1) - 1 - 1 = 0.71828
        ("k3", [0.1065306597, 0.7182818285]),
    ],
)
def test_hand_worked(name, expected):
    out = kl.compute(name, logprobs=LP, ref_logprobs=RLP)
    assert out.shape == (1, 2)
    assert out[0].tolist() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_have_kl_as_exact_expectation(name):
    # Tokens x ~ p with p = [0.7, 0.2, 0.1], reference q = [0.3, 0.3, 0.4]. Weighting each token's
    # estimate by p(x) gives E_p[k]; for k1 and k3 that must be KL(p || q) (this pins the direction):
    # KL = 0.7 ln(7/3) + 0.2 ln(2/3) + 0.1 ln(1/4) = 0.59311 - 0.08109 - 0.13863 = 0.37339.
    p = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.3, 0.4]], dtype=torch.float64)
    per_token = kl.compute(name, logprobs=p.log(), ref_logprobs=q.log())  # [1, 3]
    assert (p * per_token).sum().item() == pytest.approx(0.3733860445, rel=1e-9)


def test_k3_clamps_log_ratio_to_20():
    # d = RLP - LP = -1000 -> clamped to -20: exp(-20) + 20 - 1 = 19.000000002
    # d = +1000 -> clamped to +20: exp(20) - 20 - 1 = 485165195.41 - 21 = 485165174.41 (finite, not inf)
    lp = torch.tensor([[0.0, -1000.0]])
    rlp = torch.tensor([[-1000.0, 0.0]])
    out = kl.compute("k3", logprobs=lp, ref_logprobs=rlp)
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == pytest.approx(19.0, rel=1e-6)
    assert out[0, 1].item() == pytest.approx(485165174.41, rel=1e-6)


def _loop_reference(name: str, lp: float, rlp: float) -> float:
    if name == "k1":
        return lp - rlp
    if name == "k2":
        return 0.5 * (lp - rlp) ** 2
    if name == "k3":
        d = min(max(rlp - lp, -20.0), 20.0)
        return math.exp(d) - d - 1.0
    raise AssertionError(name)


@pytest.mark.invariant
@pytest.mark.parametrize("name", kl.names())
def test_matches_loop_reference(name):
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    rlp = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    out = kl.compute(name, logprobs=lp, ref_logprobs=rlp)
    assert out.shape == (4, 7)
    expected = [[_loop_reference(name, a, b) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), rlp.tolist())]
    for got_row, exp_row in zip(out.tolist(), expected):
        assert got_row == pytest.approx(exp_row, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", kl.names())
def test_zero_when_policies_match(name):
    lp = torch.log(torch.tensor([[0.5, 0.1, 0.9]]))
    assert kl.compute(name, logprobs=lp, ref_logprobs=lp.clone()).abs().max().item() == 0.0


@pytest.mark.invariant
@pytest.mark.parametrize("name", ["k2", "k3"])
def test_nonnegative(name):
    gen = torch.Generator().manual_seed(1)
    lp, rlp = torch.randn(2, 3, 50, generator=gen)
    assert (kl.compute(name, logprobs=lp, ref_logprobs=rlp) >= 0).all()


def test_gradient_flows_to_logprobs():
    lp = LP.clone().requires_grad_(True)
    kl.compute("k3", logprobs=lp, ref_logprobs=RLP).sum().backward()
    # d/dLP [exp(RLP - LP) - (RLP - LP) - 1] = 1 - exp(RLP - LP) = [1 - 0.60653, 1 - 2.71828]
    assert lp.grad[0].tolist() == pytest.approx([1 - math.exp(-0.5), 1 - math.e], rel=1e-9)


def test_unknown_name_lists_names():
    with pytest.raises(KeyError) as info:
        kl.compute("k4", logprobs=LP, ref_logprobs=RLP)
    for name in kl.names():
        assert name in str(info.value)


def test_unknown_option_is_type_error():
    with pytest.raises(TypeError, match="clamp"):
        kl.compute("k3", logprobs=LP, ref_logprobs=RLP, clamp=10.0)


# -- adaptive KL controller -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "observed_kl, expected",
    [
        # target 6, horizon 10000, 512 samples -> num_samples / horizon = 0.0512
        # 9 / 6 - 1 = 0.5, clipped to 0.2: 0.1 * (1 + 0.2 * 0.0512) = 0.1 * 1.01024 = 0.101024
        (9.0, 0.101024),
        # 6.6 / 6 - 1 = 0.1 (inside the clip): 0.1 * (1 + 0.1 * 0.0512) = 0.100512
        (6.6, 0.100512),
        # on target: e = 0 -> unchanged
        (6.0, 0.1),
        # 5.4 / 6 - 1 = -0.1: 0.1 * (1 - 0.00512) = 0.099488
        (5.4, 0.099488),
        # 0 / 6 - 1 = -1, clipped to -0.2: 0.1 * (1 - 0.01024) = 0.098976
        (0.0, 0.098976),
    ],
)
def test_adaptive_kl_coef_hand_worked(observed_kl, expected):
    coef = kl.adaptive_kl_coef(coef=0.1, observed_kl=observed_kl, target_kl=6.0, horizon=10000, num_samples=512)
    assert coef == pytest.approx(expected, rel=1e-12)


@pytest.mark.invariant
def test_adaptive_kl_coef_matches_loop_reference():
    # Ziegler et al. 2019, sec. 2.2, iterated over 200 steps of random observed KLs (some far off target).
    gen = torch.Generator().manual_seed(0)
    observed = (torch.rand(200, generator=gen, dtype=torch.float64) * 0.3).tolist()
    samples = torch.randint(16, 1024, (200,), generator=gen).tolist()
    coef, ref = 0.05, 0.05
    for kl_t, n in zip(observed, samples):
        coef = kl.adaptive_kl_coef(coef=coef, observed_kl=kl_t, target_kl=0.1, horizon=5000, num_samples=n)
        e = kl_t / 0.1 - 1.0
        e = -0.2 if e < -0.2 else (0.2 if e > 0.2 else e)
        ref = ref * (1.0 + e * n / 5000)
        assert coef == pytest.approx(ref, rel=1e-12)
    assert coef > 0


def test_adaptive_kl_coef_moves_toward_target():
    # Above target the coefficient grows, below it shrinks; one step never moves it by more than
    # a factor 1 +- 0.2 * num_samples / horizon.
    up = kl.adaptive_kl_coef(coef=0.2, observed_kl=1.0, target_kl=0.1, horizon=100, num_samples=10)
    down = kl.adaptive_kl_coef(coef=0.2, observed_kl=0.0, target_kl=0.1, horizon=100, num_samples=10)
    assert up == pytest.approx(0.2 * 1.02) and down == pytest.approx(0.2 * 0.98)
