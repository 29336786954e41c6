"""Fused mHC: `hc_pre` (mixes -> Sinkhorn -> collapse) and `hc_post` as compiled kernels, forward and backward.

The eager reference (`nanoflash.model.hc_pre_reference`, `hc_post`) launches ~80 small kernels per sublayer
(20 Sinkhorn iterations of two normalisations on [N,M,M], the sigmoid/softmax splits) and materialises fp32
copies of the M-stream residual h [N,M,D] three times (mixes, collapse, post). `torch.compile` of those exact
functions (fullgraph, dynamic shapes, so one graph serves every micro-batch length) fuses the elementwise
chains, the 20-iteration Sinkhorn and the collapse into a few kernels and reads h in its own dtype, upcasting
in registers; AOTAutograd derives the backward from the same code. The arithmetic is the reference's, in fp32,
so results differ from eager only by the order of floating-point reductions (tolerances in the tests).

Dispatch is the same switch as the attention kernels (`ModelConfig.kernels`), on CUDA only and opt-in:
"triton" uses these functions in `Block.forward`; "auto" keeps the eager reference until the compiled path
has run inside a whole model on a GPU (so far: the functions alone at real width, docs/benchmarks.md B14a);
CPU models always run the reference (the CPU test calls these functions directly). Tests: `pytest tests/test_kernels_mhc.py -q` (CPU: inductor's C++ backend; GPU-marked: real width).
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def compiled(backend: str = "inductor"):
    """(hc_pre, hc_post) compiled with `backend`: "inductor" generates the fused kernels; the CPU test uses
    "aot_eager" (the same dynamo + AOTAutograd graphs, run eagerly: inductor's C++ build takes minutes there)."""
    from nanoflash.model import hc_post, hc_pre_reference
    opts = dict(fullgraph=True, dynamic=True, backend=backend)
    return torch.compile(hc_pre_reference, **opts), torch.compile(hc_post, **opts)


def hc_pre_fused(h, fn, scale, base, M: int, iters: int, eps: float, norm_eps: float):
    """Compiled `model.hc_pre_reference`: h [B,S,M,D] -> (x [B,S,D], post [B,S,M], comb [B,S,M,M])."""
    return compiled()[0](h, fn, scale, base, M, iters, eps, norm_eps)


def hc_post_fused(x, res, post, comb):
    """Compiled `model.hc_post`: out_k = post_k x + sum_j comb[j,k] res_j.  -> [B,S,M,D]"""
    return compiled()[1](x, res, post, comb)
