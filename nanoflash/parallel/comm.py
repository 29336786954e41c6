"""Communication primitives of the training engine, autograd-aware where gradients must flow through them.

1. `all_to_all(x, out_splits, in_splits, group)`: the expert-parallel token exchange. Rank r sends rows
   `x[sum(in_splits[:j]) : sum(in_splits[:j+1])]` to rank j and receives `out_splits[j]` rows from rank j.
   Its adjoint is the same exchange with the split lists swapped, so backward is one more all_to_all:

       y = A2A_{in -> out}(x)        dL/dx = A2A_{out -> in}(dL/dy)

   We use `all_to_all_single` (one flat buffer + per-peer split sizes), never the list form `all_to_all`,
   which gloo does not implement with uneven sizes.
   `all_to_all_many(tensors, ...)` sends several row-aligned tensors of any dtypes (tokens in bf16 and their
   fp32 routing weights) packed as bytes in ONE exchange, forward and backward (see `_AllToAllMany` for why
   one exchange is a correctness requirement, not only a saving).
2. `exchange_counts(send_counts, group)`: an even all_to_all of int64 counts, so every rank learns how many
   rows it will receive from each peer before the token exchange (the host sync that every pure-PyTorch EP
   implementation pays; DeepEP hides it in a kernel).
3. `p2p_exchange(sends, recvs, staging)`: pipeline send/recv of `[B,S,M,D]` activation streams (and their gradients)
   plus the `[B,S]` input ids and loss fields that travel with them. All sends and receives of one
   schedule step are posted together with `batch_isend_irecv`, so the neighbouring stages never deadlock
   however the two directions interleave (the pattern of Megatron's `send_forward_recv_backward`).
4. `all_reduce_(tensors, group)`: in-place SUM of a list of tensors, bucketed into one flat buffer per dtype.

No distributed call happens when the group is None (a trivial group of one rank).
Tests: `pytest tests/test_parallel_comm.py -q`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """y = A2A(x) with per-peer split sizes; the backward is the reverse exchange.

    Shapes: x [sum(in_splits), *F] -> y [sum(out_splits), *F].
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, dy):
        return _a2a(dy, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    assert x.shape[0] == sum(in_splits), f"all_to_all: x has {x.shape[0]} rows, in_splits {in_splits} sum differs"
    y = x.new_empty((sum(out_splits), *x.shape[1:]))  # [sum(out_splits), *F]
    dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
    return y


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single over dim 0 (identity when `group` is None)."""
    if group is None:
        assert out_splits == in_splits, f"single rank all_to_all needs equal splits: {out_splits} vs {in_splits}"
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def _pack(tensors) -> torch.Tensor:
    """[T,F_i] tensors of any dtypes -> one [T, sum bytes] uint8 buffer (bit-exact, no casts)."""
    return torch.cat([t.contiguous().view(t.shape[0], t.shape[1:].numel()).view(torch.uint8) for t in tensors],
                     1)  # [T,bytes]


def _unpack(buf: torch.Tensor, likes) -> list[torch.Tensor]:
    out, col = [], 0
    for t in likes:
        nbytes = t.shape[1:].numel() * t.element_size()
        part = buf[:, col: col + nbytes].contiguous().view(t.dtype)       # [T, prod F]
        out.append(part.view(buf.shape[0], *t.shape[1:]))
        col += nbytes
    return out


class _AllToAllMany(torch.autograd.Function):
    """Several row-aligned tensors exchanged in ONE all_to_all (packed as bytes), forward and backward.

    One collective per direction matters for correctness, not only speed: a rank whose experts received no
    rows never uses some of the outputs, and separate exchanges would then run their backward in a
    different order (or not at all) on different ranks, which deadlocks or mismatches the collectives.
    Shapes: tensors [sum(in_splits), *F_i] -> [sum(out_splits), *F_i].
    """

    @staticmethod
    def forward(ctx, out_splits, in_splits, group, *tensors):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        ctx.likes = [t.new_empty((0, *t.shape[1:])) for t in tensors]
        return tuple(_unpack(_a2a(_pack(tensors), out_splits, in_splits, group), ctx.likes))

    @staticmethod
    def backward(ctx, *grads):
        rows = sum(ctx.out_splits)
        grads = [torch.zeros((rows, *l.shape[1:]), dtype=l.dtype, device=l.device) if g is None else g
                 for g, l in zip(grads, ctx.likes)]
        back = _unpack(_a2a(_pack(grads), ctx.in_splits, ctx.out_splits, ctx.group), ctx.likes)
        return (None, None, None, *back)


def all_to_all_many(tensors: list[torch.Tensor], out_splits: list[int], in_splits: list[int], group):
    """Differentiable exchange of row-aligned tensors (e.g. tokens and their routing weights) in one call."""
    if group is None:
        assert out_splits == in_splits, f"single rank all_to_all needs equal splits: {out_splits} vs {in_splits}"
        return list(tensors)
    return list(_AllToAllMany.apply(list(out_splits), list(in_splits), group, *tensors))


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """send_counts [P, C] int64 (row j goes to peer j) -> recv_counts [P, C] (row j came from peer j)."""
    if group is None:
        return send_counts.clone()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


def p2p_exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                 staging=None) -> None:
    """Post every (tensor, global peer rank) send and receive at once and wait for all of them.

    Receive buffers are filled in place. Messages between one ordered pair of ranks are matched in the order
    they are listed, so both sides must list them in the same order. `staging` (`ParallelDims.staging`, a
    `colocate.HostStaging` when ranks share a GPU over gloo): the same exchange through host buffers.
    """
    if staging is not None:
        return staging.p2p(sends, recvs)
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def all_reduce_(tensors: list[torch.Tensor], group, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of many tensors, flattened into one buffer per dtype (one collective each)."""
    if group is None or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])  # [sum numel]
        dist.all_reduce(flat, op=op, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
