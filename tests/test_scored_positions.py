"""The head at the scored positions only (`Transformer.head_logprobs(mask=)`, the trainer's `stage_logprobs`):
the values and gradients at the scored positions are those of the head over every position, the others are 0,
the head's GEMMs really run on the scored rows alone, and a micro-batch with nothing to score still backprops.

Run: pytest tests/test_scored_positions.py -q
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanoflash import grpo
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny forwards: latency-bound (conftest.one_thread)
# Fewer rows can take another BLAS kernel (another summation order over D and V) in the head GEMM, hc_head's
# mixes and the logsumexp: fp32 ulps at the scale of the values. Observed <= 2 ulps of max |log p| (~5.5 on tiny,
# one ulp 4.8e-7) and bit-equal on most shapes; gradients the same at the scale of each gradient.
ULPS = 16
EPS32 = torch.finfo(torch.float32).eps


def close(a, b):
    return (a - b).abs().max() <= ULPS * EPS32 * b.abs().max().clamp_min(1.0)


def _model_and_streams(gen):
    m = Transformer(preset("tiny")).init_weights(0, std=0.2)
    ids = torch.randint(0, m.cfg.vocab_size, (3, 41), generator=gen)
    return m, ids[:, :-1], ids[:, 1:]


def test_scored_positions_match_the_full_head_values_and_gradients(gen):
    """A mask applied to the wrong rows (an index off by one, targets not gathered with the rows) or a
    scatter back to the wrong places moves values; the rest must be exactly 0."""
    m, x, tgt = _model_and_streams(gen)
    mask = (torch.rand(x.shape, generator=gen) < 0.4).float()
    mask[0, -5:] = 1.0                                                    # a response at the end of a row
    on = mask > 0
    w = torch.randn(x.shape, generator=gen)                               # a loss weighting every scored token
    params = [p for p in m.parameters() if p.requires_grad]
    full = m.token_logprobs(x, tgt, temperature=0.7)
    g_full = torch.autograd.grad((full * w * mask).sum(), params, allow_unused=True)
    part = m.token_logprobs(x, tgt, temperature=0.7, mask=mask)
    g_part = torch.autograd.grad((part * w * mask).sum(), params, allow_unused=True)
    assert close(part[on], full[on]) and torch.equal(part[~on], torch.zeros_like(part[~on]))
    for (name, _), a, b in zip(m.named_parameters(), g_part, g_full):
        assert (a is None) == (b is None) and (a is None or close(a, b)), name


def test_the_head_runs_on_the_scored_rows_only(gen):
    """Masking after a head over every position gives the same values and saves nothing: the head's GEMMs
    (hc_head mixes, the vocabulary GEMM) must count FLOPs for the scored rows only."""
    m, x, tgt = _model_and_streams(gen)
    h = m.run_layers(m.embed_streams(x), x).detach()
    mask = torch.zeros(x.shape)
    mask[:, -7:] = 1.0                                                    # 21 of 120 positions scored
    with FlopCounterMode(display=False) as full:
        m.head_logprobs(h, tgt)
    with FlopCounterMode(display=False) as part:
        m.head_logprobs(h, tgt, mask=mask)
    assert part.get_total_flops() * x.numel() == full.get_total_flops() * int(mask.sum()) > 0


def test_a_micro_batch_with_nothing_to_score_still_backprops(gen):
    """EP ranks run every micro-batch's backward (each MoE layer is a collective): a dummy micro-batch (mask all
    0) must give zeros that hang on the graph, not an error or a constant."""
    m, x, tgt = _model_and_streams(gen)
    lp = m.token_logprobs(x[:1, :1], tgt[:1, :1], mask=torch.zeros(1, 1))
    assert lp.shape == (1, 1) and float(lp.detach()) == 0.0 and lp.requires_grad
    lp.sum().backward()
    assert m.layers["0"].attn.wq_a.weight.grad is not None


@pytest.mark.parametrize("weights", ["fp8", "fp32"])   # fp32 with the fp32 trainer: matched precision
def test_trainer_old_logprobs_at_the_scored_positions(gen, weights):
    """`Trainer.logprobs` (the old log-probs: forward-only pipeline over token-budget micro-batches; matched
    precision: each sample alone, the head over every position as the engine scores) against the plain
    model's log-probs over every position of the padded batch: the same on the mask, 0 off it."""
    cfg = parse_args(["--recipe", "smoke", "--parallel.micro_batch_tokens", "48", "--rollout.weights", weights,
                      "--train.dtype", "fp32"])
    actor = Trainer(cfg, preset("tiny", **cfg.model), ParallelDims())
    assert actor.matched == (weights == "fp32")
    eps = []
    for i, (P, R) in enumerate([(9, 6), (20, 3), (5, 12), (14, 1)]):
        ids = torch.randint(1, actor.model.cfg.vocab_size, (P + R,), generator=gen).tolist()
        eps.append(grpo.Episode(ids[:P], ids[P:], [-1.0] * R, float(i % 2), i // 2))
    batch = grpo.pack(eps, grpo.episode_advantages(eps, 2))
    old = actor.logprobs(batch)
    with torch.no_grad():
        ref = actor.model.token_logprobs(batch.input_ids, batch.targets, temperature=cfg.rollout.temperature)
    on = batch.mask > 0
    assert close(old[on], ref[on]) and torch.equal(old[~on], torch.zeros_like(old[~on]))
