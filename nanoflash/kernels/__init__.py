"""Triton kernels for the two hot spots of V4 attention; `nanoflash/model.py` stays the readable reference.

    attention.py  sparse_attention: one softmax with a per-head sink over, per query, the sliding window
                  [t-W+1, t] of the shared K=V head plus a -1 padded list of selected compressed entries;
                  forward and backward (dQ, dKV, dComp, dSink), bf16 MMA with fp32 accumulation.
    attention_bwd.py  its backward on Hopper's wgmma as passes that each own one accumulator: dq query-major,
                  dkv / dComp key-major (or dComp query-major with atomics); selected by attention.launch_configs
                  (the wgmma passes by default on Hopper: HOPPER_BWD_CONFIG).
    indexer.py    indexer_topk: the lightning indexer's scores for each query's visible entries, fused
                  (no [S, heads, C] tensor), then top-k with the reference's tie-break (lower index wins).
    moe.py        the routed experts: slot permutation on the device (both dispatchers, every path),
                  grouped GEMMs over the stacked w13 / w2 and a fused SwiGLU (`model.RoutedExperts`);
                  imported by its users directly, not re-exported here.
    mhc.py        hc_pre (mixes, 20-iteration Sinkhorn, collapse) and hc_post in Triton, forward and backward.
    matmul.py     bf16 GEMMs with fp32 results for the head, gate and compressor (fp32 in the official code).
    decode.py     a decode step's attention in few launches (`model.Block.decode_step`): RMSNorm + rope fused,
                  one query per row over its window and kept entries, a compressor's state update and pooling;
                  imported by the model directly, not re-exported here.

Which path runs is one config switch, `ModelConfig.kernels`:
    "auto"       attention + indexer kernels on CUDA for bf16/fp16 training forwards (no decode cache) and the
                 grouped experts for bf16 on CUDA, the reference elsewhere -- only kernels that have run inside
                 a whole model on a GPU; in decoding (a cache) on CUDA the Triton mHC and dense experts,
                 and in a decode step of rows at their own positions decode.py (`model.decode_kernels`);
    "reference"  always model.py (matched precision forces this: train.py sets it);
    "triton"     also the grouped experts (moe.py) in every dtype, the Triton mHC and the bf16 GEMMs on CUDA
                 (run inside the 8-layer real-geometry stack on the H200, B14b); attention kernels also on CPU under
                 TRITON_INTERPRET=1 (tests).

model.py imports this package only when the kernel path is taken, so the reference needs no Triton. Triton
reads TRITON_INTERPRET when it is first imported, so the CPU tests run the kernels under the interpreter in a
subprocess (`tests/test_kernels_attention.py`); GPU tests: `tests/test_kernels_attention_gpu.py`; speed:
`bench/bench_attention.py`, docs/benchmarks.md K1.
"""
from nanoflash.kernels.attention import sparse_attention, window_and_selection_mask
from nanoflash.kernels.indexer import index_scores, indexer_topk, topk_lower_index_wins

__all__ = ["sparse_attention", "window_and_selection_mask", "index_scores", "indexer_topk",
           "topk_lower_index_wins"]
