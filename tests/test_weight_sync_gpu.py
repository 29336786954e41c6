"""GPU side of the weight push (marker `gpu`; excluded on CPU): the Triton FP8 block quantizer bit for bit
against the CPU reference, SGLang's hash on the GPU equal to the CPU transcription, the stream's flat buckets
equal on both devices, and a push's GPU memory within `live_budget` (torch.cuda.max_memory_allocated).

Run on a GPU machine: `pytest -m gpu tests/test_weight_sync_gpu.py -q`.
"""
from __future__ import annotations

import pytest
import torch

from nanoflash.config import RolloutConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.quant import quantize_fp8_block, quantize_fp8_block_into
from nanoflash.sglang.client import SGLangClient
from nanoflash.sglang.layout import sglang_hash
from nanoflash.parallel.planner import live_budget
from nanoflash.sglang.push import StagePusher
from nanoflash.sglang.buckets import stream_buckets

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape,dtype", [((128, 128), torch.bfloat16), ((300, 260), torch.float32),
                                         ((7, 129), torch.bfloat16), ((2048, 4096), torch.bfloat16),
                                         ((4096, 1), torch.float32)])
def test_triton_quantizer_is_the_reference_bit_for_bit(shape, dtype, gen):
    w = (torch.randn(shape, generator=gen) * torch.logspace(-6, 2, shape[1])[None]).to(dtype)
    if shape[0] > 200:   # poisoned blocks: NaN / inf stay in their own block (scale NaN / inf, as on the CPU)
        w[0, 0], w[-1, -1] = float("nan"), float("inf")
    q_ref, s_ref = quantize_fp8_block(w, fmt="fp32")
    wc = w.cuda()
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(s_ref.shape, dtype=torch.float32, device="cuda")
    quantize_fp8_block_into(wc, q, s)
    fin = torch.isfinite(s_ref)
    assert torch.equal(s.cpu()[fin], s_ref[fin]) and torch.equal(torch.isnan(s.cpu()), torch.isnan(s_ref))
    rows = fin.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]  # healthy blocks
    assert torch.equal(q.cpu().view(torch.uint8)[rows], q_ref.view(torch.uint8)[rows])
    q2 = torch.empty_like(q)                      # a transposed (non-contiguous) source quantizes the same
    quantize_fp8_block_into(wc.t().contiguous().t(), q2, s)
    assert torch.equal(q2.view(torch.uint8)[rows.cuda()], q.view(torch.uint8)[rows.cuda()])


@pytest.mark.parametrize("numel,dtype", [(5, torch.float32), (8192 * 3 + 11, torch.bfloat16),
                                         (1 << 22, torch.float8_e4m3fn)])
def test_sglang_hash_same_on_gpu_and_cpu(numel, dtype, gen):
    t = torch.randn(numel, generator=gen).to(dtype)
    assert sglang_hash(t.cuda()) == sglang_hash(t)


def test_stream_buckets_identical_on_gpu():
    model = Transformer(preset("tiny")).init_weights(0)
    cpu = [fb.flat for fb in stream_buckets(model.state_dict().items(), model.cfg, fp8=True, bucket_bytes=1 << 15)]
    model.cuda()
    gpu = [fb for fb in stream_buckets(model.state_dict().items(), model.cfg, fp8=True, bucket_bytes=1 << 15)]
    assert all(fb.flat.is_cuda for fb in gpu) and len(gpu) == len(cpu)
    assert all(torch.equal(a, b.flat.cpu()) for a, b in zip(cpu, gpu))


class SinkClient(SGLangClient):
    """A real-looking SGLang server that accepts everything (no verification): the push's own cost only."""

    def __init__(self):
        super().__init__(["http://sink:1"], retry_s=0.0)
        self.bodies = 0

    def request(self, url, method, path, body=None, timeout=None, retry_s=None):
        self.bodies += path.startswith("/update_weights")
        return {"paths": {}} if path == "/openapi.json" else {"success": True, "version": "0.5.16"}


def test_push_gpu_memory_within_budget(tmp_path):
    """A disk push of the small preset (bf16, 1 GiB buckets) from the GPU: the peak above the shard stays
    within live_budget (the GPU quantizer has no scratch)."""
    bucket = 1 << 28
    with torch.device("cuda"):
        model = Transformer(preset("small")).init_weights(0).cast_(torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    client = SinkClient()
    rc = RolloutConfig(weights="fp8", transport="disk", bucket_bytes=bucket, verify=False)
    pusher = StagePusher(ParallelDims(), client, rc, model.cfg, disk_dir=str(tmp_path))
    named = [(n, t) for n, t in model.state_dict().items() if not n.startswith("mtp.")]   # references
    info = pusher.push(lambda: named, version=1)
    peak = torch.cuda.max_memory_allocated() - base
    largest = max(t.numel() * t.element_size() for _, t in named)   # bf16 embed / head: a unit above the bucket
    assert info["bytes"] > 2e9 and client.bodies == 1
    assert peak <= live_budget(max(bucket, largest), 1, 0), (peak, bucket, largest)


def test_local_push_into_a_gpu_engine_stays_on_the_gpu_and_verifies():
    """transport=local (the `gpu` recipe): a StagePusher push from a bf16 GPU model into an embedded FP8 engine
    of the same process hands the GPU tensors over: the push is verified by checksums, the engine's store and
    model stay on the GPU, and the engine then serves the pushed values (its FP8 dequantized weights differ
    from the trainer's bf16 ones by FP8 rounding only)."""
    from nanoflash.server.engine import RolloutEngine
    from nanoflash.server.http import serve
    with torch.device("cuda"):
        trainer = Transformer(preset("tiny")).init_weights(0).cast_(torch.bfloat16)
        served = Transformer(preset("tiny")).init_weights(1)
    httpd, url = serve(RolloutEngine(served, weights="fp8"))
    try:
        client = SGLangClient(url, retry_s=2.0)
        client.wait_healthy()
        rc = RolloutConfig(weights="fp8", transport="local", bucket_bytes=1 << 16)
        pusher = StagePusher(ParallelDims(), client, rc, trainer.cfg)
        named = [(n, t) for n, t in trainer.state_dict().items() if not n.startswith("mtp.")]
        info = pusher.push(lambda: named, version=1)
        engine = httpd.rollout.engine
        assert info["bytes"] > 0 and client.weight_version == pusher.tag(1)   # "{version}-{launch nonce}"
        assert all(t.is_cuda for t in engine.store.params.values())
        w = engine.model.layers["0"].attn.wo_b.weight
        ref = trainer.layers["0"].attn.wo_b.weight.float()
        assert w.is_cuda and (w - ref).abs().max() <= 2 ** -3 * ref.abs().max()  # e4m3: 3 mantissa bits
    finally:
        httpd.shutdown()
