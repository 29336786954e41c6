"""bf16 GEMMs with fp32 results (`nanoflash.kernels.matmul`) for the head, gate and compressor matmuls.

CPU: the autograd functions (their CPU math is fp32 on the bf16-rounded operands) against the reference
F.linear(x.float(), w.float()) / `model._ChunkLogprob`, and the switch: only kernels="triton" on CUDA takes
them (matched precision forces "reference": tests/test_train_e2e.py keeps |dlogp| = 0). GPU-marked: real
width through `torch.mm(..., out_dtype=float32)`.
"""
import pytest
import torch
import torch.nn.functional as F

from nanoflash.config import preset
from nanoflash.kernels.matmul import ChunkLogprobBf16, linear_fp32
from nanoflash.model import Transformer, _ChunkLogprob, fp32_linear

# Forward: bf16 operands have exact fp32 products; only the summation order differs (fp32 rounding over
# K terms, measured <= 1e-6 relative on the GPU at K = 4096) -> 1e-5.
FWD_REL = 1e-5
# Backward: the fp32 cotangent is rounded to bf16 (2^-9 relative per element) before the GEMMs; over many
# terms of both signs the result moves by a few 2^-9 of its scale -> 1e-2.
BWD_REL = 1e-2


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _case(N, K, V, dev, gen, wdtype=torch.float32):
    x = torch.randn(N, K, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(V, K, generator=gen) * K ** -0.5).to(dev).to(torch.bfloat16).to(wdtype).requires_grad_()
    return x, w


def _linear_errs(N, K, V, dev, gen):
    x, w = _case(N, K, V, dev, gen)
    g = torch.randn(N, V, generator=gen).to(dev)
    ref = F.linear(x.float(), w.float())
    dx, dw = torch.autograd.grad((ref * g).sum(), (x, w))
    got = linear_fp32(x, w)
    assert got.dtype == torch.float32
    gx, gw = torch.autograd.grad((got * g).sum(), (x, w))
    return rel(got, ref), rel(gx, dx), rel(gw, dw)


def _logprob_errs(N, K, V, dev, gen):
    x, w = _case(N, K, V, dev, gen)
    tgt = torch.randint(0, V, (N,), generator=gen).to(dev)
    g = torch.randn(N, generator=gen).to(dev)
    ref = _ChunkLogprob.apply(x, w, tgt, 0.7)
    dx, dw = torch.autograd.grad((ref * g).sum(), (x, w))
    got = ChunkLogprobBf16.apply(x, w, w.detach().bfloat16(), tgt, 0.7)
    gx, gw = torch.autograd.grad((got * g).sum(), (x, w))
    return rel(got, ref), rel(gx, dx), rel(gw, dw)


@pytest.mark.parametrize("fn", [_linear_errs, _logprob_errs])
def test_bf16_fp32_out_equals_reference_cpu(fn, gen):
    f, bx, bw = fn(12, 40, 24, "cpu", gen)
    assert f <= FWD_REL and bx <= BWD_REL and bw <= BWD_REL, (f, bx, bw)


def test_fp32_linear_switch(gen, monkeypatch):
    """Only kernels="triton" on CUDA reaches kernels.matmul; every other path is the fp32 reference."""
    import nanoflash.kernels.matmul as km
    monkeypatch.setattr(km, "linear_fp32", lambda *a: pytest.fail("kernels.matmul called off the triton path"))
    x, w = _case(3, 8, 5, "cpu", gen)
    for k in ("reference", "auto", "triton"):   # CPU tensors: always the reference
        assert torch.equal(fp32_linear(x, w, preset("tiny", kernels=k)), F.linear(x.float(), w.float()))
    with pytest.raises(ValueError, match="features"):
        linear_fp32(x, w[:, :4])


@pytest.mark.gpu
def test_bf16_fp32_out_gpu_real_width(gen):
    for fn, shape in ((_linear_errs, (2048, 4096, 1024)), (_logprob_errs, (1024, 4096, 32768))):
        f, bx, bw = fn(*shape, "cuda", gen)
        print(fn.__name__, "errors fwd / dx / dw", f, bx, bw)
        assert f <= FWD_REL and bx <= BWD_REL and bw <= BWD_REL, (f, bx, bw)


@pytest.mark.gpu
def test_triton_model_matches_reference_gpu(gen):
    """tiny model, bf16: kernels="triton" (fused mHC, bf16 head/gate/compressor GEMMs, grouped MoE, attention
    kernels) against kernels="reference" -- log-probs within bf16 noise of the whole stack."""
    cfg = preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen).cuda()
    out = {}
    for k in ("reference", "triton"):
        m = Transformer(preset("tiny", kernels=k)).init_weights(0).cast_(torch.bfloat16).cuda()
        out[k] = m.token_logprobs(ids, torch.roll(ids, -1, 1))
    err = float((out["triton"] - out["reference"]).abs().max())
    print("tiny model triton vs reference max |dlogp|", err)
    assert err <= 5e-2 * float(out["reference"].abs().max())
