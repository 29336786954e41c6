"""V4 sparse attention on one GPU: nanoflash.kernels vs FlexAttention (compiled, BlockMask) at the same shapes,
forward and forward+backward, as TFLOP/s of useful work and as ratios to the bf16 matmul ceiling measured in
the same run; peak memory; the indexer; the `small` preset's MFU with the reference and with the kernels.

    python bench/bench_attention.py --out docs/results/attention_h200.json       # on an H200 (~5 min)
    python bench/bench_attention.py --seqs 4096 --no-flex --no-model --no-sweep  # kernels only
    python bench/bench_attention.py --bwd --out docs/results/attention_bwd_h200.json    # old vs wgmma backward

--bwd (issue 43): for S = 4096, 8192 and each layer kind, the fused backward (ka.FUSED_BWD_CONFIG) against the wgmma
backward (attention_bwd.py) in each of BWD_CANDIDATES (with its forward, FWD_CANDIDATES, where not the default):
fwd+bwd and backward-only ms, fwd+bwd TFLOP/s and its ratio to the matmul ceiling measured in the same run, the
gradients' largest difference to the fused backward's (relative to its largest value), the forward kernel's ms
(fwd_kernel_ms) and its o's largest difference to the default forward's (o_max_rel_diff_vs_default), and the
fastest candidate per shape. ~3 min on an H200.

Shapes: 64 heads x 512, one shared K=V head, window 128, batch 1. Layer kinds: C4 (window + indexer top-512
of S/4 entries; the selection is the top-512 of random scores), C128 (window + every visible of S/128 entries),
sliding (window only). Useful FLOPs = 4 H Dh sum_t keys(t) forward (q.k and p.v over the keys query t really
attends: min(W, t+1) window keys + its selected entries); forward+backward = 3.5 x forward (FlashAttention's
convention: the backward's five dots are 2.5 x the forward's two). FlexAttention gets the same keys through a
mask_mod (window rule | dense selection table) and the sink as out * sigmoid(lse - sink).
"""
import argparse
import json
import time

import torch
import triton

from bench_model import matmul_ceiling, model_flops_per_token, timed
from nanoflash.config import preset
from nanoflash.kernels import attention as ka
from nanoflash.kernels.attention_bwd import comp_mode
from nanoflash.kernels import indexer as ki
from nanoflash.kernels import index_scores, sparse_attention, topk_lower_index_wins, window_and_selection_mask
from nanoflash.model import Transformer

DEV = "cuda"
H, DH, W, TOPK, HI, DI = 64, 512, 128, 512, 64, 128


def _c(h, k, w, st):
    return dict(BLOCK_H=h, BLOCK_K=k, num_warps=w, num_stages=st)


# Candidates that compile without register spills or with a few bytes (ptxas -v for sm_90a, offline).
FWD_SWEEP = [_c(64, 32, 8, 3), _c(64, 16, 8, 3), _c(64, 32, 8, 2), _c(64, 64, 8, 2)]
BWD_SWEEP = [dict(fused=False, dq=_c(32, 32, 8, 2), dkv=_c(32, 32, 8, 2)),
             dict(fused=False, dq=_c(64, 16, 8, 2), dkv=_c(32, 32, 8, 2)),
             dict(fused=True, dq=_c(32, 32, 8, 2)),
             dict(fused=True, dq=_c(32, 16, 8, 2))]


_W = dict(num_warps=8)
# wgmma backward candidates (attention_bwd.py; shared memory per pass in attention.py's WGMMA_BWD_CONFIG note).
# "m128": every chained dot has M = 128 rows (no warpgroup computes another's rows), loads unpipelined
# where 128 KiB (q, dO) row tiles leave no room for a second stage; "pipe": 2-3 stage pipelines, the key-major
# passes on 32-row tiles (M = 64: both warpgroups compute the same s / dp, 1.5x those dots' work).
BWD_CANDIDATES = {
    "m128-keys": dict(ka.WGMMA_BWD_CONFIG, comp=dict(ka.WGMMA_BWD_CONFIG["comp"], comp_mode="keys")),
    "m128-rows": dict(ka.WGMMA_BWD_CONFIG, comp=dict(ka.WGMMA_BWD_CONFIG["comp"], comp_mode="rows")),
    "pipe": dict(kind="wgmma", dq=dict(BLOCK_H=64, BLOCK_K=16, num_stages=3, **_W),
                 dkv=dict(BLOCK_K=64, BLOCK_R=32, num_stages=2, programs=264, min_chunk=32, **_W),
                 comp=dict(BLOCK_K=64, BLOCK_R=32, num_stages=2, chunk=64, comp_mode="keys",
                           rows=dict(BLOCK_H=64, BLOCK_K=64, num_stages=1, **_W), **_W)),
    "dq64": dict(ka.WGMMA_BWD_CONFIG, dq=dict(BLOCK_H=64, BLOCK_K=64, num_stages=1, **_W)),
}
# Measured slower than the default (H100, 2026-12-07, docs/benchmarks.md; issue 43 item 1): the Hopper
# default with delta computed in the dq pass ("+delta", fuse_delta) and / or the keys-on-M forward ("+kfwd":
# attention._fwd_keys, FWD_KEYS_CONFIG; "+kfwd32": 32 heads a program, fewer spills at C4 (84 B against 808 B,
# ptxas sm_90a) but each key block read by two programs). FWD_CANDIDATES: the forward each candidate runs
# (absent: ka.FWD_CONFIG, the default).
_DELTA = dict(ka.HOPPER_BWD_CONFIG, dq=dict(ka.HOPPER_BWD_CONFIG["dq"], fuse_delta=True))
BWD_CANDIDATES.update({"m128-rows+kfwd": ka.HOPPER_BWD_CONFIG, "m128-rows+kfwd32": ka.HOPPER_BWD_CONFIG,
                       "m128-rows+delta": _DELTA, "m128-rows+kfwd+delta": _DELTA})
FWD_CANDIDATES = {"m128-rows+kfwd": ka.FWD_KEYS_CONFIG, "m128-rows+kfwd+delta": ka.FWD_KEYS_CONFIG,
                  "m128-rows+kfwd32": dict(ka.FWD_KEYS_CONFIG, BLOCK_H=32)}


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def unit_rms(x):
    return (x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).bfloat16()


def make_inputs(S, kind, g):
    """q [1,S,H,Dh], kv [1,S,Dh], sink [H], comp [1,C,Dh] | None, sel [1,S,K] | None, all as in the model."""
    q, kv = unit_rms(torch.randn(1, S, H, DH, device=DEV, generator=g)), unit_rms(
        torch.randn(1, S, DH, device=DEV, generator=g))
    sink = torch.randn(H, device=DEV, generator=g)
    if kind == "sliding":
        return q, kv, sink, None, None
    ratio = 4 if kind == "c4" else 128
    C = S // ratio
    comp = unit_rms(torch.randn(1, C, DH, device=DEV, generator=g))
    vis = torch.arange(C, device=DEV)[None] < (torch.arange(S, device=DEV)[:, None] + 1) // ratio
    if kind == "c4":
        score = torch.rand(1, S, C, device=DEV, generator=g).masked_fill(~vis, float("-inf"))
        sel = topk_lower_index_wins(score, TOPK)
    else:
        sel = torch.where(vis, torch.arange(C, device=DEV), -1)[None]
    return q, kv, sink, comp, sel


def useful_flops(S, sel) -> float:
    keys = torch.clamp(torch.arange(S, device=DEV) + 1, max=W).sum().item()
    keys += (sel >= 0).sum().item() if sel is not None else 0
    return 4.0 * H * DH * keys


def kernel_fwd_ms(q, kv, sink, comp, sel, config=None) -> float:
    """The forward kernel alone (selection compacted beforehand, no checks, no autograd); config None: the
    current ka.FWD_CONFIG."""
    sel_c, n_sel = ka.compact_selection(sel, comp.shape[1]) if comp is not None else (None, None)
    return ms(lambda: ka.attention_forward(q, kv, comp, sel_c, n_sel, sink, DH ** -0.5, W, config))


def run_ours(q, kv, sink, comp, sel, do):
    """As the model calls it (prefix lists: no sort, no checks). -> (forward ms, forward+backward ms, peak MiB)"""
    fwd = ms(lambda: sparse_attention(q, kv, sink, DH ** -0.5, W, comp, sel, prefix=True))
    leaves = [t.detach().requires_grad_() for t in (q, kv, sink) + ((comp,) if comp is not None else ())]
    args = leaves[:3] + [DH ** -0.5, W] + ([leaves[3], sel] if comp is not None else [])

    def step():
        torch.autograd.backward(sparse_attention(*args, prefix=True), do)
    both = ms(step)
    return fwd, both, peak_mib(step)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def flex_fn(S, sel, C, options=None):
    """A compiled FlexAttention with the same key lists; -> f(q, kv, comp, sink) -> o [1,S,H,Dh]"""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    keep = window_and_selection_mask(S, W, sel, C)[0, :, S:] if sel is not None else None   # [S,C]

    def mask_mod(b, h, qi, ki):
        win = (ki < S) & (qi >= ki) & (qi - ki < W)
        if keep is None:
            return win
        return win | ((ki >= S) & keep[qi, torch.clamp(ki - S, min=0)])
    bm = create_block_mask(mask_mod, 1, None, S, S + C, device=DEV)
    flex = torch.compile(flex_attention, dynamic=False)

    def f(q, kv, comp, sink):
        keys = (kv if comp is None else torch.cat([kv, comp], 1))[:, None]            # [1,1,S+C,Dh]
        out, aux = flex(q.transpose(1, 2), keys, keys, block_mask=bm, scale=DH ** -0.5, enable_gqa=True,
                        kernel_options=options, return_aux=AuxRequest(lse=True))
        return (out * torch.sigmoid(aux.lse - sink[None, :, None])[..., None]).transpose(1, 2)
    return f


# FlexAttention's own configs (None) and, on the first C4 shape, larger backward blocks than its default for
# head dim > 256 (16 x 16 everywhere), so the comparison is not against a needlessly slow Flex backward.
FLEX_SEARCH = [None, dict(bwd_BLOCK_M1=32, bwd_BLOCK_N1=32, bwd_BLOCK_M2=32, bwd_BLOCK_N2=32, bwd_num_stages=1),
               dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=16, bwd_BLOCK_M2=16, bwd_BLOCK_N2=64, bwd_num_stages=1,
                    bwd_num_warps=8)]


def run_flex(S, q, kv, sink, comp, sel, do, ours_out, options=(None,)):
    """The fastest forward+backward over `options`.
    -> (forward ms, forward+backward ms, peak MiB, max |flex - ours| / max |ours|, options, tried)"""
    leaves = [t.detach().requires_grad_() for t in (q, kv, sink) + ((comp,) if comp is not None else ())]
    best, tried = None, []
    for opts in options:
        f = flex_fn(S, sel, comp.shape[1] if comp is not None else 0, opts)

        def step():
            torch.autograd.backward(f(leaves[0], leaves[1], leaves[3] if comp is not None else None, leaves[2]), do)
        try:
            err = ((f(q, kv, comp, sink).float() - ours_out.float()).abs().max() / ours_out.float().abs().max()).item()
            res = (ms(lambda: f(q, kv, comp, sink)), ms(step), peak_mib(step), err, opts)
        except Exception as e:   # out of resources: recorded, the next options are tried
            tried.append(dict(options=opts, error=repr(e)[:200]))
            continue
        tried.append(dict(options=opts, fwd_ms=res[0], fwdbwd_ms=res[1]))
        print("flex", tried[-1], flush=True)
        best = res if best is None or res[1] < best[1] else best
    if best is None:
        raise RuntimeError(f"no FlexAttention options ran: {tried}")
    return best + (tried,)


def sweep(S, g, out):
    """Pick FWD_CONFIG / BWD_CONFIG on the C4 layer (the most common, and the largest key lists)."""
    q, kv, sink, comp, sel = make_inputs(S, "c4", g)
    do = torch.randn_like(q)
    fl = useful_flops(S, sel)
    rows, best_f, best_b = [], (1e9, None), (1e9, None)
    for cfg in FWD_SWEEP:
        try:
            ka.FWD_CONFIG = cfg
            t = ms(lambda: sparse_attention(q, kv, sink, DH ** -0.5, W, comp, sel, prefix=True))
            rows.append(dict(pass_="fwd", cfg=cfg, ms=t, tflops=fl / t / 1e9))
            best_f = min(best_f, (t, cfg), key=lambda r: r[0])
        except Exception as e:  # out of shared memory / registers: recorded, not fatal
            rows.append(dict(pass_="fwd", cfg=cfg, error=repr(e)[:200]))
        print(rows[-1], flush=True)
    ka.FWD_CONFIG = best_f[1]
    for cfg in BWD_SWEEP:
        try:
            ka.BWD_CONFIG = cfg
            _, both, _ = run_ours(q, kv, sink, comp, sel, do)
            rows.append(dict(pass_="fwd+bwd", cfg=cfg, ms=both, tflops=3.5 * fl / both / 1e9))
            best_b = min(best_b, (both, cfg), key=lambda r: r[0])
        except Exception as e:
            rows.append(dict(pass_="fwd+bwd", cfg=cfg, error=repr(e)[:200]))
        print(rows[-1], flush=True)
    ka.BWD_CONFIG = best_b[1]
    out["sweep"] = rows
    out["chosen"] = dict(fwd=ka.FWD_CONFIG, bwd=ka.BWD_CONFIG)


def bench_indexer(S, g):
    C = S // 4
    q = torch.randn(1, S, HI, DI, device=DEV, generator=g).bfloat16()
    keys = torch.randn(1, C, DI, device=DEV, generator=g).bfloat16()
    w = torch.randn(1, S, HI, device=DEV, generator=g)
    vis = torch.arange(C, device=DEV)[None] < (torch.arange(S, device=DEV)[:, None] + 1) // 4

    def reference():   # model.Indexer's scoring and full stable sort
        s = (torch.einsum("bshd,bcd->bshc", q.float(), keys.float()).relu() * w[..., None]).sum(2)
        return s.masked_fill(~vis, float("-inf")).sort(dim=-1, descending=True, stable=True).indices[..., :TOPK]
    useful = 2.0 * HI * DI * vis.sum().item()
    t_s, t_k = ms(lambda: index_scores(q, keys, w)), ms(lambda: topk_lower_index_wins(index_scores(q, keys, w), TOPK))
    t_r = ms(reference)
    return dict(S=S, scores_ms=t_s, scores_tflops=useful / t_s / 1e9, scores_plus_topk_ms=t_k, reference_ms=t_r,
                peak_mib=peak_mib(lambda: topk_lower_index_wins(index_scores(q, keys, w), TOPK)),
                reference_peak_mib=peak_mib(reference))


def bench_model(S):
    """The small preset's training step (bench_model.py's), reference attention vs kernels."""
    cfg = preset("small")
    with torch.device("cuda"):
        model = Transformer(cfg).init_weights(0).cast_(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, S), device=DEV)

    def step():
        model.zero_grad(set_to_none=True)
        (-model.token_logprobs(ids, torch.roll(ids, -1, 1)).mean()).backward()
    flops = 3 * model_flops_per_token(cfg, S) * S
    res = {}
    for mode in ("reference", "auto"):
        cfg.kernels = mode     # every module holds this one config object
        sec = timed(step, iters=5, warmup=2)
        res[mode] = dict(step_s=sec, tokens_per_s=S / sec, tflops=flops / sec / 1e12, mfu=flops / sec / 989e12,
                         peak_gib=peak_mib(step) / 1024)
        print(mode, res[mode], flush=True)
    return res


def table(out):
    print(f"\n{'S':>5} {'kind':>7} {'fwd TF/s':>9} {'flex':>6} {'x':>5} {'f+b TF/s':>9} {'flex':>6} {'x':>5} "
          f"{'MiB':>7} {'flex MiB':>8}")
    for r in out["rows"]:
        print(f"{r['S']:>5} {r['kind']:>7} {r['fwd_tflops']:>9.1f} {r.get('flex_fwd_tflops', 0):>6.1f} "
              f"{r.get('fwd_ratio', 0):>5.2f} {r['fwdbwd_tflops']:>9.1f} {r.get('flex_fwdbwd_tflops', 0):>6.1f} "
              f"{r.get('fwdbwd_ratio', 0):>5.2f} {r['peak_mib']:>7.0f} {r.get('flex_peak_mib', 0):>8.0f}")
    print(f"ceiling {out['ceiling_tflops']:.0f} TFLOP/s")


def pass_ms(cfg, q, kv, comp, sel_c, n_sel, o, lse, do) -> dict:
    """ms of each pass of the wgmma backward under `cfg`: the separate delta pass, the dq pass (with delta in
    it under fuse_delta: "m128-rows+delta" is timed so too), the dkv pass, the entry pass both ways and its
    lists."""
    from nanoflash.kernels import attention_bwd as kb
    scale, prec, BD = DH ** -0.5, "tf32", triton.next_power_of_2(DH)
    delta = kb.attention_backward_wgmma(do, q, kv, comp, sel_c, n_sel, o, lse, scale, W, cfg)[3]
    sl = scale * 1.4426950408889634
    R = delta.numel()
    t = dict(delta=ms(lambda: kb._bwd_delta[(triton.cdiv(R, kb.DELTA_ROWS),)](o, do, delta, R, DH,
                                                                               BLOCK_R=kb.DELTA_ROWS, BLOCK_D=BD)),
             dq=ms(lambda: kb._dq_pass(do, q, kv, comp, sel_c, n_sel, lse, delta, scale, sl, W, prec, BD, cfg["dq"],
                                       o)),
             dkv=ms(lambda: kb._key_major(q, do, lse, delta, kv, None, scale, sl, W, prec, BD, cfg["dkv"])))
    if comp is not None:
        c = cfg["comp"]
        t["comp_lists"] = ms(lambda: kb.selection_lists(sel_c, n_sel, comp.shape[1], c["BLOCK_K"], c["chunk"]))
        t["comp_keys"] = ms(lambda: kb._key_major(q, do, lse, delta, comp, (sel_c, n_sel), scale, sl, W, prec, BD, c))
        t["comp_rows"] = ms(lambda: kb._rows_comp(q, do, lse, delta, comp, sel_c, n_sel, scale, sl, prec, BD,
                                                  c["rows"]))
    return t


def grads(q, kv, sink, comp, sel, do):
    """Gradients of (q, kv, sink[, comp]) through the model's call with the current ka.BWD_CONFIG."""
    leaves = [t.detach().requires_grad_() for t in (q, kv, sink) + ((comp,) if comp is not None else ())]
    args = leaves[:3] + [DH ** -0.5, W] + ([leaves[3], sel] if comp is not None else [])
    return torch.autograd.grad(sparse_attention(*args, prefix=True), leaves, do)


def compare_backward(seqs, g, out, save):
    """The fused backward vs each wgmma candidate at every (S, kind); see the module docstring."""
    old, old_fwd, rows = ka.BWD_CONFIG, ka.FWD_CONFIG, []
    out["bwd_candidates"] = {"fused": ka.FUSED_BWD_CONFIG, **BWD_CANDIDATES}
    out["fwd_candidates"] = {"default": ka.FWD_CONFIG, **FWD_CANDIDATES}
    for S in seqs:
        for kind in ("c4", "c128", "sliding"):
            q, kv, sink, comp, sel = make_inputs(S, kind, g)
            do = torch.randn(q.shape, device=DEV, generator=g).bfloat16()
            fl = useful_flops(S, sel)
            sel_c, n_sel = (ka.compact_selection(sel, comp.shape[1]) if comp is not None else (None, None))
            o, lse = ka.attention_forward(q, kv, comp, sel_c, n_sel, sink, DH ** -0.5, W)
            ref = None
            for name, cfg in {"fused": ka.FUSED_BWD_CONFIG, **BWD_CANDIDATES}.items():
                if comp is None and name.endswith("-rows"):
                    continue   # no entries: the same passes as without the suffix
                ka.BWD_CONFIG, ka.FWD_CONFIG = cfg, FWD_CANDIDATES.get(name, old_fwd)
                row = dict(S=S, kind=kind, config=name)
                try:
                    o_c = ka.attention_forward(q, kv, comp, sel_c, n_sel, sink, DH ** -0.5, W)[0]
                    row["o_max_rel_diff_vs_default"] = ((o_c.float() - o.float()).abs().max()
                                                        / o.float().abs().max()).item()
                    row["fwd_kernel_ms"] = kernel_fwd_ms(q, kv, sink, comp, sel)
                    got = grads(q, kv, sink, comp, sel, do)
                    ref = got if ref is None else ref
                    row["max_rel_diff_vs_fused"] = max(
                        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, ref))
                    _, both, mem = run_ours(q, kv, sink, comp, sel, do)
                    bwd = ms(lambda: ka.attention_backward(do, q, kv, comp, sel_c, n_sel, o, lse, DH ** -0.5, W))
                    tb = 3.5 * fl / both / 1e9
                    row.update(fwdbwd_ms=both, bwd_ms=bwd, fwdbwd_tflops=tb,
                               fwdbwd_of_ceiling=tb / out["ceiling_tflops"], peak_mib=mem)
                    if cfg.get("kind") == "wgmma" and comp is not None:
                        row["comp_mode"] = comp_mode(cfg["comp"], sel_c, comp.shape[1])
                    if name in ("m128-keys", "m128-rows+delta"):   # where the time goes, pass by pass
                        row["pass_ms"] = pass_ms(cfg, q, kv, comp, sel_c, n_sel, o, lse, do)
                except Exception as e:   # out of resources on this GPU: recorded, the next candidate runs
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            ka.BWD_CONFIG, ka.FWD_CONFIG = old, old_fwd
            save()
    out["bwd_rows"] = rows
    best = {}
    for r in rows:
        k = (r["S"], r["kind"])
        if "fwdbwd_ms" in r and r["config"] != "fused" and (k not in best or r["fwdbwd_ms"] < best[k]["fwdbwd_ms"]):
            best[k] = r
    fused = {(r["S"], r["kind"]): r for r in rows if r["config"] == "fused" and "fwdbwd_ms" in r}
    out["bwd_best"] = [dict(S=S, kind=kind, config=r["config"], fwdbwd_tflops=r["fwdbwd_tflops"],
                            fwdbwd_of_ceiling=r["fwdbwd_of_ceiling"],
                            speedup_vs_fused=fused[S, kind]["fwdbwd_ms"] / r["fwdbwd_ms"] if (S, kind) in fused else None)
                       for (S, kind), r in sorted(best.items())]
    print(f"\n{'S':>5} {'kind':>7} {'fused f+b TF/s':>14} {'(ceil)':>6} {'best new':>10} {'f+b TF/s':>9} {'(ceil)':>6} "
          f"{'x':>5}")
    for b in out["bwd_best"]:
        f = fused.get((b["S"], b["kind"]), {})
        print(f"{b['S']:>5} {b['kind']:>7} {f.get('fwdbwd_tflops', 0):>14.1f} {f.get('fwdbwd_of_ceiling', 0):>6.3f} "
              f"{b['config']:>10} {b['fwdbwd_tflops']:>9.1f} {b['fwdbwd_of_ceiling']:>6.3f} {b['speedup_vs_fused'] or 0:>5.2f}")
    print(f"ceiling {out['ceiling_tflops']:.0f} TFLOP/s")
    save()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--flex-budget-s", type=float, default=150.0, help="start no FlexAttention run after this")
    ap.add_argument("--flex-search", action="store_true", help="also try FLEX_SEARCH on the first C4 shape")
    ap.add_argument("--bwd", action="store_true", help="only the fused vs wgmma backward comparison (issue 43)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    g = torch.Generator(DEV).manual_seed(0)
    out = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, ceiling_tflops=matmul_ceiling() / 1e12, rows=[])

    def save():   # after every section, so a run cut short still leaves its numbers
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(out, fh, indent=1)
    print("matmul ceiling", out["ceiling_tflops"], flush=True)
    if a.bwd:
        compare_backward(a.seqs, g, out, save)
        return
    if not a.no_sweep:
        sweep(a.seqs[0], g, out)
        save()
    cases = {}
    for S in a.seqs:
        for kind in ("c4", "c128", "sliding"):
            cases[S, kind] = make_inputs(S, kind, g)
            q, kv, sink, comp, sel = cases[S, kind]
            fl = useful_flops(S, sel)
            f, b, mem = run_ours(q, kv, sink, comp, sel, torch.randn_like(q))
            tf, tb = fl / f / 1e9, 3.5 * fl / b / 1e9
            out["rows"].append(dict(S=S, kind=kind, gflop_fwd=fl / 1e9, fwd_ms=f, fwdbwd_ms=b, fwd_tflops=tf,
                                    fwd_kernel_ms=kernel_fwd_ms(q, kv, sink, comp, sel),
                                    fwd_checked_ms=ms(lambda: sparse_attention(q, kv, sink, DH ** -0.5, W, comp, sel)),
                                    fwdbwd_tflops=tb, fwd_of_ceiling=tf / out["ceiling_tflops"],
                                    fwdbwd_of_ceiling=tb / out["ceiling_tflops"], peak_mib=mem))
            print(json.dumps(out["rows"][-1]), flush=True)
            save()
    out["indexer"] = [bench_indexer(S, g) for S in a.seqs]
    print(json.dumps(out["indexer"]), flush=True)
    save()
    if not a.no_model:
        out["model_small_s4096"] = bench_model(4096)
        save()
    t0 = time.time()
    order = sorted(out["rows"], key=lambda r: (r["kind"] != "c4", r["S"]))   # C4 first: the target's layer
    for row in [] if a.no_flex else order:
        if time.time() - t0 > a.flex_budget_s:
            row["flex_error"] = "not run: --flex-budget-s spent (compiles)"
            continue
        q, kv, sink, comp, sel = cases[row["S"], row["kind"]]
        try:
            ours_o = sparse_attention(q, kv, sink, DH ** -0.5, W, comp, sel)
            search = FLEX_SEARCH if a.flex_search and row is order[0] else [None]
            ff, fb, fm, err, opts, tried = run_flex(row["S"], q, kv, sink, comp, sel, torch.randn_like(q), ours_o,
                                                    search)
            fl = row["gflop_fwd"] * 1e9
            row.update(flex_fwd_ms=ff, flex_fwdbwd_ms=fb, flex_peak_mib=fm, flex_vs_ours_err=err, flex_options=opts,
                       flex_tried=tried,
                       flex_fwd_tflops=fl / ff / 1e9, flex_fwdbwd_tflops=3.5 * fl / fb / 1e9,
                       fwd_ratio=ff / row["fwd_ms"], fwdbwd_ratio=fb / row["fwdbwd_ms"])
        except Exception as e:
            row["flex_error"] = repr(e)[:300]
        print(json.dumps(row), flush=True)
        save()
    table(out)


if __name__ == "__main__":
    main()
