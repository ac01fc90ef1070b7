"""PPO clipped policy loss: hand-worked clipping, metrics, gradients, a loop reference and errors."""

import math

import pytest
import torch

from engines.algorithms import losses

# Four tokens, the last outside the response. OLP = 0, so ratio = exp(LP).
#   t0: A = +1, LP = +0.5 -> ratio 1.64872 > 1.2: pg1 = -1.64872, pg2 = -1.2, max = -1.2  (clipped)
#   t1: A = -1, LP = -0.5 -> ratio 0.60653 < 0.8: pg1 = +0.60653, pg2 = +0.8, max = +0.8 (clipped)
#   t2: A = +2, LP =  0   -> ratio 1:           pg1 = pg2 = -2, max = -2                 (not clipped)
#   t3: outside the mask; LP = 100 would overflow exp in float32 if it were used.
# token-mean loss = (-1.2 + 0.8 - 2) / 3 = -0.8; clipfrac = 2/3;
# approx_kl = 0.5 * (0.25 + 0.25 + 0) / 3 = 0.083333; ratio_mean = (1.64872 + 0.60653 + 1) / 3 = 1.08508.
LP = torch.tensor([[0.5, -0.5, 0.0, 100.0]])  # [1, 4]
OLP = torch.zeros(1, 4)  # [1, 4]
A = torch.tensor([[1.0, -1.0, 2.0, 5.0]])  # [1, 4]
M = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # [1, 4]


def test_names():
    assert "ppo_clip" in losses.names()


def test_hand_worked_loss_and_metrics():
    loss, metrics = losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, response_mask=M)
    assert loss.item() == pytest.approx(-0.8, rel=1e-6)
    assert metrics == pytest.approx(
        {
            "actor/pg_loss": -0.8,
            "actor/clipfrac": 2 / 3,
            "actor/approx_kl": 0.25 / 3,
            "actor/ratio_mean": 1.0850839768,
        },
        rel=1e-6,
    )
    assert all(type(v) is float for v in metrics.values())


def test_gradient_flows_only_through_unclipped_tokens():
    lp = LP.clone().requires_grad_(True)
    loss, _ = losses.compute("ppo_clip", logprobs=lp, old_logprobs=OLP, advantages=A, response_mask=M)
    loss.backward()
    # Clipped t0, t1 and masked t3 get 0; t2: d/dLP (-A * exp(LP - OLP)) / 3 = -2 * 1 / 3 = -0.66667.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -2 / 3, 0.0]]))


@pytest.mark.parametrize(
    "adv, log_ratio, expected_tok_loss, clipped",
    [
        # A > 0, ratio 1.5 > 1.2: the gain is capped, loss = -1 * 1.2 = -1.2; pg2 (-1.2) > pg1 (-1.5) -> clipped.
        (1.0, math.log(1.5), -1.2, True),
        # A < 0, ratio 0.5 < 0.8: the gain is capped, loss = +1 * 0.8 = 0.8; pg2 (0.8) > pg1 (0.5) -> clipped.
        (-1.0, math.log(0.5), 0.8, True),
        # A > 0, ratio 0.5 < 0.8: pessimistic bound keeps the unclipped -0.5 (pg1 -0.5 > pg2 -0.8) -> not clipped.
        (1.0, math.log(0.5), -0.5, False),
        # A < 0, ratio 1.5 > 1.2: keeps the unclipped +1.5 (pg1 1.5 > pg2 1.2) -> not clipped.
        (-1.0, math.log(1.5), 1.5, False),
    ],
)
def test_clipping_per_sign(adv, log_ratio, expected_tok_loss, clipped):
    loss, metrics = losses.compute(
        "ppo_clip",
        logprobs=torch.tensor([[log_ratio]]),
        old_logprobs=torch.zeros(1, 1),
        advantages=torch.tensor([[adv]]),
        response_mask=torch.ones(1, 1),
    )
    assert loss.item() == pytest.approx(expected_tok_loss, rel=1e-6)
    assert metrics["actor/clipfrac"] == (1.0 if clipped else 0.0)


def test_asymmetric_clip_higher():
    # clip_high = 0.28: t0's ratio 1.64872 is capped at 1.28 -> -1.28; t1 capped below at 1 - 0.2 = 0.8.
    # token-mean = (-1.28 + 0.8 - 2) / 3 = -0.82667
    loss, _ = losses.compute(
        "ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, response_mask=M, clip_low=0.2, clip_high=0.28
    )
    assert loss.item() == pytest.approx(-2.48 / 3, rel=1e-6)


def test_agg_mode_and_options_are_passed_through():
    # Two rows: row 0 is the hand-worked row (token losses [-1.2, 0.8, -2]), row 1 one token with
    # A = 1, ratio 1 -> loss -1.
    lp = torch.cat([LP, torch.zeros(1, 4)])
    olp = torch.zeros(2, 4)
    adv = torch.cat([A, torch.tensor([[1.0, 0.0, 0.0, 0.0]])])
    mask = torch.cat([M, torch.tensor([[1.0, 0.0, 0.0, 0.0]])])
    kwargs = dict(logprobs=lp, old_logprobs=olp, advantages=adv, response_mask=mask)
    # seq-mean-token-mean: row means [-2.4 / 3 = -0.8, -1] -> -0.9
    loss, metrics = losses.compute("ppo_clip", agg="seq-mean-token-mean", **kwargs)
    assert loss.item() == pytest.approx(-0.9, rel=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(-0.9, rel=1e-6)
    # Dr.GRPO with norm = 10: (-2.4 - 1) / (2 * 10) = -0.17
    loss, _ = losses.compute("ppo_clip", agg="seq-mean-token-sum-norm", agg_options={"norm": 10}, **kwargs)
    assert loss.item() == pytest.approx(-0.17, rel=1e-6)


def _loop_reference(lp, olp, adv, mask, clip_low=0.2, clip_high=0.2):
    """Token-by-token PPO-clip with token-mean aggregation in plain python."""
    total, count, clipped = 0.0, 0, 0
    for lp_r, olp_r, a_r, m_r in zip(lp, olp, adv, mask):
        for x, y, a, m in zip(lp_r, olp_r, a_r, m_r):
            if m == 0:
                continue
            ratio = math.exp(x - y)
            pg1 = -a * ratio
            pg2 = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            total += max(pg1, pg2)
            clipped += pg2 > pg1
            count += 1
    return total / count, clipped / count


def test_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    B, L = 6, 11
    olp = -torch.rand(B, L, generator=gen, dtype=torch.float64) * 3
    lp = olp + 0.4 * torch.randn(B, L, generator=gen, dtype=torch.float64)  # ratios both sides of the clip
    adv = torch.randn(B, L, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float64)
    loss, metrics = losses.compute(
        "ppo_clip", logprobs=lp, old_logprobs=olp, advantages=adv, response_mask=mask, clip_low=0.2, clip_high=0.3
    )
    expected_loss, expected_clipfrac = _loop_reference(
        lp.tolist(), olp.tolist(), adv.tolist(), mask.tolist(), clip_low=0.2, clip_high=0.3
    )
    assert 0 < expected_clipfrac < 1  # the random batch exercises both branches
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert metrics["actor/clipfrac"] == pytest.approx(expected_clipfrac, rel=1e-12)


def test_outside_mask_never_matters():
    # Changing LP, OLP and A on the masked-out t3 (to huge values) changes nothing, and gives no NaN.
    outside = torch.tensor([[0.0, 0.0, 0.0, 1e4]])
    loss_a, metrics_a = losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, response_mask=M)
    loss_b, metrics_b = losses.compute(
        "ppo_clip", logprobs=LP + outside, old_logprobs=OLP - outside, advantages=A + outside, response_mask=M
    )
    assert torch.isfinite(loss_b)
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-6)
    assert metrics_b == pytest.approx(metrics_a, rel=1e-6)


def test_unknown_name_lists_names():
    with pytest.raises(KeyError, match="ppo_clip"):
        losses.compute("ppo", logprobs=LP, old_logprobs=OLP, advantages=A, response_mask=M)


def test_unknown_option_is_type_error():
    with pytest.raises(TypeError, match="clip_ratio"):
        losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, response_mask=M, clip_ratio=0.2)
