"""mHC (hc_pre + hc_post of one sublayer) forward+backward at real width on one GPU: eager reference vs the
compiled kernels of `nanoflash.kernels.mhc`, next to a device copy of the residual measured in the same run.

    python bench/bench_mhc.py [--tokens 8192] [--dim 4096]

Shapes: h [1, N, 4, D] bf16 (the 4-stream residual), fn [24, 4D] fp32. The byte floor of one fwd+bwd
(read h twice and write the streams forward; read/write them again backward) is about 8 x |h|; the copy
ceiling is the bandwidth of `h.clone()`. Prints JSON.
"""
import argparse
import json
import time

import torch

from nanoflash.kernels.mhc import compiled
from nanoflash.model import hc_post, hc_pre_reference

ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6


def timeit(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=4096)
    a = ap.parse_args()
    M, D, N = 4, a.dim, a.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, N, M, D, device="cuda", generator=g).bfloat16().requires_grad_()
    fn = (torch.randn(24, M * D, device="cuda", generator=g) * D ** -0.5).requires_grad_()
    scale = torch.ones(3, device="cuda", requires_grad=True)
    base = torch.zeros(24, device="cuda", requires_grad=True)
    dy = torch.randn(1, N, M, D, device="cuda", generator=g).bfloat16()

    def step(pre, post):
        def run():
            x, p, c = pre(h, fn, scale, base, M, ITERS, EPS, NORM_EPS)
            post(x, h, p, c).backward(dy)
        return run
    pre_c, post_c = compiled("inductor")
    res = {"tokens": N, "dim": D, "device": torch.cuda.get_device_name()}
    res["eager_ms"] = timeit(step(hc_pre_reference, hc_post)) * 1e3
    torch.cuda.reset_peak_memory_stats()
    res["compiled_ms"] = timeit(step(pre_c, post_c)) * 1e3
    res["compiled_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    hb = h.numel() * h.element_size()
    t_copy = timeit(lambda: h.detach().clone())
    res["copy_gbps"] = 2 * hb / t_copy / 1e9
    res["compiled_gbps_at_8x_h"] = 8 * hb / (res["compiled_ms"] / 1e3) / 1e9
    res["compiled_vs_copy"] = res["compiled_gbps_at_8x_h"] / res["copy_gbps"]
    res["speedup"] = res["eager_ms"] / res["compiled_ms"]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
