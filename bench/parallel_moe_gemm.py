"""Benchmark (c) of the training-engine issue: MoE-MLP forward+backward vs a dense GEMM of the same FLOPs.

V4-Flash expert shapes at EP4: 64 local experts, D=4096, I=2048 (SwiGLU: w1|w3 fused [D,2I], w2 [I,D]), bf16.
Three ways to run the experts on T = 64 x rows tokens (already sorted by expert):
    grouped   torch._grouped_mm over all experts (one kernel per projection)
    loop      one torch.mm per expert (what a plain-PyTorch MoE does)
    model     nanoflash.model.MoE itself (gate + LocalDispatcher + Expert modules, fp32 SwiGLU) on
              T*? tokens with top-6 routing (its rows per expert are whatever the router picks)
against   dense     one [T,D] x [D,2I] and one [T,I] x [I,D] GEMM (same FLOPs as grouped/loop).
Ratio = dense time / method time (1.0 = as fast as a dense GEMM). Goal >= 0.6 at >= 768 rows/expert.

Run on a GPU: PYTHONPATH=. python bench/parallel_moe_gemm.py
"""
import dataclasses
import statistics

import torch
import torch.nn.functional as F

E, D, I = 64, 4096, 2048
WARMUP, ITERS = 3, 10


def timed(fn) -> float:
    """Median milliseconds of fn() over ITERS runs after WARMUP, CUDA events."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(ITERS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def swiglu(h):
    g, u = h.chunk(2, -1)
    return F.silu(g) * u


def make_counts(rows: int, skew: bool, g) -> torch.Tensor:
    if not skew:
        return torch.full((E,), rows, dtype=torch.long)
    w = torch.distributions.LogNormal(0.0, 1.0).sample((E,))
    c = (w / w.sum() * rows * E).round().long().clamp(min=1)
    c[0] += rows * E - c.sum()
    return c


def bench(rows: int, skew: bool, dev="cuda") -> dict:
    g = torch.Generator().manual_seed(0)
    counts = make_counts(rows, skew, g)
    T = int(counts.sum())
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    # nn.Linear layout [out, in] per expert; the transposed view is the column-major B that grouped GEMMs want
    w13_p = (torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2_p = (torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    w13, w2 = w13_p.transpose(-2, -1), w2_p.transpose(-2, -1)  # [E,D,2I], [E,I,D]
    d13 = (torch.randn(D, 2 * I, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    d2 = (torch.randn(I, D, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    offs = counts.cumsum(0).to(dev, torch.int32)
    splits = counts.tolist()

    def grouped():
        y = torch._grouped_mm(swiglu(torch._grouped_mm(x, w13, offs=offs)), w2, offs=offs)
        y.backward(dy)

    # separate leaf tensors per expert, as in a model with one module per expert (indexing one big tensor
    # would make every expert's backward write a full-size zero gradient)
    w13_l = [w.detach().clone().requires_grad_() for w in w13]
    w2_l = [w.detach().clone().requires_grad_() for w in w2]

    def loop():
        ys = [swiglu(xe @ w13_l[e]) @ w2_l[e] for e, xe in enumerate(x.split(splits))]
        torch.cat(ys).backward(dy)

    def dense():
        (swiglu(x @ d13) @ d2).backward(dy)

    flops = 3 * 2 * T * (D * 2 * I + I * D)  # fwd + 2x bwd
    out = {"rows/expert": rows, "skew": skew, "max rows": int(counts.max()), "T": T}
    t_dense = timed(dense)
    out["dense ms"], out["dense TFLOP/s"] = t_dense, flops / t_dense / 1e9
    for name, fn in (("grouped", grouped), ("loop", loop)):
        try:
            t = timed(fn)
            out[f"{name} ms"], out[f"{name} TFLOP/s"], out[f"{name}/dense"] = t, flops / t / 1e9, t_dense / t
        except Exception as e:  # e.g. _grouped_mm without a backward on this torch build
            out[f"{name} error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def bench_model_moe(tokens: int) -> dict:
    """nanoflash.model.MoE with 64 experts, top-6, flash dims, bf16 weights; fwd+bwd vs dense same FLOPs."""
    from nanoflash.config import preset
    from nanoflash.model import MoE
    cfg = dataclasses.replace(preset("flash"), n_routed_experts=E, n_hash_layers=0)
    with torch.device("cuda"):
        moe = MoE(5, cfg)
    with torch.no_grad():
        for n, p in moe.named_parameters():
            p.zero_() if n.endswith("bias") else p.normal_(0, 0.02)
    moe.to(torch.bfloat16)
    x = torch.randn(1, tokens, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="cuda")
    t = timed(lambda: moe(x, ids).float().sum().backward())
    K = cfg.n_activated_experts
    flops = 3 * 2 * tokens * (K + 1) * 3 * D * I  # routed top-K + shared expert, 3 projections each
    return {"tokens": tokens, "rows/expert (mean)": tokens * K / E, "model MoE ms": t, "TFLOP/s": flops / t / 1e9}


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.__version__, torch.cuda.get_device_name())
    for rows in (192, 768):
        for skew in (False, True):
            print(bench(rows, skew), flush=True)
    for tokens in (8192, 16384):
        print(bench_model_moe(tokens), flush=True)
