"""Stacked routed experts: the grouped path against the per-expert reference loop, and the official per-expert
names at every boundary (state_dict, HF and DCP checkpoints, the weight stream, the optimizer, EP shards).

The grouped path (`nanoflash.kernels.moe`: grouped GEMMs + the fused Triton SwiGLU) runs on CPU under
TRITON_INTERPRET=1, which must be set before Triton is first imported: those cases run in ONE subprocess
(this file run as a script, `python tests/test_model_moe.py OUT.json`, as in tests/test_kernels_attention.py),
the pytest side reads {case: "ok" | traceback}. Everything else runs in-process.

References: the `kernels="reference"` loop (one `expert_ffn` per expert, itself checked against the float64
per-token loop of tests/reference.py in tests/test_model_blocks.py); the SwiGLU in float64; and the layout
before stacking, rebuilt here by hand (`per_expert_layout`: an nn.ModuleDict of `Expert` modules per layer,
filled from explicit slices w1 = w13[i, :I], w3 = w13[i, I:], w2 = w2[i]).
"""
from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch
from torch import nn

from nanoflash.names import official_inventory, official_views
from nanoflash.config import preset
from nanoflash.model import Expert, MoE, Transformer

import interp  # tests/interp.py: the kernel cases under Triton's interpreter, in a subprocess

# Grouped vs reference loop in fp32: the same products, but w1|w3 in one GEMM, Triton's sigmoid and drw summed
# in another order: a few fp32 ulps of O(10) values (measured <= 4e-7 relative to the largest value).
FP32_TOL = 1e-5
# bf16: both paths round h, a and y to bf16, at the same points; measured <= 4e-3 relative (one bf16 ulp of
# a value near the maximum), so 2^-6.
BF16_TOL = 2 ** -6
# The fused SwiGLU (fp32 math) against float64: fp32 roundings of values up to L^2 = 25.
SWIGLU_TOL = 1e-6
INTERP_TIMEOUT_S = 300  # ~25 s on the 2-core CI box (two gloo ranks spawned for the EP cases); 10x headroom
N_TOK = 24              # tokens of the EP global batch, split evenly over the ranks


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def moe_pair(layer_id: int, g, dtype=torch.float32, skew=False, **kw):
    """(grouped, reference) MoE modules of the tiny config with the same random weights; `skew` sends the
    score layer's top-2 mostly to experts 0..2 (others empty or nearly), the hash table never uses 5..7."""
    cfg = preset("tiny", **kw)
    ref = MoE(layer_id, dataclasses.replace(cfg, kernels="reference"))
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if ref.gate.hash:
            ref.gate.tid2eid.copy_(torch.randint(0, 5 if skew else 8, ref.gate.tid2eid.shape, generator=g))
        elif skew:
            ref.gate.bias.copy_(torch.tensor([3.0, 2.0, 1.0, 0, 0, 0, -9.0, -9.0]))
    fast = MoE(layer_id, dataclasses.replace(cfg, kernels="triton"))
    fast.load_state_dict(ref.state_dict())
    return fast.to(dtype), ref.to(dtype)


def official_grads(module) -> dict:
    """Parameter gradients by official name (stacks split per expert; zeros where none arrived)."""
    return {n: t for name, p in module.named_parameters()
            for n, t in official_views(name, p, torch.zeros_like(p) if p.grad is None else p.grad)}


def run_and_grads(m, x, ids, cot, replay=None):
    m.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = m(x, ids, replay)
    (y.float() * cot).sum().backward()
    return y.detach(), x.grad, official_grads(m)


def assert_same(got, want, tol, what):
    (y, dx, gp), (ry, rdx, rgp) = got, want
    assert rel_err(y, ry) <= tol, f"{what}: output {rel_err(y, ry):.2e}"
    assert rel_err(dx, rdx) <= tol, f"{what}: dx {rel_err(dx, rdx):.2e}"
    assert gp.keys() == rgp.keys()
    for n in gp:
        if rgp[n].abs().max() == 0:
            assert gp[n].abs().max() == 0, f"{what}: {n} has a gradient, the reference none"
        else:
            assert rel_err(gp[n], rgp[n]) <= tol, f"{what}: grad {n} {rel_err(gp[n], rgp[n]):.2e}"


# ------------------------------------------------------------------------------------------ interpreter cases
def case_fused_swiglu_matches_float64(g):
    """Clamp active (values beyond +-L and exactly at it), no clamp, rows / columns not multiples of the block."""
    from nanoflash.kernels.moe import fused_swiglu
    from nanoflash.model import swiglu
    for limit, dtype in ((5.0, torch.float32), (0.0, torch.float32), (5.0, torch.bfloat16)):
        h = torch.randn(37, 2 * 300, generator=g) * 6
        h[0, :4] = torch.tensor([5.0, -5.0, 5.0, -5.0])            # g = L; and u = +-L at h[0, 300:304]
        h[0, 300:304] = torch.tensor([5.0, -5.0, -5.0, 5.0])
        h = h.to(dtype).requires_grad_()
        rw = torch.rand(37, 1, generator=g).requires_grad_()
        cot = torch.randn(37, 300, generator=g)
        a = fused_swiglu(h, rw, limit)
        want = swiglu(*h.double().chunk(2, -1), limit, rw.double())
        tol = SWIGLU_TOL if dtype == torch.float32 else BF16_TOL
        assert a.dtype == dtype and rel_err(a, want) <= tol, f"L={limit} {dtype}: a {rel_err(a, want):.2e}"
        got = torch.autograd.grad((a.float() * cot).sum(), [h, rw])
        ref = torch.autograd.grad((want * cot.double()).sum(), [h, rw])
        for n, x, y in zip(("dh", "drw"), got, ref):
            assert rel_err(x, y) <= tol, f"L={limit} {dtype}: {n} {rel_err(x, y):.2e}"


def case_grouped_matches_reference_fp32(g):
    """Hash and score routing, routing replay, uneven and empty experts: output, dx, every parameter's grad."""
    for layer_id, skew in ((0, False), (0, True), (3, False), (3, True)):
        fast, ref = moe_pair(layer_id, g, skew=skew)
        x, ids = torch.randn(2, 13, 64, generator=g), torch.randint(0, 256, (2, 13), generator=g)
        cot = torch.randn(2, 13, 64, generator=g)
        want = run_and_grads(ref, x, ids, cot)
        counts = torch.bincount(ref.last_indices.flatten(), minlength=8)
        if skew:
            assert (counts == 0).any() and len(set(counts.tolist())) > 2, counts
        assert_same(run_and_grads(fast, x, ids, cot), want, FP32_TOL, f"layer {layer_id} skew={skew}")
        if not ref.gate.hash:   # replay: the rollout's experts (reversed top-k here) in both paths
            replay = ref.last_indices.flip(-1)
            want = run_and_grads(ref, x, ids, cot, replay)
            assert torch.equal(ref.last_indices, replay)
            assert_same(run_and_grads(fast, x, ids, cot, replay), want, FP32_TOL, f"layer {layer_id} replay")


def case_grouped_matches_reference_bf16_and_qat(g):
    for dtype, kw, tol in ((torch.bfloat16, {}, BF16_TOL), (torch.float32, {"qat": True}, FP32_TOL)):
        fast, ref = moe_pair(3, g, dtype=dtype, skew=True, **kw)
        x, ids = torch.randn(2, 11, 64, generator=g).to(dtype), torch.randint(0, 256, (2, 11), generator=g)
        cot = torch.randn(2, 11, 64, generator=g)
        assert_same(run_and_grads(fast, x, ids, cot), run_and_grads(ref, x, ids, cot), tol, f"{dtype} {kw}")


def _ep_rank(rank, world, skew):
    interp.patch_interpreter()
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.parallel.expert import apply_expert_parallel
    from nanoflash.parallel.train_step import reduce_gradients
    fast, ref = moe_pair(3, torch.Generator().manual_seed(7), skew=skew)
    m = apply_expert_parallel(fast, ParallelDims(ep=world))
    x, ids, cot, replay = _ep_data(ref)
    sl = slice(rank * N_TOK // world, (rank + 1) * N_TOK // world)
    rx = None if skew else replay.view(1, N_TOK, -1)[:, sl].flatten(0, 1)
    y, dx, _ = run_and_grads(m, x[:, sl], ids[:, sl], cot[:, sl], rx)
    reduce_gradients(m, ParallelDims(ep=world))
    return y, dx, official_grads(m), m.experts.ids


def _ep_data(ref):
    g = torch.Generator().manual_seed(8)
    x, ids = torch.randn(1, N_TOK, 64, generator=g), torch.randint(0, 256, (1, N_TOK), generator=g)
    replay = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(N_TOK)])   # [N,K] R3 experts
    return x, ids, torch.randn(1, N_TOK, 64, generator=g), replay


def case_grouped_ep2_matches_single_process(g):
    """EP2 on gloo with the grouped path (replay on a score layer; skewed routing without replay: rank 1's
    experts receive no rows at all) vs the single-process reference loop."""
    from conftest import run_ranks
    for skew in (False, True):
        _, ref = moe_pair(3, torch.Generator().manual_seed(7), skew=skew)
        x, ids, cot, replay = _ep_data(ref)
        want = run_and_grads(ref, x, ids, cot, None if skew else replay)
        if skew:
            assert not (ref.last_indices >= 4).any(), "the skewed case must leave rank 1 without rows"
        for rank, (y, dx, grads, held) in enumerate(run_ranks(_ep_rank, 2, skew)):
            sl = slice(rank * N_TOK // 2, (rank + 1) * N_TOK // 2)
            assert held == list(range(4 * rank, 4 * rank + 4))
            assert rel_err(y, want[0][:, sl]) <= FP32_TOL and rel_err(dx, want[1][:, sl]) <= FP32_TOL
            for n, t in grads.items():   # experts of this rank by global id; dense grads summed over ranks
                assert rel_err(t, want[2][n]) <= FP32_TOL or want[2][n].abs().max() == t.abs().max() == 0, n


CASES = {n: f for n, f in dict(globals()).items() if n.startswith("case_")}


@pytest.fixture(scope="module")
def interpreted():
    """Every case once in a subprocess under TRITON_INTERPRET=1 (tests/interp.py); -> {case: "ok" | traceback}"""
    return interp.interpreted(__file__, INTERP_TIMEOUT_S)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_path_under_interpreter(interpreted, case):
    assert interpreted.get(case) == "ok", interpreted.get(case, "case did not run")


# ------------------------------------------------------------------------------------------ the names
def per_expert_layout(model: nn.Module) -> nn.Module:
    """A copy of `model` in the layout before stacking: each MoE's `experts` an nn.ModuleDict of `Expert`
    modules (w1, w2, w3 Linear) in the same place, filled from explicit slices of the stacks."""
    old = copy.deepcopy(model)
    for mod in old.modules():
        if isinstance(mod, MoE):
            st, cfg = mod.experts, mod.experts.cfg
            I = cfg.moe_inter_dim
            per = nn.ModuleDict({str(e): Expert(cfg.dim, I, cfg.swiglu_limit, cfg.qat) for e in st.ids})
            with torch.no_grad():
                for i, e in enumerate(st.ids):
                    per[str(e)].w1.weight.copy_(st.w13[i, :I])
                    per[str(e)].w3.weight.copy_(st.w13[i, I:])
                    per[str(e)].w2.weight.copy_(st.w2[i])
            mod._modules["experts"] = per.to(st.w13.dtype)
    return old


@pytest.fixture(scope="module")
def tiny():
    return Transformer(preset("tiny")).init_weights(0, std=0.2)


def test_state_dict_is_the_per_expert_layout(tiny):
    """Same keys in the same order (the weight stream's order), same values; official inventory; load back."""
    old, new = per_expert_layout(tiny).state_dict(), tiny.state_dict()
    assert list(new) == list(old) and set(new) == set(official_inventory(tiny.cfg))
    assert all(torch.equal(new[k], old[k]) for k in old)
    assert not any(".w13" in n or n.endswith("experts.w2") for n in new)
    back = Transformer(preset("tiny"))
    assert back.load_state_dict(old) is not None
    for (n, p), (_, q) in zip(back.named_parameters(), tiny.named_parameters()):
        assert torch.equal(p, q), n
    views = tiny.state_dict(keep_vars=True)   # views of the stacks: writes land in the parameters
    assert views["layers.2.ffn.experts.5.w3.weight"].data_ptr() == \
        tiny.layers["2"].ffn.experts.w13[5, tiny.cfg.moe_inter_dim:].data_ptr()


def test_load_state_dict_names_the_culprit(tiny):
    sd = tiny.state_dict()
    m = Transformer(preset("tiny"))
    bad = dict(sd)
    del bad["layers.1.ffn.experts.3.w2.weight"]
    bad["layers.1.ffn.experts.8.w1.weight"] = torch.zeros(32, 64)     # tiny has experts 0..7
    missing, unexpected = m.load_state_dict(bad, strict=False)
    assert missing == ["layers.1.ffn.experts.3.w2.weight"] and unexpected == ["layers.1.ffn.experts.8.w1.weight"]
    with pytest.raises(RuntimeError, match=r"layers\.1\.ffn\.experts\.3\.w2\.weight"):
        m.load_state_dict(bad)
    bad = dict(sd, **{"layers.0.ffn.experts.2.w3.weight": torch.zeros(32, 65)})
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.0\.ffn\.experts\.2\.w3\.weight"):
        m.load_state_dict(bad)


def test_ep_shard_keeps_global_names_and_layout_independent_init(tiny):
    """An EP rank's stacks are slices of the full ones, named by global expert id; a meta-built EP rank
    materialised and seeded gets exactly the full model's values (init by official name)."""
    from types import SimpleNamespace
    from nanoflash.parallel.expert import apply_expert_parallel
    with torch.device("meta"):
        part = Transformer(preset("tiny"))
    apply_expert_parallel(part, SimpleNamespace(ep=2, ep_rank=1, ep_group=None))   # rank 1 of EP2, no group
    part.to_empty(device="cpu").init_weights(0, std=0.2)
    full = tiny.state_dict()
    held = part.state_dict()
    first = [f"layers.0.ffn.experts.4.{w}.weight" for w in ("w1", "w2", "w3")]   # global ids, former order
    assert [k for k in held if ".experts." in k][:3] == first
    assert all(torch.equal(v, full[k]) for k, v in held.items())
    assert part.layers["0"].ffn.experts.w13.expert_ids == (4, 5, 6, 7)   # tag survives to_empty
    with pytest.raises(ValueError, match="not a contiguous block"):
        part.layers["0"].ffn.experts.keep([4, 6])


def test_optimizer_state_keys_are_official(tiny):
    from nanoflash.parallel.optim import AdamW, trainable_parameters
    m = copy.deepcopy(tiny)
    opt = AdamW(trainable_parameters(m), lr=1e-3)
    old = AdamW(trainable_parameters(per_expert_layout(tiny)), lr=1e-3)
    assert set(opt.state_dict()) == set(old.state_dict())
    g = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g) if p.requires_grad else None
    opt.step()
    sd = opt.state_dict()
    w13 = opt.state["layers.1.ffn.experts.w13"]["exp_avg"]
    assert torch.equal(sd["layers.1.ffn.experts.6.w3.weight.exp_avg"], w13[6, 32:]) and w13.abs().sum() > 0
    fresh = AdamW(trainable_parameters(copy.deepcopy(tiny)), lr=1e-3)
    fresh.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in sd.items()})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in sd.items() if k != "step")


@pytest.mark.parametrize("fp8", [False, True])
def test_weight_stream_byte_identical_to_per_expert_layout(tiny, fp8):
    from nanoflash.sglang.buckets import stream_buckets
    bucket = 1 << 14   # 16 KiB: ~30 buckets, boundaries inside the expert list
    old = list(stream_buckets(per_expert_layout(tiny).state_dict().items(), tiny.cfg, fp8=fp8, bucket_bytes=bucket))
    new = list(stream_buckets(tiny.state_dict().items(), tiny.cfg, fp8=fp8, bucket_bytes=bucket))
    assert len(new) == len(old) > 10
    for a, b in zip(new, old):
        assert a.slots == b.slots and torch.equal(a.flat, b.flat)


def test_dcp_checkpoint_of_per_expert_layout_loads(tmp_path, tiny):
    """A DCP checkpoint written from the per-expert layout (model + AdamW state by per-expert names, exactly
    what the code before stacking saved) loads into stacked experts; a new save has the same keys."""
    from torch.distributed.checkpoint import FileSystemReader
    from nanoflash.parallel import dcp as ckpt
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.parallel.optim import AdamW, trainable_parameters
    old = per_expert_layout(tiny)
    old_opt = AdamW(trainable_parameters(old), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for p in old.parameters():
        p.grad = torch.randn(p.shape, generator=g) if p.requires_grad else None
    old_opt.step()
    path = ckpt.save_checkpoint(str(tmp_path / "old"), 3, old, old_opt, ParallelDims())
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    assert "model.layers.2.ffn.experts.5.w1.weight" in keys and "optim.layers.2.ffn.experts.5.w1.weight.exp_avg" in keys
    new = Transformer(preset("tiny"))
    opt = AdamW(trainable_parameters(new), lr=1e-3)
    assert ckpt.load_checkpoint(path, new, opt, ParallelDims())["step"] == 3
    for sd_new, sd_old in ((new.state_dict(), old.state_dict()), (opt.state_dict(), old_opt.state_dict())):
        assert set(sd_new) == set(sd_old)
        assert all(sd_new[k] == v if k == "step" else torch.equal(sd_new[k], v) for k, v in sd_old.items())
    again = ckpt.save_checkpoint(str(tmp_path / "new"), 4, new, opt, ParallelDims())
    assert set(FileSystemReader(again).read_metadata().state_dict_metadata) == keys


def test_hf_round_trip_of_bf16_stacks(tmp_path, tiny):
    """bf16 model saved bf16: the per-expert tensors are views of one storage (no copy); they load back."""
    from nanoflash.checkpoint import load_hf_checkpoint, save_hf_checkpoint
    m = copy.deepcopy(tiny).cast_(torch.bfloat16)
    save_hf_checkpoint(m, str(tmp_path), weights="bf16")
    back = Transformer(preset("tiny")).cast_(torch.bfloat16)
    load_hf_checkpoint(back, str(tmp_path))
    experts = {k: v for k, v in back.state_dict().items() if ".experts." in k}   # (fp32 compressors: bf16 rounded)
    assert len(experts) == 3 * 8 * 5 and all(torch.equal(v, m.state_dict()[k]) for k, v in experts.items())


if __name__ == "__main__":
    interp.run_cases(CASES, sys.argv[1])


def test_shared_expert_clamp_follows_the_config_official_off_sglang_on():
    """The shared expert as published has no SwiGLU clamp; SGLang 0.5.16 builds it with the config's
    swiglu_limit (srt/models/deepseek_v2.py 725-732: `DeepseekV2MLP(..., swiglu_limit=config.swiglu_limit)`
    inside the DeepseekV2MoE that deepseek_v4.py 1323 uses; its forward clamps gate <= L, |up| <= L), so a
    trainer serving through it sets `shared_expert_clamp`. Reference: the float64 SwiGLU on the module's own
    w1 x, w3 x. Bugs caught: the flag ignored (the clamp never on, or always on); the routed experts' clamp
    lost with it; the recipes that roll out through SGLang (flash, the H200 experiment's) not setting it."""
    from nanoflash.cli import read_recipe
    tiny = preset("tiny")
    torch.manual_seed(0)
    x = 12.0 * torch.randn(16, tiny.dim, dtype=torch.float64)        # pre-activations past L = 10 somewhere
    outs = []
    for clamp in (False, True):
        cfg = dataclasses.replace(tiny, shared_expert_clamp=clamp)
        moe = MoE(3, cfg).double()
        ex = moe.shared_experts
        g, u = ex.w1.weight @ x.T, ex.w3.weight @ x.T                   # [I,T]
        assert g.abs().max() > cfg.swiglu_limit and u.abs().max() > cfg.swiglu_limit
        if clamp:
            g, u = g.clamp(max=cfg.swiglu_limit), u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        want = (ex.w2.weight @ (torch.nn.functional.silu(g) * u)).T
        got = ex(x)
        assert (got - want).abs().max() <= SWIGLU_TOL * want.abs().max(), clamp
        outs.append(got)
        assert moe.experts.cfg.swiglu_limit == tiny.swiglu_limit       # the routed experts' clamp unchanged
    assert (outs[0] - outs[1]).abs().max() > 0.1 * outs[0].abs().max()  # the clamp acts on these inputs
    assert not tiny.shared_expert_clamp                                 # the default is the published model
    import os
    recipes = [os.path.join(os.path.dirname(__file__), "..", "experiments", "h200", "h200.txt"), "flash"]
    for r in recipes:
        assert "model.shared_expert_clamp=true" in read_recipe(r), r
