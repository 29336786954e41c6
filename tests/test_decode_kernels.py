"""The decode seam (`model.decode_kernels`): a cached forward's few-launch paths against the readable reference.

* `RoutedExperts.dense` (every expert on every token, batched GEMMs) against the per-expert loop of
  `MoE.forward` (dispatch -> `expert_ffn` per expert -> combine), fp32 and with QAT, on the CPU;
* the switch: which forwards take it (a cache; "auto" on CUDA, "triton" anywhere, "reference" never; dense
  experts only on one-token steps and where `dense_pays`);
* a whole decode (prefill of two rows, `cat_caches`, per-row steps) with kernels="triton" (fused mHC under
  Triton's interpreter, dense experts) against kernels="reference", in a subprocess (TRITON_INTERPRET=1 must be
  set before Triton is imported: tests/interp.py).
The GPU check of the same on the `small` geometry is `tests/test_rollout_batching.py -m gpu` (bench/gpu_batching.sh).

Run: pytest tests/test_decode_kernels.py -q
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interp  # noqa: E402  tests/interp.py: the kernel cases under Triton's interpreter, in a subprocess

from nanoflash.config import preset  # noqa: E402
from nanoflash.model import LayerCache, MoE, Transformer, decode_kernels, round_robin_tid2eid  # noqa: E402

# Dense vs loop experts, fp32: the same products, summed over 8 experts (zeros included) instead of over the
# top-2 slots, and the GEMMs in other shapes: measured 3e-7 relative to the output's max (tiny, weights ~0.3).
# A routing weight on the wrong expert, a lost clamp or a dropped expert moves outputs by O(1) relative.
DENSE_REL = 1e-5
# Whole decode, fused mHC + dense experts vs the reference (fp32): FMA dots over M*D in another order, exp in
# numpy; logits of order 1 after 4 layers, measured <= 1e-6 relative. A Sinkhorn iteration short, comb applied
# untransposed or a row on another row's routing moves them by > 1e-2.
DECODE_REL = 1e-4
INTERP_TIMEOUT_S = 240   # the case takes ~10 s on the 2-core CI box


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _moe(cfg, layer_id, gen):
    moe = MoE(layer_id, cfg)
    with torch.no_grad():
        for n, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if moe.gate.hash:                       # Transformer.init_weights' table: K distinct experts per token
            moe.gate.tid2eid.copy_(round_robin_tid2eid(cfg.vocab_size, cfg.n_activated_experts, cfg.n_routed_experts))
    return moe


@pytest.mark.parametrize("qat", [False, True])
@pytest.mark.parametrize("layer_id", [1, 3])          # a hash-routed layer and a score-routed one (tiny)
def test_dense_experts_equal_the_per_expert_loop(gen, qat, layer_id):
    """`MoE.forward(dense=True)` equals the dispatch -> loop -> combine path within DENSE_REL, the clamp of the
    SwiGLU engaged (inputs ~3, weights ~0.3 put |gate| above swiglu_limit=10 for some units). Bugs caught: the routing
    weight scattered to the wrong expert (or onto every expert), w1 / w3 halves swapped, the limit dropped,
    experts summed before w2 without their own weight."""
    cfg = preset("tiny", qat=qat)
    moe = _moe(cfg, layer_id, gen)
    x = 3 * torch.randn(7, 1, cfg.dim, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (7, 1), generator=gen)
    with torch.no_grad():
        want, got = moe(x, ids), moe(x, ids, dense=True)
        gate = moe.experts.w13[:, :cfg.moe_inter_dim] @ x[:, 0].T
    assert bool((gate.abs() > cfg.swiglu_limit).any()), "the clamp is not exercised"
    assert moe.dense_pays() and rel(got, want) <= DENSE_REL, rel(got, want)


def test_dense_experts_sum_a_repeated_expert_twice(gen):
    """A hash table naming one expert twice for a token (a pushed tid2eid may) counts it twice, as the loop does.
    Bug caught: `scatter_` instead of `scatter_add_` (the second weight overwrites the first)."""
    cfg = preset("tiny")
    moe = _moe(cfg, 0, gen)                      # layer 0: hash routing
    moe.gate.tid2eid[:] = 5                      # both slots of every token -> expert 5
    x, ids = torch.randn(4, 1, cfg.dim, generator=gen), torch.randint(0, cfg.vocab_size, (4, 1), generator=gen)
    with torch.no_grad():
        assert rel(moe(x, ids, dense=True), moe(x, ids)) <= DENSE_REL


def test_the_decode_seam_switch():
    """Which forwards take the decode paths. Bugs caught: the seam taken without a cache (training and scoring
    forwards would change), on the CPU under "auto" (CPU behaviour would change), under "reference"; dense
    experts where they cost more than E/K allows (V4-Flash) or on a layer holding a slice of the experts (EP)."""
    h = torch.zeros(1, 1, 4, 8)
    for mode, want in (("auto", False), ("triton", True), ("reference", False)):
        cfg = preset("tiny", kernels=mode)
        assert decode_kernels(cfg, h, LayerCache()) is want, mode
        assert not decode_kernels(cfg, h, None), mode
    assert MoE(1, preset("tiny")).dense_pays()
    flash = preset("tiny", n_routed_experts=64, n_activated_experts=6)      # 64 / 6 > DENSE_MAX_FLOPS
    assert not MoE(1, flash).dense_pays()
    ep = MoE(1, preset("tiny"))
    ep.experts.keep(range(4))
    assert not ep.dense_pays()


# ------------------------------------------------------------------------------------------ interpreter case
def _decode_logits(model, rows, steps):
    """Prefill each row alone, join the caches, then `steps` one-token steps at per-row positions.
    -> [steps + 1, rows, V] (the prefill's last logits, then each step's)"""
    caches, out = [model.new_cache() for _ in rows], []
    out.append(torch.stack([model(r[None], 0, c)[0, -1] for r, c in zip(rows, caches)]))
    cache, pos = model.cat_caches(caches), torch.tensor([len(r) for r in rows])
    for t in range(steps):
        ids = torch.stack([(r[-1:] + 3 * t + 1) % model.cfg.vocab_size for r in rows])       # [B,1]
        out.append(model(ids, pos, cache)[:, -1])
        pos = pos + 1
    return torch.stack(out)


def case_decode_triton_vs_reference(gen):
    """tiny (sliding, C4 with the indexer, ratio 8; hash and score routing), 3 rows at lengths 9, 6, 13 decoding
    6 steps, so windows end at different steps per row: kernels="triton" (fused mHC, dense experts) within
    DECODE_REL of kernels="reference"."""
    cfg = preset("tiny", kernels="reference")
    model = Transformer(cfg).init_weights(0).eval()
    with torch.no_grad():   # mHC coefficients far from uniform (at init comb ~ J/M: a transposed comb would pass)
        for n, p in model.named_parameters():
            if n.endswith(("hc_attn_fn", "hc_ffn_fn", "hc_attn_base", "hc_ffn_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 if n.endswith("base") else 0.5))
    rows = [torch.randint(0, cfg.vocab_size, (L,), generator=gen) for L in (9, 6, 13)]
    with torch.no_grad():
        want = _decode_logits(model, rows, 6)
        for m in model.modules():                        # every module holds the one config: switch it
            if hasattr(m, "cfg"):
                m.cfg = dataclasses.replace(cfg, kernels="triton")
        got = _decode_logits(model, rows, 6)
    assert rel(got, want) <= DECODE_REL, f"relative error {rel(got, want):.2e}"


CASES = {n: f for n, f in dict(globals()).items() if n.startswith("case_")}


@pytest.fixture(scope="module")
def interpreted():
    return interp.interpreted(__file__, INTERP_TIMEOUT_S)


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_under_interpreter(interpreted, case):
    """Bugs caught: see each case's docstring (the fused mHC or the dense experts wrong inside a decode)."""
    assert interpreted.get(case) == "ok", interpreted.get(case, "case did not run")


if __name__ == "__main__":   # the subprocess side (TRITON_INTERPRET=1)
    interp.run_cases(CASES, sys.argv[1])
