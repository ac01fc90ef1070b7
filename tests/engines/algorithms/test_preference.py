"""Preference losses (DPO and variants): hand-worked values for every loss, DPO at initialisation, metrics,
gradients, a plain-loop reference for sigmoid and errors."""

import math

import pytest
import torch

from engines.algorithms import preference

# Two pairs, beta = 0.5. Log-ratios cl = PC - RC, rl = PR - RR; h = cl - rl.
#   pair 0: cl = -2 - (-3) = +1, rl = -4 - (-3) = -1, h = 2, beta h = +1.0; lengths |y_w| = 2, |y_l| = 4
#   pair 1: cl = -4 - (-4) =  0, rl = -3 - (-4) = +1, h = -1, beta h = -0.5; lengths |y_w| = 1, |y_l| = 2
# softplus(x) = log(1 + e^x) = -log sigma(-x):
#   softplus(-1) = 0.3132617, softplus(1) = 1.3132617, softplus(0.5) = 0.9740770, softplus(-0.5) = 0.4740770,
#   softplus(0) = ln 2 = 0.6931472; sigma(0.5) = 0.6224593, sigma(1) = 0.7310586, sigma(-0.5) = 0.3775407.
BETA = 0.5
PC = torch.tensor([-2.0, -4.0], dtype=torch.float64)  # [P] policy chosen
PR = torch.tensor([-4.0, -3.0], dtype=torch.float64)  # [P] policy rejected
RC = torch.tensor([-3.0, -4.0], dtype=torch.float64)  # [P] reference chosen
RR = torch.tensor([-3.0, -4.0], dtype=torch.float64)  # [P] reference rejected
LC = torch.tensor([2, 1])  # [P] chosen lengths
LR = torch.tensor([4, 2])  # [P] rejected lengths


def _compute(name, pc=PC, pr=PR, rc=RC, rr=RR, beta=BETA, **options):
    return preference.compute(name, policy_chosen_logps=pc, policy_rejected_logps=pr, ref_chosen_logps=rc,
                              ref_rejected_logps=rr, chosen_lengths=LC, rejected_lengths=LR, beta=beta, **options)


HAND_WORKED = [
    # sigmoid: -log sigma(beta h) = softplus(-beta h): [softplus(-1), softplus(0.5)]
    ("sigmoid", {}, [0.3132617, 0.9740770]),
    # cdpo, eps = 0.1: (1 - eps) softplus(-x) + eps softplus(x) = softplus(-x) + eps x  (softplus(x) - softplus(-x) = x)
    #   pair 0: 0.3132617 + 0.1 * 1 = 0.4132617; pair 1: 0.9740770 + 0.1 * (-0.5) = 0.9240770
    ("cdpo", {"label_smoothing": 0.1}, [0.4132617, 0.9240770]),
    # robust, eps = 0.1: ((1 - eps) softplus(-x) - eps softplus(x)) / (1 - 2 eps) = softplus(-x) - eps x / (1 - 2 eps)
    #   pair 0: 0.3132617 - 0.1 / 0.8 = 0.1882617; pair 1: 0.9740770 + 0.05 / 0.8 = 1.0365770
    ("robust", {"label_smoothing": 0.1}, [0.1882617, 1.0365770]),
    # hinge: max(0, 1 - beta h): pair 0 sits exactly on the margin, max(0, 0) = 0; pair 1: 1 + 0.5 = 1.5
    ("hinge", {}, [0.0, 1.5]),
    # ipo: (h - 1 / (2 beta))^2 = (h - 1)^2: (2 - 1)^2 = 1, (-1 - 1)^2 = 4
    ("ipo", {}, [1.0, 4.0]),
    # ipo, length_normalize: h' = cl/|y_w| - rl/|y_l|: pair 0: 1/2 + 1/4 = 0.75 -> (0.75 - 1)^2 = 0.0625;
    #   pair 1: 0/1 - 1/2 = -0.5 -> (-1.5)^2 = 2.25
    ("ipo", {"length_normalize": True}, [0.0625, 2.25]),
    # sigmoid_norm: softplus(-beta h') with the h' above: softplus(-0.375) = log(1 + 0.6872893) = 0.5231233;
    #   softplus(0.25) = log(1 + 1.2840254) = 0.8259394
    ("sigmoid_norm", {}, [0.5231233, 0.8259394]),
    # sppo_hard: (cl - 1)^2 + (rl + 1)^2 with 1/(2 beta) = 1: pair 0: 0 + 0 = 0; pair 1: 1 + 4 = 5
    ("sppo_hard", {}, [0.0, 5.0]),
    # nca_pair: r_w = beta cl, r_l = beta rl; softplus(-r_w) + 0.5 softplus(r_w) + 0.5 softplus(r_l)
    #   pair 0 (r_w = 0.5, r_l = -0.5): 0.4740770 + 0.4870385 + 0.2370385 = 1.1981540
    #   pair 1 (r_w = 0,   r_l = 0.5):  0.6931472 + 0.3465736 + 0.4870385 = 1.5267593
    ("nca_pair", {}, [1.1981540, 1.5267593]),
    # bco_pair, delta = 0: softplus(-r_w) + softplus(r_l): 0.4740770 + 0.4740770 = 0.9481540; 0.6931472 + 0.9740770
    ("bco_pair", {}, [0.9481540, 1.6672242]),
    # bco_pair, delta = 0.5: softplus(-(r_w - 0.5)) + softplus(r_l - 0.5):
    #   pair 0: softplus(0) + softplus(-1) = 0.6931472 + 0.3132617 = 1.0064089; pair 1: softplus(0.5) + softplus(0)
    ("bco_pair", {"delta": 0.5}, [1.0064089, 1.6672242]),
    # apo_zero: 1 - sigma(r_w) + sigma(r_l): pair 0: 1 - 0.6224593 + 0.3775407 = 0.7550814; pair 1: 0.5 + 0.6224593
    ("apo_zero", {}, [0.7550814, 1.1224593]),
    # apo_down: sigma(r_w) + 1 - sigma(beta h): pair 0: 0.6224593 + 1 - 0.7310586 = 0.8914008;
    #   pair 1: 0.5 + 1 - sigma(-0.5) = 1.5 - 0.3775407 = 1.1224593
    ("apo_down", {}, [0.8914008, 1.1224593]),
]


def test_names():
    assert preference.names() == sorted(["sigmoid", "cdpo", "robust", "hinge", "ipo", "sigmoid_norm", "sppo_hard",
                                         "nca_pair", "bco_pair", "apo_zero", "apo_down"])


def test_every_loss_has_a_hand_worked_case():
    assert {name for name, _, _ in HAND_WORKED} == set(preference.names())


@pytest.mark.parametrize("name, options, expected", HAND_WORKED)
def test_hand_worked(name, options, expected):
    loss, metrics = _compute(name, **options)
    assert loss.shape == (2,)
    assert loss.tolist() == pytest.approx(expected, abs=1e-6)
    assert metrics["loss"] == pytest.approx(sum(expected) / 2, abs=1e-6)


def test_metrics():
    # rewards beta * cl = [0.5, 0], beta * rl = [-0.5, 0.5]; margins [1, -0.5]; pair 0 wins, pair 1 loses.
    _, metrics = _compute("sigmoid")
    assert metrics == pytest.approx({
        "rewards/chosen": 0.25, "rewards/rejected": 0.0, "rewards/margins": 0.25, "rewards/accuracies": 0.5,
        "logps/chosen": -3.0, "logps/rejected": -3.5, "loss": (0.3132617 + 0.9740770) / 2,
    }, abs=1e-6)
    assert all(type(v) is float for v in metrics.values())


@pytest.mark.parametrize("name", ["sigmoid", "cdpo", "robust", "sigmoid_norm"])
def test_dpo_at_initialisation_is_ln2_with_zero_rewards(name):
    # policy == reference: h = 0, -log sigma(0) = ln 2 (cdpo/robust: label smoothing leaves ln 2 at h = 0).
    loss, metrics = _compute(name, pc=RC, pr=RR)
    assert loss.tolist() == pytest.approx([math.log(2)] * 2, rel=1e-12)
    assert metrics["rewards/chosen"] == metrics["rewards/rejected"] == metrics["rewards/margins"] == 0.0
    assert metrics["rewards/accuracies"] == 0.0  # a tie is not a win


def test_sigmoid_gradient_and_detached_reference():
    # d/dPC softplus(-beta h) = -beta sigma(-beta h): pair 0: -0.5 sigma(-1) = -0.5 * 0.2689414 = -0.1344707;
    # pair 1: -0.5 sigma(0.5) = -0.3112297. d/dPR is the negative. The reference gets no gradient.
    pc, pr = PC.clone().requires_grad_(True), PR.clone().requires_grad_(True)
    rc = RC.clone().requires_grad_(True)
    loss, _ = _compute("sigmoid", pc=pc, pr=pr, rc=rc)
    loss.sum().backward()
    assert pc.grad.tolist() == pytest.approx([-0.1344707, -0.3112297], abs=1e-6)
    assert pr.grad.tolist() == pytest.approx([0.1344707, 0.3112297], abs=1e-6)
    assert rc.grad is None


def test_sigmoid_matches_a_plain_loop():
    torch.manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, dtype=torch.float64) * 5 for _ in range(4))
    loss, _ = preference.compute("sigmoid", policy_chosen_logps=pc, policy_rejected_logps=pr, ref_chosen_logps=rc,
                                 ref_rejected_logps=rr, chosen_lengths=torch.ones(6), rejected_lengths=torch.ones(6),
                                 beta=0.1)
    for i in range(6):
        logit = 0.1 * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
        assert loss[i].item() == pytest.approx(-math.log(1.0 / (1.0 + math.exp(-logit))), rel=1e-12)


def test_ipo_length_normalize_clamps_zero_lengths_to_one():
    # A zero-length answer counts as length 1: h' = cl / 1 - rl / 1 = h, same as the unnormalised loss.
    loss, _ = preference.compute("ipo", policy_chosen_logps=PC, policy_rejected_logps=PR, ref_chosen_logps=RC,
                                 ref_rejected_logps=RR, chosen_lengths=torch.zeros(2), rejected_lengths=torch.zeros(2),
                                 beta=BETA, length_normalize=True)
    assert loss.tolist() == pytest.approx([1.0, 4.0])


def test_unknown_loss_lists_the_registered_ones():
    with pytest.raises(KeyError, match="unknown preference loss 'dpo'; registered: apo_down, apo_zero"):
        _compute("dpo")


def test_option_the_loss_does_not_take_names_the_loss_and_its_options():
    with pytest.raises(ValueError, match="preference loss 'sigmoid' does not take label_smoothing; it takes: no options"):
        _compute("sigmoid", label_smoothing=0.1)
    with pytest.raises(ValueError, match="'ipo' does not take delta; it takes: length_normalize"):
        _compute("ipo", delta=0.1)


def test_option_names():
    assert preference.option_names("cdpo") == {"label_smoothing"}
    assert preference.option_names("bco_pair") == {"delta"}
    assert preference.option_names("apo_zero") == set()


@pytest.mark.parametrize("name, eps", [("cdpo", 0.6), ("cdpo", -0.1), ("robust", 0.5)])
def test_label_smoothing_out_of_range(name, eps):
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        _compute(name, label_smoothing=eps)


def test_bad_beta_and_shapes():
    with pytest.raises(ValueError, match="beta must be > 0"):
        _compute("sigmoid", beta=0.0)
    with pytest.raises(ValueError, match=r"every input must be one \[P\] tensor"):
        _compute("sigmoid", pc=PC[:1])


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="preference loss 'sigmoid' is already registered"):
        preference.register("sigmoid")(lambda **_: None)
