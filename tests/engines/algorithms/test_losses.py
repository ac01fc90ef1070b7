"""Policy losses (ppo_clip with dual-clip, gspo, topr), value loss and truncated IS: hand-worked values,
metrics, gradients, plain-loop references, masking and errors."""

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
# approx_kl = 0.5 * (0.25 + 0.25 + 0) / 3 = 0.083333; ratio_mean = (1.64872 + 0.60653 + 1) / 3 = 1.08508;
# ratio_max = e^0.5 = 1.64872, ratio_min = e^-0.5 = 0.60653 (t3's e^100 is outside the mask).
LP = torch.tensor([[0.5, -0.5, 0.0, 100.0]])  # [1, 4]
OLP = torch.zeros(1, 4)  # [1, 4]
A = torch.tensor([[1.0, -1.0, 2.0, 5.0]])  # [1, 4]
M = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # [1, 4]


def test_names():
    assert "ppo_clip" in losses.names()


def test_hand_worked_loss_and_metrics():
    loss, metrics = losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, loss_mask=M)
    assert loss.item() == pytest.approx(-0.8, rel=1e-6)
    assert metrics == pytest.approx(
        {
            "actor/pg_loss": -0.8,
            "actor/clipfrac": 2 / 3,
            "actor/dual_clipfrac": 0.0,  # dual_clip is off by default
            "actor/approx_kl": 0.25 / 3,
            "actor/ratio_mean": 1.0850839768,
            "actor/ratio_max": math.exp(0.5),
            "actor/ratio_min": math.exp(-0.5),
        },
        rel=1e-6,
    )
    assert all(type(v) is float for v in metrics.values())


def test_gradient_flows_only_through_unclipped_tokens():
    lp = LP.clone().requires_grad_(True)
    loss, _ = losses.compute("ppo_clip", logprobs=lp, old_logprobs=OLP, advantages=A, loss_mask=M)
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
        loss_mask=torch.ones(1, 1),
    )
    assert loss.item() == pytest.approx(expected_tok_loss, rel=1e-6)
    assert metrics["actor/clipfrac"] == (1.0 if clipped else 0.0)


def test_asymmetric_clip_higher():
    # clip_high = 0.28: t0's ratio 1.64872 is capped at 1.28 -> -1.28; t1 capped below at 1 - 0.2 = 0.8.
    # token-mean = (-1.28 + 0.8 - 2) / 3 = -0.82667
    loss, _ = losses.compute(
        "ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, loss_mask=M, clip_low=0.2, clip_high=0.28
    )
    assert loss.item() == pytest.approx(-2.48 / 3, rel=1e-6)


def test_agg_mode_and_options_are_passed_through():
    # Two rows: row 0 is the hand-worked row (token losses [-1.2, 0.8, -2]), row 1 one token with
    # A = 1, ratio 1 -> loss -1.
    lp = torch.cat([LP, torch.zeros(1, 4)])
    olp = torch.zeros(2, 4)
    adv = torch.cat([A, torch.tensor([[1.0, 0.0, 0.0, 0.0]])])
    mask = torch.cat([M, torch.tensor([[1.0, 0.0, 0.0, 0.0]])])
    kwargs = dict(logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask)
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


@pytest.mark.invariant
def test_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    B, L = 6, 11
    olp = -torch.rand(B, L, generator=gen, dtype=torch.float64) * 3
    lp = olp + 0.4 * torch.randn(B, L, generator=gen, dtype=torch.float64)  # ratios both sides of the clip
    adv = torch.randn(B, L, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float64)
    loss, metrics = losses.compute(
        "ppo_clip", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask, clip_low=0.2, clip_high=0.3
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
    loss_a, metrics_a = losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, loss_mask=M)
    loss_b, metrics_b = losses.compute(
        "ppo_clip", logprobs=LP + outside, old_logprobs=OLP - outside, advantages=A + outside, loss_mask=M
    )
    assert torch.isfinite(loss_b)
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-6)
    assert metrics_b == pytest.approx(metrics_a, rel=1e-6)


def test_unknown_name_lists_names():
    with pytest.raises(KeyError, match="ppo_clip"):
        losses.compute("ppo", logprobs=LP, old_logprobs=OLP, advantages=A, loss_mask=M)


def test_unknown_option_is_type_error():
    with pytest.raises(TypeError, match="clip_ratio"):
        losses.compute("ppo_clip", logprobs=LP, old_logprobs=OLP, advantages=A, loss_mask=M, clip_ratio=0.2)


# -- shared helpers -------------------------------------------------------------------------------------


def _random_policy_batch(seed: int, *, B: int = 9, L: int = 10, per_row_adv: bool = False, empty_row: bool = True):
    """Random float64 batch: 0-2 prompt tokens, a response, right padding; row 1 optionally has no response
    (as after DAPO's overlong filter). ``per_row_adv``: one advantage per row, 0 outside the mask (what the
    outcome estimators produce); otherwise dense per-token noise, also outside the mask."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 3, (B,), generator=gen)
    lengths = torch.randint(1, L - 1, (B,), generator=gen)
    pos = torch.arange(L)[None, :]
    mask = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).to(torch.float64)  # [B, L]
    if empty_row:
        mask[1] = 0.0
    olp = -torch.rand(B, L, generator=gen, dtype=torch.float64) * 3  # [B, L]
    lp = olp + 0.4 * torch.randn(B, L, generator=gen, dtype=torch.float64)  # ratios on both sides of a clip
    rlp = olp + 0.5 * torch.randn(B, L, generator=gen, dtype=torch.float64)  # the sampler's logprobs
    if per_row_adv:
        adv = torch.randn(B, 1, generator=gen, dtype=torch.float64) * mask
    else:
        adv = torch.randn(B, L, generator=gen, dtype=torch.float64)
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 0).any()
    return lp, olp, rlp, adv, mask


def _loop_aggregate(token_losses, mask, agg):
    """token-mean / seq-mean-token-mean in plain python (see test_aggregation.py)."""
    rows = [[x for x, m in zip(xr, mr) if m] for xr, mr in zip(token_losses, mask)]
    if agg == "token-mean":
        return sum(sum(r) for r in rows) / max(sum(len(r) for r in rows), 1)
    if agg == "seq-mean-token-mean":
        return sum(sum(r) / len(r) if r else 0.0 for r in rows) / len(rows)
    raise AssertionError(agg)


def _row_advantage(adv_row, mask_row):
    """A_i of a row whose advantage is constant on the response (None for an empty row)."""
    on = [a for a, m in zip(adv_row, mask_row) if m]
    return on[0] if on else None


# -- ppo_clip: dual-clip ---------------------------------------------------------------------------------

# Three tokens, OLP = 0 so ratio = exp(LP), clip 0.2, dual_clip 3:
#   t0: A = -1, ratio 5: pg1 = 5, pg2 = 1 * 1.2 = 1.2, max = 5 -> min(5, -A * 3 = 3) = 3  (dual-clipped)
#   t1: A = -1, ratio 2: pg1 = 2, pg2 = 1.2, max = 2 -> min(2, 3) = 2                      (unclipped)
#   t2: A = +1, ratio 5: pg1 = -5, pg2 = -1.2, max = -1.2; A > 0 so no dual clip           (clipped)
# token-mean = (3 + 2 - 1.2) / 3 = 1.266667; clipfrac = 1/3 (t2 only: pg2 > pg1); dual_clipfrac = 1/3 (t0).
DUAL_LP = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], dtype=torch.float64)
DUAL_A = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)


def test_dual_clip_hand_worked():
    lp = DUAL_LP.clone().requires_grad_(True)
    loss, metrics = losses.compute("ppo_clip", logprobs=lp, old_logprobs=torch.zeros_like(DUAL_LP), advantages=DUAL_A,
                                   loss_mask=torch.ones_like(DUAL_LP), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.8 / 3, rel=1e-12)
    assert metrics["actor/clipfrac"] == pytest.approx(1 / 3)
    assert metrics["actor/dual_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # t0: dual-clipped loss -A * 3 is constant -> 0; t1: d(-A * exp(LP)) / dLP / 3 = 2 / 3; t2: clipped -> 0.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2 / 3, 0.0]], dtype=torch.float64))
    # Without dual_clip, t0 keeps its unbounded 5: (5 + 2 - 1.2) / 3 = 1.933333.
    loss, metrics = losses.compute("ppo_clip", logprobs=DUAL_LP, old_logprobs=torch.zeros_like(DUAL_LP),
                                   advantages=DUAL_A, loss_mask=torch.ones_like(DUAL_LP))
    assert loss.item() == pytest.approx(5.8 / 3, rel=1e-12)
    assert metrics["actor/dual_clipfrac"] == 0.0


@pytest.mark.parametrize("dual_clip", [1.0, 0.5, -3.0])
def test_dual_clip_at_most_one_raises(dual_clip):
    with pytest.raises(ValueError, match="dual_clip"):
        losses.compute("ppo_clip", logprobs=DUAL_LP, old_logprobs=torch.zeros_like(DUAL_LP), advantages=DUAL_A,
                       loss_mask=torch.ones_like(DUAL_LP), dual_clip=dual_clip)


def _ppo_loop(lp, olp, adv, mask, clip_low, clip_high, dual_clip):
    """PPO-clip (+ dual-clip) per token from the docstring: token losses, d loss_t / d LP_t, metrics."""
    tok, grad = [], []
    clipped = dual = kl_sum = ratio_sum = count = 0
    for lp_r, olp_r, a_r, m_r in zip(lp, olp, adv, mask):
        tok.append([]), grad.append([])
        for x, y, a, m in zip(lp_r, olp_r, a_r, m_r):
            if not m:
                tok[-1].append(0.0), grad[-1].append(0.0)
                continue
            ratio = math.exp(x - y)
            pg1, pg2 = -a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            pg, g = (pg1, -a * ratio) if pg1 >= pg2 else (pg2, 0.0)  # the clamp has no slope where it is active
            if dual_clip and a < 0 and pg > -a * dual_clip:
                pg, g, dual = -a * dual_clip, 0.0, dual + 1
            tok[-1].append(pg), grad[-1].append(g)
            clipped += pg2 > pg1
            kl_sum += 0.5 * (x - y) ** 2
            ratio_sum += ratio
            count += 1
    metrics = {"actor/clipfrac": clipped / count, "actor/dual_clipfrac": dual / count,
               "actor/approx_kl": kl_sum / count, "actor/ratio_mean": ratio_sum / count}
    return tok, grad, metrics, count


@pytest.mark.invariant
@pytest.mark.parametrize("dual_clip", [0.0, 1.5, 3.0])
def test_ppo_clip_with_dual_clip_matches_loop_reference(dual_clip):
    lp, olp, _, adv, mask = _random_policy_batch(20, B=12, L=11)
    lp = olp + 0.8 * (lp - olp)  # wider ratios so that dual-clip (ratio > dual_clip) happens
    lp.requires_grad_(True)
    loss, metrics = losses.compute("ppo_clip", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask,
                                   clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    tok, grad, exp_metrics, count = _ppo_loop(lp.tolist(), olp.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, dual_clip)
    if dual_clip == 1.5:
        assert 0 < exp_metrics["actor/dual_clipfrac"] < exp_metrics["actor/clipfrac"] < 1
    assert loss.item() == pytest.approx(_loop_aggregate(tok, mask.tolist(), "token-mean"), rel=1e-12)
    assert {k: metrics[k] for k in exp_metrics} == pytest.approx(exp_metrics, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64) / count, rtol=1e-12, atol=1e-15)


# -- gspo -----------------------------------------------------------------------------------------------

# Row 0: prompt t0, response t1..t2, pad t3; LP - OLP on the response = [0.1, 0.3], A = +1.
#   log s = (0.1 + 0.3) / 2 = 0.2, s = exp(0.2) = 1.2214028 > 1.2 -> loss = max(-1.2214, -1.2) = -1.2 (clipped)
# Row 1: response t0..t2, pad t3; LP - OLP = [-0.3, 0, 0], A = -0.5.
#   log s = -0.1, s = 0.9048374 (inside [0.8, 1.2]) -> loss = 0.5 * 0.9048374 = 0.4524187 on each token
# seq-mean-token-mean: (-1.2 + 0.4524187) / 2 = -0.3737906; clipfrac = 1/2 rows;
# seq_ratio_mean = (1.2214028 + 0.9048374) / 2 = 1.0631201.
GSPO_OLP = torch.tensor([[-9.0, -1.0, -2.0, -9.0], [-0.5, -1.0, -1.5, -9.0]], dtype=torch.float64)
GSPO_LP = GSPO_OLP + torch.tensor([[40.0, 0.1, 0.3, 40.0], [-0.3, 0.0, 0.0, 40.0]], dtype=torch.float64)
GSPO_A = torch.tensor([[0.0, 1.0, 1.0, 0.0], [-0.5, -0.5, -0.5, 0.0]], dtype=torch.float64)
GSPO_M = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_gspo_hand_worked():
    lp = GSPO_LP.clone().requires_grad_(True)
    loss, metrics = losses.compute("gspo", logprobs=lp, old_logprobs=GSPO_OLP, advantages=GSPO_A,
                                   loss_mask=GSPO_M, agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    assert loss.item() == pytest.approx((-1.2 + 0.5 * s1) / 2, rel=1e-12)
    assert metrics["actor/clipfrac"] == 0.5
    assert metrics["actor/seq_ratio_mean"] == pytest.approx((s0 + s1) / 2, rel=1e-12)
    assert (metrics["actor/ratio_max"], metrics["actor/ratio_min"]) == pytest.approx((s0, s1), rel=1e-12)  # sequence ratios
    loss.backward()
    # Row 0 is clipped -> no gradient. Row 1: d/dLP_t of (1/2) * (1/3) * sum_t (-A * s_t), with
    # ds_t/dLP_t = s (the token form) -> 0.5 * 0.9048374 / 6 = 0.0754031 per response token; 0 outside.
    g = 0.5 * s1 / 6
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0, 0.0], [g, g, g, 0.0]], dtype=torch.float64))


def _gspo_sequence_objective(lp, olp, row_adv, mask, clip_low, clip_high):
    """GSPO's sequence-level loss (Zheng et al. 2025, eq. 5-7) written directly, for autograd:
    s_i = (pi / pi_old)^(1 / |o_i|), loss = mean_i max(-A_i s_i, -A_i clip(s_i))."""
    lengths = mask.sum(-1)
    s = torch.exp(((lp - olp) * mask).sum(-1) / lengths)  # [B]
    return torch.maximum(-row_adv * s, -row_adv * s.clamp(1 - clip_low, 1 + clip_high)).mean()


@pytest.mark.invariant
def test_gspo_token_form_gradient_equals_sequence_level_gradient():
    lp, olp, _, adv, mask = _random_policy_batch(21, B=10, per_row_adv=True, empty_row=False)
    row_adv = (adv * mask).sum(-1) / mask.sum(-1)  # [B], A constant per row
    lp_token = lp.clone().requires_grad_(True)
    lp_seq = lp.clone().requires_grad_(True)
    loss_token, metrics = losses.compute("gspo", logprobs=lp_token, old_logprobs=olp, advantages=adv,
                                         loss_mask=mask, agg="seq-mean-token-mean", clip_low=0.05, clip_high=0.08)
    loss_seq = _gspo_sequence_objective(lp_seq, olp, row_adv, mask, 0.05, 0.08)
    assert 0 < metrics["actor/clipfrac"] < 1  # both branches exercised
    assert loss_token.item() == pytest.approx(loss_seq.item(), rel=1e-12)
    loss_token.backward()
    loss_seq.backward()
    torch.testing.assert_close(lp_token.grad, lp_seq.grad, rtol=1e-10, atol=1e-14)
    assert (lp_token.grad[mask == 0] == 0).all()


@pytest.mark.invariant
def test_gspo_matches_loop_reference():
    lp, olp, _, adv, mask = _random_policy_batch(22, B=12, per_row_adv=True)
    lp.requires_grad_(True)
    loss, metrics = losses.compute("gspo", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask,
                                   agg="seq-mean-token-mean", clip_low=0.04, clip_high=0.06)
    B = len(mask)
    row_losses, grad, clipped, ratios = [], [], 0, []
    for lp_r, olp_r, a_r, m_r in zip(lp.tolist(), olp.tolist(), adv.tolist(), mask.tolist()):
        n = sum(m_r)
        a = _row_advantage(a_r, m_r)
        if a is None:  # no response tokens: counts 0 in the seq-mean, no gradient, not in the metrics
            row_losses.append(0.0), grad.append([0.0] * len(m_r))
            continue
        log_s = sum((x - y) for x, y, m in zip(lp_r, olp_r, m_r) if m) / n
        s = math.exp(min(max(log_s, -20.0), 20.0))
        pg1, pg2 = -a * s, -a * min(max(s, 1 - 0.04), 1 + 0.06)
        row_losses.append(max(pg1, pg2))  # the same value on every token, so the token mean is this
        g = -a * s / n / B if pg1 >= pg2 else 0.0
        grad.append([g if m else 0.0 for m in m_r])
        clipped += pg2 > pg1
        ratios.append(s)
    assert 0 < clipped < len(ratios)
    assert loss.item() == pytest.approx(sum(row_losses) / B, rel=1e-12)
    assert metrics["actor/clipfrac"] == pytest.approx(clipped / len(ratios), rel=1e-12)
    assert metrics["actor/seq_ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-10, atol=1e-15)


# -- topr (loss) ----------------------------------------------------------------------------------------

# Row 0: A = +2 on t1..t2 (prompt t0, pad t3), LP - OLP sum = 0.5 + 0.5 = 1 (ratio e): positive -> c = 1
#   token losses -1 * 2 * LP = -2 * [-0.5, -1.0] = [1.0, 2.0]
# Row 1: A = -1 on t0..t1, LP - OLP = [-0.6931472, 0] -> rho = 0.5 < 1 -> c = 0.5
#   token losses -0.5 * -1 * LP = 0.5 * [-1.0, -0.5] = [-0.5, -0.25]
# Row 2: A = -1 on t0..t2, LP - OLP = [0.2, 0, 0.2] -> rho = exp(0.4) = 1.4918 > 1 -> c = 1 (capped)
#   token losses 1 * [-0.1, -0.2, -0.3]
# token-mean over 7 tokens: (1 + 2 - 0.5 - 0.25 - 0.1 - 0.2 - 0.3) / 7 = 1.65 / 7 = 0.2357143
# negative_frac = 2/3 rows; negative_weight_mean = (0.5 + 1) / 2 = 0.75
TOPR_LP = torch.tensor([[-30.0, -0.5, -1.0, -30.0], [-1.0, -0.5, -30.0, -30.0], [-0.1, -0.2, -0.3, -30.0]],
                       dtype=torch.float64)
TOPR_OLP = torch.tensor([[-1.0, -1.0, -1.5, 0.0], [-1.0 + math.log(2.0), -0.5, 0.0, 0.0], [-0.3, -0.2, -0.5, 0.0]],
                        dtype=torch.float64)
TOPR_A = torch.tensor([[0.0, 2.0, 2.0, 0.0], [-1.0, -1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
TOPR_M = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_topr_loss_hand_worked():
    lp = TOPR_LP.clone().requires_grad_(True)
    loss, metrics = losses.compute("topr", logprobs=lp, old_logprobs=TOPR_OLP, advantages=TOPR_A, loss_mask=TOPR_M)
    assert loss.item() == pytest.approx(1.65 / 7, rel=1e-12)
    assert metrics["actor/negative_frac"] == pytest.approx(2 / 3)
    assert metrics["actor/negative_weight_mean"] == pytest.approx(0.75, rel=1e-12)
    # Sequence log-ratios: row 0: 0.5 + 0.5 = 1; row 1: -ln 2; row 2: 0.2 + 0 + 0.2 = 0.4. Of the negative
    # rows (1, 2) only row 2's ratio e^0.4 > 1 is truncated: 1/3 of the rows.
    assert metrics["actor/truncated_frac"] == pytest.approx(1 / 3)
    assert (metrics["actor/ratio_max"], metrics["actor/ratio_min"]) == pytest.approx((math.e, 0.5), rel=1e-12)
    # approx_kl: 0.5 * (0.25 + 0.25 + ln(2)^2 + 0 + 0.04 + 0 + 0.04) / 7 response tokens
    assert metrics["actor/approx_kl"] == pytest.approx(0.5 * (0.58 + math.log(2) ** 2) / 7, rel=1e-6)
    loss.backward()
    # d loss / d LP_t = -c_i * A_i / 7 with c_i detached (no gradient through the ratio):
    #   row 0 (positive, no ratio): -2 / 7; row 1 (rho 0.5): 0.5 / 7; row 2 (rho 1.49 capped at 1): 1 / 7
    expected = torch.tensor([[0.0, -2.0, -2.0, 0.0], [0.5, 0.5, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64) / 7
    torch.testing.assert_close(lp.grad, expected)


def test_topr_positive_rows_ignore_the_ratio():
    # A positive row's loss and gradient are those of SFT weighted by A, whatever OLP is.
    lp = TOPR_LP[:1].clone().requires_grad_(True)
    for shift in (-5.0, 0.0, 5.0):
        lp.grad = None
        loss, _ = losses.compute("topr", logprobs=lp, old_logprobs=TOPR_OLP[:1] + shift, advantages=TOPR_A[:1],
                                 loss_mask=TOPR_M[:1])
        loss.backward()
        assert loss.item() == pytest.approx(3.0 / 2, rel=1e-12)  # (1 + 2) / 2 tokens
        torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0, -1.0, 0.0]], dtype=torch.float64))


@pytest.mark.invariant
def test_topr_loss_matches_loop_reference():
    lp, olp, _, adv, mask = _random_policy_batch(23, B=14, per_row_adv=True)
    lp = olp + 0.25 * (lp - olp)  # sequence ratios on both sides of 1
    lp.requires_grad_(True)
    loss, metrics = losses.compute("topr", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask)
    tok, grad, weights_neg, count = [], [], [], sum(sum(r) for r in mask.tolist())
    for lp_r, olp_r, a_r, m_r in zip(lp.tolist(), olp.tolist(), adv.tolist(), mask.tolist()):
        a = _row_advantage(a_r, m_r)
        rho = math.exp(min(max(sum(x - y for x, y, m in zip(lp_r, olp_r, m_r) if m), -20.0), 20.0))
        c = min(rho, 1.0) if a is not None and a < 0 else 1.0
        if a is not None and a < 0:
            weights_neg.append(c)
        tok.append([-c * a * x if m else 0.0 for x, m in zip(lp_r, m_r)])
        grad.append([-c * a / count if m else 0.0 for m in m_r])
    assert 0 < sum(w < 1 for w in weights_neg) < len(weights_neg)  # some negatives truncated, some capped at 1
    assert loss.item() == pytest.approx(_loop_aggregate(tok, mask.tolist(), "token-mean"), rel=1e-12)
    # negative_frac is a float32 mean of a bool tensor, so compare at float32 precision.
    assert metrics["actor/negative_frac"] == pytest.approx(len(weights_neg) / len(mask), rel=1e-6)
    assert metrics["actor/negative_weight_mean"] == pytest.approx(sum(weights_neg) / len(weights_neg), rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


# -- every policy loss: masking and gradients -------------------------------------------------------------


def test_all_policy_losses_registered():
    assert losses.names() == ["cispo", "gspo", "importance_sampling", "ppo_clip", "topr"]


@pytest.mark.invariant
@pytest.mark.parametrize("name", losses.names())
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_every_loss_ignores_outside_mask_and_has_no_gradient_there(name, agg):
    lp, olp, rlp, adv, mask = _random_policy_batch(24, per_row_adv=True)
    outside = (mask == 0).to(torch.float64)
    kwargs = dict(old_logprobs=olp, advantages=adv, loss_mask=mask, agg=agg, rollout_logprobs=rlp, tis_cap=2.0)
    lp_a = lp.clone().requires_grad_(True)
    loss_a, metrics_a = losses.compute(name, logprobs=lp_a, **kwargs)
    loss_a.backward()
    # Garbage outside the mask: log-ratios of +-60 (exp would overflow float32), huge advantages.
    lp_b = (lp + 30 * outside).requires_grad_(True)
    kwargs.update(old_logprobs=olp - 30 * outside, advantages=adv + 1e3 * outside, rollout_logprobs=rlp + 30 * outside)
    loss_b, metrics_b = losses.compute(name, logprobs=lp_b, **kwargs)
    loss_b.backward()
    assert torch.isfinite(loss_b)
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-12)
    assert metrics_b == pytest.approx(metrics_a, rel=1e-12)
    assert (lp_a.grad[mask == 0] == 0).all() and (lp_b.grad[mask == 0] == 0).all()
    torch.testing.assert_close(lp_b.grad, lp_a.grad, rtol=1e-12, atol=0)
    assert (lp_a.grad[mask == 1] != 0).any()


@pytest.mark.invariant
@pytest.mark.parametrize("name", losses.names())
def test_every_token_loss_is_zero_outside_mask_for_masked_advantages(name):
    # The estimators give A = 0 outside the mask; then each registered per-token loss is exactly 0 there.
    lp, olp, _, adv, mask = _random_policy_batch(25, per_row_adv=True)
    token_losses, metrics = losses.POLICY_LOSSES.get(name)(logprobs=lp, old_logprobs=olp, advantages=adv,
                                                           loss_mask=mask)
    assert token_losses.shape == mask.shape
    assert (token_losses[mask == 0] == 0).all()
    assert all(type(v) is float for v in metrics.values())


# -- truncated importance sampling and mismatch metrics ---------------------------------------------------

# Four tokens, the last outside the mask; LP = OLP (ratio 1), so each ppo_clip token loss is -A.
#   OLP - RLP = [ln 3, ln 0.5, 0, (50 outside)], cap 2 -> w = [min(3, 2), 0.5, 1] = [2, 0.5, 1]
#   A = [1, 2, -1] -> weighted token losses [-2, -1, 1] -> token-mean = -2 / 3
#   tis_weight_mean = (2 + 0.5 + 1) / 3 = 1.1666667; max_abs_logprob_diff = ln 3 = 1.0986123
TIS_OLP = torch.tensor([[-1.0, -2.0, -0.5, 10.0]], dtype=torch.float64)
TIS_RLP = TIS_OLP - torch.tensor([[math.log(3.0), math.log(0.5), 0.0, 50.0]], dtype=torch.float64)
TIS_A = torch.tensor([[1.0, 2.0, -1.0, 7.0]], dtype=torch.float64)
TIS_M = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_tis_hand_worked():
    lp = TIS_OLP.clone().requires_grad_(True)
    loss, metrics = losses.compute("ppo_clip", logprobs=lp, old_logprobs=TIS_OLP, advantages=TIS_A,
                                   loss_mask=TIS_M, rollout_logprobs=TIS_RLP, tis_cap=2.0)
    assert loss.item() == pytest.approx(-2 / 3, rel=1e-12)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(3.5 / 3, rel=1e-12)
    assert metrics["mismatch/max_abs_logprob_diff"] == pytest.approx(math.log(3.0), rel=1e-12)
    loss.backward()
    # ratio 1 is inside the clip: d(-w A exp(LP - OLP)) / dLP / 3 = -w * A / 3 = [-2/3, -1/3, 1/3, 0]
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3, -1 / 3, 1 / 3, 0.0]], dtype=torch.float64))


def test_truncated_is_weights_hand_worked_and_detached():
    olp = TIS_OLP.clone().requires_grad_(True)
    w = losses.truncated_is_weights(olp, TIS_RLP, TIS_M, cap=2.0)
    # [min(3, 2), min(0.5, 2), min(1, 2)] on the response; 1 outside the mask (log-ratio set to 0 there).
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 1.0]], dtype=torch.float64))
    assert not w.requires_grad


def test_mismatch_metrics_reported_without_correction():
    # rollout_logprobs alone: the mismatch is measured, the loss is not reweighted (no tis metric).
    plain, _ = losses.compute("ppo_clip", logprobs=TIS_OLP, old_logprobs=TIS_OLP, advantages=TIS_A, loss_mask=TIS_M)
    loss, metrics = losses.compute("ppo_clip", logprobs=TIS_OLP, old_logprobs=TIS_OLP, advantages=TIS_A,
                                   loss_mask=TIS_M, rollout_logprobs=TIS_RLP)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-12)  # (-1 - 2 + 1) / 3
    assert "actor/tis_weight_mean" not in metrics
    assert {"mismatch/k3", "mismatch/max_abs_logprob_diff"} <= set(metrics)
    assert metrics["mismatch/k3"] > 0
    # Identical policies: no mismatch at all.
    _, same = losses.compute("ppo_clip", logprobs=TIS_OLP, old_logprobs=TIS_OLP, advantages=TIS_A,
                             loss_mask=TIS_M, rollout_logprobs=TIS_OLP.clone())
    assert same["mismatch/k3"] == 0.0 and same["mismatch/max_abs_logprob_diff"] == 0.0


def test_mismatch_k3_is_exact_kl_of_rollout_to_trainer_in_expectation():
    # The sampler draws tokens from p = pi_rollout = [1/2, 1/4, 1/4]; the trainer has q = [1/8, 1/2, 3/8].
    # Four sampled tokens in proportion to p (x0, x0, x1, x2) make the token-mean an exact E_p[.].
    # k3 with r = q / p (kl.py's convention, the sample drawn from p): E_p[r - 1 - ln r] = KL(p || q)
    #   = 0.5 ln 4 + 0.25 ln 0.5 + 0.25 ln(2/3) = 0.6931472 - 0.1732868 - 0.1013663 = 0.4184941
    #   per token: x0: 0.25 - 1 + ln 4 = 0.6362944; x1: 2 - 1 - ln 2 = 0.3068528; x2: 1.5 - 1 - ln 1.5 = 0.0945349
    #   mean = (2 * 0.6362944 + 0.3068528 + 0.0945349) / 4 = 0.4184941
    # (The wrong direction, r = p / q, would give (2 * 1.6137056 + 0.1931472 + 0.0721318) / 4 = 0.8731726,
    #  which is chi^2(p || q) - KL(p || q), neither KL direction; an earlier version had that bug.)
    p, q = [0.5, 0.5, 0.25, 0.25], [0.125, 0.125, 0.5, 0.375]
    rlp = torch.tensor([p], dtype=torch.float64).log()
    olp = torch.tensor([q], dtype=torch.float64).log()
    metrics = losses.mismatch_metrics(olp, rlp, torch.ones(1, 4, dtype=torch.float64))
    kl_pq = 0.5 * math.log(4) + 0.25 * math.log(0.5) + 0.25 * math.log(2 / 3)
    assert metrics["mismatch/k3"] == pytest.approx(kl_pq, rel=1e-9)


def test_tis_cap_without_rollout_logprobs_raises():
    with pytest.raises(ValueError, match="rollout_logprobs"):
        losses.compute("ppo_clip", logprobs=TIS_OLP, old_logprobs=TIS_OLP, advantages=TIS_A, loss_mask=TIS_M,
                       tis_cap=2.0)


@pytest.mark.invariant
@pytest.mark.parametrize("name, agg", [("ppo_clip", "token-mean"), ("gspo", "seq-mean-token-mean"), ("topr", "token-mean")])
def test_tis_matches_loop_reference(name, agg):
    # The corrected loss is agg(w * loss_t) with w_t = min(exp(OLP_t - RLP_t), cap), whatever the loss.
    lp, olp, rlp, adv, mask = _random_policy_batch(26, B=11, per_row_adv=True)
    cap = 1.5
    token_losses, _ = losses.POLICY_LOSSES.get(name)(logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask)
    w = [[min(math.exp(y - z), cap) if m else 1.0 for y, z, m in zip(yr, zr, mr)]
         for yr, zr, mr in zip(olp.tolist(), rlp.tolist(), mask.tolist())]
    weighted = [[x * wi for x, wi in zip(xr, wr)] for xr, wr in zip(token_losses.tolist(), w)]
    flat_w = [wi for wr, mr in zip(w, mask.tolist()) for wi, m in zip(wr, mr) if m]
    assert 0 < sum(wi == cap for wi in flat_w) < len(flat_w)  # the cap binds on some tokens only
    diffs = [abs(z - y) for yr, zr, mr in zip(olp.tolist(), rlp.tolist(), mask.tolist()) for y, z, m in zip(yr, zr, mr) if m]
    loss, metrics = losses.compute(name, logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask, agg=agg,
                                   rollout_logprobs=rlp, tis_cap=cap)
    assert loss.item() == pytest.approx(_loop_aggregate(weighted, mask.tolist(), agg), rel=1e-12)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(sum(flat_w) / len(flat_w), rel=1e-12)
    assert metrics["mismatch/max_abs_logprob_diff"] == pytest.approx(max(diffs), rel=1e-12)
    torch.testing.assert_close(losses.truncated_is_weights(olp, rlp, mask, cap=cap), torch.tensor(w, dtype=torch.float64),
                               rtol=1e-12, atol=0)


@pytest.mark.invariant
@pytest.mark.parametrize("name", sorted(losses.ZERO_AT_ZERO_ADVANTAGE))
def test_losses_listed_as_zero_at_zero_advantage_are(name):
    """The train step skips zero-advantage rows for these losses: their token loss and gradient must be 0."""
    gen = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(4, 6, generator=gen)).requires_grad_()
    old = -torch.rand(4, 6, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.2).float()
    token_losses, _ = losses.POLICY_LOSSES.get(name)(logprobs=logprobs, old_logprobs=old,
                                                     advantages=torch.zeros(4, 6), loss_mask=mask)
    (grad,) = torch.autograd.grad((token_losses * mask).sum(), logprobs, allow_unused=True)
    assert float((token_losses * mask).detach().abs().max()) == 0.0
    assert grad is None or float(grad.abs().max()) == 0.0
