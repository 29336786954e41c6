"""MoE forward+backward vs a dense GEMM of the same FLOPs, measured in the same run (issue 13; B2 before).

V4-Flash expert shapes at EP4: 64 local experts, D=4096, I=2048, top-6, bf16 weights and activations. Each case
fixes the rows per expert through routing replay (the gate's weights still come from its scores), balanced
(every expert exactly R rows) or skewed (experts drawn per token with lognormal popularity, no repeats):

    dense     the ceiling: swiglu(x W13) W2 on T rows as two plain GEMMs (+ bf16 SwiGLU), T = the rows of
              the method measured, so both do the same GEMM FLOPs; fwd + bwd (dx and both weight grads)
    experts   nanoflash.kernels.moe.grouped_experts on T = 64 R expert-sorted rows (grouped GEMMs + fused SwiGLU)
    raw       torch._grouped_mm + bf16 SwiGLU, no clamp / routing weight (the ceiling of the grouped GEMMs)
    moe       nanoflash.model.MoE (kernels="triton" -> grouped): gate, slot permutation, experts, combine and
              the shared expert, on N = 64 R / 6 tokens; its dense twin has T = N (6 + 1) rows
    moe_ref   the same module with kernels="reference" (per-expert loop, counts on the host), balanced only

ratio = dense time / method time at equal FLOPs (1.0 = as fast as a dense GEMM). Target >= 0.6 at 768 rows.

Run on a GPU: PYTHONPATH=. python bench/parallel_moe_gemm.py [--out results.json]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from nanoflash.config import preset
from nanoflash.kernels.moe import grouped_experts
from nanoflash.model import MoE

E, D, I, K = 64, 4096, 2048, 6
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


def leaf(*shape, std=0.02):
    return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * std).requires_grad_()


def dense_ms(T: int) -> float:
    x, w13, w2, dy = leaf(T, D, std=1.0), leaf(2 * I, D), leaf(D, I), torch.randn(T, D, device="cuda").bfloat16()

    def run():
        g, u = F.linear(x, w13).chunk(2, -1)
        F.linear(F.silu(g) * u, w2).backward(dy)
    return timed(run)


def replay(N: int, skew: bool, g) -> torch.Tensor:
    """[N,K] experts per token: round robin (each expert N K / E rows) or lognormal popularity."""
    if not skew:
        return (torch.arange(N)[:, None] * K + torch.arange(K)[None]) % E
    pop = torch.randn(E, generator=g).exp()                                             # lognormal(0, 1)
    return torch.multinomial(pop.expand(N, E), K, replacement=False, generator=g)


def experts_case(rows: int, skew: bool, g) -> dict:
    idx = replay(E * rows // K, skew, g)
    counts = torch.bincount(idx.flatten(), minlength=E).cuda()
    T = int(counts.sum())
    x, rw, dy = leaf(T, D, std=1.0), torch.rand(T, 1, device="cuda").requires_grad_(), leaf(T, D, std=1.0).detach()
    w13, w2 = leaf(E, 2 * I, D), leaf(E, D, I)
    offs = counts.cumsum(0).to(torch.int32)
    t_exp = timed(lambda: grouped_experts(x, rw, counts, w13, w2, 10.0).backward(dy))

    def raw():
        g_, u = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs).chunk(2, -1)
        torch._grouped_mm(F.silu(g_) * u, w2.transpose(-2, -1), offs=offs).backward(dy)
    t_raw, t_dense = timed(raw), dense_ms(T)
    return {"case": "experts", "rows/expert": rows, "skew": skew, "max rows": int(counts.max()), "T": T,
            "dense ms": t_dense, "experts ms": t_exp, "experts/dense": t_dense / t_exp,
            "raw ms": t_raw, "raw/dense": t_dense / t_raw, "TFLOP/s": 18 * T * D * I / t_exp / 1e9}


def moe_case(rows: int, skew: bool, g, kernels="triton") -> dict:
    N = E * rows // K
    cfg = preset("flash", n_routed_experts=E, n_hash_layers=0, kernels=kernels)
    with torch.device("cuda"):
        moe = MoE(5, cfg)
    with torch.no_grad():
        for n, p in moe.named_parameters():
            p.zero_() if n.endswith("bias") else p.normal_(0, 0.02)
    moe.to(torch.bfloat16)
    x = leaf(1, N, D, std=1.0)
    ids, rx, dy = torch.zeros(1, N, dtype=torch.long, device="cuda"), replay(N, skew, g).cuda(), leaf(1, N, D).detach()
    t = timed(lambda: moe(x, ids, rx).backward(dy))
    t_dense = dense_ms(N * (K + 1))
    counts = torch.bincount(rx.flatten(), minlength=E)
    return {"case": "moe" if kernels == "triton" else "moe_ref", "rows/expert": rows, "skew": skew,
            "max rows": int(counts.max()), "tokens": N, "dense ms": t_dense, "moe ms": t, "moe/dense": t_dense / t,
            "TFLOP/s": 18 * N * (K + 1) * D * I / t / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    g, rows_ = torch.Generator().manual_seed(0), []
    for rows, skew in ((768, False), (768, True), (192, False), (192, True)):
        for fn in (experts_case, moe_case):
            rows_.append(fn(rows, skew, g))
            print(json.dumps(rows_[-1]), flush=True)
    rows_.append(moe_case(768, False, g, kernels="reference"))
    print(json.dumps(rows_[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows_, f, indent=1)


if __name__ == "__main__":
    main()
