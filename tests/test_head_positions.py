"""The head computed only at the scored positions (`chunked_logprobs(positions=)`, the trainer's
`scored_positions`): what a GRPO step saves at long prompts must change nothing it reads.

Bugs caught: log-probs scattered back to the wrong positions or with a shifted target; a gradient lost or
doubled through the gather / scatter; the unscored positions not exactly 0; matched precision losing its
bit-identical shapes (it must keep every position).

Run: pytest tests/test_head_positions.py -q
"""
import pytest
import torch

from nanoflash.model import chunked_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

# The selected rows go through the same fp32 GEMM and log-sum-exp as in the full computation, only in other
# chunks: a row's result may differ in the last bits if the GEMM's blocking changes with the row count.
ATOL = 1e-5


def _inputs(seed=0, B=3, S=11, D=16, V=37):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(B, S, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    tgt = torch.randint(0, V, (B, S), generator=g)
    mask = torch.zeros(B, S)
    mask[0, 4:9], mask[1, 7:11], mask[2, 1:3] = 1, 1, 1     # response spans of three packed rows
    return y, w, tgt, mask


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_positions_give_the_full_results_there_and_zero_elsewhere_forward_and_backward(device):
    y, w, tgt, mask = (t.detach().to(device).requires_grad_(t.requires_grad) for t in _inputs())
    full = chunked_logprobs(y, w, tgt, 0.7, chunk=4)
    gy_full, gw_full = torch.autograd.grad((full * mask).sum(), (y, w))
    part = chunked_logprobs(y, w, tgt, 0.7, chunk=4, positions=mask > 0)
    gy, gw = torch.autograd.grad((part * mask).sum(), (y, w))
    on = mask > 0
    assert torch.allclose(part[on], full[on], atol=ATOL, rtol=0)
    assert (part[~on] == 0).all()
    assert torch.allclose(gy, gy_full, atol=ATOL, rtol=0) and torch.allclose(gw, gw_full, atol=ATOL, rtol=0)


def test_no_scored_position_gives_zeros_and_a_zero_gradient():
    y, w, tgt, mask = _inputs()
    part = chunked_logprobs(y, w, tgt, positions=torch.zeros_like(mask, dtype=torch.bool))
    assert part.shape == tgt.shape and (part == 0).all()
    gy, = torch.autograd.grad(part.sum(), (y,), allow_unused=True)
    assert gy is None or (gy == 0).all()


def test_the_trainer_scores_the_loss_mask_and_matched_precision_every_position():
    class T:   # the method alone: its rule, not a Trainer's construction
        from nanoflash.rl.trainer import Trainer
        scored_positions = Trainer.scored_positions
    t, mb = T(), {"mask": torch.ones(2, 3)}
    t.matched = False
    assert t.scored_positions(mb) is mb["mask"]
    t.matched = True
    assert t.scored_positions(mb) is None
