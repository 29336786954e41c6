"""Benchmark (b) of the training-engine issue: the 1F1B pipeline bubble, measured vs (p-1)/m.

Each stage holds L MLP blocks (D -> 4D -> D, bf16, residual) on one GPU, fed micro-batches of T tokens, run by
`nanoflash.parallel.pipeline.forward_backward` (the engine's own 1F1B with P2P of [B,S,M,D] + ids). A toy
model with the engine's stage seams (embed_streams / run_layers / hidden) keeps the stages equal, so the
bubble is the schedule's, not an imbalance.

    bubble(m) = (T_step(m) - m * t_mb) / (m * t_mb),   t_mb = one micro-batch's forward+backward on one stage
    formula    = (p - 1) / m

t_mb is measured on each rank alone (no communication) and the slowest stage's value is used.

    torchrun --nproc-per-node 2 bench/parallel_pp_bubble.py                       # GPUs (NCCL)
    torchrun --nproc-per-node 2 bench/parallel_pp_bubble.py --dim 64 --tokens 64   # CPU smoke (gloo)
"""
import argparse
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from nanoflash.parallel.dims import init_distributed
from timing import timed   # bench/timing.py
from nanoflash.parallel.pipeline import forward_backward


class ToyStage(nn.Module):
    """Stage seams of nanoflash.model.Transformer over residual MLP blocks. Shapes: ids [B,S] -> h [B,S,1,D]"""

    def __init__(self, dim: int, n_layers: int, first: bool, vocab: int = 1024):
        super().__init__()
        self.cfg = SimpleNamespace(hc_mult=1, dim=dim)
        self.embed = nn.Embedding(vocab, dim) if first else None
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                     for i in range(n_layers)})

    def embed_streams(self, ids):
        return self.embed(ids).unsqueeze(2)                                            # [B,S,1,D]

    def run_layers(self, h, ids):
        for layer in self.layers.values():
            h = h + layer(h)
        return h


def loss_fn(model, h, mb):
    return h.float().square().mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    dims = init_distributed(pp=int(os.environ.get("WORLD_SIZE", "1")))
    dev, cuda = dims.device, dims.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = ToyStage(a.dim, a.layers, dims.is_first_stage).to(dev, dtype)
    ids = torch.randint(0, 1024, (1, a.tokens), device=dev)
    h0 = torch.randn(1, a.tokens, 1, a.dim, device=dev, dtype=dtype, requires_grad=True)

    def one_mb():  # this stage alone: forward + backward of one micro-batch
        h = model.embed_streams(ids) if dims.is_first_stage else h0
        model.run_layers(h, ids).float().square().mean().backward()

    t_mb = torch.tensor(timed(one_mb, a.iters, cuda), dtype=torch.float64, device=dev)
    dist.all_reduce(t_mb, op=dist.ReduceOp.MAX)
    for m in (4, 8, 16):
        mbs = [{"input_ids": ids} for _ in range(m)] if dims.is_first_stage else None
        t = timed(lambda: forward_backward(model, dims, mbs, loss_fn, 1.0), a.iters, cuda)
        if dims.rank == 0:
            bubble = (t - m * float(t_mb)) / (m * float(t_mb))
            print(f"p={dims.pp} m={m}: step {t * 1e3:.1f} ms, t_mb {float(t_mb) * 1e3:.2f} ms, bubble {bubble:.3f} "
                  f"vs (p-1)/m = {(dims.pp - 1) / m:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
