"""Off-policy corrections (TIS token/sequence, decoupled PPO) against float64 formulas written out here, and
their reduction to DAPO's loss, bit for bit, when the behaviour logprobs equal the old ones."""

import math

import pytest
import torch

from skyrl_mtp.algorithms.off_policy import corrected_policy_loss, decoupled_weights, tis_weights
from skyrl_mtp.algorithms.policy_loss import dapo_policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _batch(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s = 4, 9
    mask = torch.ones(b, s)
    mask[:, :2] = 0              # prompt
    mask[1, 6:] = 0              # a shorter response
    mask[3, 4] = 0               # a tool-output token
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3
    behaviour = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.6
    adv = torch.tensor([1.5, -0.7, 0.4, -1.2], dtype=torch.float64)[:, None] * mask
    return (lp.to(dtype), old.to(dtype), behaviour.to(dtype), adv.to(dtype), mask.to(dtype))


def _reference(lp, old, behaviour, adv, mask, weight_of):
    """token_mean of w(i, t) * max(-A r, -A clip(r)) in float64, token by token; weight_of(i, t) -> w."""
    total, count = 0.0, 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t] == 0:
                continue
            r = math.exp(float(lp[i, t]) - float(old[i, t]))
            a = float(adv[i, t])
            clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            total += weight_of(i, t) * max(-a * r, -a * clipped)
            count += 1
    return total / count


def _tis_token(old, behaviour, cap):
    return lambda i, t: min(math.exp(float(old[i, t]) - float(behaviour[i, t])), cap)


def _tis_sequence(old, behaviour, mask, cap):
    def w(i, t):
        s = sum(float(old[i, u]) - float(behaviour[i, u]) for u in range(old.shape[1]) if mask[i, u])
        return min(math.exp(s), cap)
    return w


def _decoupled(old, behaviour, cap):
    def w(i, t):
        x = math.exp(float(old[i, t]) - float(behaviour[i, t]))
        return 0.0 if cap is not None and x > cap else x
    return w


CASES = [
    ("tis", dict(tis_cap=1.5, tis_level="token"), lambda o, b, m: _tis_token(o, b, 1.5)),
    ("tis", dict(tis_cap=2.0, tis_level="sequence"), lambda o, b, m: _tis_sequence(o, b, m, 2.0)),
    ("decoupled", dict(decoupled_weight_cap=None), lambda o, b, m: _decoupled(o, b, None)),
    ("decoupled", dict(decoupled_weight_cap=1.3), lambda o, b, m: _decoupled(o, b, 1.3)),
]


@pytest.mark.parametrize("correction,settings,weight", CASES)
def test_corrected_loss_matches_the_float64_formula(correction, settings, weight):
    lp, old, behaviour, adv, mask = _batch()
    want = _reference(lp, old, behaviour, adv, mask, weight(old, behaviour, mask))
    loss, _ = corrected_policy_loss(lp, old, adv, mask, behaviour_logprobs=behaviour,
                                    off_policy_correction=correction, eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH,
                                    **settings)
    assert loss.dtype == torch.float64 and abs(float(loss) - want) < 1e-12, (float(loss), want)
    lp32, old32, b32, adv32, mask32 = _batch(torch.float32)
    loss32, _ = corrected_policy_loss(lp32, old32, adv32, mask32, behaviour_logprobs=b32,
                                      off_policy_correction=correction, eps_clip_low=EPS_LOW,
                                      eps_clip_high=EPS_HIGH, **settings)
    assert abs(float(loss32) - want) < 1e-5 * max(1.0, abs(want))


@pytest.mark.parametrize("correction,settings,weight", CASES)
def test_corrected_gradient_is_the_weighted_clipped_gradient(correction, settings, weight):
    # d/d lp of w * max(-A r, -A clip(r)) = -w A r unless the clipped term wins (inside the clip range both terms
    # are -A r), else 0; w has no gradient
    lp, old, behaviour, adv, mask = _batch()
    lp = lp.clone().requires_grad_(True)
    loss, _ = corrected_policy_loss(lp, old, adv, mask, behaviour_logprobs=behaviour,
                                    off_policy_correction=correction, eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH,
                                    **settings)
    loss.backward()
    w = weight(old, behaviour, mask)
    n = int(mask.sum())
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            r = math.exp(float(lp.detach()[i, t]) - float(old[i, t]))
            a = float(adv[i, t])
            clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            unclipped_wins = -a * r >= -a * clipped
            want = 0.0 if mask[i, t] == 0 or not unclipped_wins else -w(i, t) * a * r / n
            assert abs(float(lp.grad[i, t]) - want) < 1e-12, (i, t, float(lp.grad[i, t]), want)
    assert behaviour.grad is None and old.grad is None


@pytest.mark.parametrize("correction,settings", [(c, s) for c, s, _ in CASES] + [("none", {})])
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_behaviour_equal_to_old_gives_dapo_bit_for_bit(correction, settings, reduction, dual_clip_c):
    lp, old, _, adv, mask = _batch(torch.float32)
    kw = dict(eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH, loss_reduction=reduction, dual_clip_c=dual_clip_c)
    lp_a, lp_b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    want, want_m = dapo_policy_loss(lp_a, old, adv, mask, **kw)
    got, got_m = corrected_policy_loss(lp_b, old, adv, mask, behaviour_logprobs=old.clone(),
                                       off_policy_correction=correction, **settings, **kw)
    want.backward()
    got.backward()
    assert torch.equal(got, want) and torch.equal(lp_b.grad, lp_a.grad)
    assert {k: v for k, v in got_m.items() if not k.startswith("off_policy/")} == want_m
    if correction != "none":
        assert got_m["off_policy/weight_mean"] == 1.0 and got_m["off_policy/log_ratio_abs_mean"] == 0.0


def test_weights_truncate_or_mask_and_report_it():
    old = torch.tensor([[0.0, -1.0, -1.0, -2.0]])
    behaviour = torch.tensor([[0.0, -2.0, -0.5, -1.0]])       # ratios 1, e, e^-0.5, e^-1; token 0 is the prompt
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    w, trunc = tis_weights(old, behaviour, mask, cap=2.0, level="token")
    assert torch.allclose(w[0, 1:], torch.tensor([2.0, math.exp(-0.5), math.exp(-1.0)]))
    assert trunc.tolist() == [[False, True, False, False]]
    ws, _ = tis_weights(old, behaviour, mask, cap=2.0, level="sequence")   # exp(1 - 0.5 - 1) = e^-0.5 < 2
    assert torch.allclose(ws[0, 1:], torch.full((3,), math.exp(-0.5)))
    wd, masked = decoupled_weights(old, behaviour, mask, cap=2.0)
    assert torch.allclose(wd[0, 1:], torch.tensor([0.0, math.exp(-0.5), math.exp(-1.0)]))
    assert masked.tolist() == [[False, True, False, False]]
    adv = torch.ones(1, 4) * mask
    _, m = corrected_policy_loss(old, old, adv, mask, behaviour_logprobs=behaviour, off_policy_correction="tis",
                                 tis_cap=2.0)
    assert m["off_policy/truncated_frac"] == pytest.approx(1 / 3)
    assert m["off_policy/weight_mean"] == pytest.approx((2.0 + math.exp(-0.5) + math.exp(-1.0)) / 3)
    assert m["off_policy/log_ratio_abs_mean"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    _, m = corrected_policy_loss(old, old, adv, mask, behaviour_logprobs=behaviour,
                                 off_policy_correction="decoupled", decoupled_weight_cap=2.0)
    assert m["off_policy/masked_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("kw,words", [
    (dict(off_policy_correction="is"), "correction='is' unknown; allowed: ('none', 'tis', 'decoupled')"),
    (dict(off_policy_correction="tis", tis_cap=0.5), "tis_cap=0.5 must be >= 1"),
    (dict(off_policy_correction="tis", tis_level="step"), "tis_level='step' unknown"),
    (dict(off_policy_correction="decoupled", decoupled_weight_cap=1.0), "decoupled_weight_cap=1.0 must be > 1"),
    (dict(off_policy_correction="tis"), "needs behaviour_logprobs"),
])
def test_bad_settings_are_refused_by_name(kw, words):
    lp, old, _, adv, mask = _batch()
    with pytest.raises(ValueError) as info:
        corrected_policy_loss(lp, old, adv, mask, **kw)
    assert words in str(info.value)


def test_behaviour_logprobs_of_another_shape_are_refused():
    lp, old, behaviour, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"behaviour_logprobs has shape \(4, 8\), expected \(4, 9\)"):
        corrected_policy_loss(lp, old, adv, mask, behaviour_logprobs=behaviour[:, :8], off_policy_correction="tis")
