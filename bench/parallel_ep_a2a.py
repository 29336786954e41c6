"""Benchmark (a) of the training-engine issue: EP dispatch + combine bandwidth vs a plain all_to_all.

Every rank routes N tokens x top-K to E experts (uniform random, E/P per rank) and runs
`AllToAllDispatcher.dispatch` -> identity experts -> `combine` (forward only), i.e. the count exchange, the
host sync, the packed token exchange, the permutations and the reverse exchange. Bytes counted: the rows that
leave the rank in both exchanges (rows to other ranks x D x 2 bytes, times 2). Reference: one plain
`all_to_all_single` of the same per-peer bytes (even splits), and a point-to-point send/recv of 1 GiB.

    torchrun --nproc-per-node 2 bench/parallel_ep_a2a.py                    # GPUs (NCCL): 8K tok, top-6, D=4096
    torchrun --nproc-per-node 2 bench/parallel_ep_a2a.py --tokens 256 --dim 64   # CPU smoke (gloo)

Goal (issue): dispatch+combine >= 0.6x of the GPU-to-GPU copy bandwidth, count exchange included.
"""
import argparse
import os

import torch
import torch.distributed as dist

from nanoflash.parallel.dims import init_distributed
from timing import timed   # bench/timing.py
from nanoflash.parallel.expert import AllToAllDispatcher, expert_range


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    dims = init_distributed(ep=int(os.environ.get("WORLD_SIZE", "1")))
    dev, cuda = dims.device, dims.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    P = dims.ep
    g = torch.Generator(device="cpu").manual_seed(dims.rank)
    x = torch.randn(a.tokens, a.dim, generator=g).to(dev, dtype)
    idx = torch.stack([torch.randperm(a.experts, generator=g)[: a.topk] for _ in range(a.tokens)]).to(dev)
    w = torch.rand(a.tokens, a.topk, generator=g).to(dev)
    disp = AllToAllDispatcher(expert_range(a.experts, P, dims.ep_rank), a.experts, P, dims.ep_group)

    def ep_round():
        xs, ws, counts, ctx = disp.dispatch(x, idx, w)
        disp.combine(xs, ctx)

    t_ep = timed(ep_round, a.iters, cuda)
    owner = idx // (a.experts // P)
    remote_rows = int((owner != dims.ep_rank).sum())
    ep_bytes = 2 * remote_rows * a.dim * x.element_size()
    rows = a.tokens * a.topk // P * P
    buf = torch.empty(rows, a.dim, device=dev, dtype=dtype)
    out = torch.empty_like(buf)
    t_a2a = timed(lambda: dist.all_to_all_single(out, buf, group=dims.ep_group), a.iters, cuda)
    a2a_bytes = rows * (P - 1) // P * a.dim * x.element_size()
    big = torch.empty(2 ** 29 // x.element_size() if cuda else 2 ** 22, device=dev, dtype=dtype)  # 1 GiB on GPU

    def p2p():
        peer = (dims.rank + 1) % P
        ops = [dist.P2POp(dist.isend, big, peer), dist.P2POp(dist.irecv, torch.empty_like(big), (dims.rank - 1) % P)]
        for wk in dist.batch_isend_irecv(ops):
            wk.wait()

    t_p2p = timed(p2p, max(3, a.iters // 4), cuda)
    p2p_bw = big.numel() * big.element_size() / t_p2p
    if dims.rank == 0:
        ep_bw, a2a_bw = ep_bytes / t_ep, a2a_bytes / t_a2a
        print(f"{P} ranks on {dev.type}, {a.tokens} tok x top-{a.topk} x {a.dim} {dtype}: "
              f"dispatch+combine {t_ep * 1e3:.2f} ms = {ep_bw / 1e9:.0f} GB/s sent per rank; "
              f"plain all_to_all {t_a2a * 1e3:.2f} ms = {a2a_bw / 1e9:.0f} GB/s; p2p copy {p2p_bw / 1e9:.0f} GB/s; "
              f"ratios: EP/p2p {ep_bw / p2p_bw:.2f}, a2a/p2p {a2a_bw / p2p_bw:.2f}, EP/a2a {ep_bw / a2a_bw:.2f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
