"""AdamW step rates on one GPU host: nanoflash's offloaded AdamW against torch's fused CPU AdamW in the same run.

For B billion trainable parameters in the `small` preset's real shapes (bf16 weights and gradients on the
GPU), seconds per billion parameters of one step (median of `--iters` after one warm-up) of:

    offload      nanoflash.parallel.optim.AdamW(offload=True) at its defaults: grads down, host fused AdamW
                 tile by tile, weights up, streamed through bounded pinned slots; host threads = the default
                 (CPUs / local ranks)
    offload_t1   the same with host_threads=1 (what OMP_NUM_THREADS=1 under torchrun gave the old code)
    torch_cpu    torch.optim.AdamW(fused=True) over fp32 host tensors whose gradients are already on the host
                 (the host math alone, no transfers: 28 bytes of host memory traffic per parameter), measured
                 before and after the sweep; every ratio below is to the mean of the two
    torch_cpu_offload  the same optimizer used as an offload, the plain way: every gradient copied to its
                 fp32 host tensor, the fused step, every weight copied back (no overlap, pageable memory)
    torch_cpu_t1 torch_cpu on one thread
    device       nanoflash AdamW with the state on the GPU (torch's fused CUDA kernel)
    legacy       the previous offload (a Python loop per parameter, whole state pinned, full fp32 gradient
                 copy on the host), on a quarter of the parameters
    host_copy_gbs / h2d_gbs / d2h_gbs   ceilings in the same run: a 1 GiB fp32 host copy_ on the host threads
                 (GB/s of bytes read + written), pinned 1 GiB host->device and device->host copies

With `--sweep`, every (chunk, tile, grad_cast) of `--chunks` x `--tiles` x `--casts` (or of `--configs`
'16M:1M:host,...'; tile 0 = the whole chunk) is timed on the same optimizer (`AdamW.set_streaming`), each
after a bitwise check: from the same initial state, one step's master must equal torch_cpu's first step bit
for bit. Each row carries its rate ratio to torch_cpu and its breakdown (`AdamW.last_breakdown`, median per
phase over the timed steps: host kernel, host grad / weight casts, waits on the copy events, issuing
copies, the final upload).

Prints JSON lines (the sweep rows as they finish, the sweep table, the summary, then the slow `extras` rows
unless --no-extras); `--out FILE` also writes them there.
Run on the GPU host: PYTHONPATH=. python bench/bench_optim.py --billions 1.0 --sweep
CPU smoke test: PYTHONPATH=. python bench/bench_optim.py --billions 0.02 --sweep --iters 1
"""
import argparse
import json
import math
import os
import statistics
import time

import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel.optim import AdamW, default_host_threads, trainable_parameters

KW = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
HOST_KERNEL_BYTES = 28  # per parameter: the fused kernel reads master, m, v, grad (fp32) and writes master, m, v
CEIL_ELEMS = 1 << 28    # 1 GiB of fp32 for the bandwidth ceilings


def shapes(billions: float) -> list:
    """The small preset's trainable shapes (bf16 model), in order, until `billions` parameters."""
    with torch.device("meta"):
        model = Transformer(preset("small"))
    out, n = [], 0
    for _, p in trainable_parameters(model):
        if n >= billions * 1e9:
            break
        out.append(tuple(p.shape))
        n += p.numel()
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, iters: int, after=None) -> float:
    """Median wall seconds of `iters` calls of step() after one warm-up; after(): called after each timed one."""
    step()
    ts = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t)
        if after:
            after()
    return statistics.median(ts)


def gpu_params(shp, gen_seed: int):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to smoke-test this script
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    ps = []
    for i, s in enumerate(shp):
        p = torch.nn.Parameter(torch.randn(s, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
        p.grad = torch.randn(s, device=dev, generator=g, dtype=torch.bfloat16) * 1e-3
        ps.append((f"p{i}", p))
    return ps


def legacy_step(ps, state, step_no: int):
    """The previous offloaded step: every gradient to the host as fp32, a Python loop, weights back."""
    b1, b2 = KW["betas"]
    grads = {n: p.grad.float().to("cpu", non_blocking=True) for n, p in ps}
    sync()
    for n, p in ps:
        st, g = state[n], grads[n]
        w = st["master"]
        if p.ndim >= 2:
            w.mul_(1 - KW["lr"] * KW["weight_decay"])
        st["m"].lerp_(g, 1 - b1)
        st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (st["v"].sqrt() / math.sqrt(1 - b2 ** step_no)).add_(KW["eps"])
        w.addcdiv_(st["m"], denom, value=-KW["lr"] / (1 - b1 ** step_no))
        p.data.copy_(w, non_blocking=True)
    sync()


def elems(text: str) -> int:
    """'256K' / '16M' / '1024' -> elements."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def ceilings(threads: int) -> dict:
    """Host copy bandwidth on `threads` threads and pinned DMA bandwidths, GB/s (1 GiB, best of 3)."""
    out, prev = {}, torch.get_num_threads()
    src, dst = torch.ones(CEIL_ELEMS), torch.empty(CEIL_ELEMS)
    torch.set_num_threads(threads)
    out["host_copy_gbs"] = 2 * src.nbytes / min(_once(lambda: dst.copy_(src)) for _ in range(3)) / 1e9
    torch.set_num_threads(prev)
    if torch.cuda.is_available():
        pin, gpu = torch.empty(CEIL_ELEMS, pin_memory=True), torch.empty(CEIL_ELEMS, device="cuda")
        out["h2d_gbs"] = pin.nbytes / min(_once(lambda: gpu.copy_(pin, non_blocking=True)) for _ in range(3)) / 1e9
        out["d2h_gbs"] = pin.nbytes / min(_once(lambda: pin.copy_(gpu, non_blocking=True)) for _ in range(3)) / 1e9
    return out


def _once(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


class Ref:
    """torch's fused CPU AdamW on the same inputs: fp32 host copies of the weights and gradients; its first
    step's result (`first`) and the initial weights (`init`) kept for the bitwise checks."""

    def __init__(self, ps):
        self.params = [torch.nn.Parameter(p.detach().float().cpu()) for _, p in ps]
        for r, (_, p) in zip(self.params, ps):
            r.grad = p.grad.float().cpu()
        self.init = [r.detach().clone() for r in self.params]
        groups = [{"params": [r for r in self.params if r.ndim >= 2]},
                  {"params": [r for r in self.params if r.ndim < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, fused=True, **KW)
        self.opt.step()
        self.first = [r.detach().clone() for r in self.params]


def reset_and_check(off: AdamW, ref: Ref) -> bool:
    """Put `off` back at the initial state, step once, compare its master with torch's first step."""
    for (name, _), w0 in zip(off.params.items(), ref.init):
        st = off.state[name]
        st["master"].copy_(w0)
        st["exp_avg"].zero_()
        st["exp_avg_sq"].zero_()
    off.step_count = 0
    off.step()
    return all(torch.equal(off.state[name]["master"], r) for name, r in zip(off.params, ref.first))


def measure_config(off: AdamW, ref: Ref, iters: int, per_b, **stream) -> dict:
    """One sweep row: set the stream, bitwise check, then time it with a median breakdown per phase."""
    off.set_streaming(**stream)
    row = {**stream, "bitwise": reset_and_check(off, ref)}
    phases = []
    row["s_per_b"] = per_b(timed(off.step, iters, after=lambda: phases.append(dict(off.last_breakdown))))
    keys = sorted({k for ph in phases for k in ph})
    row["breakdown_s_per_b"] = {k: round(per_b(statistics.median(ph.get(k, 0.0) for ph in phases)), 4)
                                for k in keys}
    row["tiles"] = sum(len(ch) for ch in off.chunks)
    return row


def sweep_configs(a) -> list[tuple[int, int, str]]:
    """--configs 'chunk:tile:cast,...' or else --chunks x --tiles x --casts; tile 0 = the chunk; no repeats."""
    if a.configs:
        triples = [c.split(":") for c in a.configs.split(",")]
    else:
        triples = [(c, t, g) for c in a.chunks.split(",") for t in a.tiles.split(",") for g in a.casts.split(",")]
    out = []
    for c, t, g in triples:
        chunk, tile = elems(c), elems(t)
        cfg = (chunk, chunk if tile == 0 else min(tile, chunk), g)
        if cfg not in out:
            out.append(cfg)
    return out


def sweep(off: AdamW, ref: Ref, a, per_b, emit) -> list:
    rows = []
    for chunk, tile, cast in sweep_configs(a):
        rows.append(measure_config(off, ref, a.iters, per_b, chunk_elems=chunk, tile_elems=tile, grad_cast=cast))
        emit({"sweep": rows[-1]})
    return rows


def extras(ps, ref: Ref, off: AdamW, shp, n, res, per_b):
    """The slow comparison rows: plain offload, one thread, state on the GPU, the previous offload."""
    def plain_offload():
        for r, (_, p) in zip(ref.params, ps):
            r.grad.copy_(p.grad)
        ref.opt.step()
        for r, (_, p) in zip(ref.params, ps):
            p.data.copy_(r)
    res["torch_cpu_offload"] = per_b(timed(plain_offload, 2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res["torch_cpu_t1"] = per_b(timed(ref.opt.step, 1))
    torch.set_num_threads(threads)
    off.host_threads = 1
    res["offload_t1"] = per_b(timed(off.step, 1))
    off.host_threads = default_host_threads()
    dev = AdamW(ps, **KW)
    res["device"] = per_b(timed(dev.step, 3))
    del dev
    cum = [sum(math.prod(x) for x in shp[:i + 1]) for i in range(len(shp))]
    quarter = gpu_params(shp[: next(i + 1 for i, c in enumerate(cum) if c >= n / 4)], 1)
    nq = sum(p.numel() for _, p in quarter)
    pin = torch.cuda.is_available()
    state = {nm: {k: torch.zeros(p.shape, pin_memory=pin) for k in ("m", "v")} for nm, p in quarter}
    for nm, p in quarter:
        state[nm]["master"] = p.detach().float().cpu().pin_memory() if pin else p.detach().float().clone()
    count = [0]

    def leg():
        count[0] += 1
        legacy_step(quarter, state, count[0])
    res["legacy"] = timed(leg, 1) / (nq / 1e9)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--billions", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time every --chunks x --tiles x --casts")
    ap.add_argument("--chunks", default="1M,4M,16M")
    ap.add_argument("--tiles", default="256K,1M,4M,0", help="0: the whole chunk (no tiling)")
    ap.add_argument("--casts", default="host,device")
    ap.add_argument("--configs", default="", help="explicit 'chunk:tile:cast,...' instead of the product")
    ap.add_argument("--no-extras", action="store_true", help="skip the slow comparison rows")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    return ap.parse_args()


def emitter(path):
    out = open(path, "w") if path else None

    def emit(obj):
        line = json.dumps(obj, default=lambda v: str(v))
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
    return emit


def main():
    a = parse_args()
    emit = emitter(a.out)
    shp = shapes(a.billions)
    n = sum(math.prod(s) for s in shp)
    res = {"params": n, "tensors": len(shp), "host_threads": default_host_threads(), "cpus": os.cpu_count()}
    per_b = lambda s: s / (n / 1e9)  # noqa: E731
    res.update(ceilings(default_host_threads()))
    ps = gpu_params(shp, 0)
    ref = Ref(ps)
    off = AdamW(ps, offload=True, **KW)
    res["offload_equals_torch_cpu_bitwise"] = reset_and_check(off, ref)
    base = [per_b(timed(ref.opt.step, a.iters))]
    res["offload"] = per_b(timed(off.step, a.iters))
    res["offload_breakdown_s_per_b"] = {k: round(per_b(v), 4) for k, v in off.last_breakdown.items()}
    res["pinned_mib"] = off.host_bytes()["pinned"] / 2 ** 20
    emit({"start": {**res, "torch_cpu_before": base[0]}})
    rows = sweep(off, ref, a, per_b, emit) if a.sweep else []
    base.append(per_b(timed(ref.opt.step, a.iters)))
    res.update(torch_cpu_before_after=base, torch_cpu=statistics.mean(base))
    res["torch_cpu_host_gbs"] = HOST_KERNEL_BYTES / res["torch_cpu"]  # bytes/param / (s per 1e9 params)
    res["offload_vs_torch_cpu"] = res["torch_cpu"] / res["offload"]  # rate ratio: > 1 is faster than the math alone
    for r in rows:
        r["vs_torch_cpu"] = round(res["torch_cpu"] / r["s_per_b"], 3)
    if rows:
        res["sweep_best"] = min(rows, key=lambda r: r["s_per_b"])
    emit({"sweep_table": [{k: r[k] for k in ("chunk_elems", "tile_elems", "grad_cast", "bitwise", "s_per_b",
                                             "vs_torch_cpu")} for r in rows]})
    emit({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()})
    if not a.no_extras:
        off.set_streaming()  # the defaults again for the one-thread row
        more = {}
        extras(ps, ref, off, shp, n, more, per_b)
        more["offload_vs_torch_cpu_offload"] = more["torch_cpu_offload"] / res["offload"]
        emit({"extras": {k: round(v, 4) for k, v in more.items()}})


if __name__ == "__main__":
    main()
