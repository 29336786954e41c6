"""Proof against SGLang's real DeepSeek-V4 loader, on a CPU (opt-in; needs its own ~6 GB environment).

One command builds the environment (once) and runs the check (sglang_loader_check.md explains why it works):

    python -m instruments.loader_check --build-env .venv-sglang --sglang 0.5.23
    python -m instruments.loader_check --build-env .venv-sglang-0.5.16 --sglang 0.5.16

Both pass (2026-11-29, CPU): BF16 101/101 and FP8 138/138 SGLang parameters bit-identical after each of two
updates, and the control push without tid2eid is reported; 0.5.16 again on 2026-12-01 with the flat-bucket
stream, and the hash check (6.) equal on all six cases.

What it does, inside that environment:
1. builds SGLang's own `DeepseekV4ForCausalLM` on the CPU for a small V4 geometry (real per-head sizes:
   64 heads x 512, rope 64, indexer 64 x 128; hidden 256, 4 layers with compress ratios [0, 4, 128, 0], one
   hash layer, 8 experts top-2), BF16 or FP8 128x128 (`SGLANG_OPT_FP8_WO_A_GEMM=0`, Miles' setting);
2. builds a nanoflash `Transformer` of the same geometry and streams `iter_sglang_buckets(model, fp8=...)`
   into SGLang's real `load_weights`, one call per bucket -- exactly the entry point every live update
   (`update_weights_from_tensor` / `_from_distributed`) ends in;
3. compares every SGLang parameter bit for bit with what nanoflash meant: the loader layout nanoflash derives
   on its own side (`layout.LoaderState`: fused wqkv_a / wkv_gate, permuted ape, int32 tid2eid, experts
   stacked), cast to the parameter's dtype where SGLang stores a different one (e.g. compressor norms fp32);
4. perturbs the weights and pushes again (two updates in a row), this time through SGLang's own colocated
   payload (`transports.sglang_flattened_payload` -> SGLang's safe unpickler -> `reconstruct_tensors`),
   and compares again;
5. lists every SGLang parameter the push did not cover (there must be none besides attention KV scales);
6. runs SGLang's own `gpu_tensor_hash` Triton kernels (Triton's interpreter, on the CPU) and its FP8
   `Fp8BlockComparable.dequantize` against nanoflash's reproduction of `/weights_checker` (`layout.sglang_hash`),
   on the shapes of fused experts too: the hash every push into real SGLang is verified with.

Exit status 0 iff everything matched. `tests/test_rollout_loader_check.py` (marker `sglang`) runs it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

SMALL = dict(vocab_size=512, dim=256, moe_inter_dim=128, n_layers=4, n_hash_layers=1, n_mtp_layers=0,
             n_heads=64, n_routed_experts=8, n_activated_experts=2, q_lora_rank=128, head_dim=512,
             rope_head_dim=64, o_groups=8, o_lora_rank=128, compress_ratios=(0, 4, 128, 0), index_n_heads=64,
             index_head_dim=128, index_topk=16, hc_mult=4)
NOT_PUSHED = ("attn_mqa.k_scale", "attn_mqa.v_scale")  # attention KV-cache scales, not model weights
# sglang version -> (torch, torchvision, transformers, extra imports it needs) -- sglang is installed --no-deps
PINS = {"0.5.23": ("2.14.1", "0.29.1", "5.19.0", []),
        "0.5.16": ("2.11.0", "0.26.0", "5.12.1", ["xgrammar", "zstandard"])}
EXTRA = ("orjson psutil pybase64 requests msgspec pyzmq IPython aiohttp dill apache-tvm-ffi==0.1.11 "
         "sentencepiece compressed-tensors gguf openai partial_json_parser uvicorn fastapi setproctitle "
         "starlette safetensors einops numpy").split()


def build_env(path: str, version: str):
    """Create the virtual environment of sglang_loader_check.md (torch + sglang --no-deps + pure-Python deps)."""
    torch_v, tv_v, tf_v, extra = PINS[version]
    py = os.path.join(path, "bin", "python")
    steps = [[sys.executable, "-m", "venv", path], [py, "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [py, "-m", "pip", "install", "-q", f"torch=={torch_v}", f"torchvision=={tv_v}"],
             [py, "-m", "pip", "install", "-q", "--no-deps", f"sglang=={version}"],
             [py, "-m", "pip", "install", "-q", f"transformers=={tf_v}", *EXTRA, *extra]]
    for cmd in steps:
        subprocess.run(cmd, check=True)
    return py


def sglang_model(cfg, fp8: bool):
    """SGLang's DeepseekV4ForCausalLM for nanoflash config `cfg`, on the CPU (world-size-1 gloo groups)."""
    import torch
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs
    if not ps.model_parallel_is_initialized():
        args = ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1)
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        try:  # 0.5.23: the runtime context is published explicitly
            from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
            reset_context()
            publish(args, role="test", ranks=SpawnRanks(world_rank=0))
            get_parallel().override_permanently(world_group=ps._WORLD)
        except ImportError:  # 0.5.16: global server args, context reads parallel_state lazily
            from sglang.srt.runtime_context import get_context
            from sglang.srt.server_args import set_global_server_args_for_scheduler
            set_global_server_args_for_scheduler(args)
            get_context().set_server_args(args)
        ps.initialize_model_parallel(backend="gloo")
    import sglang.srt.layers.rotary_embedding.base as rope_base
    import sglang.srt.layers.rotary_embedding.rope_variant as rope_var
    rope_base._is_cpu = True                       # rope construction only: no CUDA rotary op
    rope_var.get_device = lambda *a, **k: "cpu"
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
             "weight_block_size": [128, 128]} if fp8 else None
    sc = DeepSeekV4Config(architectures=["DeepseekV4ForCausalLM"], quantization_config=None, rope_scaling={},
                          compress_ratios=[], kv_source_layer_ids=[], index_source_layer_ids=[],
                          engram_layer_ids=[], engram_num_embeddings=[])
    for k, v in dict(hidden_size=cfg.dim, head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_head_dim,
                     num_attention_heads=cfg.n_heads, q_lora_rank=cfg.q_lora_rank, o_lora_rank=cfg.o_lora_rank,
                     o_groups=cfg.o_groups, index_topk=cfg.index_topk, moe_intermediate_size=cfg.moe_inter_dim,
                     n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.n_activated_experts,
                     n_group=1, topk_group=1, num_hidden_layers=cfg.n_layers, num_hash_layers=cfg.n_hash_layers,
                     n_hash_layers=cfg.n_hash_layers, num_nextn_predict_layers=0,
                     compress_ratios=list(cfg.compress_ratios), max_position_embeddings=4096,
                     compress_rope_theta=cfg.compress_rope_theta, vocab_size=cfg.vocab_size,
                     rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                   "original_max_position_embeddings": 65536, "type": "yarn"},
                     quantization_config=quant).items():
        setattr(sc, k, v)
    if getattr(sc, "rope_parameters", None) is not None or not hasattr(sc, "rope_scaling"):  # 0.5.16 reads these
        sc.rope_parameters = dict(sc.rope_scaling, rope_theta=cfg.rope_theta, rope_type="yarn")
    torch.set_default_dtype(torch.bfloat16)
    try:
        return DeepseekV4ForCausalLM(sc, quant_config=Fp8Config.from_config(quant) if fp8 else None)
    finally:
        torch.set_default_dtype(torch.float32)


def meant(buckets) -> dict:
    """nanoflash's own derivation of SGLang's parameters: loader layout, experts stacked [E, ...]."""
    import torch
    from nanoflash.sglang.layout import LoaderState
    st = LoaderState()
    for b in buckets:
        st.load(b)
    out, experts = {}, {}
    for name, t in st.params.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            stacked = ".".join(parts[:i + 1] + parts[i + 2:])
            experts.setdefault(stacked, {})[int(parts[i + 1])] = t
        else:
            out[name] = t
    for name, d in experts.items():
        out[name] = torch.stack([d[e] for e in sorted(d)])
    return out


def compare(model, expected: dict) -> list:
    """Problems: parameters that differ from what nanoflash meant, or that no pushed tensor covered."""
    import torch
    problems = []
    state = dict(model.named_parameters())
    state.update({n: b for n, b in model.named_buffers() if n.endswith("tid2eid")})
    for name, p in state.items():
        if name.endswith(NOT_PUSHED):
            continue
        if name not in expected:
            problems.append(f"not covered by the push: {name}")
            continue
        want = expected[name]
        if tuple(want.shape) != tuple(p.shape):
            problems.append(f"{name}: shape {tuple(p.shape)} vs meant {tuple(want.shape)}")
        elif p.dtype == torch.float8_e4m3fn:
            if want.dtype != p.dtype or not torch.equal(p.data.view(torch.uint8), want.view(torch.uint8)):
                problems.append(f"{name}: FP8 bytes differ (meant dtype {want.dtype})")
        elif not torch.equal(p.data, want.to(p.dtype)):
            problems.append(f"{name}: max |diff| {float((p.data.float() - want.float()).abs().max()):.3g}")
    problems += [f"meant but absent in SGLang: {n}" for n in sorted(set(expected) - set(state))]
    return problems


def via_payload(bucket: list) -> list:
    """The colocated path: our `sglang_flattened_payload`, then what SGLang's server does with it
    (`MultiprocessingSerializer.deserialize` with its safe unpickler, `FlattenedTensorBucket.reconstruct_tensors`)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    from nanoflash.sglang.transports import sglang_flattened_payload
    payload = sglang_flattened_payload(bucket)
    data = MultiprocessingSerializer.deserialize(payload["serialized_named_tensors"][0])
    fb = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    named = fb.reconstruct_tensors()
    if [n for n, _ in named] != [n for n, _ in bucket]:
        raise AssertionError("flattened bucket changed the tensor order")
    return named


def run_check(fp8: bool, bucket_bytes: int) -> int:
    import torch
    from nanoflash.config import ModelConfig
    from nanoflash.model import Transformer
    from nanoflash.sglang.transports import iter_sglang_buckets
    cfg = ModelConfig(**SMALL)
    trainer = Transformer(cfg).init_weights(0)
    g = torch.Generator().manual_seed(1)
    trainer.layers["0"].ffn.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, (cfg.vocab_size, 2), generator=g))
    if not fp8:
        trainer.cast_(torch.bfloat16)
    model = sglang_model(cfg, fp8)
    failures, tag = 0, "fp8" if fp8 else "bf16"
    for update in (1, 2):
        buckets = list(iter_sglang_buckets(trainer, fp8=fp8, bucket_bytes=bucket_bytes))
        for b in buckets:  # update 2 travels as SGLang's own pickled FlattenedTensorBucket payload
            model.load_weights(iter(via_payload(b) if update == 2 else b))  # what every live update ends in
        problems = compare(model, meant(buckets))
        n = sum(1 for _ in model.parameters())
        print(f"[{tag} update {update}] {len(buckets)} buckets, {n} SGLang parameters, {len(problems)} problem(s)")
        for p in problems[:20]:
            print("   ", p)
        failures += len(problems)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)
    # negative control: a push that forgets tid2eid (SGLang only warns) must be reported by the comparison
    forgot = [[(n, t) for n, t in b if "tid2eid" not in n]
              for b in iter_sglang_buckets(trainer, fp8=fp8, bucket_bytes=bucket_bytes)]
    for b in forgot:
        model.load_weights(iter(b))
    caught = [p for p in compare(model, meant(forgot)) if "tid2eid" in p]
    print(f"[{tag} control] push without tid2eid -> {'caught: ' + caught[0] if caught else 'NOT CAUGHT'}")
    # second control: the trap the bucket packer avoids -- wq_a and wkv in two load_weights calls
    sent = {n: t for b in iter_sglang_buckets(trainer, fp8=fp8, bucket_bytes=bucket_bytes) for n, t in b}
    qa, kv = "model.layers.1.self_attn.wq_a.weight", "model.layers.1.self_attn.wkv.weight"
    try:
        model.load_weights(iter([(qa, sent[qa])]))
        model.load_weights(iter([(kv, sent[kv])]))
        split_refused = False
    except AssertionError:
        split_refused = True
    print(f"[{tag} control] wq_a and wkv in separate load calls -> "
          f"{'SGLang asserts (so the pair must share a bucket)' if split_refused else 'accepted'}")
    return failures + (0 if caught else 1)


def sglang_kernel_hash(t):
    """SGLang's own `gpu_tensor_hash` kernels (0.5.16 `kernels/ops/memory/gpu_tensor_hash.py`), run by Triton's
    interpreter on the CPU: its body without the `is_cuda` assert."""
    import torch
    import triton
    import sglang.kernels.ops.memory.gpu_tensor_hash as H
    tb = t.contiguous().reshape(-1).view(torch.uint8)
    tb = torch.cat([tb, tb.new_zeros(-tb.numel() % 4)])
    u32, seed = tb.view(torch.uint32), 0x243F6A88
    cur = torch.empty(triton.cdiv(u32.numel(), 8192), dtype=torch.uint64)
    H.hash_tiles32_kernel_blocked[(cur.numel(),)](
        u32, cur, u32.numel(), seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=H.FMIX32_C1, FM_C2=H.FMIX32_C2, POS_A=H.POS_C1, POS_B=H.POS_C2, TILE=8192, BLOCK=256, USE_CG=False)
    while cur.numel() > 1:
        nxt = torch.empty(triton.cdiv(cur.numel(), 1024), dtype=torch.uint64)
        H.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=1024)
        cur = nxt
    return f"{H._final_splitmix64(int(cur.view(torch.int64).item())):016x}"


def run_hash_check() -> int:
    """nanoflash's reproduction of SGLang's `/weights_checker` value (layout.sglang_hash, _comparable) against
    SGLang's own kernels and its FP8 dequantization (`Fp8BlockComparable`), fused-expert shapes included."""
    import torch
    from sglang.srt.utils.weight_checker_comparator import Fp8BlockComparable
    from nanoflash.quant import quantize_fp8_block
    from nanoflash.sglang.layout import _comparable, sglang_hash
    g, bad = torch.Generator().manual_seed(0), 0
    for numel, dt in [(5, torch.float32), (3, torch.bfloat16), (8192 * 2 + 77, torch.bfloat16),
                      (9001, torch.float8_e4m3fn), (300000, torch.bfloat16)]:
        t = (torch.randn(numel, generator=g) * 3).to(dt)
        ok = sglang_kernel_hash(t) == sglang_hash(t)
        bad += not ok
        print(f"[hash] {numel} x {dt}: {'equal' if ok else 'DIFFERENT'}")
    qs = [quantize_fp8_block(torch.randn(256, 384, generator=g), fmt="fp32") for _ in range(3)]  # [E, 2I, D]
    q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
    ours, theirs = _comparable({"w": q, "w_scale_inv": s}, "w"), Fp8BlockComparable(q, s).dequantize()
    ok = torch.equal(ours.view(torch.int16), theirs.view(torch.int16)) \
        and sglang_hash(ours) == sglang_kernel_hash(theirs)
    print(f"[hash] stacked FP8 experts [3, 256, 384] dequantized and hashed: {'equal' if ok else 'DIFFERENT'}")
    return bad + (not ok)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-env", default=None, help="create this venv (if missing) and re-run inside it")
    ap.add_argument("--sglang", default="0.5.23", choices=sorted(PINS))
    ap.add_argument("--bucket-bytes", type=int, default=4 << 20)
    ap.add_argument("--hash", action="store_true", help=argparse.SUPPRESS)   # the interpreted-Triton part
    args = ap.parse_args(argv)
    if args.hash:
        sys.exit(1 if run_hash_check() else 0)
    if args.build_env:
        py = os.path.join(args.build_env, "bin", "python")
        if not os.path.exists(py):
            build_env(args.build_env, args.sglang)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        cmd = [py, "-m", "instruments.loader_check", "--sglang", args.sglang, "--bucket-bytes",
               str(args.bucket_bytes)]
        sys.exit(subprocess.run(cmd, env=env).returncode)
    import logging
    logging.disable(logging.WARNING)  # SGLang warns "weights not initialized" for every partial bucket
    os.environ.setdefault("SGLANG_OPT_USE_TILELANG_MHC_PRE", "0")   # else load_weights JIT-compiles GPU kernels
    os.environ["SGLANG_OPT_FP8_WO_A_GEMM"] = "0"                     # Miles' setting: wo_a BF16, re-loadable
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29633", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    failures = sum(run_check(fp8=fp8, bucket_bytes=args.bucket_bytes) for fp8 in (False, True))
    env = dict(os.environ, TRITON_INTERPRET="1")   # SGLang's hash kernels on the CPU (a process of their own)
    failures += subprocess.run([sys.executable, "-m", "instruments.loader_check", "--hash"], env=env).returncode
    print("OK: every SGLang parameter is what nanoflash meant" if failures == 0 else f"FAILED: {failures} problem(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
