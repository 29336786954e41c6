"""Expert parallelism at the MoE level: AllToAllDispatcher vs the single-process LocalDispatcher, forward and
backward, with balanced routing and with routing so skewed that some ranks receive no rows at all (the
`kernels="reference"` loop on CPU; the grouped path at EP2 runs in tests/test_model_moe.py); gradients compared
by official per-expert name (an EP rank's stacks hold experts by global id); plus the (src, expert) ->
(expert, src) permutation against a Python loop.
Run: pytest tests/test_parallel_expert.py -q"""
import pytest
import torch

from conftest import run_ranks
from nanoflash.names import official_views
from nanoflash.config import preset
from nanoflash.model import MoE
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.expert import _expert_major_perm, apply_expert_parallel
from nanoflash.parallel.train_step import reduce_gradients

N_TOK = 24  # tokens of the global batch, split evenly over the EP ranks
# fp32; the expert rows and the fp32 combine are the same numbers in the same order as the single-process
# dispatcher, but the matmuls run on other row counts and dense grads are summed over ranks. Gradients here
# are O(1..8) (unnormalised loss, weights of std 0.1); observed max |diff| 2.8e-7, so a 1e-6 floor.
RTOL, ATOL = 1e-5, 1e-6


def _moe(skewed: bool):
    m = MoE(2, preset("tiny"))  # layer 2: score routing (not hash)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.normal_(0, 0.1, generator=g)
        if skewed:  # top-2 is always experts {0, 1}: every EP rank but the first receives nothing
            m.gate.bias.copy_(torch.tensor([100.0, 100.0] + [0.0] * 6))
    return m


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, N_TOK, 64, generator=g)
    return x, torch.randint(0, 256, (1, N_TOK), generator=g), torch.randn(1, N_TOK, 64, generator=g)


def _ep_rank(rank, world, skewed):
    dims = ParallelDims(ep=world)
    moe = apply_expert_parallel(_moe(skewed), dims)
    x, ids, c = _data()
    sl = slice(rank * N_TOK // world, (rank + 1) * N_TOK // world)
    xs = x[:, sl].clone().requires_grad_()
    y = moe(xs, ids[:, sl])
    (y * c[:, sl]).sum().backward()
    reduce_gradients(moe, dims)
    return y.detach(), xs.grad, official_grads(moe), moe.experts.ids


def official_grads(m) -> dict:
    """{official name: gradient}; stacks split per expert, zeros for a parameter that got no gradient."""
    return {n: t for name, p in m.named_parameters()
            for n, t in official_views(name, p, torch.zeros_like(p) if p.grad is None else p.grad)}


@pytest.mark.parametrize("world,skewed", [(2, False), (4, True)])
def test_all_to_all_dispatcher_matches_local(world, skewed):
    moe = _moe(skewed)
    x, ids, c = _data()
    x.requires_grad_()
    y = moe(x, ids)
    (y * c).sum().backward()
    results = run_ranks(_ep_rank, world, skewed)
    per = N_TOK // world
    for rank, (yr, dx, grads, local) in enumerate(results):
        sl = slice(rank * per, (rank + 1) * per)
        torch.testing.assert_close(yr, y[:, sl].detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(dx, x.grad[:, sl], rtol=RTOL, atol=ATOL)
        assert local == list(range(rank * 8 // world, (rank + 1) * 8 // world))
        want = official_grads(moe)   # zeros for an expert no token chose
        assert set(grads) <= set(want) and len([n for n in grads if n.startswith("experts.")]) == 3 * 8 // world
        for n, g in grads.items():
            torch.testing.assert_close(g, want[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank} {n}: {m}")


def test_expert_major_perm_matches_loop():
    g = torch.Generator().manual_seed(0)
    recv = torch.randint(0, 4, (3, 5), generator=g)  # [P, E_local] rows from each source per local expert
    recv[1] = 0
    rows, start = {}, 0
    for p in range(3):  # incoming buffer is source-major
        for e in range(5):
            rows[(p, e)] = list(range(start, start + int(recv[p, e])))
            start += int(recv[p, e])
    want = [i for e in range(5) for p in range(3) for i in rows[(p, e)]]
    assert _expert_major_perm(recv, int(recv.sum())).tolist() == want
