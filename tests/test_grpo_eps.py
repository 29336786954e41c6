"""The epsilon of the group advantages' std, at a scale where it matters (nanoflash.grpo.group_advantages).

Contract (grpo.py): A_i = (r_i - mean_g r) / (std_g r + eps), std unbiased (n-1), eps = 1e-6 by default; where
std == 0 (all-equal group, or one sample) A = 0, never inf/nan. The existing hand tests use rewards of order 1,
where eps moves A by ~1e-6 relative: a `centered / std` without `+ eps` passes them. Here std ~ eps, so
dropping eps doubles A, and the hand values are written out as Python floats (no torch, no code under test).

Run: pytest tests/test_grpo_eps.py -q
"""
import math

import pytest
import torch

from nanoflash.grpo import group_advantages

# the code computes in fp64 and returns fp32: the hand values below are exact to fp32 rounding (rel 2^-24)
FP32_REL_TOL = 4 * 2.0 ** -24


def _hand(group, eps):
    """A_i of one group by the formula, in plain Python floats."""
    n = len(group)
    mean = sum(group) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
    return [0.0 if std == 0 else (r - mean) / (std + eps) for r in group]


@pytest.mark.parametrize("eps", [1e-6, 3e-7])
def test_eps_is_added_to_the_std_when_the_std_is_of_order_eps(eps):
    """Bug caught: the eps dropped from the denominator (A = centered / std); at std ~ eps the values differ
    by a factor (std + eps) / std ~ 1.7-2.4, not by the ~1e-6 of order-1 rewards."""
    rewards = [0.0, 1e-6, 0.0, 2e-6,            # group 1: std ~ 9.6e-7 ~ eps
               0.5, 0.5 + 1e-6, 0.5, 0.5]        # group 2: std 5e-7, offset by 0.5 (fp64 keeps the differences)
    got = group_advantages(rewards, group_size=4, eps=eps).tolist()
    want = _hand(rewards[:4], eps) + _hand(rewards[4:], eps)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=FP32_REL_TOL, abs=1e-12), (got, want)
    # the pair [0, 1e-6]: std = 1e-6/sqrt(2), A = +-0.5e-6 / (std + eps); with eps = 1e-6 that is +-0.29289,
    # without eps it would be +-0.70711
    pair = group_advantages([0.0, 1e-6], group_size=2).tolist()
    assert pair == pytest.approx([-(1 - 1 / math.sqrt(2)), 1 - 1 / math.sqrt(2)], rel=1e-5), pair


def test_default_eps_is_1e_6():
    """Bug caught: a default eps of 0 (or 1e-8: invisible at order-1 rewards) instead of Miles' 1e-6."""
    r = [0.0, 1e-6, 3e-6]
    assert group_advantages(r, 3).tolist() == pytest.approx(_hand(r, 1e-6), rel=FP32_REL_TOL)


def test_all_equal_groups_give_zero_not_nan():
    """Bug caught: a guard-free `centered / (std + eps)` with eps 0 (0/0 = nan), or the guard dropped when eps
    is dropped; also a group of one sample. Every A must be exactly 0 and finite."""
    for eps in (1e-6, 0.0):
        a = group_advantages([0.3] * 4 + [1.0] * 4 + [0.0] * 4, 4, eps=eps)
        assert torch.isfinite(a).all() and a.eq(0).all(), a
    one = group_advantages([5.0, -2.0], 1)
    assert torch.isfinite(one).all() and one.eq(0).all(), one
