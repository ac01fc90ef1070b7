"""Off-policy corrections (engines.algorithms.corrections) and the CISPO loss: formulas on hand-worked numbers,
the identity at ρ ≡ 1, how a train batch carries them, and their config checks."""

from __future__ import annotations

import math

import pytest
import torch

from engines.algorithms import corrections, losses

# Two rows; row 1's last token is padding (its garbage log-ratio of 40 must never count).
#   log ρ = log π_prox - log μ:   row 0: [ln 3, ln 0.5, 0]      row 1: [ln 0.25, ln 1.5, (40)]
#   token ratios ρ:               row 0: [3, 0.5, 1]            row 1: [0.25, 1.5]
#   sequence products Π ρ:        row 0: 1.5                    row 1: 0.375
#   geometric means:              row 0: 1.5^(1/3) = 1.1447     row 1: 0.375^(1/2) = 0.6124
MU = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.7, -9.0]], dtype=torch.float64)
LOG_RHO = torch.tensor([[math.log(3.0), math.log(0.5), 0.0], [math.log(0.25), math.log(1.5), 40.0]], dtype=torch.float64)
PROX = MU + LOG_RHO
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def _apply(name, **options):
    return corrections.compute(name, prox_logprobs=PROX, rollout_logprobs=MU, loss_mask=MASK, **options)


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# name, options, weights, keep, (masked_fraction, clipped_fraction, weight_mean over kept tokens)
HAND_WORKED = [
    ("tis", {"cap": 2.0}, [[2.0, 0.5, 1.0], [0.25, 1.5, 1.0]], [[1, 1, 1], [1, 1, 0]], (0.0, 1 / 5, 5.25 / 5)),
    ("icepop", {"low": 0.4, "high": 2.5}, [[3.0, 0.5, 1.0], [0.25, 1.5, 1.0]], [[0, 1, 1], [0, 1, 0]], (2 / 5, 0.0, 3.0 / 3)),
    ("seq_tis", {"cap": 1.2}, [[1.2, 1.2, 1.2], [0.375, 0.375, 1.0]], [[1, 1, 1], [1, 1, 0]],
     (0.0, 3 / 5, (3 * 1.2 + 2 * 0.375) / 5)),
    ("seq_mis", {"cap": 1.2}, [[1.5, 1.5, 1.5], [0.375, 0.375, 1.0]], [[0, 0, 0], [1, 1, 0]], (3 / 5, 0.0, 0.375)),
    ("geo_mask", {"low": 0.6, "high": 1.1}, [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[0, 0, 0], [1, 1, 0]], (3 / 5, 0.0, 1.0)),
    ("decoupled_ppo", {"cap": 2.0}, [[3.0, 0.5, 1.0], [0.25, 1.5, 1.0]], [[0, 1, 1], [1, 1, 0]], (1 / 5, 0.0, 3.25 / 4)),
]


def test_registered_corrections():
    assert corrections.names() == ["decoupled_ppo", "geo_mask", "icepop", "seq_mis", "seq_tis", "tis"]
    assert sorted(case[0] for case in HAND_WORKED) == corrections.names()


@pytest.mark.parametrize("name, options, weights, keep, figures", HAND_WORKED, ids=[c[0] for c in HAND_WORKED])
def test_hand_worked(name, options, weights, keep, figures):
    got_weights, got_keep, metrics = _apply(name, **options)
    torch.testing.assert_close(got_weights, _t(weights), rtol=1e-12, atol=0)
    torch.testing.assert_close(got_keep, _t(keep), rtol=0, atol=0)
    masked, clipped, weight_mean = figures
    assert metrics["offpolicy/masked_fraction"] == pytest.approx(masked, rel=1e-12, abs=1e-15)
    assert metrics["offpolicy/clipped_fraction"] == pytest.approx(clipped, rel=1e-12, abs=1e-15)
    assert metrics["offpolicy/weight_mean"] == pytest.approx(weight_mean, rel=1e-12)


@pytest.mark.invariant
@pytest.mark.parametrize("name", corrections.names())
def test_identity_when_rollout_policy_is_the_proximal_one(name):
    # ρ ≡ 1: every weight 1, every response token kept, nothing reported as masked or clipped.
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).float()
    weights, keep, metrics = corrections.compute(name, prox_logprobs=logprobs, rollout_logprobs=logprobs.clone(),
                                                 loss_mask=mask)
    assert torch.equal(weights, torch.ones_like(weights)) and torch.equal(keep, mask)
    assert metrics == {"offpolicy/masked_fraction": 0.0, "offpolicy/clipped_fraction": 0.0, "offpolicy/weight_mean": 1.0}


@pytest.mark.parametrize("name", corrections.names())
def test_padding_never_counts(name):
    # Whatever sits outside the mask (here log-ratios of ±60), the response tokens' results do not change.
    clean, garbage = MU.clone(), MU.clone()
    garbage[1, 2] -= 60.0
    a = corrections.compute(name, prox_logprobs=PROX, rollout_logprobs=clean, loss_mask=MASK)
    b = corrections.compute(name, prox_logprobs=PROX, rollout_logprobs=garbage, loss_mask=MASK)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert a[2] == b[2]


@pytest.mark.parametrize("name, options, message", [
    ("tis", {"cap": 0.5}, "changes on-policy tokens"),
    ("icepop", {"low": 1.2, "high": 5.0}, "changes on-policy tokens"),
    ("geo_mask", {"low": 0.5, "high": 0.9}, "changes on-policy tokens"),
    ("seq_mis", {"cap": 0.9}, "changes on-policy tokens"),
    ("tis", {"cpa": 2.0}, "does not take cpa; it takes: cap"),
])
def test_check_refuses_options_that_touch_on_policy_tokens(name, options, message):
    with pytest.raises(ValueError, match=message):
        corrections.check(name, options)


def test_is_weights_multiply_the_policy_term_and_rejected_tokens_leave_the_mean():
    # icepop (0.4, 2.5) on the hand-worked batch; LP = OLP = π_prox, so each ppo_clip token loss is -A.
    #   A = 1 everywhere; kept tokens: row 0 [_, 0.5, 1], row 1 [_, 1.5] -> token-mean over the 3 kept
    #   = -(0.5 + 1 + 1.5) / 3 = -1.0; the gradient on a kept token is -w / 3, 0 on rejected ones.
    weights, keep, _ = _apply("icepop", low=0.4, high=2.5)
    lp = PROX.clone().requires_grad_(True)
    loss, _ = losses.compute("ppo_clip", logprobs=lp, old_logprobs=PROX, advantages=torch.ones_like(MASK),
                             loss_mask=MASK * keep, is_weights=weights)
    assert loss.item() == pytest.approx(-1.0, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, _t([[0.0, -0.5 / 3, -1 / 3], [0.0, -0.5, 0.0]]), rtol=1e-12, atol=0)


def test_tis_cap_is_the_tis_correction():
    weights, _, _ = _apply("tis", cap=2.0)
    torch.testing.assert_close(losses.truncated_is_weights(PROX, MU, MASK, cap=2.0), weights, rtol=0, atol=0)


def test_mismatch_metrics_mean_abs_and_k3():
    # |log ρ| on the 5 tokens: ln 3, ln 2, 0, ln 4, ln 1.5; k3 = ρ - 1 - ln ρ per token.
    metrics = losses.mismatch_metrics(PROX, MU, MASK)
    abs_mean = (math.log(3) + math.log(2) + math.log(4) + math.log(1.5)) / 5
    k3 = sum(r - 1 - math.log(r) for r in (3.0, 0.5, 1.0, 0.25, 1.5)) / 5
    assert metrics["mismatch/mean_abs_logprob_diff"] == pytest.approx(abs_mean, rel=1e-12)
    assert metrics["mismatch/k3"] == pytest.approx(k3, rel=1e-12)


# -- CISPO ---------------------------------------------------------------------------------------------------


def test_cispo_hand_worked():
    # ratios exp(LP - OLP) = [2, 0.5, 1.1] (clip_low 1: no lower bound, clip_high 0.28: at most 1.28)
    #   -> stop-gradient weights [1.28, 0.5, 1.1]; A = [1, -2, 3]; loss_t = -w A LP
    #   gradient of the token-mean over 3 tokens: -w A / 3 = [-1.28/3, 1/3, -1.1]; clipfrac 1/3
    olp = _t([[-1.0, -1.0, -1.0]])
    lp = (olp + _t([[math.log(2.0), math.log(0.5), math.log(1.1)]])).requires_grad_(True)
    adv, mask = _t([[1.0, -2.0, 3.0]]), torch.ones(1, 3, dtype=torch.float64)
    loss, metrics = losses.compute("cispo", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask)
    expected = -(1.28 * 1 * lp[0, 0] + 0.5 * -2 * lp[0, 1] + 1.1 * 3 * lp[0, 2]).item() / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["actor/clipfrac"] == pytest.approx(1 / 3, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, _t([[-1.28 / 3, 1 / 3, -1.1]]), rtol=1e-12, atol=0)


def test_cispo_gradient_at_ratio_one_is_ppo_clip_gradient():
    gen = torch.Generator().manual_seed(1)
    olp = -torch.rand(4, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=gen) > 0.2).to(torch.float64)
    grads = []
    for name in ("cispo", "ppo_clip"):
        lp = olp.clone().requires_grad_(True)
        loss, _ = losses.compute(name, logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask)
        loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)


# -- config ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.correction=icepop"], "set algorithm.old_logprobs=trainer"),
    (["algorithm.correction=icepp", "algorithm.old_logprobs=trainer"], "did you mean 'icepop'"),
    (["algorithm.correction=tis", "algorithm.old_logprobs=trainer", "algorithm.correction_options.cap=0.5"],
     "changes on-policy tokens"),
    (["algorithm.correction_options.cap=2"], "correction_options without a correction"),
])
def test_config_refuses_corrections_without_effect_or_unknown(overrides, message):
    from configs.loader import load_config

    with pytest.raises(ValueError, match=message):
        load_config("configs/tiny.yaml", overrides)


def test_config_correction_reaches_the_advantage_spec():
    from configs.loader import load_config
    from flows.rlvr import build_advantage_spec

    config = load_config("configs/tiny.yaml", ["algorithm.correction=seq_mis", "algorithm.old_logprobs=trainer",
                                               "algorithm.correction_options.cap=3"])
    spec = build_advantage_spec(config, pad_token_id=0)
    assert (spec.correction, spec.correction_options) == ("seq_mis", {"cap": 3.0})


def test_advantage_batch_carries_weights_and_drops_rejected_tokens():
    from engines.batches import AdvantageSpec, advantage_batch
    from tests.engines.test_reward_worker import _rollouts

    # Two rows of 2 response tokens (positions 2, 3) sampled at log μ = -1; the trainer's π_prox gives
    # ρ = [3, 0.5] and [1, 4]; icepop (0.4, 2.5) keeps [0.5] and [1] only.
    rollouts = _rollouts([2, 2])
    prox = torch.tensor([[0.0, 0.0, -1 + math.log(3.0), -1 + math.log(0.5)], [0.0, 0.0, -1.0, -1 + math.log(4.0)]])
    spec = AdvantageSpec("grpo", pad_token_id=0, correction="icepop", correction_options={"low": 0.4, "high": 2.5})
    batch, summary, _ = advantage_batch(rollouts, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), spec, old_logprobs=prox)
    torch.testing.assert_close(batch.loss_mask[:, 2:4], torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    torch.testing.assert_close(batch.tensors["is_weights"][:, 2:4], torch.tensor([[3.0, 0.5], [1.0, 4.0]]))
    assert batch.tensors["advantages"][0, 2] == 0 and batch.tensors["advantages"][1, 3] == 0  # rejected: out of the loss
    assert summary["offpolicy/masked_fraction"] == pytest.approx(0.5)
    assert summary["offpolicy/weight_mean"] == pytest.approx(0.75)
