"""Parity of the engine's layouts against one device, under torchrun: NCCL on GPUs, gloo on CPU.

The GPU counterpart of tests/test_parallel_parity.py: every rank also computes the single-device reference
(whole batch, same weights, fp32, TF32 off), then compares its loss, grad norm, every gradient it holds and
every parameter after one AdamW step; the worst errors over all ranks are printed per layout.

    torchrun --nproc-per-node 2 bench/parallel_parity.py      # EP2, PP2 (hash layer on stage 1), DP2
    torchrun --nproc-per-node 4 bench/parallel_parity.py      # EP4, PP4, PP2xEP2, DP2xEP2
"""
import os

import torch
import torch.distributed as dist

from nanoflash.config import OptimConfig, ParallelConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims, init_distributed
from nanoflash.parallel.train_step import global_count, make_optimizer, parallelize, train_step

N_SEQ, SEQ_LEN, LR, CLIP = 4, 16, 1e-3, 0.05
OPT = OptimConfig(lr=LR, eps=1e-6)
LAYOUTS = {2: {"EP2": (1, 2, None, 2), "PP2": (2, 1, (1, 3), 4), "DP2": (1, 1, None, 2)},
           4: {"EP4": (1, 4, None, 1), "PP4": (4, 1, None, 4), "PP2xEP2": (2, 2, (1, 3), 2),
               "DP2xEP2": (1, 2, None, 1)}}


def batch(dev):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (N_SEQ, SEQ_LEN + 1), generator=g)
    mask = (torch.rand(N_SEQ, SEQ_LEN, generator=g) > 0.2).float()
    return {k: v.to(dev) for k, v in {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask}.items()}


def reference(dev):
    with torch.device(dev):
        model = Transformer(preset("tiny"))
    parallelize(model.init_weights(0), _single(), ParallelConfig())
    b = batch(dev)
    out = train_step(model, _single(), [b], make_optimizer(model, OPT), 1 / float(b["loss_mask"].sum()), grad_clip=CLIP)
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, model.state_dict()


def _single():
    """A world-size-1 view for the reference while the process group is up (no collectives)."""
    d = ParallelDims.__new__(ParallelDims)
    d.pp = d.dp = d.ep = d.world_size = 1
    d.rank = d.pp_rank = d.dp_rank = d.ep_rank = 0
    d.pp_group = d.dp_group = d.ep_group = d.data_group = None
    d.pp_ranks = [0]
    return d


def run_layout(pp, ep, split, n_mb, dev):
    dims = ParallelDims(pp=pp, ep=ep)
    with torch.device(dev):
        model = parallelize(Transformer(preset("tiny")), dims, ParallelConfig(pp, ep, None, split))
    full = Transformer(preset("tiny")).init_weights(0)
    model.load_state_dict({k: v for k, v in full.state_dict().items() if k in model.state_dict()})
    b, per = batch(dev), N_SEQ // dims.data_world
    shard = {k: v[dims.data_rank * per:(dims.data_rank + 1) * per] for k, v in b.items()}
    mbs = [{k: v.chunk(n_mb)[i] for k, v in shard.items()} for i in range(n_mb)]
    z = global_count(shard["loss_mask"].sum(), dims)
    out = train_step(model, dims, mbs if dims.is_first_stage else None, make_optimizer(model, OPT),
                     1 / z if dims.is_first_stage else None, grad_clip=CLIP)
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, model.state_dict()


def main():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_distributed()
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dev = ParallelDims().device
    ref_out, ref_g, ref_p = reference(dev)
    for name, (pp, ep, split, n_mb) in LAYOUTS[world].items():
        out, grads, params = run_layout(pp, ep, split, n_mb, dev)
        err = torch.tensor([abs(out["loss"] - ref_out["loss"]) / abs(ref_out["loss"]),
                            abs(out["grad_norm"] - ref_out["grad_norm"]) / ref_out["grad_norm"],
                            max(float((g - ref_g[n]).abs().max()) for n, g in grads.items()),
                            max(float((p.float() - ref_p[n].float()).abs().max()) for n, p in params.items())],
                           dtype=torch.float64, device=dev)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(f"{name} on {dev.type} ({dist.get_backend()}): loss rel {err[0]:.1e}, grad-norm rel {err[1]:.1e}, "
                  f"max |grad diff| {err[2]:.1e}, max |param diff| after AdamW {err[3]:.1e} (lr {LR})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
