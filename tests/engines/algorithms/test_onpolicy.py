"""On-policy distillation: the per-token advantage by hand, routing rows to teachers, ``teacher_kl``
metrics, the importance-sampling loss, and the advantage batch with teacher log-probs (rewards on and off)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.algorithms import losses, onpolicy
from engines.batches import AdvantageSpec, advantage_batch, routed_logprobs
from tests.engines.test_reward_worker import _rollouts

MASK = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
STUDENT = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]])  # 9.0 sits outside the mask
TEACHER = torch.tensor([[0.0, -1.5, -1.0], [0.0, -0.5, -3.0]])


def test_distill_advantage_by_hand():
    # k = log q - log p on masked tokens: row 0: -1 - (-1.5) = 0.5, -2 - (-1) = -1; row 1: -0.5 - (-0.5) = 0.
    # λ = 2 -> A = -2k = [-1, 2], [0]; outside the mask 0 (never 9 - (-3)).
    adv, k = onpolicy.distill_advantages(student_logprobs=STUDENT, teacher_logprobs=TEACHER, loss_mask=MASK, coef=2.0)
    assert k.tolist() == [[0.0, 0.5, -1.0], [0.0, 0.0, 0.0]]
    assert adv.tolist() == [[0.0, -1.0, 2.0], [0.0, 0.0, 0.0]]
    # With the reward advantage: A = A_RL - λk; A_RL 0.3 on every token (masked outside): 0.3 - 1 = -0.7, 0.3 + 2 = 2.3, 0.3.
    adv, _ = onpolicy.distill_advantages(student_logprobs=STUDENT, teacher_logprobs=TEACHER, loss_mask=MASK, coef=2.0,
                                         rl_advantages=torch.full((2, 3), 0.3))
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.7, 2.3], [0.0, 0.3, 0.0]]))


def test_teacher_equal_to_student_gives_zero():
    adv, k = onpolicy.distill_advantages(student_logprobs=STUDENT, teacher_logprobs=STUDENT, loss_mask=MASK, coef=1.0)
    assert not adv.any() and not k.any()


def test_teacher_kl_metrics_overall_and_per_group():
    _, k = onpolicy.distill_advantages(student_logprobs=STUDENT, teacher_logprobs=TEACHER, loss_mask=MASK, coef=1.0)
    # Token-mean over the 3 masked tokens: (0.5 - 1 + 0) / 3 = -1/6; row 0 alone: -0.25; row 1: 0.
    metrics = onpolicy.teacher_kl_metrics(k, MASK, {"math": [0], "code": [1], "empty": []})
    assert metrics == pytest.approx({"teacher_kl": -1 / 6, "teacher_kl/math": -0.25, "teacher_kl/code": 0.0})


def test_rows_go_to_the_teacher_that_takes_their_value_else_the_default():
    teachers = [("mathy", ["math", "arith"]), ("rest", []), ("coder", ["code"])]
    routes = onpolicy.route_rows(["math", "qa", "code", "arith", "qa"], teachers)
    assert routes == {"mathy": [0, 3], "rest": [1, 4], "coder": [2]}
    assert onpolicy.route_rows([1, 2], [("one", ["1"]), ("other", [])]) == {"one": [0], "other": [1]}  # str() match
    with pytest.raises(ValueError, match="row 1 has lang 'fr', which no teacher takes"):
        onpolicy.route_rows(["en", "fr"], [("en", ["en"])], "lang")


def test_routed_logprobs_place_each_teachers_rows():
    # Teacher a scored rows 0 and 2 (width 3), teacher b row 1 (width 2): the joined tensor is 3 wide, 0-padded.
    joined = routed_logprobs([torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[7.0, 8.0]])],
                             [[0, 2], [1]], 3)
    assert joined.tolist() == [[1, 2, 3], [7, 8, 0], [4, 5, 6]]


def test_importance_sampling_loss_by_hand():
    # ratio = exp(LP - OLP): row 0 tokens exp(0) = 1 and exp(ln 2) = 2; A = 1.5 and -1 -> -A·ratio = -1.5, 2.
    # token-mean over the 2 masked tokens: (-1.5 + 2) / 2 = 0.25; the padded token (LP 5) is never used.
    lp = torch.tensor([[-1.0, -1.0 + math.log(2.0), 5.0]], requires_grad=True)
    olp = torch.tensor([[-1.0, -1.0, 0.0]])
    adv = torch.tensor([[1.5, -1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = losses.compute("importance_sampling", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask)
    assert float(loss.detach()) == pytest.approx(0.25)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.5)
    assert metrics["actor/ratio_max"] == pytest.approx(2.0) and metrics["actor/ratio_min"] == pytest.approx(1.0)
    loss.backward()
    # d/dLP of -A·ratio/2 = -A·ratio/2: -1.5·1/2 = -0.75, 1·2/2 = 1; 0 on the padded token.
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.75, 1.0, 0.0]]))
    assert "importance_sampling" in losses.ZERO_AT_ZERO_ADVANTAGE


def test_advantage_batch_with_teacher_logprobs_rewards_off_and_on():
    # Two rows of one group, prompt 2 tokens, responses of 2 tokens at sampler log-prob -1 (positions 2, 3).
    rollouts = _rollouts([2, 2])
    teacher = torch.tensor([[0.0, 0.0, -1.5, -0.5], [0.0, 0.0, -1.0, -3.0]])
    # k = -1 - teacher: row 0: 0.5, -0.5; row 1: 0, 2. λ = 0.5 -> -λk: row 0: -0.25, 0.25; row 1: 0, -1.
    spec = AdvantageSpec("grpo", pad_token_id=0)
    batch, summary, _ = advantage_batch(rollouts, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), spec,
                                        teacher_logprobs=teacher, teacher_coef=0.5, distill_only=True,
                                        teacher_kl_groups={"a": [0], "b": [1]})
    torch.testing.assert_close(batch.tensors["advantages"][:, 2:4], torch.tensor([[-0.25, 0.25], [0.0, -1.0]]))
    assert batch.tensors["advantages"][:, :2].abs().sum() == 0  # prompt tokens carry nothing
    # teacher_kl: (0.5 - 0.5 + 0 + 2) / 4 = 0.5; row 0: 0; row 1: 1.
    assert summary["teacher_kl"] == pytest.approx(0.5)
    assert summary["teacher_kl/a"] == pytest.approx(0.0) and summary["teacher_kl/b"] == pytest.approx(1.0)
    assert summary["advantage/mean"] == pytest.approx(-0.5 * 0.5)  # = -λ · teacher_kl when rewards are off
    # Rewards on: GRPO over rewards (1, 0): ±0.7071 on every token, then -λk added unnormalised.
    batch, _, _ = advantage_batch(rollouts, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), spec,
                                  teacher_logprobs=teacher, teacher_coef=0.5)
    a = 1 / math.sqrt(2)
    torch.testing.assert_close(batch.tensors["advantages"][:, 2:4],
                               torch.tensor([[a - 0.25, a + 0.25], [-a, -a - 1.0]]), atol=1e-4, rtol=0)
