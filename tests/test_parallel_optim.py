"""AdamW with fp32 master weights against torch.optim.AdamW; global-norm clipping against
torch.nn.utils.clip_grad_norm_; offload; the RL freeze list; layer splits.
Run: pytest tests/test_parallel_optim.py -q"""
import copy
import itertools

import pytest
import torch
from torch import nn

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel import optim as optim_mod
from nanoflash.parallel.optim import ALIGN, AdamW, merge_pieces, plan_chunks, plan_tiles, trainable_parameters
from nanoflash.parallel.pipeline import split_layers
from nanoflash.parallel.train_step import clip_gradients_, token_nll_loss, train_step

# torch's fused AdamW kernel vs torch.optim.AdamW's per-tensor loop (foreach off): the same fp32 formula,
# evaluated in a different order (bias corrections, fused multiply-adds): 1 ulp-level noise.
ADAM_RTOL, ADAM_ATOL = 1e-6, 1e-9
# Clipping vs torch.nn.utils.clip_grad_norm_: the same factor max_norm / (||g|| + 1e-6) clamped to 1; only the
# order of the fp32 sum of squares differs (relative ~1e-7 on the norm, and so on every clipped gradient).
CLIP_RTOL = 1e-6


def _toy(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _run(model, opt, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("offload", [False, True])
def test_adamw_matches_torch(offload):
    ours = _toy()
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    # torch decays every parameter; ours only matrices, so compare with decay on biases switched off there:
    ref2 = _toy()
    groups = [{"params": [p for p in ref2.parameters() if p.ndim >= 2]},
              {"params": [p for p in ref2.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    _run(ref2, torch.optim.AdamW(groups, foreach=False, **kw))
    opt = AdamW(ours.named_parameters(), offload=offload, **kw)
    _run(ours, opt)
    for (n, a), b in zip(ours.named_parameters(), ref2.parameters()):
        torch.testing.assert_close(a, b, rtol=ADAM_RTOL, atol=ADAM_ATOL, msg=lambda m: f"{n}: {m}")
    assert opt.step_count == 3
    assert all(st["exp_avg"].device.type == "cpu" for st in opt.state.values())
    assert all(("master" in st) == offload for st in opt.state.values())  # fp32 model: no copy unless offloaded


def test_bf16_model_keeps_fp32_master():
    """Two steps on a bf16 model: the fp32 master follows torch AdamW run in fp32 on the same numbers, and the
    model weight is the master rounded to bf16 (a 1e-4 update would vanish in bf16 weights alone)."""
    ours = _toy(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_() for p in ours.parameters()]
    kw = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    opt = AdamW(ours.named_parameters(), **kw)
    groups = [{"params": [p for p in ref if p.ndim >= 2]}, {"params": [p for p in ref if p.ndim < 2], "weight_decay": 0.0}]
    ropt = torch.optim.AdamW(groups, foreach=False, **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p, r in zip(ours.parameters(), ref):
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            r.grad = p.grad.float()
        opt.step()
        ropt.step()
    for (n, p), st, r in zip(ours.named_parameters(), opt.state.values(), ref):
        assert st["master"].dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(st["master"], r.detach(), rtol=ADAM_RTOL, atol=ADAM_ATOL, msg=lambda m: f"{n}: {m}")
        assert torch.equal(p, st["master"].to(torch.bfloat16)), n
    assert any(not torch.equal(st["master"].to(torch.bfloat16).float(), st["master"]) for st in opt.state.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("offload", [False, True])
def test_storage_rounded_parameters_hold_bf16_values_and_keep_every_update(offload, device, gen):
    """`storage`: an fp32 parameter kept at bf16 values (as the servers hold it). Its master follows plain fp32
    AdamW exactly (the same fused call on the same numbers), the parameter is the master rounded to bf16 --
    at construction and after every step, on device and offloaded -- and updates far below half a bf16 step,
    which a bf16 weight alone would lose, accumulate in the master until the rounding moves."""
    # the reference steps where the state lives (offloaded: the host's fused kernel, whose bits it matches)
    ours, ref = _toy().to(device), _toy().to("cpu" if offload else device)
    with torch.no_grad():   # bf16 values near 1 (a norm's, as read from a release checkpoint): half a bf16
        for p in ref.parameters():   # step there is 2^-8, ~8 steps of lr 5e-4 in one direction
            p.copy_((p + 1.0).to(torch.bfloat16).float())
        for p, q in zip(ours.parameters(), ref.parameters()):
            p.copy_(q.to(device))
    kw = dict(lr=5e-4, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
    rounded = {"2.weight": torch.bfloat16, "2.bias": torch.bfloat16}
    opt = AdamW(ours.named_parameters(), offload=offload, host_threads=2, storage=rounded, **kw)
    ropt = AdamW(ref.named_parameters(), **kw)
    params, first = dict(ours.named_parameters()), {n: dict(ours.named_parameters())[n].clone() for n in rounded}
    for n in rounded:
        assert torch.equal(params[n], params[n].to(torch.bfloat16).float()), n     # rounded at construction
    moved_early = []
    for step in range(12):
        _seeded_grads(list(ref.parameters()), gen)
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad.mul_(0.1).add_(1.0)   # one sign: every step moves a weight by ~lr the same way
            p.grad = q.grad.to(device, copy=True)
        opt.step()
        ropt.step()
        moved_early.append(any(not torch.equal(params[n], first[n]) for n in rounded))
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        p, q = p.detach().cpu(), q.detach().cpu()
        if n in rounded:
            assert p.dtype == torch.float32 and torch.equal(opt.state[n]["master"].cpu(), q), n
            assert torch.equal(p, q.to(torch.bfloat16).float()), n
        else:
            assert torch.equal(p, q), n
    assert not moved_early[0] and moved_early[-1]   # invisible at first, carried by the master until it shows


def test_frozen_parameters_get_no_state_no_grad(gen):
    model = Transformer(preset("tiny")).init_weights(0)
    named = trainable_parameters(model)
    names = {n for n, _ in named}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all((".ffn.gate." in n) or (".attn.indexer." in n) or n.startswith("mtp.") for n in frozen)
    assert "layers.0.ffn.gate.weight" in frozen and "layers.2.ffn.gate.bias" in frozen
    assert any(".attn.indexer." in n for n in frozen) and any(n.startswith("mtp.") for n in frozen)
    opt = AdamW(named)
    assert set(opt.state) == names and not (frozen & set(opt.state))
    ids = torch.randint(0, 256, (1, 8), generator=gen)
    model(ids).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    assert {n for n, _ in trainable_parameters(model, train_mtp=True)} > names  # MTP trainable on request


def test_split_layers():
    # 43 = 4 x 10 + 3: the remainder goes to the middle stages first, then the first; the last stage (head + MTP)
    # keeps the fewest.
    assert [len(s) for s in split_layers(43, 4)] == [11, 11, 11, 10]
    assert [len(s) for s in split_layers(42, 4)] == [10, 11, 11, 10]
    assert sum(split_layers(43, 4), []) == list(range(43))
    assert split_layers(4, 2, (1, 3)) == [[0], [1, 2, 3]]
    with pytest.raises(AssertionError, match="layer_split"):
        split_layers(4, 2, (2, 3))


def test_optimizer_state_roundtrip_and_bad_state():
    model = _toy()
    opt = AdamW(model.named_parameters(), lr=1e-2)
    _run(model, opt, steps=2)
    sd = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state_dict().items()}
    opt2 = AdamW(_toy().named_parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    assert opt2.step_count == 2 and torch.equal(opt2.state["0.weight"]["exp_avg"], opt.state["0.weight"]["exp_avg"])
    del sd["2.bias.exp_avg_sq"]
    with pytest.raises(ValueError, match="2.bias.exp_avg_sq"):
        opt2.load_state_dict(sd)


def _tiny_with_grads(gen):
    model = Transformer(preset("tiny")).init_weights(0)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=gen)
    model(ids).logsumexp(-1).mean().backward()
    return model


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _with_grads(model):
    """The parameters clip_grad_norm_ is handed (it reads and scales their .grad)."""
    return [p for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("ratio", [0.1, 10.0])   # max_norm below the norm (scaled down) / above (left alone)
def test_clip_matches_torch_clip_grad_norm(ratio, gen):
    model = _tiny_with_grads(gen)
    ref = copy.deepcopy(model)   # Parameter.__deepcopy__ leaves .grad behind: copy it
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    norm = torch.cat([g.flatten() for g in _grads(model).values()]).norm().item()
    ref_norm = torch.nn.utils.clip_grad_norm_(_with_grads(ref), ratio * norm)
    got_norm = clip_gradients_(model, ParallelDims(), ratio * norm)
    assert got_norm.item() == pytest.approx(ref_norm.item(), rel=CLIP_RTOL)
    want = _grads(ref)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, want[n], rtol=CLIP_RTOL, atol=0, msg=lambda m: f"{n}: {m}")


def test_train_step_clips_like_torch(gen):
    """train_step's gradients after the step are the plain backward's, clipped by clip_grad_norm_."""
    model = Transformer(preset("tiny")).init_weights(0)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 10), generator=gen)
    mb = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    opt = AdamW(trainable_parameters(model), lr=0.0)     # freezes router / indexer / MTP, as the trainer does
    ref = copy.deepcopy(model)                           # the same parameters frozen
    scale = 1.0 / mb["targets"].numel()
    (token_nll_loss(ref, ref.run_layers(ref.embed_streams(mb["input_ids"]), mb["input_ids"]), mb) * scale).backward()
    max_norm = 0.1 * torch.cat([g.flatten() for g in _grads(ref).values()]).norm().item()
    ref_norm = torch.nn.utils.clip_grad_norm_(_with_grads(ref), max_norm)
    out = train_step(model, ParallelDims(), [mb], opt, scale, grad_clip=max_norm)
    assert out["grad_norm"] == pytest.approx(ref_norm.item(), rel=CLIP_RTOL)
    want = _grads(ref)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, want[n], rtol=CLIP_RTOL, atol=1e-12, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------- fused / offload
def _seeded_grads(params, gen, dtype=None):
    for p in params:
        if dtype is not None and dtype != p.dtype:
            p.grad_dtype = None  # torch >= 2.10: allow a gradient dtype other than the parameter's
        p.grad = torch.randn(p.shape, generator=gen).to(dtype or p.dtype).to(p.device)


def test_fused_step_equals_torch_fused_adamw_bitwise(gen):
    """The on-device step is torch.optim.AdamW(fused=True) with decay on matrices only: the same bits."""
    ours, ref = _toy(), _toy()
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    opt = AdamW(ours.named_parameters(), **kw)
    groups = [{"params": [p for p in ref.parameters() if p.ndim >= 2]},
              {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    ropt = torch.optim.AdamW(groups, fused=True, **kw)
    for _ in range(3):
        _seeded_grads(list(ours.parameters()), gen)
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        ropt.step()
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n


def _offload_vs_device(dev_model, off_model, gen, steps=3, grad_dtype=None, **stream):
    """`steps` AdamW steps with weight decay, on-device vs offloaded (`stream`: chunk/tile/grad_cast) from the
    same seeded gradients; -> (dev, off) optimizers."""
    kw = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    dev = AdamW(trainable_parameters(dev_model), **kw)
    off = AdamW(trainable_parameters(off_model), offload=True, host_threads=2, **stream, **kw)
    for _ in range(steps):
        _seeded_grads([p for _, p in trainable_parameters(dev_model)], gen, grad_dtype)
        for (_, p), (_, q) in zip(trainable_parameters(dev_model), trainable_parameters(off_model)):
            q.grad_dtype = p.grad_dtype if hasattr(p, "grad_dtype") else None
            q.grad = p.grad.to(q.device)
        dev.step()
        off.step()
    return dev, off


def _assert_same_bits(dev_model, off_model, dev, off):
    for (n, p), (_, q) in zip(dev_model.named_parameters(), off_model.named_parameters()):
        assert torch.equal(p, q.cpu()), n
    for n, st in off.state.items():
        for k, v in st.items():
            assert torch.equal(v, dev.state[n].get(k, dict(dev.params)[n])), (n, k)


@pytest.mark.parametrize("dtype,tile,grad_cast", [(torch.float32, 512, "host"), (torch.bfloat16, 1024, "device"),
                                                  (torch.bfloat16, 256, "host")])
def test_offload_equals_on_device_bitwise(dtype, tile, grad_cast, gen):
    """Streamed through small chunks and tiles (tensors cut inside by both, several tensors per chunk and per
    tile, bf16 and fp32 parameters mixed in the bf16 model), with the gradient cast to fp32 on the host or on
    the device, the offloaded update gives the on-device one's bits: weights, master, m and v, over 3 steps."""
    dev_model = Transformer(preset("tiny")).init_weights(0)
    if dtype != torch.float32:
        dev_model.cast_(dtype)
    off_model = copy.deepcopy(dev_model)
    dev, off = _offload_vs_device(dev_model, off_model, gen, chunk_elems=1024, tile_elems=tile, grad_cast=grad_cast)
    pieces = [pc for ch in off.chunks for t in ch for pc in t]
    assert any(a % tile != 0 for _, a, _, _ in pieces)                        # a tile cuts inside a tensor
    assert any(len(t) > 1 for ch in off.chunks for t in ch)                   # some tile holds several
    assert (tile < 1024) == any(len(ch) > 1 for ch in off.chunks)             # chunks cut into tiles
    _assert_same_bits(dev_model, off_model, dev, off)


def test_offload_fp32_grads_of_bf16_weights_travel_in_fp32(gen):
    """fp32 gradients (fp32 accumulation) of bf16 weights go down in fp32 under grad_cast="host" (a bf16 slot
    would round them): the on-device update's bits, which reads the fp32 gradient as it is."""
    dev_model = Transformer(preset("tiny")).init_weights(0).cast_(torch.bfloat16)
    off_model = copy.deepcopy(dev_model)
    dev, off = _offload_vs_device(dev_model, off_model, gen, steps=2, grad_dtype=torch.float32,
                                  chunk_elems=1024, tile_elems=256, grad_cast="host")
    assert set(off._staging["down"]) == {torch.float32}
    _assert_same_bits(dev_model, off_model, dev, off)


def test_plan_tiles_cut_chunks_on_align(gen):
    """Tiles cover each chunk piece once, in order, contiguous in the slot, at most tile_elems each; a cut inside
    a tensor lands on a multiple of ALIGN from the tensor's start (not from the piece's or the chunk's)."""
    sizes = [(f"t{i}", int(n)) for i, n in enumerate(torch.randint(1, 700, (40,), generator=gen))] + [("big", 5000)]
    T = 192
    for chunk in plan_chunks(sizes, 640):
        tiles = plan_tiles(chunk, T)
        flat = [pc for t in tiles for pc in t]
        assert all(sum(b - a for _, a, b, _ in t) <= T for t in tiles)
        assert [o for *_, o in flat] == [chunk[0][3]] + list(itertools.accumulate(b - a for _, a, b, _ in flat))[:-1]
        for name, a, b, off in chunk:
            spans = [(x, y) for n, x, y, _ in flat if n == name]
            assert spans[0][0] == a and spans[-1][1] == b and all(p[1] == q[0] for p, q in zip(spans, spans[1:]))
            assert all(y % ALIGN == 0 for _, y in spans[:-1]), name
        assert merge_pieces(flat) == chunk  # the copies see one piece per tensor span again
    with pytest.raises(ValueError, match="tile_elems=100 must be a positive multiple of ALIGN"):
        AdamW(_toy().named_parameters(), offload=True, tile_elems=100)
    with pytest.raises(ValueError, match="grad_cast='gpu'"):
        AdamW(_toy().named_parameters(), offload=True, grad_cast="gpu")


def test_plan_chunks_cover_every_element_once(gen):
    sizes = [(f"t{i}", int(n)) for i, n in enumerate(torch.randint(1, 700, (40,), generator=gen))] + [("big", 5000)]
    C = 320
    chunks = plan_chunks(sizes, C)
    seen = {n: [] for n, _ in sizes}
    for ch in chunks:
        assert sum(b - a for _, a, b, _ in ch) <= C
        offs = [off for *_, off in ch]
        assert offs == sorted(offs) and offs[0] == 0
        for name, a, b, off in ch:
            seen[name].append((a, b))
    for name, n in sizes:
        spans = seen[name]
        assert spans[0][0] == 0 and spans[-1][1] == n and all(x[1] == y[0] for x, y in zip(spans, spans[1:])), name
        assert all(b % ALIGN == 0 for _, b in spans[:-1]), name   # interior cuts on the kernel's alignment
    with pytest.raises(ValueError, match="multiple of ALIGN"):
        plan_chunks(sizes, 100)


@pytest.mark.parametrize("grad_cast,down_bytes", [("host", 2), ("device", 4)])
def test_offload_threads_set_for_the_step_and_staging_bounded(grad_cast, down_bytes, monkeypatch, gen):
    model = _toy(torch.bfloat16)
    opt = AdamW(model.named_parameters(), offload=True, chunk_elems=128, tile_elems=64, host_threads=3,
                grad_cast=grad_cast)
    seen = []
    real = optim_mod.fused_adamw_
    monkeypatch.setattr(optim_mod, "fused_adamw_", lambda *a, **k: (seen.append(torch.get_num_threads()),
                                                                    real(*a, **k)))
    before = torch.get_num_threads()
    _seeded_grads(list(model.parameters()), gen)
    opt.step()
    assert seen and set(seen) == {3} and torch.get_num_threads() == before
    assert len(seen) >= sum(len(ch) for ch in opt.chunks) > len(opt.chunks)  # one call (or two) per tile
    # pinned staging: 2 slots x 128 elements down (bf16 or fp32) + 2 x 128 bf16 up, whatever the model size
    assert opt.host_bytes() == {"state": 3 * 4 * sum(p.numel() for p in model.parameters()),
                                "pinned": 2 * 128 * down_bytes + 2 * 128 * 2}
    phases = {"setup_s", "issue_down_s", "kernel_s", "grad_cast_s", "weight_cast_s", "issue_up_s", "tail_s"}
    assert phases <= set(opt.last_breakdown) and sum(opt.last_breakdown.values()) <= opt.last_step_s


@pytest.mark.gpu
@pytest.mark.parametrize("tile,grad_cast", [(1024, "device"), (256, "host"), (128, "device")])
def test_offload_on_cuda_equals_cpu_update_bitwise(tile, grad_cast, gen):
    """bf16 weights on the GPU, state on the host: the host runs the CPU fused kernel on the exact fp32 image
    of the bf16 gradients, so the result is the CPU on-device update's bits."""
    cpu_model = Transformer(preset("tiny")).init_weights(0)
    cpu_model.cast_(torch.bfloat16)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    kw = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    ref = AdamW(trainable_parameters(cpu_model), **kw)
    off = AdamW(trainable_parameters(gpu_model), offload=True, chunk_elems=1024, tile_elems=tile,
                grad_cast=grad_cast, **kw)
    for _ in range(3):
        _seeded_grads([p for _, p in trainable_parameters(cpu_model)], gen)
        for (_, p), (_, q) in zip(trainable_parameters(cpu_model), trainable_parameters(gpu_model)):
            q.grad = p.grad.cuda()
        ref.step()
        off.step()
    for (n, p), (_, q) in zip(cpu_model.named_parameters(), gpu_model.named_parameters()):
        assert torch.equal(p, q.cpu()), n
    assert all(not v.is_pinned() for st in off.state.values() for v in st.values())
    assert all(t.is_pinned() for way in ("down", "up") for ts in off._staging[way].values() for t in ts)
    assert set(off._staging["down"]) == ({torch.float32} if grad_cast == "device" else {torch.bfloat16, torch.float32})
