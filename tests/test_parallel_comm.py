"""Process grid and communication primitives on gloo: coordinates, groups, all_to_all forward/backward
against a naive gather-everything reference, and batched P2P. Run: pytest tests/test_parallel_comm.py -q"""
import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from nanoflash.parallel.comm import all_reduce_, all_to_all, all_to_all_many, exchange_counts, p2p_exchange
from nanoflash.parallel.dims import ParallelDims


def _splits(src: int, world: int) -> list[int]:
    """Deterministic uneven rows that rank `src` sends to each peer (some zero)."""
    return [(3 * src + 2 * dst) % 4 for dst in range(world)]


def _grid_and_comm(rank, world):
    dims = ParallelDims(pp=2, ep=2)  # world 4 -> dp 1
    group_members = {name: dist.get_process_group_ranks(getattr(dims, name))
                     for name in ("pp_group", "ep_group", "data_group")}
    # all_to_all over the world with uneven per-peer splits, forward and backward.
    in_splits = _splits(rank, world)
    out_splits = [_splits(src, world)[rank] for src in range(world)]
    x = (torch.arange(sum(in_splits) * 3, dtype=torch.float32).view(-1, 3) + 100 * rank).requires_grad_()
    counts = exchange_counts(torch.tensor(in_splits).view(world, 1), None if world == 1 else dist.group.WORLD)
    y = all_to_all(x, out_splits, in_splits, dist.group.WORLD)
    (y * (rank + 1)).sum().backward()  # dL/dy = rank + 1 on this rank
    # Packed exchange of a bf16 and an fp32 tensor; only the first output is used, like a rank whose experts
    # got no rows ignoring the routing weights: the backward must still run (and not hang).
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    wf = (x.detach()[:, :1] / 7).requires_grad_()  # fp32 [T,1]: exact values must survive the byte packing
    yb, yw = all_to_all_many([xb, wf], out_splits, in_splits, dist.group.WORLD)
    yb.float().sum().backward()
    many = dict(yb=yb.detach(), yw=yw.detach(), dxb=xb.grad, dwf=wf.grad)
    # Pipeline-style P2P: every rank sends its rank to the next and receives from the previous, both at once.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty(2, dtype=torch.int64)
    p2p_exchange([(torch.tensor([rank, 7]), nxt)], [(buf, prv)])
    t = [torch.full((2,), float(rank)), torch.full((3,), 1, dtype=torch.int64)]
    all_reduce_(t, dist.group.WORLD)
    return dict(coords=(dims.pp_rank, dims.dp_rank, dims.ep_rank), groups=group_members, prev=dims.prev_rank,
                next=dims.next_rank, data_rank=dims.data_rank, x=x.detach(), y=y.detach(), dx=x.grad,
                counts=counts.view(-1).tolist(), out_splits=out_splits, p2p=buf.tolist(), ar=t, many=many)


def test_grid_groups_all_to_all_and_p2p():
    world = 4
    res = run_ranks(_grid_and_comm, world)
    # grid = arange(4).view(pp=2, dp=1, ep=2): EP innermost.
    assert [r["coords"] for r in res] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert res[0]["groups"] == {"pp_group": [0, 2], "ep_group": [0, 1], "data_group": [0, 1]}
    assert res[3]["groups"] == {"pp_group": [1, 3], "ep_group": [2, 3], "data_group": [2, 3]}
    assert [(r["prev"], r["next"]) for r in res] == [(None, 2), (None, 3), (0, None), (1, None)]
    assert [r["data_rank"] for r in res] == [0, 1, 0, 1]
    for rank, r in enumerate(res):
        # Naive reference: rank `rank` receives, from each src in order, the block src sent it.
        blocks = []
        for src in range(world):
            sp = _splits(src, world)
            start = sum(sp[:rank])
            blocks.append(res[src]["x"][start: start + sp[rank]])
        assert torch.equal(r["y"], torch.cat(blocks)), f"rank {rank} all_to_all output"
        assert r["counts"] == r["out_splits"]
        # Backward: each row of x went to exactly one peer j, whose loss weight is (j + 1).
        sp = _splits(rank, world)
        want = torch.cat([torch.full((n, 3), float(j + 1)) for j, n in enumerate(sp)])
        assert torch.equal(r["dx"], want), f"rank {rank} all_to_all backward"
        assert torch.equal(r["many"]["yb"], r["y"].to(torch.bfloat16)) and torch.equal(r["many"]["yw"], r["y"][:, :1] / 7)
        assert torch.equal(r["many"]["dxb"], torch.ones_like(r["many"]["dxb"])) and not r["many"]["dwf"].any()
        assert r["p2p"] == [(rank - 1) % world, 7]
        assert torch.equal(r["ar"][0], torch.full((2,), 6.0)) and torch.equal(r["ar"][1], torch.full((3,), 4))


def test_grid_rejects_bad_world():
    with pytest.raises(AssertionError, match=r"world size \(1\) != PP \(2\) \* DP \(1\) \* EP \(2\)"):
        ParallelDims(pp=2, ep=2, dp=1)
    with pytest.raises(AssertionError, match="not divisible by PP 2 x EP 1"):
        ParallelDims(pp=2)


def test_single_process_dims_are_trivial(gen):
    dims = ParallelDims()
    assert (dims.pp, dims.dp, dims.ep, dims.world_size) == (1, 1, 1, 1)
    assert dims.pp_group is None and dims.ep_group is None and dims.data_group is None
    assert dims.is_first_stage and dims.is_last_stage and dims.prev_rank is None and dims.next_rank is None
    x = torch.randn(5, 2, generator=gen)
    assert all_to_all(x, [5], [5], None) is x


GROUP_TIMEOUT_S = 77   # distinct from every default (torch's 600 s, INIT_TIMEOUT_S, the launcher's)


def _group_timeouts(rank, world):
    dims = ParallelDims(pp=2, ep=2, timeout_s=GROUP_TIMEOUT_S, wait_timeout_s=99)
    cpu = torch.device("cpu")
    return {name: getattr(dims, name)._get_backend(cpu).options._timeout.total_seconds()
            for name in ("pp_group", "ep_group", "data_group", "side_group")}


def test_every_subgroup_gets_the_training_timeout():
    """Bug caught (issue 37): the PP / EP / data groups created without `timeout=`, so they ran under torch's
    10-minute default instead of `--parallel.timeout_s` (read back from each group's backend)."""
    for res in run_ranks(_group_timeouts, 4):
        assert res == {"pp_group": GROUP_TIMEOUT_S, "ep_group": GROUP_TIMEOUT_S, "data_group": GROUP_TIMEOUT_S,
                       "side_group": 99}, res
