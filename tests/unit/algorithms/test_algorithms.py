"""Hand-computed checks for advantages, DAPO loss, dynamic sampling and overlong handling."""

import math

import pytest
import torch

from skyrl_mtp.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from skyrl_mtp.algorithms.dynamic_sampling import GroupAccumulator
from skyrl_mtp.algorithms.overlong import overlong_filter_mask, soft_overlong_penalty
from skyrl_mtp.algorithms.policy_loss import dapo_policy_loss


def test_grpo_with_and_without_std():
    r = torch.tensor([1.0, 0.0, 1.0, 2.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    a = grpo_advantages(r, g, norm_by_std=False)
    assert torch.allclose(a, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0, 0, 0]))
    std = math.sqrt(1 / 3)  # unbiased std of [1,0,1]
    a = grpo_advantages(r, g, eps=0.0)
    assert torch.allclose(a[:3], torch.tensor([1 / 3, -2 / 3, 1 / 3]) / std)
    assert torch.all(a[3:] == 0)  # all-equal group -> 0, no NaN
    a2 = grpo_advantages(r.view(2, 3), eps=0.0)
    assert torch.allclose(a2.flatten(), a)


def test_broadcast_and_errors():
    tok = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert torch.equal(tok, torch.tensor([[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3))


def _loss(lp, adv, **kw):
    lp = torch.tensor([lp])
    return dapo_policy_loss(lp, torch.zeros_like(lp), torch.tensor([adv]), torch.ones_like(lp), **kw)


def test_clip_boundaries():
    # ratio e^0.5=1.6487, A>0 -> clipped at 1.28: loss = -1.28
    loss, m = _loss([0.5], [1.0])
    assert loss.item() == pytest.approx(-1.28)
    assert m["policy/clip_frac_high"] == 1.0
    # ratio e^-0.5=0.6065, A<0 -> max(0.6065, 0.8) -> loss 0.8
    loss, m = _loss([-0.5], [-1.0])
    assert loss.item() == pytest.approx(0.8)
    assert m["policy/clip_frac_low"] == 1.0
    # ratio inside range -> unclipped
    loss, m = _loss([0.1], [1.0])
    assert loss.item() == pytest.approx(-math.exp(0.1))
    assert m["policy/clip_frac_high"] == 0.0 and m["policy/ratio_mean"] == pytest.approx(math.exp(0.1))
    assert m["policy/approx_kl"] == pytest.approx(0.005)


def test_dual_clip():
    # ratio e^2=7.389, A=-1: standard loss 7.389, dual clip c=3 caps at 3
    loss, _ = _loss([2.0], [-1.0])
    assert loss.item() == pytest.approx(math.exp(2.0))
    loss, m = _loss([2.0], [-1.0], dual_clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert m["policy/dual_clip_frac"] == 1.0
    loss, _ = _loss([2.0], [1.0], dual_clip_c=3.0)  # positive A untouched
    assert loss.item() == pytest.approx(-1.28)


def test_reductions_and_grad():
    lp = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([[0, 1.0, 1.0, 1.0], [0, 2.0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    old = torch.zeros(2, 4)
    tm, _ = dapo_policy_loss(lp, old, adv, mask)
    assert tm.item() == pytest.approx(-(3 + 2) / 4)
    sm, _ = dapo_policy_loss(lp, old, adv, mask, loss_reduction="seq_mean_token_mean")
    assert sm.item() == pytest.approx(-(1 + 2) / 2)
    ss, _ = dapo_policy_loss(lp, old, adv, mask, loss_reduction="seq_mean_token_sum")
    assert ss.item() == pytest.approx(-(3 + 2) / 2)
    g, _ = dapo_policy_loss(lp, old, adv, mask, global_num_tokens=10)
    assert g.item() == pytest.approx(-0.5)
    tm.backward()
    assert torch.allclose(lp.grad, -adv * mask / 4)


@pytest.mark.parametrize(
    "kw,word",
    [({"eps_clip_low": -0.1}, "eps_clip_low"), ({"dual_clip_c": 1.0}, "dual_clip_c"),
     ({"loss_reduction": "foo"}, "foo")],
)
def test_policy_loss_validation(kw, word):
    with pytest.raises(ValueError, match=word):
        _loss([0.0], [1.0], **kw)


def test_group_accumulator_keeps_groups_with_reward_spread_over_rounds():
    acc = GroupAccumulator(target_groups=3, max_rounds=3)
    acc.add_round(["a", "b", "c"], [[1, 1], [0, 1], [0, 0]])
    assert not acc.done and acc.kept == ["b"] and acc.groups_dropped == 2
    acc.add_round(["d", "e", "f"], [[0, 1], [1, 0], [1, 0]])
    assert acc.done
    s = acc.stats()
    assert s["dynamic_sampling/rounds"] == 2 and s["dynamic_sampling/groups_dropped"] == 2
    assert acc.take() == ["b", "d", "e"]
    acc.add_round(["x"], [[1, 1]])
    acc.add_round(["y"], [[1, 1]])
    acc.add_round(["z"], [[0, 1]])
    assert acc.done and acc.rounds_used == 3 and acc.take() == ["z"]  # max rounds hit with fewer groups


def test_overlong():
    assert overlong_filter_mask(["stop", "length", "stop"]).tolist() == [1.0, 0.0, 1.0]
    assert overlong_filter_mask(torch.tensor([True, False])).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="finish_reasons\\[0\\]"):
        overlong_filter_mask(["bogus"])
    p = soft_overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_response_len=16, buffer_len=4,
                              penalty_factor=2.0)
    assert torch.allclose(p, torch.tensor([0.0, 0.0, -1.0, -2.0, -2.0]))
    with pytest.raises(ValueError, match="buffer_len"):
        soft_overlong_penalty(torch.tensor([1]), 8, 0)


def test_accumulator_keep_all_fills_in_one_round_without_dropping():
    acc = GroupAccumulator(target_groups=2, max_rounds=1, keep_all=True)
    acc.add_round(["a", "b", "c"], [[1, 1], [0, 0], [0, 1]])
    assert acc.done and acc.groups_dropped == 0
    assert acc.stats()["dynamic_sampling/groups_kept"] == 3.0
    assert acc.take() == ["a", "b"]
