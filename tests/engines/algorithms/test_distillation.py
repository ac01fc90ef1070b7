"""Distillation divergences: hand-worked values for every divergence, zero when teacher equals student,
top-k+tail buckets (exact at k = V and when k covers the teacher's support), zero-probability buckets,
plain-loop references, masking and errors."""

import math

import pytest
import torch

from engines.algorithms import distillation

INF = math.inf


def _lp(*probs):
    """Log-probs ``[1, 1, K]`` (float64) of one token's distribution; 0 becomes -inf."""
    return torch.tensor(probs, dtype=torch.float64).log().view(1, 1, -1)


def _loss(name, teacher, student, mask=None, **options):
    mask = torch.ones(teacher.shape[:-1], dtype=teacher.dtype) if mask is None else mask
    return distillation.compute(name, teacher_logprobs=teacher, student_logprobs=student, mask=mask, **options)


def test_names():
    assert distillation.names() == sorted(["forward_kl", "reverse_kl", "js", "gkd_jsd", "skewed_forward_kl",
                                           "skewed_reverse_kl", "adaptive_kl", "mixed"])


# Two buckets: teacher p = [0.5, 0.5], student q = [0.25, 0.75]; ln 2 = 0.6931472, ln 3 = 1.0986123.
P2, Q2 = _lp(0.5, 0.5), _lp(0.25, 0.75)
# Three buckets for adaptive_kl (two equal teacher buckets would make its head/tail split a tie):
# p = [0.6, 0.3, 0.1], q = [0.5, 0.1, 0.4].
P3, Q3 = _lp(0.6, 0.3, 0.1), _lp(0.5, 0.1, 0.4)

HAND_WORKED = [
    # KL(p||q) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 (ln 2 - ln 3) = ln 2 - 0.5 ln 3 = 0.1438410
    ("forward_kl", {}, P2, Q2, 0.1438410),
    # KL(q||p) = 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.25 ln 2 + 0.75 (ln 3 - ln 2) = 0.75 ln 3 - ln 2 = 0.1308120
    ("reverse_kl", {}, P2, Q2, 0.1308120),
    # m = [0.375, 0.625]; KL(p||m) = 0.5 ln(4/3) + 0.5 ln(0.8) = 0.5 (0.2876821 - 0.2231436) = 0.0322693;
    # KL(q||m) = 0.25 ln(2/3) + 0.75 ln(1.2) = 0.25 (-0.4054651) + 0.75 (0.1823216) = 0.0353749; JS = mean = 0.0338221
    ("js", {}, P2, Q2, 0.0338221),
    # beta = 0.25: m = 0.25 p + 0.75 q = [0.3125, 0.6875];
    # KL(p||m) = 0.5 ln(1.6) + 0.5 ln(0.5/0.6875) = 0.5 (0.4700036 - 0.3184537) = 0.0757749;
    # KL(q||m) = 0.25 ln(0.8) + 0.75 ln(0.75/0.6875) = 0.25 (-0.2231436) + 0.75 (0.0870114) = 0.0094726;
    # JSD = 0.25 * 0.0757749 + 0.75 * 0.0094726 = 0.0189437 + 0.0071045 = 0.0260482
    ("gkd_jsd", {"beta": 0.25}, P2, Q2, 0.0260482),
    # beta = 0 is TRL's forward KL, beta = 1 its reverse KL (values above)
    ("gkd_jsd", {"beta": 0.0}, P2, Q2, 0.1438410),
    ("gkd_jsd", {"beta": 1.0}, P2, Q2, 0.1308120),
    # lam = 0.1: m = 0.1 p + 0.9 q = [0.275, 0.725];
    # KL(p||m) = 0.5 ln(0.5/0.275) + 0.5 ln(0.5/0.725) = 0.5 (0.5978370 - 0.3715636) = 0.1131367
    ("skewed_forward_kl", {"lam": 0.1}, P2, Q2, 0.1131367),
    # lam = 0.1: m = 0.1 q + 0.9 p = [0.475, 0.525];
    # KL(q||m) = 0.25 ln(0.25/0.475) + 0.75 ln(0.75/0.525) = 0.25 (-0.6418539) + 0.75 (0.3566749) = 0.1070427
    ("skewed_reverse_kl", {"lam": 0.1}, P2, Q2, 0.1070427),
    # weight = 0.25: 0.25 * 0.1438410 + 0.75 * 0.1308120 = 0.0359603 + 0.0981090 = 0.1340693
    ("mixed", {"weight": 0.25}, P2, Q2, 0.1340693),
    # alpha = 0.5: teacher ascending [0.1 (b2), 0.3 (b1), 0.6 (b0)], cumulative [0.1, 0.4, 1.0]: tail = {b2, b1},
    # head = {b0}. g_head = |0.6 - 0.5| = 0.1; g_tail = |0.3 - 0.1| + |0.1 - 0.4| = 0.5 -> weights 1/6, 5/6.
    # KL(p||q) = 0.6 ln(1.2) + 0.3 ln 3 + 0.1 ln(0.25) = 0.1093929 + 0.3295837 - 0.1386294 = 0.3003472
    # KL(q||p) = 0.5 ln(5/6) + 0.1 ln(1/3) + 0.4 ln 4 = -0.0911608 - 0.1098612 + 0.5545177 = 0.3534957
    # AKL = 0.3003472 / 6 + 5 * 0.3534957 / 6 = 0.0500579 + 0.2945798 = 0.3446376
    ("adaptive_kl", {"alpha": 0.5}, P3, Q3, 0.3446376),
]


def test_every_divergence_has_a_hand_worked_case():
    assert {name for name, *_ in HAND_WORKED} == set(distillation.names())


@pytest.mark.parametrize("name, options, teacher, student, expected", HAND_WORKED)
def test_hand_worked(name, options, teacher, student, expected):
    loss, metrics = _loss(name, teacher, student, **options)
    assert loss.item() == pytest.approx(expected, abs=1e-7)
    assert metrics["distill/loss"] == pytest.approx(expected, abs=1e-7)


def test_disjoint_supports_zero_buckets_count_as_zero():
    # p = [1, 0], q = [0, 1]: m = [0.5, 0.5]; KL(p||m) = 1 ln 2 + 0 ln 0 = ln 2 (0 log 0 = 0), KL(q||m) = ln 2,
    # so JS = ln 2, its maximum. Forward KL is infinite: q's log 0 reads as LOG_PROB_FLOOR = -100, giving
    # 1 * (0 - (-100)) + 0 = 100.
    p, q = _lp(1.0, 0.0), _lp(0.0, 1.0)
    assert _loss("js", p, q)[0].item() == pytest.approx(math.log(2), rel=1e-12)
    assert _loss("forward_kl", p, q)[0].item() == pytest.approx(-distillation.LOG_PROB_FLOOR, rel=1e-12)


def _random_logprobs(*shape, zeros=(), seed=0, dtype=torch.float64):
    """Random log-softmax over the last dim; buckets listed in ``zeros`` get probability 0 (-inf)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=gen, dtype=dtype) * 2
    for index in zeros:
        logits[..., index] = -INF
    return torch.log_softmax(logits, dim=-1)


OPTIONS = {"gkd_jsd": {"beta": 0.3}, "skewed_forward_kl": {"lam": 0.2}, "skewed_reverse_kl": {"lam": 0.2},
           "adaptive_kl": {"alpha": 0.4}, "mixed": {"weight": 0.7}}


@pytest.mark.parametrize("name", distillation.names())
def test_zero_when_teacher_equals_student(name):
    # Buckets 1 and 4 have probability 0 on both sides: every term is 0 log(0/0) = 0 or a log(a/a) = 0.
    lp = _random_logprobs(2, 3, 5, zeros=(1, 4))
    student = lp.clone().requires_grad_(True)
    loss, _ = _loss(name, lp, student, **OPTIONS.get(name, {}))
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    assert torch.isfinite(student.grad).all()


@pytest.mark.parametrize("name", distillation.names())
def test_gradients_finite_with_zero_probability_buckets(name):
    # Teacher and student each put 0 on buckets the other uses (bucket 0 teacher-only 0, bucket 3 student-only 0):
    # the value is large but finite, and the -inf student entries get gradient 0, never NaN.
    teacher = _random_logprobs(2, 3, 5, zeros=(0,), seed=1)
    student = _random_logprobs(2, 3, 5, zeros=(3,), seed=2).requires_grad_(True)
    loss, _ = _loss(name, teacher, student, **OPTIONS.get(name, {}))
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(student.grad).all()
    assert (student.grad[..., 3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", distillation.names())
def test_topk_with_k_equal_vocabulary_equals_full(name, dtype):
    V = 6
    teacher = _random_logprobs(2, 3, V, seed=3, dtype=dtype)
    student = _random_logprobs(2, 3, V, seed=4, dtype=dtype)
    ids, teacher_topk = distillation.full_to_topk(teacher, V)
    teacher_b, student_b = distillation.topk_buckets(teacher_topk_logprobs=teacher_topk,
                                                     student_topk_logprobs=student.gather(-1, ids))
    assert teacher_b.shape == student_b.shape == (2, 3, V + 1)
    # The top-k hold all the mass on both sides: both tails are exactly empty.
    assert torch.isneginf(teacher_b[..., -1]).all() and torch.isneginf(student_b[..., -1]).all()
    full, _ = _loss(name, teacher, student, **OPTIONS.get(name, {}))
    topk, _ = _loss(name, teacher_b, student_b, **OPTIONS.get(name, {}))
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert topk.item() == pytest.approx(full.item(), abs=tol)


@pytest.mark.parametrize("k", [3, 4])
def test_topk_forward_kl_is_exact_when_k_covers_the_teacher_support(k):
    # The teacher gives tokens 0, 2, 5 of 7 all the mass; the student spreads over all 7. With k = 3 the ids are
    # the support; with k = 4 one id has p = 0. Teacher tail = 0 (exactly -inf), student tail = its mass outside
    # the ids, so sum over buckets of p log(p/q) is the full-vocabulary sum (p = 0 elsewhere).
    teacher = _random_logprobs(2, 3, 7, zeros=(1, 3, 4, 6), seed=5)
    student = _random_logprobs(2, 3, 7, seed=6).requires_grad_(True)
    ids, teacher_topk = distillation.full_to_topk(teacher, k)
    teacher_b, student_b = distillation.topk_buckets(teacher_topk_logprobs=teacher_topk,
                                                     student_topk_logprobs=student.gather(-1, ids))
    assert torch.isneginf(teacher_b[..., -1]).all()
    torch.testing.assert_close(student_b[..., -1].exp(), 1 - student.gather(-1, ids).exp().sum(-1))
    full, _ = _loss("forward_kl", teacher, student)
    topk, _ = _loss("forward_kl", teacher_b, student_b)
    assert topk.item() == pytest.approx(full.item(), rel=1e-12)
    # Same gradient too: d KL / d log q_i = -p_i on the support, 0 elsewhere, through the tail as well.
    (full_grad,) = torch.autograd.grad(full, student)
    (topk_grad,) = torch.autograd.grad(topk, student)
    torch.testing.assert_close(topk_grad, full_grad)


def test_topk_buckets_hand_worked_tail():
    # Teacher top-2 probabilities [0.5, 0.25] -> tail 1 - 0.75 = 0.25; student [0.4, 0.1] -> tail 0.5.
    teacher_b, student_b = distillation.topk_buckets(teacher_topk_logprobs=_lp(0.5, 0.25),
                                                     student_topk_logprobs=_lp(0.4, 0.1))
    assert teacher_b.exp().flatten().tolist() == pytest.approx([0.5, 0.25, 0.25], rel=1e-12)
    assert student_b.exp().flatten().tolist() == pytest.approx([0.4, 0.1, 0.5], rel=1e-12)
    # forward KL over the buckets: 0.5 ln(1.25) + 0.25 ln(2.5) + 0.25 ln(0.5)
    #   = 0.1115718 + 0.2290727 - 0.1732868 = 0.1673577
    assert _loss("forward_kl", teacher_b, student_b)[0].item() == pytest.approx(0.1673577, abs=1e-7)


def test_topk_tail_gradient_reaches_the_student_topk():
    # Student top-1 log-prob x with tail log(1 - e^x): d tail / d x = -e^x / (1 - e^x); at e^x = 0.25: -1/3.
    x = torch.tensor([[[math.log(0.25)]]], dtype=torch.float64, requires_grad=True)
    _, student_b = distillation.topk_buckets(teacher_topk_logprobs=_lp(0.5), student_topk_logprobs=x)
    (grad,) = torch.autograd.grad(student_b[..., -1].sum(), x)
    assert grad.item() == pytest.approx(-1 / 3, rel=1e-12)


def test_full_to_topk():
    ids, values = distillation.full_to_topk(_lp(0.1, 0.6, 0.3), 2)
    assert ids.flatten().tolist() == [1, 2]
    assert values.exp().flatten().tolist() == pytest.approx([0.6, 0.3])
    with pytest.raises(ValueError, match=r"k must be in \[1, 3\]"):
        distillation.full_to_topk(_lp(0.1, 0.6, 0.3), 4)


def _loop_kl(a, b):
    """sum a log(a/b), skipping a = 0; b = 0 (infinite KL) reads log b as the documented floor."""
    return sum(x * (math.log(x) - (math.log(y) if y > 0 else distillation.LOG_PROB_FLOOR))
               for x, y in zip(a, b) if x > 0)


def _loop_gkd_jsd(p, q, beta):
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return beta * _loop_kl(p, m) + (1 - beta) * _loop_kl(q, m)


@pytest.mark.parametrize("name, options, reference", [
    ("forward_kl", {}, lambda p, q: _loop_kl(p, q)),
    ("reverse_kl", {}, lambda p, q: _loop_kl(q, p)),
    ("js", {}, lambda p, q: _loop_gkd_jsd(p, q, 0.5)),
    ("gkd_jsd", {"beta": 0.3}, lambda p, q: _loop_gkd_jsd(p, q, 0.3)),
])
def test_matches_a_plain_loop(name, options, reference):
    teacher = _random_logprobs(2, 3, 5, zeros=(2,), seed=7)
    student = _random_logprobs(2, 3, 5, seed=8)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    loss, _ = _loss(name, teacher, student, mask=mask, **options)
    per_token = [reference(teacher[b, t].exp().tolist(), student[b, t].exp().tolist())
                 for b in range(2) for t in range(3) if mask[b, t] > 0]
    assert loss.item() == pytest.approx(sum(per_token) / len(per_token), rel=1e-10)


def test_forward_kl_gradient_is_minus_teacher_prob():
    # d/d log q_i sum_j p_j (log p_j - log q_j) = -p_i, divided by the 2 masked-in tokens of the token-mean.
    student = torch.cat([Q2, Q2], dim=1).requires_grad_(True)  # [1, 2, 2]
    teacher = torch.cat([P2, P2], dim=1).requires_grad_(True)
    loss, _ = _loss("forward_kl", teacher, student)
    loss.backward()
    torch.testing.assert_close(student.grad, torch.full((1, 2, 2), -0.25, dtype=torch.float64))
    assert teacher.grad is None  # the teacher is a constant


def test_student_far_below_the_floor_still_gets_its_gradient():
    # Only -inf reads as the floor: a finite log q = -150 on a teacher token keeps d KL / d log q_0 = -p_0 = -0.5
    # and its value 0.5 (ln 0.5 + 150) + 0.5 ln(0.5 / 1) = 75 - ln 2 = 74.3068528 (q_1 = 1 - e^-150 = 1).
    student = torch.tensor([[[-150.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    loss, _ = _loss("forward_kl", P2, student)
    assert loss.item() == pytest.approx(75 - math.log(2), rel=1e-12)
    loss.backward()
    assert student.grad.flatten().tolist() == pytest.approx([-0.5, -0.5])


def test_mask_drops_positions_and_weights_the_mean():
    # Position 1 holds disjoint one-hot distributions (forward KL 100 via the floor) but is masked out;
    # positions 0 and 2 carry forward KL 0.1438410 and 0; token-mean = 0.1438410 / 2.
    teacher = torch.cat([P2, _lp(1.0, 0.0), P2], dim=1)
    student = torch.cat([Q2, _lp(0.0, 1.0), P2], dim=1)
    loss, metrics = _loss("forward_kl", teacher, student, mask=torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64))
    assert loss.item() == pytest.approx(0.1438410 / 2, abs=1e-7)
    # top-1: position 0 teacher tie -> bucket 0, student bucket 1 (disagree); position 2 agrees -> 1/2
    assert metrics["distill/top1_agreement"] == 0.5
    empty, metrics = _loss("forward_kl", teacher, student, mask=torch.zeros(1, 3, dtype=torch.float64))
    assert empty.item() == 0.0 and metrics["distill/top1_agreement"] == 0.0


def test_per_token_divergence():
    out = distillation.divergence("reverse_kl", teacher_logprobs=torch.cat([P2, P2], 1),
                                  student_logprobs=torch.cat([Q2, P2], 1))
    assert out.shape == (1, 2)
    assert out.flatten().tolist() == pytest.approx([0.1308120, 0.0], abs=1e-7)


def test_unknown_divergence_lists_the_registered_ones():
    with pytest.raises(KeyError, match="unknown distillation divergence 'kl'; registered: adaptive_kl, forward_kl"):
        _loss("kl", P2, Q2)


def test_option_the_divergence_does_not_take_names_it_and_its_options():
    with pytest.raises(ValueError, match="'forward_kl' does not take beta; it takes: no options"):
        _loss("forward_kl", P2, Q2, beta=0.5)
    with pytest.raises(ValueError, match="'gkd_jsd' does not take lam; it takes: beta"):
        _loss("gkd_jsd", P2, Q2, lam=0.5)


@pytest.mark.parametrize("name, option", [("gkd_jsd", "beta"), ("skewed_forward_kl", "lam"),
                                          ("skewed_reverse_kl", "lam"), ("adaptive_kl", "alpha"),
                                          ("mixed", "weight")])
def test_options_out_of_range(name, option):
    with pytest.raises(ValueError, match=f"{option} must be in \\[0, 1\\], got 1.5"):
        _loss(name, P2, Q2, **{option: 1.5})


def test_shape_errors():
    with pytest.raises(ValueError, match="must have the same"):
        _loss("forward_kl", P2, Q3)
    with pytest.raises(ValueError, match=r"mask must be \[B, L\]"):
        _loss("forward_kl", P2, Q2, mask=torch.ones(1, 2))


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="distillation divergence 'js' is already registered"):
        distillation.register("js")(lambda **_: None)


def test_topk_tail_of_half_precision_inputs_is_computed_in_float32():
    # 8 ids of 0.11875 each hold 0.95: the tail is 0.05. bf16's eps 2^-7 makes k * eps = 0.0625 > 0.05, so a
    # bf16 tail would read as empty (-inf); in float32 it is log 0.05 up to bf16's rounding of the inputs.
    topk = torch.full((1, 1, 8), math.log(0.11875), dtype=torch.bfloat16)
    teacher_b, student_b = distillation.topk_buckets(teacher_topk_logprobs=topk, student_topk_logprobs=topk)
    assert teacher_b.dtype == student_b.dtype == torch.float32
    assert teacher_b[..., -1].exp().item() == pytest.approx(0.05, abs=0.01)
