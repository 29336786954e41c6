"""Every Triton kernel of nanoflash compiles for the H200 (cuda:90), MI300X (hip:gfx942) and MI355X (hip:gfx950),
on the CPU, at the flash preset's shapes and with the configs and dot precisions its launcher picks for that
target (tests/compile_targets.py: launchers run on meta tensors, launches recorded, then triton.compile).

Bugs caught (issue 38):
* a tl.dot precision the target rejects: `input_precision="tf32"` on gfx950 ("input_precision must be one of
  ('ieee', 'bf16x3', 'bf16x6')"), "tf32x3" anywhere on AMD -- found only at the first launch on the GPU before;
  seen to fail with dot_precision planted back to "tf32" for AMD (tests/README.md habit);
* a launch config that spills on AMD: the H200 attention configs need > 512 VGPRs a lane on CDNA (scratch
  1,436-3,680 bytes a lane at the flash shapes); any VGPR spill or scratch fails here;
* a config whose shared memory / LDS exceeds the device's (gfx942 has 64 KiB; the H200 forward uses 192 KiB);
* bf16 dots of attention and the indexer that no longer reach the tensor cores (no wgmma/mma, no v_mfma).

Not checked on CUDA: register spills. The H200 configs are the fastest measured (docs/benchmarks.md K1) and
ptxas gives the attention kernels a small stack (104 bytes for the C4 forward): reported, not failed.
Time on 2 CPU cores: ~1 min for the file (the attention kernels at head_dim 512 are most of it).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_targets as ct  # noqa: E402

TENSOR_CORE_LAUNCHERS = ("attention_fwd", "attention_bwd", "indexer")   # bf16 dots only


@pytest.mark.parametrize("target", list(ct.TARGETS))
@pytest.mark.parametrize("launcher", ct.LAUNCHERS)
def test_kernels_compile_within_the_targets_registers_and_shared_memory(launcher, target):
    results = ct.check_launcher(launcher, target)
    assert results, f"{launcher}: no launch recorded (TRITON_INTERPRET set in this process?)"
    backend, *_ = ct.TARGETS[target]
    limit = ct.SHARED_LIMIT[ct.TARGETS[target][:2]]
    for key, r, _ in results:
        print(f"{target} {key}: {r}")
        assert r["shared"] <= limit, f"{target} {key}: {r['shared']} bytes of shared memory / LDS > {limit}"
        if backend == "hip":
            assert r["spills"] == 0 and r["scratch"] == 0, \
                f"{target} {key}: {r['regs']} VGPRs, {r['spills']} spilled, {r['scratch']} bytes of scratch a lane"
        if launcher in TENSOR_CORE_LAUNCHERS:
            assert r["mfma"], f"{target} {key}: its bf16 dots do not use the tensor cores"


@pytest.mark.slow   # ~30 s on 2 cores: six kernels at 64 heads x 512
def test_wgmma_backward_fits_the_h200_on_wgmma_without_duplicated_rows():
    """attention_bwd.py's passes with WGMMA_BWD_CONFIG, compiled for cuda:90 at the flash shapes. Bugs caught
    (each seen in this file's history): a pass over the 227 KiB of shared memory (the dq pass at 64 keys x 2
    stages: 256 KiB; the entry rows pass with one [64, 512] fp32 tile converted for its atomics: 256 KiB); a
    dot that leaves wgmma for mma.sync (M < 64, e.g. 32-key tiles); a chained dot of 64 rows on 8 warps,
    which both warpgroups compute (the first key-major pass: s and dp as two 64-row dots, 11 KB of spills)."""
    limit = ct.SHARED_LIMIT[("cuda", 90)]
    results = ct.check_launcher("attention_bwd_wgmma", "cuda:90")
    assert {k.split("(")[0] for k, _, _ in results} >= {"_bwd_delta", "_bwd_dq", "_bwd_dkv", "_bwd_dcomp_rows"}
    for key, r, _ in results:
        print(f"cuda:90 {key}: {r}")
        assert r["shared"] <= limit, f"{key}: {r['shared']} bytes of shared memory > {limit}"
        if not key.startswith("_bwd_delta"):
            assert r["wgmma"] and not r["mma_sync"], f"{key}: not every dot on wgmma"
            assert not r["duplicated"], f"{key}: dots whose rows two warpgroups compute: {r['duplicated']}"


@pytest.mark.slow   # ~10 s on 2 cores: two kernels at 64 heads x 512, plus `_fwd` to compare
def test_keys_forward_fits_the_h200_on_wgmma_without_duplicated_rows():
    """attention._fwd_keys with FWD_KEYS_CONFIG (128 keys on M), compiled for cuda:90 (ptxas -v, sm_90a) at the
    flash shapes, C4 and sliding. Bugs caught: a key block over the 227 KiB of shared memory (two stages of
    128 x 512 keys: 344,064 B); a dot off wgmma or with rows two warpgroups compute (the point of the kernel:
    `_fwd`'s s [64 heads, 64 keys] feeds the p.v dot, so its 8 warps sit on M = 64 -- asserted below, so a
    Triton that stops duplicating is noticed); spills grown past 2 KiB (4 warps: 7,044 B stored).
    Measured 2026-12-05 (Triton 3.6): C4 212,992 B, 255 regs, spills 808 / 736 B (stores / loads); sliding
    300 / 240 B (996 / 916 and 412 / 292 with both head-dim halves of a key block loaded before the first dot);
    `_fwd` 196,608 B, C4 spills 100 / 124 B. Printed with -s."""
    limit = ct.SHARED_LIMIT[("cuda", 90)]
    keys = ct.check_launcher_ptxas("attention_fwd_keys")
    assert {k.split("(")[0] for k, _, _ in keys} == {"_fwd_keys"} and len(keys) == 2
    for key, r, _ in keys + ct.check_launcher_ptxas("attention_fwd"):
        print(f"cuda:90 {key}: regs {r['regs']}, spills {r['spill_stores']} / {r['spill_loads']} B, "
              f"shared {r['shared']} B, duplicated {r['duplicated']}")
        assert r["shared"] <= limit, f"{key}: {r['shared']} bytes of shared memory > {limit}"
        assert r["wgmma"] and not r["mma_sync"], f"{key}: not every dot on wgmma"
        if key.startswith("_fwd_keys"):
            assert not r["duplicated"], f"{key}: dots whose rows two warpgroups compute: {r['duplicated']}"
            assert r["spill_stores"] <= 2048, f"{key}: {r['spill_stores']} bytes of spill stores"
        else:
            assert r["duplicated"], f"{key}: _fwd no longer duplicates rows: the keys forward's reason is gone"


@pytest.mark.slow   # ~15 s on 2 cores: the Hopper backward's passes, with and without fuse_delta
def test_fused_delta_dq_pass_fits_the_h200_as_the_separate_one():
    """The dq pass with fuse_delta=True (delta = rows of o . dO computed there) against the default dq pass,
    compiled for cuda:90 at the flash shapes (ptxas -v, sm_90a). Bugs caught: o and dO loaded as whole
    [64, 512] rows for delta (255 regs, 432 / 404 B of spills at C4), so the fused pass no longer fits
    where the separate one does; fuse_delta still launching `_bwd_delta` (the launcher order); a dot off
    wgmma. Measured 2026-12-05: fused C4 204,800 B, 240 regs, 0 spills (separate: 212,992 B, 233 regs, 0)."""
    limit = ct.SHARED_LIMIT[("cuda", 90)]
    res = {k: r for k, r, _ in ct.check_launcher_ptxas("attention_bwd_fused_delta")}
    dq = {k: r for k, r in res.items() if k.startswith("_bwd_dq")}
    assert len(dq) == 4, sorted(res)      # C4 / sliding x separate / fused
    for key, r in sorted(dq.items()):
        print(f"cuda:90 {key}: regs {r['regs']}, spills {r['spill_stores']} / {r['spill_loads']} B, "
              f"shared {r['shared']} B")
        assert r["shared"] <= limit, f"{key}: {r['shared']} bytes of shared memory > {limit}"
        assert r["wgmma"] and not r["mma_sync"] and not r["duplicated"], f"{key}: {r}"
        if "FUSE_DELTA=True" in key:
            sep = dq[key.replace("FUSE_DELTA=True", "FUSE_DELTA=False")]
            assert r["spill_stores"] <= sep["spill_stores"] and r["spill_loads"] <= sep["spill_loads"], \
                f"{key}: spills {r['spill_stores']} / {r['spill_loads']} B, separate {sep}"


def test_fuse_delta_skips_the_delta_kernel_and_the_dq_pass_runs_first():
    """Launch order of the wgmma backward (recorded, not run): with fuse_delta the dq pass is the first
    launch (every later pass reads the delta it writes) and `_bwd_delta` is not launched; without, the
    delta kernel comes first. Bug caught: the dq pass moved after the dkv / entry passes with fuse_delta on
    (they would read an uninitialised delta; on the GPU torch.empty is often zeros, so values look plausible)."""
    from nanoflash.kernels import attention as ka
    target = ct.gpu_target("cuda:90")
    names = [k.fn.__name__ for k, _, _ in ct.flash_launches(target, "attention_bwd_fused_delta")]
    sep, fused = ["_bwd_delta", "_bwd_dq", "_bwd_dkv"], ["_bwd_dq", "_bwd_dkv"]   # C4 adds the entry pass
    assert names == sep + ["_bwd_dcomp_rows"] + fused + ["_bwd_dcomp_rows"] + sep + fused, names
    assert ka.HOPPER_BWD_CONFIG["dq"].get("fuse_delta", False) is False, "the default changed unmeasured"
