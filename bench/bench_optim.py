"""AdamW step rates on one GPU host: nanoflash's offloaded AdamW against torch's fused CPU AdamW in the same run.

For B billion trainable parameters in the `small` preset's real shapes (bf16 weights and gradients on the
GPU), seconds per billion parameters of one step (median of `--iters` after one warm-up) of:

    offload      nanoflash.parallel.optim.AdamW(offload=True): grads down, host fused AdamW, weights up,
                 streamed through bounded pinned slots; host threads = the default (CPUs / local ranks)
    offload_t1   the same with host_threads=1 (what OMP_NUM_THREADS=1 under torchrun gave the old code)
    torch_cpu    torch.optim.AdamW(fused=True) over fp32 host tensors whose gradients are already on the host
                 (the host math alone, no transfers: 28 bytes of host memory traffic per parameter, where
                 the offloaded step also casts the weights up, 6 more, and the DMA writes / reads 6)
    torch_cpu_offload  the same optimizer used as an offload, the plain way: every gradient copied to its
                 fp32 host tensor, the fused step, every weight copied back (no overlap, pageable memory)
    torch_cpu_t1 torch_cpu on one thread
    device       nanoflash AdamW with the state on the GPU (torch's fused CUDA kernel)
    legacy       the previous offload (a Python loop per parameter, whole state pinned, full fp32 gradient
                 copy on the host), on a quarter of the parameters

and whether the offloaded master after one step equals torch_cpu's parameters bit for bit (same inputs).
Prints one JSON line. Run on the GPU host: PYTHONPATH=. python bench/bench_optim.py --billions 1.0
"""
import argparse
import json
import math
import os
import statistics
import time

import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel.optim import AdamW, default_host_threads, trainable_parameters

KW = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)


def shapes(billions: float) -> list:
    """The small preset's trainable shapes (bf16 model), in order, until `billions` parameters."""
    with torch.device("meta"):
        model = Transformer(preset("small"))
    out, n = [], 0
    for _, p in trainable_parameters(model):
        if n >= billions * 1e9:
            break
        out.append(tuple(p.shape))
        n += p.numel()
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, iters: int) -> float:
    step()
    ts = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def gpu_params(shp, gen_seed: int):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to smoke-test this script
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    ps = []
    for i, s in enumerate(shp):
        p = torch.nn.Parameter(torch.randn(s, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
        p.grad = torch.randn(s, device=dev, generator=g, dtype=torch.bfloat16) * 1e-3
        ps.append((f"p{i}", p))
    return ps


def legacy_step(ps, state, step_no: int):
    """The previous offloaded step: every gradient to the host as fp32, a Python loop, weights back."""
    b1, b2 = KW["betas"]
    grads = {n: p.grad.float().to("cpu", non_blocking=True) for n, p in ps}
    sync()
    for n, p in ps:
        st, g = state[n], grads[n]
        w = st["master"]
        if p.ndim >= 2:
            w.mul_(1 - KW["lr"] * KW["weight_decay"])
        st["m"].lerp_(g, 1 - b1)
        st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (st["v"].sqrt() / math.sqrt(1 - b2 ** step_no)).add_(KW["eps"])
        w.addcdiv_(st["m"], denom, value=-KW["lr"] / (1 - b1 ** step_no))
        p.data.copy_(w, non_blocking=True)
    sync()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--billions", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    shp = shapes(a.billions)
    n = sum(math.prod(s) for s in shp)
    res = {"params": n, "tensors": len(shp), "host_threads": default_host_threads(), "cpus": os.cpu_count()}
    per_b = lambda s: s / (n / 1e9)  # noqa: E731

    ps = gpu_params(shp, 0)
    ref = [torch.nn.Parameter(p.detach().float().cpu()) for _, p in ps]  # torch_cpu: the same inputs
    for r, (_, p) in zip(ref, ps):
        r.grad = p.grad.float().cpu()
    off = AdamW(ps, offload=True, **KW)
    off.step()  # one step from identical inputs: compare with torch's fused CPU step below
    groups = [{"params": [r for r in ref if r.ndim >= 2]},
              {"params": [r for r in ref if r.ndim < 2], "weight_decay": 0.0}]
    topt = torch.optim.AdamW(groups, fused=True, **KW)
    topt.step()
    res["offload_equals_torch_cpu_bitwise"] = all(torch.equal(off.state[nm]["master"], r)
                                                  for (nm, _), r in zip(ps, ref))
    res["offload"] = per_b(timed(off.step, a.iters))
    res["pinned_mib"] = off.host_bytes()["pinned"] / 2 ** 20
    res["torch_cpu"] = per_b(timed(topt.step, a.iters))

    def plain_offload():
        for r, (_, p) in zip(ref, ps):
            r.grad.copy_(p.grad)
        topt.step()
        for r, (_, p) in zip(ref, ps):
            p.data.copy_(r)
    res["torch_cpu_offload"] = per_b(timed(plain_offload, a.iters))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res["torch_cpu_t1"] = per_b(timed(topt.step, 1))
    torch.set_num_threads(threads)
    del topt, ref, groups
    off.host_threads = 1
    res["offload_t1"] = per_b(timed(off.step, 1))
    del off

    dev = AdamW(ps, **KW)
    res["device"] = per_b(timed(dev.step, a.iters))
    del dev, ps
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    cum = [sum(math.prod(x) for x in shp[:i + 1]) for i in range(len(shp))]
    quarter = gpu_params(shp[: next(i + 1 for i, c in enumerate(cum) if c >= n / 4)], 1)
    nq = sum(p.numel() for _, p in quarter)
    pin = torch.cuda.is_available()
    state = {nm: {k: torch.zeros(p.shape, pin_memory=pin) for k in ("m", "v")} for nm, p in quarter}
    for nm, p in quarter:
        state[nm]["master"] = p.detach().float().cpu().pin_memory() if pin else p.detach().float().clone()
    count = [0]

    def leg():
        count[0] += 1
        legacy_step(quarter, state, count[0])
    res["legacy"] = timed(leg, 1) / (nq / 1e9)
    res["offload_vs_torch_cpu"] = res["torch_cpu"] / res["offload"]  # rate ratio: > 1 is faster than the math alone
    res["offload_vs_torch_cpu_offload"] = res["torch_cpu_offload"] / res["offload"]
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)


if __name__ == "__main__":
    main()
