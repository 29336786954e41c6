"""Compile every Triton kernel of nanoflash for a GPU target on the CPU, and read its registers and shared memory.

How: each launcher (`attention_forward`, `HcPre.forward`, ...) runs on meta tensors of the flash preset's shapes
with `JITFunction.run` patched to record (kernel, args, kwargs) instead of launching, and `target.device_target`
patched to return the target -- so the configs and precisions are the ones the launcher picks for that target.
Each recorded launch is bound with the target's backend exactly as `JITFunction.run` binds it (same
specialisation: divisibility-16 hints, constexprs) and compiled with `triton.compile(ASTSource(...), target)`:
the AMD backend ships in the wheel (LLVM AMDGPU -> amdgcn, no ROCm needed), CUDA uses the wheel's ptxas.

Resources read back, per compiled kernel:
    AMD   the amdgcn's kernel metadata: .vgpr_count (arch VGPRs + AGPRs), .vgpr_spill_count, .sgpr_spill_count,
          .private_segment_fixed_size (scratch bytes a lane), .group_segment_fixed_size (LDS bytes)
    CUDA  `cuobjdump --dump-resource-usage` of the cubin: REG, STACK, LOCAL (spill) and SHARED; plus
          metadata.shared (Triton's dynamic shared memory); `ptxas_report`: ptxas -v on the PTX (registers,
          spill stores / loads in bytes) with Triton's shared memory

Used by tests/test_kernels_compile_targets.py; `python tests/compile_targets.py [hip:gfx950 ...]` prints the table.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

# Per-block shared memory / LDS limits, bytes.
SHARED_LIMIT = {
    ("cuda", 90): 227 * 1024,      # H100/H200: 227 KiB dynamic shared memory per block (opt-in maximum)
    ("hip", "gfx942"): 64 * 1024,  # MI300X (CDNA3): 64 KiB LDS per workgroup
    ("hip", "gfx950"): 160 * 1024,  # MI355X (CDNA4): 160 KiB LDS per CU, all of it to one workgroup
}
TARGETS = {"cuda:90": ("cuda", 90, 32), "hip:gfx942": ("hip", "gfx942", 64), "hip:gfx950": ("hip", "gfx950", 64)}

# The flash preset's training shapes at one sequence of SEQ tokens (B = 1): big enough that every loop runs
# and every int argument specialises as in training (multiples of 16).
SEQ = 4096


def gpu_target(name: str):
    from triton.backends.compiler import GPUTarget
    return GPUTarget(*TARGETS[name])


@contextlib.contextmanager
def recorded_launches(target):
    """Within: Triton launches are recorded into the yielded list, not run; kernels see `target`."""
    from triton.runtime.jit import JITFunction

    from nanoflash.kernels import target as tgt
    calls = []
    run, device_target = JITFunction.run, tgt.device_target

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, kwargs))

    JITFunction.run, tgt.device_target = record, (lambda device: target)
    try:
        yield calls
    finally:
        JITFunction.run, tgt.device_target = run, device_target


def flash_launches(target, which: str):
    """[(kernel, args, kwargs)] the launcher `which` makes at the flash shapes for `target`."""
    from nanoflash.config import preset
    cfg = preset("flash")
    meta = dict(device="meta")
    bf = dict(meta, dtype=torch.bfloat16)
    S, H, Dh, W = SEQ, cfg.n_heads, cfg.head_dim, cfg.window_size
    with recorded_launches(target) as calls:
        if which in ("attention_fwd", "attention_bwd"):
            from nanoflash.kernels import attention as ka
            C = S // 4                                          # a C4 layer: S/4 entries, index_topk selected
            q, kv, comp = torch.empty(1, S, H, Dh, **bf), torch.empty(1, S, Dh, **bf), torch.empty(1, C, Dh, **bf)
            sel = torch.empty(1, S, cfg.index_topk, dtype=torch.int32, **meta)
            n_sel = torch.empty(1, S, dtype=torch.int32, **meta)
            sink = torch.empty(H, dtype=torch.float32, **meta)
            lse = torch.empty(1, S, H, dtype=torch.float32, **meta)
            scale = Dh ** -0.5
            for c, s_, n in ((comp, sel, n_sel), (None, None, None)):      # C4 / C128 layers, sliding layers
                if which == "attention_fwd":
                    ka.attention_forward(q, kv, c, s_, n, sink, scale, W)
                else:   # CUDA: the fused backward (pre-Hopper GPUs run it; cuda:90's default, the wgmma
                    # passes, is WGMMA_LAUNCHERS'); AMD: the arch's own config
                    fused = ka.FUSED_BWD_CONFIG if target.backend == "cuda" else None
                    ka.attention_backward(q, q, kv, c, s_, n, q, lse, scale, W, fused)
        elif which == "attention_bwd_wgmma":   # the wgmma backward, entries key-major and query-major
            from nanoflash.kernels import attention as ka
            C = S // 4
            q, kv, comp = torch.empty(1, S, H, Dh, **bf), torch.empty(1, S, Dh, **bf), torch.empty(1, C, Dh, **bf)
            sel = torch.empty(1, S, cfg.index_topk, dtype=torch.int32, **meta)
            n_sel = torch.empty(1, S, dtype=torch.int32, **meta)
            lse = torch.empty(1, S, H, dtype=torch.float32, **meta)
            wg = ka.WGMMA_BWD_CONFIG
            for mode in ("keys", "rows"):
                ka.attention_backward(q, q, kv, comp, sel, n_sel, q, lse, Dh ** -0.5, W,
                                      dict(wg, comp=dict(wg["comp"], comp_mode=mode)))
            ka.attention_backward(q, q, kv, None, None, None, q, lse, Dh ** -0.5, W, wg)
        elif which in ("attention_fwd_keys", "attention_bwd_fused_delta"):   # prepared candidates (cuda:90)
            from nanoflash.kernels import attention as ka
            C = S // 4
            q, kv, comp = torch.empty(1, S, H, Dh, **bf), torch.empty(1, S, Dh, **bf), torch.empty(1, C, Dh, **bf)
            sel = torch.empty(1, S, cfg.index_topk, dtype=torch.int32, **meta)
            n_sel = torch.empty(1, S, dtype=torch.int32, **meta)
            lse = torch.empty(1, S, H, dtype=torch.float32, **meta)
            sink = torch.empty(H, dtype=torch.float32, **meta)
            for c, s_, n in ((comp, sel, n_sel), (None, None, None)):      # C4 / C128 layers, sliding layers
                if which == "attention_fwd_keys":
                    ka.attention_forward(q, kv, c, s_, n, sink, Dh ** -0.5, W, ka.FWD_KEYS_CONFIG)
                else:   # the default (HOPPER_BWD_CONFIG) and the same with fuse_delta, to compare
                    hop = ka.HOPPER_BWD_CONFIG
                    for fuse in (False, True):
                        ka.attention_backward(q, q, kv, c, s_, n, q, lse, Dh ** -0.5, W,
                                              dict(hop, dq=dict(hop["dq"], fuse_delta=fuse)))
        elif which == "indexer":
            from nanoflash.kernels.indexer import index_scores
            HI, DI = cfg.index_n_heads, cfg.index_head_dim
            index_scores(torch.empty(1, S, HI, DI, **bf), torch.empty(1, S // 4, DI, **bf),
                         torch.empty(1, S, HI, dtype=torch.float32, **meta))
        elif which in ("mhc_pre", "mhc_post"):
            from nanoflash.kernels import mhc
            M, D, NMIX = cfg.hc_mult, cfg.dim, (2 + cfg.hc_mult) * cfg.hc_mult
            f32 = dict(meta, dtype=torch.float32)
            if which == "mhc_pre":
                h = torch.empty(1, S, M, D, **bf)
                fn, sc, base = torch.empty(NMIX, M * D, **f32), torch.empty(3, **f32), torch.empty(NMIX, **f32)

                class Ctx:   # what HcPre.forward saves, for its backward
                    def save_for_backward(self, *t):
                        self.saved_tensors = t
                ctx = Ctx()
                mhc.HcPre.forward(ctx, h, fn, sc, base, M, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
                mhc.HcPre.backward(ctx, torch.empty(1, S, D, **bf), torch.empty(1, S, M, **f32),
                                   torch.empty(1, S, M, M, **f32))
            else:
                x, res = torch.empty(1, S, D, **bf), torch.empty(1, S, M, D, **bf)
                post, comb = torch.empty(1, S, M, **f32), torch.empty(1, S, M, M, **f32)

                class Ctx:
                    def save_for_backward(self, *t):
                        self.saved_tensors = t
                ctx = Ctx()
                mhc.HcPost.forward(ctx, x, res, post, comb)
                mhc.HcPost.backward(ctx, torch.empty(1, S, M, D, **bf))
        elif which == "moe_swiglu":
            from nanoflash.kernels import moe
            T, I = S * cfg.n_activated_experts, cfg.moe_inter_dim     # the expert-sorted slot rows of S tokens

            class Ctx:
                def save_for_backward(self, *t):
                    self.saved_tensors = t
            ctx = Ctx()
            moe._SwiGLU.forward(ctx, torch.empty(T, 2 * I, **bf), torch.empty(T, 1, dtype=torch.float32, **meta),
                                cfg.swiglu_limit)
            moe._SwiGLU.backward(ctx, torch.empty(T, I, **bf))
        elif which == "decode":   # the decode seam's step kernels, at a 64-row step of the fp32 and bf16 engines
            from nanoflash.kernels import decode as kd
            B, R2, C = 64, cfg.rope_head_dim // 2, 512
            pos = torch.empty(B, dtype=torch.int64, **meta)
            cos = torch.empty(B, 1, R2, dtype=torch.float32, **meta)
            for dt in (torch.float32, torch.bfloat16):
                act = dict(meta, dtype=dt)
                w = torch.empty(cfg.dim, **act)
                kd.rms_rope(torch.empty(B, 1, cfg.dim, **act), w, cfg.norm_eps)                  # a layer norm
                kd.rms_rope(torch.empty(B, 1, H, Dh, **act), None, cfg.norm_eps, cos, cos)     # q: RMS + rope
                kd.rms_rope(torch.empty(B, 1, Dh, **act), w[:Dh], cfg.norm_eps, cos, cos)      # kv, entries
                kd.rms_rope(torch.empty(B, H, Dh, **act), cos=cos, sin=cos, inverse=True, norm=False)   # o
                q, win, comp = torch.empty(B, H, Dh, **act), torch.empty(B, W, Dh, **act), torch.empty(B, C, Dh, **act)
                sink = torch.empty(H, dtype=torch.float32, **meta)
                kd.decode_attention(q, win, pos, sink, Dh ** -0.5, W)                              # sliding
                kd.decode_attention(q, win, pos, sink, Dh ** -0.5, W, comp, ratio=128)             # C128
                kd.decode_attention(q, win, pos, sink, Dh ** -0.5, W, comp,                        # C4, top-k
                                    torch.empty(B, C, dtype=torch.bool, **meta), 4)
            f32 = dict(meta, dtype=torch.float32)
            for m, c in ((4, 2 * Dh), (4, 2 * cfg.index_head_dim), (128, Dh)):                 # C4, indexer, C128
                prev = torch.empty(B, m, c, **f32) if m == 4 else None
                for pool in (True, False):
                    kd.compress_step(torch.empty(B, m - 1, c, **f32), torch.empty(B, m - 1, c, **f32),
                                     torch.empty(B, 1, c, **f32), torch.empty(B, 1, c, **f32),
                                     torch.empty(m, c, **f32), pos, prev, prev, pool)
        elif which == "quant_fp8":
            from nanoflash import quant
            D = cfg.dim
            quant._fp8_block_cuda(torch.empty(D, D, **bf), torch.empty(D, D, dtype=torch.float8_e4m3fn, **meta),
                                  torch.empty(D // 128, D // 128, dtype=torch.float32, **meta))
        else:
            raise ValueError(which)
    return calls


LAUNCHERS = ("attention_fwd", "attention_bwd", "indexer", "mhc_pre", "mhc_post", "moe_swiglu", "quant_fp8", "decode")
# cuda:90 only (not in LAUNCHERS: AMD runs the fused backward, attention.AMD_BWD_CONFIG)
WGMMA_LAUNCHERS = ("attention_bwd_wgmma",)
# cuda:90 only, prepared but not default: the keys-on-M forward, the wgmma backward with delta in the dq pass
CANDIDATE_LAUNCHERS = ("attention_fwd_keys", "attention_bwd_fused_delta")


def _key(kernel, kwargs) -> str:
    flags = ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k.isupper() and not k.startswith("BLOCK"))
    return f"{kernel.fn.__name__}({flags})" if flags else kernel.fn.__name__


def compile_launch(kernel, args, kwargs, target):
    """triton.compile of one recorded launch for `target`, bound as JITFunction.run binds it."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def resources(compiled, target) -> dict:
    """{regs, spills, scratch, shared} of a compiled kernel (see the module docstring)."""
    shared = compiled.metadata.shared
    if target.backend == "hip":
        asm = compiled.asm["amdgcn"]

        def field(name):
            m = re.search(rf"\.{name}:\s+(\d+)", asm)
            return int(m.group(1)) if m else 0
        return dict(regs=field("vgpr_count"), spills=field("vgpr_spill_count"), sgpr_spills=field("sgpr_spill_count"),
                    scratch=field("private_segment_fixed_size"), shared=max(shared, field("group_segment_fixed_size")),
                    mfma="v_mfma" in asm)
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout

    def field(name):
        m = re.search(rf"\b{name}:(\d+)", out)
        return int(m.group(1)) if m else 0
    return dict(regs=field("REG"), spills=field("LOCAL"), sgpr_spills=0, scratch=field("STACK"),
                shared=max(shared, field("SHARED")), mfma="mma" in compiled.asm["ptx"],
                wgmma="wgmma.mma_async" in compiled.asm["ptx"], mma_sync="mma.sync" in compiled.asm["ptx"],
                duplicated=duplicated_rows(compiled.asm["ttgir"]))


def ptxas_report(compiled, arch: str = "sm_90a") -> dict:
    """ptxas -v of a CUDA kernel's PTX. -> {regs, spill_stores, spill_loads (bytes), shared (bytes: Triton's
    dynamic shared memory, or ptxas's static if larger)}"""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        err = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr

    def field(pattern):
        m = re.search(pattern, err)
        return int(m.group(1)) if m else 0
    return dict(regs=field(r"Used (\d+) registers"), spill_stores=field(r"(\d+) bytes spill stores"),
                spill_loads=field(r"(\d+) bytes spill loads"),
                shared=max(compiled.metadata.shared, field(r"(\d+) bytes smem")))


def check_launcher_ptxas(which: str, target_name: str = "cuda:90"):
    """Compile every kernel the launcher makes for a CUDA target; -> [(key, ptxas_report | resources, seconds)]"""
    target = gpu_target(target_name)
    out, seen = [], set()
    for kernel, args, kwargs in flash_launches(target, which):
        key = _key(kernel, kwargs)
        if key in seen:
            continue
        seen.add(key)
        t0 = time.time()
        compiled = compile_launch(kernel, args, kwargs, target)
        out.append((key, dict(resources(compiled, target), **ptxas_report(compiled)), time.time() - t0))
    return out


def duplicated_rows(ttgir: str) -> list:
    """Hopper dots whose rows are fewer than their warps cover: a wgmma layout with warpsPerCTA [wm, wn] spans
    16 wm rows, so a dot of M < 16 wm rows has warpgroups computing the same rows (Triton 3.6 puts all warps
    on M for a dot whose result feeds another dot). -> [(M, wm)] of such dots"""
    layouts = {m.group(1): int(m.group(2)) for m in
               re.finditer(r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 3.*?warpsPerCTA = \[(\d+), \d+\]",
                           ttgir, re.M)}
    out = []
    for m in re.finditer(r"ttng\.warp_group_dot .*?-> tensor<(\d+)x\d+xf32, (#mma\d*)>", ttgir):
        rows, wm = int(m.group(1)), layouts.get(m.group(2), 4)
        if rows < 16 * wm:
            out.append((rows, wm))
    return out


def check_launcher(which: str, target_name: str):
    """Compile every kernel the launcher makes for the target. -> [(key, resources, seconds)]"""
    target = gpu_target(target_name)
    out, seen = [], set()
    for kernel, args, kwargs in flash_launches(target, which):
        key = _key(kernel, kwargs)
        if key in seen:
            continue
        seen.add(key)
        t0 = time.time()
        compiled = compile_launch(kernel, args, kwargs, target)
        out.append((key, resources(compiled, target), time.time() - t0))
    return out


def main(argv):
    names = [a for a in argv if a in TARGETS] or list(TARGETS)
    which = [a for a in argv if a in LAUNCHERS] or list(LAUNCHERS)
    print(f"{'target':11} {'kernel':44} {'regs':>5} {'spill':>5} {'scratch':>7} {'shared':>7} {'mma':>4} {'s':>5}")
    for name in names:
        for w in which:
            for key, r, dt in check_launcher(w, name):
                print(f"{name:11} {key:44} {r['regs']:5} {r['spills']:5} {r['scratch']:7} {r['shared']:7} "
                      f"{str(r['mfma'])[0]:>4} {dt:5.1f}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
