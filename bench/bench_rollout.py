"""Rollout benchmarks on H200s: FP8 quantization, NCCL weight push, embedded-server decode.

    python bench/bench_rollout.py --part quant            # one GPU
    python bench/bench_rollout.py --part stream           # one GPU: the per-stage push's build, record, memory
    python bench/bench_rollout.py --part plan             # no GPU: V4-Flash bytes per source at PP4 x EP4
    python bench/bench_rollout.py --part push             # two GPUs: trainer cuda:0 -> embedded server cuda:1
    python bench/bench_rollout.py --part decode           # one GPU; transformers baseline if installed
    python bench/bench_rollout.py --part batching         # one GPU: the `gpu` recipe's rollout, serial vs continuous
    python bench/bench_rollout.py --part launches         # any device: where a decode forward's launches go
    python bench/bench_rollout.py --part all --preset tiny --device cpu    # smoke test

quant:  the stream's quantizer `quant.quantize_fp8_block_into` (Triton on CUDA; Miles' fmt="fp32" convention) and
        the eager reference `quant.quantize_fp8_block` on a bf16 16384^2 weight; GB/s counts bytes read (bf16) +
        written (e4m3 + fp32 scales), against a device copy of the same tensor (read + write) in the same run;
        the kernel's output is compared with the reference bit for bit.
stream: the per-stage push (`stage_push.StagePusher`, one process) of the `small` preset (bf16 on the GPU, FP8
        stream, 256 MiB buckets) into a sink server over the disk transport: GB/s of building buckets (quantize +
        cast into flat buffers), of the verification record (loader layout + SGLang's hash on the GPU), and the
        GPU memory peak above the model against `planner.live_budget`.
plan:   bytes of the V4-Flash FP8 stream per stage source and per EP rank at PP4 x EP4 (no hardware), and the
        push time extrapolated from the measured GB/s (formula in docs/benchmarks.md).
push:   the `small` model's FP8 stream (`iter_sglang_buckets`, 1 GiB buckets) from the trainer on cuda:0 into an
        embedded server on cuda:1 over NCCL (`update_weights_from_distributed`); GB/s of bytes moved, against a
        measured cuda:0 -> cuda:1 tensor copy; extrapolated to V4-Flash's FP8 stream size.
decode: the embedded engine (cache decode, bf16) generates 64 tokens for batch 1 and 32 (n samples of one
        prompt); tokens/s with and without the closing log-prob scoring pass, against transformers'
        `DeepseekV4ForCausalLM.generate` with the same geometry (random weights; speed does not depend on them).
batching: the `gpu` recipe's rollout (nanoflash/recipes/gpu.txt: `small` with the arithmetic task's 18-id vocabulary,
        the embedded FP8 engine, 8 prompts x 8 samples x 16 new tokens, 8 requests in flight through HTTP, the
        recipe's seeds) on ONE engine, switched between `batching="serial"` + exact scoring (the engine before
        continuous batching: one request per forward, every sample scored alone; docs/benchmarks.md B11 measured
        it at 59-65 tokens/s inside train.py) and continuous batching with batched, then exact, scoring; tokens/s
        per mode (median of the timed rounds, after one warm-up round per engine), decode forwards and rows per
        forward, and the agreement with serial on the same seeds: the share of identical samples and the largest
        |dlogp| on those. `--old-engine FILE` adds an engine module from another commit (e.g. `git show
        8c3148f:nanoflash/server/engine.py > bench/old_engine.py`) as one more mode.
launches: ops of one decode forward of the recipe's engine model (64 rows at their own positions), on the
        reference path and on the decode seam (`model.decode_kernels`: fused mHC, dense experts; on the CPU the
        same path under Triton's interpreter), and of one batched scoring forward, by the module that issued them
        (torch profiler, CPU side: what a launch-bound GPU pays per op; a Triton launch counts as one), kernels
        apart from views, the wall time of each on `--device`, and on CUDA the device ops (kernels, copies) and the
        host syncs. `--device cpu --out docs/results/launches_small_cpu.json` regenerates the docs' counts.
Prints one JSON object per part; `--out FILE` also writes them.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanoflash.config import preset  # noqa: E402
from nanoflash.model import Transformer  # noqa: E402
from nanoflash.quant import quantize_fp8_block  # noqa: E402


def sync(dev):
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps=5):
    fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return (time.perf_counter() - t) / reps


def bench_quant(dev, rows=16384, cols=16384):
    from nanoflash.quant import quantize_fp8_block_into
    w = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    q = torch.empty(rows, cols, device=dev, dtype=torch.float8_e4m3fn)
    s = torch.empty(rows // 128, cols // 128, device=dev, dtype=torch.float32)
    t_copy = timed(lambda: w.clone(), dev)
    t_ref = timed(lambda: quantize_fp8_block(w, fmt="fp32"), dev, reps=2)
    t_q = timed(lambda: quantize_fp8_block_into(w, q, s), dev, reps=20)
    part = slice(0, 4096)              # bit-exactness against the CPU reference on a 4096-row slab
    q_ref, s_ref = quantize_fp8_block(w[part].cpu(), fmt="fp32")
    moved, copy_gbps = w.numel() * (2 + 1) + s.numel() * 4, 2 * w.numel() * 2 / t_copy / 1e9
    return {"part": "quant", "shape": [rows, cols], "copy_GBps": copy_gbps,
            "kernel_s": t_q, "kernel_GBps": moved / t_q / 1e9, "kernel_ratio_to_copy": moved / t_q / 1e9 / copy_gbps,
            "eager_reference_GBps": moved / t_ref / 1e9, "eager_ratio_to_copy": moved / t_ref / 1e9 / copy_gbps,
            "bit_identical_to_cpu_reference": bool(torch.equal(q[part].cpu().view(torch.uint8), q_ref.view(torch.uint8))
                                                   and torch.equal(s[:32].cpu(), s_ref))}


def bench_stream(preset_name, dev, bucket_bytes=1 << 28):
    """One process's per-stage push of `preset_name` from `dev` into a sink server (disk transport)."""
    import tempfile
    from nanoflash.config import RolloutConfig
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.parallel import planner
    from nanoflash.sglang import push as stage_push
    from nanoflash.sglang.buckets import stream_buckets
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_weight_sync_gpu import SinkClient
    with torch.device(dev):
        model = Transformer(preset(preset_name)).init_weights(0).cast_(torch.bfloat16)
    named = [(n, t) for n, t in model.state_dict().items() if not n.startswith("mtp.")]   # never pushed
    params_bytes = sum(t.numel() * t.element_size() for _, t in named)
    sync(dev)
    t0, nbytes = time.perf_counter(), 0
    for fb in stream_buckets(named, model.cfg, fp8=True, bucket_bytes=bucket_bytes):
        nbytes += fb.nbytes
    sync(dev)
    t_build = time.perf_counter() - t0
    base = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as d:
        client = SinkClient()
        pusher = stage_push.StagePusher(ParallelDims(), client, RolloutConfig(weights="fp8", transport="disk",
                                        bucket_bytes=bucket_bytes, verify=False), model.cfg, disk_dir=d)
        t0 = time.perf_counter()
        info = pusher.push(lambda: named, version=1)
        sync(dev)
        t_push = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if dev.startswith("cuda") else None
    largest = max(t.numel() * t.element_size() for _, t in named)
    return {"part": "stream", "preset": preset_name, "device": dev, "bucket_bytes": bucket_bytes,
            "param_bytes_bf16": params_bytes, "stream_bytes": nbytes, "build_s": t_build,
            "build_GBps_in_plus_out": (params_bytes + nbytes) / t_build / 1e9,
            "push_with_record_and_disk_s": t_push, "buckets": info["buckets"], "gpu_peak_above_model": peak,
            "live_budget": planner.live_budget(max(bucket_bytes, largest), 1, 0)}


def flash_plan(pp=4, ep=4, fp8=True):
    """Bytes of the FP8 stream of V4-Flash per stage source / per EP rank (the inventory on paper, no tensors)."""
    from nanoflash.names import official_inventory, scale_shape, storage_kind
    from nanoflash.parallel.expert import is_expert_param
    from nanoflash.parallel.pipeline import split_layers
    from nanoflash.sglang.layout import sglang_fp8
    from nanoflash.sglang.buckets import _KIND_DTYPE
    cfg = preset("flash")
    stage_of = {lay: s for s, lays in enumerate(split_layers(cfg.n_layers, pp)) for lay in lays}
    dense, experts = [0] * pp, [0] * pp
    for name, shape in official_inventory(cfg).items():
        if name.startswith("mtp."):
            continue
        n = torch.Size(shape).numel()
        if fp8 and sglang_fp8(name, cfg):
            b = n + torch.Size(scale_shape("fp8", shape)).numel() * 4
        else:
            b = n * torch.empty((), dtype=_KIND_DTYPE.get(storage_kind(name, cfg), torch.float32)).element_size()
        top = 0 if name.startswith("embed") else pp - 1                  # embed: first stage; head/norm/hc_head: last
        s = stage_of[int(name.split(".")[1])] if name.startswith("layers.") else top
        (experts if is_expert_param(name) else dense)[s] += b
    per_source = [d + e for d, e in zip(dense, experts)]
    return {"part": "plan", "pp": pp, "ep": ep, "total_bytes": sum(per_source), "per_source_bytes": per_source,
            "dense_bytes_per_stage": dense, "expert_bytes_per_ep_rank": [e // ep for e in experts]}


def extrapolate(plan, quant_gbps, link_gbps=40.0, nvlink_gbps=300.0):
    """T = sum over stages in turn of max(wire, quantize, gather) (double-buffered), per docs/benchmarks.md."""
    ep, out = plan["ep"], []
    for src, dense, exp_rank in zip(plan["per_source_bytes"], plan["dense_bytes_per_stage"],
                                    plan["expert_bytes_per_ep_rank"]):
        wire = src / (link_gbps * 1e9)
        quant = (dense + exp_rank) * 3 / (quant_gbps * 1e9)     # bf16 read (2 B) + fp8 written (1 B) per param
        gather = exp_rank * (ep - 1) / (nvlink_gbps * 1e9)      # the source receives ep-1 sub-buckets per bucket
        out.append({"wire_s": wire, "quant_s": quant, "gather_s": gather, "stage_s": max(wire, quant, gather)})
    return {"part": "flash_extrapolation", "link_GBps_assumed": link_gbps, "nvlink_GBps_assumed": nvlink_gbps,
            "quant_GBps_measured": quant_gbps, "stages": out, "push_s": sum(x["stage_s"] for x in out)}


def bench_push(preset_name, bucket_bytes):
    from nanoflash.sglang.client import SGLangClient
    from nanoflash.sglang.transports import Broadcaster, iter_sglang_buckets, push_weights
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda:0")
    t_p2p = timed(lambda: x.to("cuda:1"), "cuda:1")
    port = 31000 + os.getpid() % 1000
    srv = subprocess.Popen([sys.executable, "-m", "nanoflash.server.http", "--preset", preset_name, "--device",
                            "cuda:1", "--weights", "fp8", "--port", str(port), "--decode", "full"], cwd=ROOT)
    try:
        client = SGLangClient(f"http://127.0.0.1:{port}", retry_s=5.0)
        client.wait_healthy(timeout=600)
        with torch.device("cuda:0"):
            model = Transformer(preset(preset_name)).init_weights(0).cast_(torch.bfloat16)
        t0 = time.perf_counter()
        buckets = list(iter_sglang_buckets(model, fp8=True, bucket_bytes=bucket_bytes))
        torch.cuda.synchronize(0)
        t_stream = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        bc = Broadcaster(client, "127.0.0.1", port + 1, backend="nccl", group_name="bench", device="cuda:0")
        t0 = time.perf_counter()
        for b in buckets:
            bc.send(b, "1")
        t_send = time.perf_counter() - t0
        t0 = time.perf_counter()
        push_weights(client, buckets, version=2, transport="distributed", broadcaster=bc)
        t_full = time.perf_counter() - t0
    finally:
        srv.kill()
    flash_fp8_bytes = 284.3e9 * 1.0 + 2 * 129280 * 4096 * 2  # ~1 B/param FP8 + bf16 embed/head (rough)
    return {"part": "push", "preset": preset_name, "bytes": nbytes, "buckets": len(buckets),
            "stream_build_s": t_stream, "send_s": t_send, "send_GBps": nbytes / t_send / 1e9,
            "p2p_copy_GBps": x.numel() / t_p2p / 1e9, "ratio_to_copy": (nbytes / t_send) / (x.numel() / t_p2p),
            "full_protocol_with_verify_s": t_full,
            "flash_extrapolated_send_s": flash_fp8_bytes / (nbytes / t_send)}


def bench_decode(preset_name, dev, new_tokens=64):
    from nanoflash.server.engine import RolloutEngine, parse_sampling
    with torch.device(dev):
        model = Transformer(preset(preset_name)).init_weights(0).cast_(torch.bfloat16)
    eng = RolloutEngine(model, weights="bf16", decode="cache")
    prompt = list(range(1, 17))
    out = {"part": "decode", "preset": preset_name, "cache_decode": eng.use_cache}
    for n in (1, 32):
        sp = parse_sampling({"n": n, "max_new_tokens": new_tokens, "temperature": 1.0}, model.cfg.vocab_size)
        eng.generate(prompt, dict(sp, max_new_tokens=2))
        sync(dev)
        t = time.perf_counter()
        eng.score, mode, eng.score_mode = (lambda full, p, T: [0.0] * (len(full) - p)), eng.score_mode, "exact"
        eng.generate(prompt, sp)   # decode only (scoring stubbed)
        sync(dev)
        t_dec = time.perf_counter() - t
        del eng.score
        eng.score_mode = mode
        t = time.perf_counter()
        eng.generate(prompt, sp)
        sync(dev)
        t_all = time.perf_counter() - t
        out[f"b{n}_decode_tok_s"] = n * new_tokens / t_dec
        out[f"b{n}_with_scoring_tok_s"] = n * new_tokens / t_all
        out[f"b{n}_hf_tok_s"] = hf_generate_tok_s(model.cfg, dev, n, prompt, new_tokens)
    return out


def recipe_rollout(preset_name, dev):
    """The `gpu` recipe's model config, task, the first round's prompts and seeds, and its sampling params."""
    from nanoflash.cli import parse_args
    from nanoflash.rl import collector
    from nanoflash.rl.rounds import request_seed
    cfg = parse_args(["--recipe", "gpu"])
    mcfg = preset(preset_name, **cfg.model)
    task = collector.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
    G, rc = cfg.grpo.n_prompts, cfg.rollout
    prompts = [task.encode(p) for p in task.train[:G]]
    seeds = [request_seed(cfg.train.seed, pos) for pos in range(G)]
    sp = {"n": cfg.grpo.group_size, "temperature": rc.temperature, "top_p": rc.top_p,
          "max_new_tokens": rc.max_new_tokens, "stop_token_ids": list(task.stop_ids)}
    return mcfg, prompts, seeds, sp, max(1, rc.max_workers)


def bench_batching(preset_name, dev, rounds=3, serial_rounds=2, old_engine=None):
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor
    from nanoflash.server.engine import RolloutEngine
    from nanoflash.server.http import serve
    from nanoflash.sglang.client import SGLangClient
    mcfg, prompts, seeds, sp, workers = recipe_rollout(preset_name, dev)
    gen = torch.Generator(dev).manual_seed(0) if dev.startswith("cuda") else None   # a fast init on the GPU
    with torch.device(dev):
        model = Transformer(mcfg).init_weights(0, generator=gen)
    engines = {"new": RolloutEngine(model, weights="fp8")}
    if old_engine:   # another commit's engine module, on the same model and weights
        spec = importlib.util.spec_from_file_location("old_engine", old_engine)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        engines["old"] = mod.RolloutEngine(model, weights="fp8")
    servers = {k: serve(e) for k, e in engines.items()}
    clients = {k: SGLangClient(url, retry_s=5.0) for k, (_, url) in servers.items()}
    eng, forwards = engines["new"], []
    real_next = eng._next_logits

    def counted(reqs, state):
        forwards.append(sum(r.n for r in reqs))
        return real_next(reqs, state)
    eng._next_logits = counted

    def one_round(client):
        with ThreadPoolExecutor(workers) as pool:
            futs = [pool.submit(client.generate, p, {**sp, "sampling_seed": s}) for p, s in zip(prompts, seeds)]
            return [f.result() for f in futs]

    modes = [("continuous_batched", "new", "continuous", "batched"), ("serial_exact", "new", "serial", "exact"),
             ("continuous_exact", "new", "continuous", "exact")]
    modes += [("old_engine", "old", None, None)] if old_engine else []
    out, gens = {"part": "batching", "preset": preset_name, "device": dev, "cache_decode": eng.use_cache,
                 "workload": f"{len(prompts)} requests x n={sp['n']} x {sp['max_new_tokens']} new tokens, "
                             f"{workers} in flight", "modes": {}}, {}
    one_round(clients["new"])               # warm-up (CUDA context, cuBLAS handles; no JIT on the fp32 engine)
    if old_engine:
        one_round(clients["old"])
    for name, which, batching, score in modes:
        if which == "new":
            eng.batching, eng.score_mode = batching, score
        n_rounds = serial_rounds if batching != "continuous" else rounds
        times, toks = [], 0
        del forwards[:]
        for _ in range(n_rounds):
            sync(dev)
            t = time.perf_counter()
            gens[name] = one_round(clients[which])
            sync(dev)
            times.append(time.perf_counter() - t)
            toks = sum(len(g.output_ids) for group in gens[name] for g in group)
        t_med = sorted(times)[len(times) // 2]
        out["modes"][name] = {"round_s": times, "tokens_per_round": toks, "tokens_per_s": toks / t_med,
                              "decode_forwards_per_round": len(forwards) / n_rounds if which == "new" else None,
                              "rows_per_forward": sum(forwards) / max(1, len(forwards)) if which == "new" else None}
        print(json.dumps({name: out["modes"][name]}), flush=True)
    base = gens["serial_exact"]
    for name in gens:
        pairs = [(a, b) for ga, gb in zip(base, gens[name]) for a, b in zip(ga, gb)]
        same = [(a, b) for a, b in pairs if a.output_ids == b.output_ids]
        dl = [abs(x - y) for a, b in same for x, y in zip(a.logprobs, b.logprobs)]
        out["modes"][name].update(same_samples_as_serial=f"{len(same)}/{len(pairs)}",
                                  max_abs_dlogp_vs_serial=max(dl, default=0.0))
    t_serial = out["modes"]["serial_exact"]["tokens_per_s"]
    out["speedup_vs_serial"] = {k: v["tokens_per_s"] / t_serial for k, v in out["modes"].items()}
    out["vs_b11_56_tok_s"] = {k: v["tokens_per_s"] / 56.0 for k, v in out["modes"].items()}
    for httpd, _ in servers.values():
        httpd.shutdown()
    return out


VIEW_OPS = {"aten::" + n for n in ("slice", "unsqueeze", "view", "flatten", "unflatten", "expand", "select", "reshape",
                                   "to", "t", "transpose", "permute", "squeeze", "alias", "_unsafe_view", "as_strided",
                                   "detach", "lift_fresh", "unbind", "split", "chunk", "narrow", "contiguous",
                                   "empty", "result_type", "is_nonzero", "item", "_local_scalar_dense")}
LAUNCH_SCOPES = ("hc_split_sinkhorn", "hc_pre_reference", "hc_post", "hc_head", "RoutedExperts", "RoutedExperts.dense",
                 "Gate", "Expert", "MoE", "Compressor", "Indexer", "Attention", "RMSNorm",
                 # the decode seam's one-token step (model.Block.decode_step)
                 "Attention.decode_step", "Compressor.decode_step", "Indexer.decode_step", "step_entries",
                 "DecodeStep.rope", "DecodeStep.windows")
FUSED_SCOPES = {"mhc": ("hc_pre_fused", "hc_post_fused"),      # nanoflash.kernels.* (imported with Triton)
                "decode": ("rms_rope", "decode_attention")}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _scope_targets(fused: bool) -> list:
    """(owner, attribute, scope name) of every function / forward / method op_profile wraps."""
    import nanoflash.model as M
    out = []
    for name in LAUNCH_SCOPES:
        cls, _, meth = name.partition(".")
        obj = getattr(M, cls)
        out.append((obj, meth or "forward", name) if isinstance(obj, type) else (M, name, name))
    if fused:
        import importlib
        for mod, names in FUSED_SCOPES.items():
            K = importlib.import_module("nanoflash.kernels." + mod)
            out += [(K, name, name) for name in names]
    return out


def op_profile(fn, fused: bool = False) -> dict:
    """Top-level aten ops and Triton launches of fn() by the innermost model scope that issued them (the wrapped
    functions, methods and module classes of LAUNCH_SCOPES, + the kernels of FUSED_SCOPES with `fused`), kernels
    and views apart. On CUDA also what the device ran (kernels, copies, memsets) and the host syncs (the CPU
    waiting on it)."""
    import triton.runtime.jit as tj
    from torch.profiler import ProfilerActivity, profile, record_function
    saved, launch = {}, tj.KernelInterface.__getitem__

    def scoped(name, f):
        def g(*a, **k):
            with record_function("scope::" + name):
                return f(*a, **k)
        return g

    def counted_launch(kernel, grid):   # a Triton launch is no aten op: name it for the count
        run = launch(kernel, grid)
        name = getattr(getattr(kernel, "fn", None), "__name__", "kernel")

        def go(*a, **k):
            with record_function("triton::" + name):
                return run(*a, **k)
        return go
    for owner, attr, name in _scope_targets(fused):   # patched for the profile only, restored after
        saved[(owner, attr)] = getattr(owner, attr)
        setattr(owner, attr, scoped(name, saved[(owner, attr)]))
    tj.KernelInterface.__getitem__ = counted_launch
    cuda = torch.cuda.is_available()
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
    finally:
        tj.KernelInterface.__getitem__ = launch
        for (owner, attr), f in saved.items():
            setattr(owner, attr, f)
    kernels, views, device_ops, syncs = {}, 0, 0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device_ops += 1
            continue
        syncs += e.name in SYNC_CALLS
        top = e.cpu_parent is None or not e.cpu_parent.name.startswith(("aten::", "triton::"))
        if not (e.name.startswith(("aten::", "triton::")) and top):
            continue
        if e.name in VIEW_OPS:
            views += 1
            continue
        par = e.cpu_parent
        while par is not None and not par.name.startswith("scope::"):
            par = par.cpu_parent
        key = par.name[len("scope::"):] if par is not None else "other"
        kernels[key] = kernels.get(key, 0) + 1
    out = {"kernel_ops": sum(kernels.values()), "view_ops": views,
           "kernel_ops_by_scope": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}
    if cuda:   # the final synchronize above is the profile's own
        out.update(device_ops=device_ops, host_syncs=syncs - 1)
    return out


def set_kernels(model, mode: str) -> None:
    """Switch `ModelConfig.kernels` of a built model: every module holds the one config object."""
    assert all(m.cfg is model.cfg for m in model.modules() if hasattr(m, "cfg")), "modules hold other configs"
    model.cfg.kernels = mode


@torch.no_grad()
def bench_launches(preset_name, dev, rows=64, groups=(8, 9, 10, 11)):
    """One decode forward (64 rows at their own positions) on the reference path (kernels="reference") and on the
    decode seam (`model.decode_kernels`: "auto" on CUDA; on the CPU "triton" under Triton's interpreter, the same
    path), and one batched scoring forward (no cache: untouched by the seam)."""
    mcfg, _, _, _, _ = recipe_rollout(preset_name, dev)
    gen = torch.Generator(dev).manual_seed(0) if dev.startswith("cuda") else None
    with torch.device(dev):
        model = Transformer(mcfg).init_weights(0, generator=gen).eval()
    cuda, first = dev.startswith("cuda"), model.cfg.kernels
    fast_mode, reps = ("auto", 3) if cuda else ("triton", 1)   # CPU: a forward takes seconds
    g = torch.Generator().manual_seed(0)
    caches, per = [], rows // len(groups)
    for L in groups:             # rows that joined at different steps: per-row positions
        caches.append(model.new_cache())
        model(torch.randint(0, mcfg.vocab_size, (per, L), generator=g).to(dev), 0, caches[-1])
    cache, pos = model.cat_caches(caches), torch.tensor(groups).repeat_interleave(per)
    ids = torch.randint(0, mcfg.vocab_size, (len(pos), 1), generator=g).to(dev)
    full = torch.randint(0, mcfg.vocab_size, (rows, 24), generator=g).to(dev)
    copies = [model.cat_caches([cache]) for _ in range(2 * (reps + 4))]   # a decode step extends its cache

    def decode():
        return model(ids, pos, copies.pop())
    out = {"part": "launches", "preset": preset_name, "device": dev, "rows": rows, "decode_kernels": fast_mode}
    logits = {}
    for name, mode in (("decode_forward_reference", "reference"), ("decode_forward", fast_mode)):
        set_kernels(model, mode)
        logits[name] = decode()          # the warm-up, and the logits compared below
        out[name] = op_profile(decode, fused=mode != "reference")
        interpreted = not cuda and mode != "reference"      # Triton's interpreter: its wall time means nothing
        out[name]["wall_s"] = None if interpreted else timed(decode, dev, reps=reps)
    ref = logits["decode_forward_reference"]
    out["decode_ops_ratio"] = out["decode_forward"]["kernel_ops"] / out["decode_forward_reference"]["kernel_ops"]
    out["decode_max_rel_diff"] = float((logits["decode_forward"] - ref).abs().max() / ref.abs().max())
    set_kernels(model, first)
    score = lambda: model.token_logprobs(full[:, :-1], full[:, 1:])   # noqa: E731
    out["scoring_forward"] = op_profile(score)                      # (CUDA: warmed up by the decode forwards)
    out["scoring_forward"]["wall_s"] = timed(score, dev, reps=reps)
    return out


def hf_generate_tok_s(cfg, dev, n, prompt, new_tokens):
    try:
        import transformers
    except ImportError:
        return None
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    L = cfg.n_layers
    hc = transformers.DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim, num_hidden_layers=L,
        num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, num_experts_per_tok=cfg.n_activated_experts,
        n_routed_experts=cfg.n_routed_experts, layer_types=[kinds.get(r, "heavily_compressed_attention")
                                                            for r in cfg.compress_ratios[:L]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        hc_mult=cfg.hc_mult, sliding_window=cfg.window_size, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        mlp_layer_types=["hash_moe"] * cfg.n_hash_layers + ["moe"] * (L - cfg.n_hash_layers),
        num_nextn_predict_layers=0)
    with torch.device(dev):
        hf = transformers.DeepseekV4ForCausalLM(hc).to(torch.bfloat16).eval()
    ids = torch.tensor([prompt] * n, device=dev)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **dict(kw, max_new_tokens=2, min_new_tokens=2))
        sync(dev)
        t = time.perf_counter()
        hf.generate(ids, **kw)
        sync(dev)
    return n * new_tokens / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["quant", "stream", "plan", "push", "decode", "batching",
                                                      "launches", "all"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--old-engine", default=None, help="batching: an engine.py of another commit, one more mode")
    args = ap.parse_args()
    if args.part == "launches" and not args.device.startswith("cuda"):   # the decode seam's Triton, interpreted
        os.environ["TRITON_INTERPRET"] = "1"          # read when Triton is first imported: nothing has yet
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from interp import patch_interpreter          # tests/interp.py: Triton 3.6 interpreter fixes
        patch_interpreter()
    results, parts = [], {"all": ("quant", "stream", "plan", "push", "decode", "batching", "launches")}.get(
        args.part, (args.part,))
    for part in parts:
        try:
            if part == "quant":
                size = 16384 if args.device.startswith("cuda") else 1024
                results.append(bench_quant(args.device, size, size))
            elif part == "stream":
                results.append(bench_stream(args.preset, args.device))
            elif part == "plan":
                plan = flash_plan()
                quant = next((r["kernel_GBps"] for r in results if r["part"] == "quant"), None)
                results += [plan] + ([extrapolate(plan, quant)] if quant else [])
            elif part == "push" and torch.cuda.device_count() >= 2:
                results.append(bench_push(args.preset, args.bucket_bytes))
            elif part == "decode":
                results.append(bench_decode(args.preset, args.device))
            elif part == "batching":
                results.append(bench_batching(args.preset, args.device, old_engine=args.old_engine))
            elif part == "launches":
                results.append(bench_launches(args.preset, args.device))
        except Exception as e:  # one broken part must not cost the others' numbers
            results.append({"part": part, "error": f"{type(e).__name__}: {e}"})
        if results:
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
