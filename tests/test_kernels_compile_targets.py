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
