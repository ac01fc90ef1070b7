"""PPO's clipped value loss (the critic's): hand-worked values, gradients and a plain-loop reference."""

import pytest
import torch

from engines.algorithms import losses


def _random_mask(gen: torch.Generator, rows: int = 9, width: int = 10) -> torch.Tensor:
    """``[rows, width]`` float64: each row 0-2 prompt tokens, then a response, then padding; row 1 empty."""
    starts = torch.randint(0, 3, (rows,), generator=gen)
    lengths = torch.randint(1, width - 1, (rows,), generator=gen)
    pos = torch.arange(width)[None, :]
    mask = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).to(torch.float64)
    mask[1] = 0.0
    return mask


# clip_range 0.2; t3 is outside the mask (its 5 / 0 / -5 must not count).
#   t0: V 1.0, OV 0.5, ret 1.2: (V - ret)^2 = 0.04; V_clip = 0.5 + 0.2 = 0.7, (0.7 - 1.2)^2 = 0.25 -> 0.5 * 0.25 = 0.125
#   t1: V 0.6, OV 0.5, ret 0.0: V - OV = 0.1 inside the range, both 0.36 -> 0.18
#   t2: V 0.0, OV 0.5, ret 0.1: 0.01; V_clip = 0.5 - 0.2 = 0.3, (0.3 - 0.1)^2 = 0.04 -> 0.02
# vf_clipfrac = 2/3 (t0, t2); vpred_mean = (1 + 0.6 + 0) / 3 = 0.5333333
# explained variance: residual ret - V = [0.2, -0.6, 0.1], mean -0.1, var = (0.09 + 0.25 + 0.04) / 2 = 0.19;
#   ret = [1.2, 0, 0.1], mean 1.3 / 3, var = (0.5877778 + 0.1877778 + 0.1111111) / 2 = 0.4433333
#   -> 1 - 0.19 / 0.4433333 = 1 - 3/7 = 4/7
VAL_V = torch.tensor([[1.0, 0.6, 0.0, 5.0]], dtype=torch.float64)
VAL_OV = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=torch.float64)
VAL_RET = torch.tensor([[1.2, 0.0, 0.1, -5.0]], dtype=torch.float64)
VAL_M = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_value_loss_hand_worked():
    v = VAL_V.clone().requires_grad_(True)
    token_losses, metrics = losses.value_loss(values=v, old_values=VAL_OV, returns=VAL_RET, loss_mask=VAL_M,
                                              clip_range=0.2)
    torch.testing.assert_close(token_losses[VAL_M > 0], torch.tensor([0.125, 0.18, 0.02], dtype=torch.float64))
    assert metrics == pytest.approx({"critic/vf_clipfrac": 2 / 3, "critic/vpred_mean": 1.6 / 3,
                                     "critic/explained_variance": 4 / 7}, rel=1e-12)
    (token_losses * VAL_M).sum().backward()
    # t0, t2: the clipped branch is active and V_clip no longer moves with V -> 0; t1: V - ret = 0.6; t3 masked.
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.6, 0.0, 0.0]], dtype=torch.float64))


def test_value_loss_without_clipping_hand_worked():
    # clip_range 0: 0.5 * (V - ret)^2 = 0.5 * [0.04, 0.36, 0.01] = [0.02, 0.18, 0.005]; nothing clipped.
    token_losses, metrics = losses.value_loss(values=VAL_V, old_values=VAL_OV, returns=VAL_RET, loss_mask=VAL_M,
                                              clip_range=0.0)
    torch.testing.assert_close(token_losses[VAL_M > 0], torch.tensor([0.02, 0.18, 0.005], dtype=torch.float64))
    assert metrics["critic/vf_clipfrac"] == 0.0


@pytest.mark.invariant
@pytest.mark.parametrize("clip_range", [0.0, 0.1, 0.5])
def test_value_loss_matches_loop_reference(clip_range):
    gen = torch.Generator().manual_seed(27)
    mask = _random_mask(gen)
    old_v = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    v = (old_v + 0.3 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    ret = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    token_losses, metrics = losses.value_loss(values=v, old_values=old_v, returns=ret, loss_mask=mask,
                                              clip_range=clip_range)
    loss = (token_losses * mask).sum() / mask.sum()
    loss.backward()
    exp_tok, exp_grad, clipped, preds, targets = [], [], 0, [], []
    count = mask.sum().item()
    for vr, ovr, rr, mr in zip(v.tolist(), old_v.tolist(), ret.tolist(), mask.tolist()):
        exp_tok.append([]), exp_grad.append([])
        for x, ox, r, m in zip(vr, ovr, rr, mr):
            if not m:
                exp_tok[-1].append(0.0), exp_grad[-1].append(0.0)
                continue
            un = (x - r) ** 2
            if clip_range > 0:
                inside = abs(x - ox) <= clip_range
                vc = ox + min(max(x - ox, -clip_range), clip_range)
                cl = (vc - r) ** 2
                loss_t = 0.5 * max(un, cl)
                g = (x - r) if un >= cl else ((vc - r) if inside else 0.0)
                clipped += cl > un
            else:
                loss_t, g = 0.5 * un, x - r
            exp_tok[-1].append(loss_t), exp_grad[-1].append(g / count)
            preds.append(x), targets.append(r)
    if clip_range == 0.1:
        assert 0 < clipped < count
    got = torch.where(mask > 0, token_losses, torch.zeros_like(token_losses))
    torch.testing.assert_close(got, torch.tensor(exp_tok, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(v.grad, torch.tensor(exp_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)

    def var(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)

    residual = [t - p for t, p in zip(targets, preds)]
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipped / count, rel=1e-12)
    assert metrics["critic/vpred_mean"] == pytest.approx(sum(preds) / count, rel=1e-12)
    assert metrics["critic/explained_variance"] == pytest.approx(1 - var(residual) / var(targets), rel=1e-12)
