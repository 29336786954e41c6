"""mHC (hc_pre + hc_post of one sublayer) forward+backward at real width on one GPU: eager reference vs the
Triton kernels of `nanoflash.kernels.mhc` (and, with --compiled, B14a's torch.compile variant), next to a
device copy of the residual measured in the same run.

    python bench/bench_mhc.py [--tokens 8192] [--dim 4096] [--compiled] [--out mhc.json]

Shapes: h [1, N, 4, D] bf16 (the 4-stream residual), fn [24, 4D] fp32. The byte floor of one fwd+bwd is
about 8 x |h| (forward: read h for the mixes and the collapse, read it and write the streams in hc_post;
backward: read dout and h, write dres; read dx and h for dpre, read h and write dh, read h for dfn -- the
kernels here move ~12 x |h|); the copy ceiling is the bandwidth of `h.clone()` (read + write). Prints JSON.
"""
import argparse
import json
import time

import torch

from nanoflash.kernels.mhc import hc_post_fused, hc_pre_fused
from nanoflash.model import hc_post, hc_pre_reference

ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6


def compiled(backend: str = "inductor"):
    """(hc_pre, hc_post) of model.py under torch.compile (B14a's variant)."""
    opts = dict(fullgraph=True, dynamic=True, backend=backend)
    return torch.compile(hc_pre_reference, **opts), torch.compile(hc_post, **opts)


def timeit(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def kernel_times(fn, n=5):
    """Device microseconds per call of each kernel of fn() (torch.profiler, n calls)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t:
            out[e.key[:60]] = round(t / n, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:20])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    M, D, N = 4, a.dim, a.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, N, M, D, device="cuda", generator=g).bfloat16().requires_grad_()
    fn = (torch.randn(24, M * D, device="cuda", generator=g) * D ** -0.5).requires_grad_()
    scale = torch.ones(3, device="cuda", requires_grad=True)
    base = torch.zeros(24, device="cuda", requires_grad=True)
    dy = torch.randn(1, N, M, D, device="cuda", generator=g).bfloat16()

    def step(pre, post, fwd_only=False):
        def run():
            with torch.set_grad_enabled(not fwd_only):
                x, p, c = pre(h, fn, scale, base, M, ITERS, EPS, NORM_EPS)
                out = post(x, h, p, c)
            if not fwd_only:
                out.backward(dy)
        return run
    paths = {"eager": (hc_pre_reference, hc_post), "triton": (hc_pre_fused, hc_post_fused)}
    if a.compiled:
        paths["compiled"] = compiled("inductor")
    res = {"tokens": N, "dim": D, "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    hb = h.numel() * h.element_size()
    t_copy = timeit(lambda: h.detach().clone())
    res["copy_gbps"] = 2 * hb / t_copy / 1e9
    for name, (pre, post) in paths.items():
        torch.cuda.reset_peak_memory_stats()
        res[f"{name}_ms"] = timeit(step(pre, post)) * 1e3
        res[f"{name}_fwd_ms"] = timeit(step(pre, post, True)) * 1e3
        res[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        res[f"{name}_gbps_at_8x_h"] = 8 * hb / (res[f"{name}_ms"] / 1e3) / 1e9
        res[f"{name}_vs_copy"] = res[f"{name}_gbps_at_8x_h"] / res["copy_gbps"]
    res["triton_speedup_vs_eager"] = res["eager_ms"] / res["triton_ms"]
    res["triton_kernels_us"] = kernel_times(step(*paths["triton"]))
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
