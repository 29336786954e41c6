"""Memory planner: a dry run of a PP x EP x DP layout on the meta device, per GPU, per rank's host share, per node.

    python -m nanoflash.parallel.planner --preset flash --pp 4 --ep 4 --recompute --offload
    python -m nanoflash.parallel.planner --preset small --pp 1 --ep 1 --recompute selective

Per rank (pp_rank, ep_rank; DP replicas are equal) it counts, from the parameter names of a model built on
`meta` and the same ownership rules as `build_stage` / `apply_expert_parallel`, every term below. GPU:

    weights     numel x element size after `model.cast_(bf16)` (fp32 where the official model keeps fp32)
    grads       trainable numel x the gradient dtype: autograd accumulates micro-batches into `.grad` in the
                parameter's dtype (bf16), no fp32 main-grad (`grad_dtype=fp32` counts one: ~+37 GiB at flash)
    optimizer   fp32 master + Adam m, v = 12 bytes per trainable param (8 if the param is fp32); host w/ offload
    activations per in-flight micro-batch of T = micro_batch_tokens tokens in sequences of `seq_len` (default:
                one sequence, the worst case); 1F1B keeps pp - pp_rank micro-batches alive on stage pp_rank.
                recompute=full: the stored layer inputs h [T,M,D] per layer, plus one layer's full activations
                (the layer being recomputed); none: every layer's full activations; sub-blocks (selective,
                or a list): every layer's activations measured under that policy (what its checkpoints keep
                plus what the other ops save), plus the most one layer's recomputed sub-blocks rebuild
                (its full minus its policy activations: a bound, they are rebuilt one at a time)
    imbalance   EP > 1: the busiest EP rank receives `imbalance` x its share of routed rows; the extra rows'
                expert activations (x, w1 x, w3 x, swiglu: K (D + 3 I) per token) in every full layer (recompute
                "experts": K D per token, their kept inputs, plus one layer rebuilt)
    a2a         EP > 1: one MoE exchange in flight: send [T K, D] + receive imbalance x [T K, D], with weights
    backward    the stream gradients in and out of the layer in backward (2 x [T,M,D]); on the last stage
                the chunked head's fp32 logits, turned in place into their gradient ([1024, V]), and the
                chunk's fp32 weight gradient ([V, D], before autograd adds it to the head's)
    clip        `grad_norm`: g.float().square() of the largest gradient tensor the rank holds
    opt step    fp32 gradient casts: on device a batch of >= one chunk (`optim.HOST_CHUNK_ELEMS`) plus its last
                tensor; offloaded one piece (<= a chunk) at a time
    nccl        NCCL_COMM_BYTES per communicator the rank joins (assumption: not measurable on one GPU)
    push        a push source (dp 0, ep 0 of each stage) or EP peer: `planner.live_budget` buckets
    engine      an embedded rollout engine on rank 0's GPU (the `gpu` recipe): its fp32 (bf16) model copy,
                the loader store of the pushed layout (built on the GPU at start-up; HTTP pushes then land
                it on the host, so it is counted on both; transport=local keeps it on the GPU), its decode
                cache; batched eval's logits

Host, per rank: the offloaded optimizer state (pageable), its pinned staging (2 slots per direction of one
chunk), push payloads (transport=tensor to embedded servers: safetensors + base64 + JSON on both ends;
disk: blob + base64; gloo: the bucket), the embedded engine's loader store (HTTP pushes land on the host) or
whole engine on a CPU, rank 0's TEMPORARY full fp32 copy (`trainer.gather_full_state` + shadow model, world
> 1), rank 0's rollout data (`rollout_bytes`: every sample of a step's rounds as Python lists, the R3 records of
the kept groups in the smallest integer type of the expert count, the packed global batch, the R3 payloads
being decoded) and HOST_PROCESS_BYTES of Python / torch / CUDA runtime. Per node: the ranks of the grid order
(grid = arange(world).view(pp, dp, ep)) that share `gpus_per_host`.

A layer's activations are *measured*, not guessed: `measure_layer_bytes` runs one Block of the config
(with only n_activated + 2 routed experts, which does not change the per-token activations beyond the gate
scores), under a recompute policy, at two lengths, counts the bytes of every storage its ops allocated that is
still alive after the forward (`Allocations`: saved tensors, checkpoint inputs, module state; the block's input
when it is kept, never its output, which is the next layer's input) and fits bytes(S) = a S + b pairs(S), where pairs(S)
counts the (query, key) pairs of nanoflash's dense masked attention (window slice per query chunk plus all
S / ratio compressed keys): that term dominates at 8K tokens and is where nanoflash pays for not having the
official sparse-gather kernel. `MEASURED_FLASH` holds the fit for `flash` (bf16, see `--measure`), so the
default run needs no compute. The CUDA context (CUDA_CONTEXT_BYTES) is outside torch's allocator and so
outside the measured `max_memory_allocated`: reported, not added. Allocator fragmentation is not counted.

Predicted vs measured on one GPU: `bench/gpu_recipe.py` (the `gpu` recipe; status in docs/benchmarks.md B11).
Tests: `pytest tests/test_parallel_planner.py -q` (each term against a hand count on tiny).
"""
from __future__ import annotations

import argparse
import dataclasses
import textwrap

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanoflash.grpo import expert_id_dtype
from nanoflash.names import official_parameters, storage_kind
from nanoflash.config import ParallelConfig, preset, recompute_blocks
from nanoflash.model import FP32_KEYS, Block, Transformer, c4_layers, init_param_, set_recompute
from nanoflash.parallel.expert import EXPERT_KEY, expert_range
from nanoflash.parallel.optim import ALIGN, HOST_CHUNK_ELEMS, is_frozen
from nanoflash.parallel.pipeline import LAST_STAGE_MODULES, LAST_STAGE_PARAMS, split_layers

LIVE_BUCKETS = 3                 # a push holds: the bucket on the wire, the one being built, the verification copy
STORAGE_BYTES = {"fp8": 1.0, "fp4": 0.5, "bf16": 2.0, "fp32": 4.0, "int64": 8.0}  # per element, release storage

GIB = 2 ** 30
# bytes(S) = a*S + b*pairs(S) of one layer's saved activations, bf16 weights, per compress ratio (0 / 4 / 128):
# `measure_layer_bytes(preset("flash"), (4096, 8192), device="cuda")` on one H200, 2026-11-29
# (bench/parallel_memory.py). A CPU fit at (512, 1024) agreed within 8%. The same method on the `small`
# preset predicted its measured T=4096 activations (no recompute) within 1% (51.1 vs 50.7 GiB).
MEASURED_FLASH: dict[int, tuple[float, float]] = {0: (1350174, 491.5), 4: (1387244, 511.81), 128: (1405243, 465.76)}
# Assumptions, not measured here (each is a knob of `Setup` or a constant you may change):
ROUTING_IMBALANCE = 1.5   # busiest EP rank's routed rows / the mean; aux-loss-free balancing keeps it near 1-1.5
NCCL_COMM_BYTES = 256 * 2 ** 20  # NCCL_BUFFSIZE 4 MiB x 2 directions x 32 channels, per communicator
CUDA_CONTEXT_BYTES = 600 * 2 ** 20  # CUDA context + cuBLAS workspace on an H200: outside torch's allocator
HOST_PROCESS_BYTES = 3 * GIB  # Python + torch + CUDA runtime resident per process (bench/gpu_recipe.py measures it)
HEAD_CHUNK = 1024         # tokens per chunk of `model.chunked_logprobs`
# Host copies of one push bucket: tensor (embedded server, one process) = CPU copy + safetensors blob + base64 +
# JSON body on the sender (1 + 1 + 4/3 + 4/3), JSON string + decoded blob + tensors on the receiver (4/3 + 1 + 1);
# disk = the blob written + the tensors read back; gloo = the bucket on the CPU; nccl = none. Estimates.
# local = a handle to the GPU tensors (in-process embedded server): none.
PUSH_HOST_FACTOR = {"tensor": 8.0, "local": 0.0, "disk": 2.0, "gloo": 1.0, "nccl": 0.0}
# Rank 0's rollout data, per token (rollout_bytes). CPython: a list holds an 8-byte pointer per item, an int
# object outside the small-int cache (token ids > 256) is 28 bytes, a float 24: 36 bytes a token id, 32 a log-prob.
# The packed batch [B,S]: input_ids and targets int64, mask, rollout / old log-probs and advantages fp32.
PY_TOKEN_BYTES, PY_LOGPROB_BYTES, PACKED_TOKEN_BYTES = 36, 32, 8 + 8 + 4 + 4 + 4 + 4
# An R3 payload being decoded (sglang.client.decode_routed_experts): base64 text of int32 ids (4 x 4/3), the
# int32 array, the int64 tensor before the cast to the record's type: bytes per expert id.
R3_DECODE_BYTES = 4 * 4 / 3 + 4 + 8
PROMPT_TOKENS = 512  # assumption: tokens of one prompt (DAPO-Math prompts in V4's chat format are ~100-300)


@dataclasses.dataclass
class Setup:
    """What besides the layout decides memory. Defaults: external SGLang servers, NCCL weight push."""
    grad_dtype: torch.dtype | None = None   # `.grad` dtype; None = the parameter's (what autograd does)
    seq_len: int | None = None              # tokens per sequence in a micro-batch; None = one of T tokens
    imbalance: float = ROUTING_IMBALANCE
    chunk_elems: int = HOST_CHUNK_ELEMS      # optimizer chunk (offload staging, fp32 casts)
    push: str = "nccl"                      # tensor | local | disk | gloo | nccl: where one push bucket is copied
    bucket_bytes: int = 1 << 30
    engine: str = ""                        # embedded engine weights on rank 0 (fp8 | bf16 | fp32), "" = none
    engine_on_gpu: bool = True
    engine_tokens: int = 0                  # decode rows x max sequence length of one engine request
    eval_logit_rows: int = 0                # batched in-process eval: rows x positions of one forward
    full_copy: bool = False                 # rank 0 holds a gathered fp32 copy + shadow model (world > 1)
    shadow_on_gpu: bool = False             # ... its shadow model on the GPU (ranks colocated on one GPU)
    gpus_per_host: int = 8
    rollout: dict | None = None             # rank 0's rollout shape (`rollout_shape`); None = not counted


def setup_from_run(cfg, mcfg, world: int, gpus_per_host: int = 8) -> Setup:
    """The `Setup` a `RunConfig` implies (train.py's choices: embedded engines when no urls, the gather)."""
    rc, ec, gc, par = cfg.rollout, cfg.eval, cfg.grpo, cfg.parallel
    embedded = not rc.urls
    push = rc.transport if rc.transport != "distributed" else ("nccl" if par.device != "cpu" else "gloo")
    batched = embedded and ec.every and ec.path in ("auto", "batched")
    if par.colocate_ranks and rc.transport == "distributed":
        push = "gloo"   # ranks sharing one GPU push over gloo (sglang.push)
    return Setup(push=push, bucket_bytes=rc.bucket_bytes, engine=rc.weights if embedded else "",
                 engine_on_gpu=par.device != "cpu", engine_tokens=max(gc.group_size, ec.k_samples) * mcfg.max_seq_len,
                 eval_logit_rows=min(max(ec.n_problems, 1) * ec.k_samples, 1024) * mcfg.max_seq_len if batched else 0,
                 full_copy=world > 1 and (embedded or bool(ec.every)), gpus_per_host=gpus_per_host,
                 shadow_on_gpu=par.colocate_ranks and par.device != "cpu",
                 rollout=rollout_shape(cfg, mcfg))


def rollout_shape(cfg, mcfg) -> dict:
    """What rank 0 holds of one step's rollout, from the run's config (`collector.collect`): rounds of
    `prompts` prompts (`grpo.prompts_to_request`: whole over-sampling chunks), n samples each, sequences of at
    most PROMPT_TOKENS + max_new_tokens (capped at the model's max_seq_len), G groups packed."""
    gc, rc = cfg.grpo, cfg.rollout
    chunk = gc.over_sampling_batch_size
    return {"prompts": chunk * -(-gc.n_prompts // chunk), "group_size": gc.group_size, "rounds": rc.max_rounds,
            "kept": gc.n_prompts, "prompt_tokens": min(PROMPT_TOKENS, mcfg.max_seq_len - 1),
            "response_tokens": min(rc.max_new_tokens, mcfg.max_seq_len - 1), "replay": rc.routing_replay,
            "indexer_replay": rc.indexer_replay, "in_flight": rc.max_workers}


def rollout_bytes(cfg, shape: dict) -> dict:
    """Rank 0's host bytes of one step's rollout (a bound), by term:
        episodes   every sample of every round, ids and log-probs as Python lists (a prompt's ids shared by its n
                   samples): rounds x prompts x (P x 36 + n x R x (36 + 32))
        r3         R3 records of the kept groups, [P+R-1, n_layers, K] in `grpo.expert_id_dtype`; at worst a round
                   keeps every group: (prompts + G) x n samples
        indexer    indexer-replay records likewise, [P+R-1, n_c4, index_topk] entries + 1 in int16 (int32 past
                   2^15 entries, `grpo.entry_record`)
        batch      the packed global batch of G x n rows of P+R-1 positions (PACKED_TOKEN_BYTES, + the records)
        decoding   replay payloads of the requests in flight (rollout.max_workers) being decoded (R3_DECODE_BYTES
                   an id: both records arrive as base64 int32 and are decoded through int64)
    with P prompt and R response tokens a sample. `cfg`: the ModelConfig (n_layers, top-k, experts, C4 layers)."""
    P, R, n = shape["prompt_tokens"], shape["response_tokens"], shape["group_size"]
    T = min(P + R, cfg.max_seq_len) - 1   # positions of a sample's record and packed row
    ids = cfg.n_layers * cfg.n_activated_experts if shape["replay"] else 0   # R3 ids per position
    id_bytes = expert_id_dtype(cfg.n_routed_experts).itemsize
    entries = len(c4_layers(cfg)) * cfg.index_topk if shape.get("indexer_replay") else 0   # indexer entries a position
    entry_bytes = 2 if cfg.max_seq_len // 4 < 2 ** 15 else 4
    per_pos = ids * id_bytes + entries * entry_bytes
    return {"episodes": shape["rounds"] * shape["prompts"] * (P * PY_TOKEN_BYTES + n * R * (PY_TOKEN_BYTES
                                                                                            + PY_LOGPROB_BYTES)),
            "r3": (shape["prompts"] + shape["kept"]) * n * T * ids * id_bytes,
            "indexer": (shape["prompts"] + shape["kept"]) * n * T * entries * entry_bytes,
            "batch": shape["kept"] * n * T * (PACKED_TOKEN_BYTES + per_pos),
            "decoding": shape["in_flight"] * n * T * (ids + entries) * R3_DECODE_BYTES}


def owner(name: str, cfg, pp: int, ep: int, layer_split=None) -> tuple[int | None, int | None]:
    """(pipeline stage, EP rank) holding parameter `name`; None means "every one" on that axis."""
    parts = name.split(".")
    ep_rank = None
    if EXPERT_KEY in name:
        e = int(name.split(EXPERT_KEY)[1].split(".")[0])
        ep_rank = next(r for r in range(ep) if e in expert_range(cfg.n_routed_experts, ep, r))
    if parts[0] == "layers":
        stage = next(s for s, ids in enumerate(split_layers(cfg.n_layers, pp, layer_split)) if int(parts[1]) in ids)
    elif parts[0] == "embed":
        stage = 0
    elif parts[0] in LAST_STAGE_MODULES or parts[0] in LAST_STAGE_PARAMS:
        stage = pp - 1
    else:
        raise ValueError(f"planner: no pipeline-stage rule for parameter {name!r}")
    return stage, ep_rank


def attention_pairs(cfg, ratio: int, S: int) -> int:
    """(query, key) pairs of nanoflash's dense masked attention on one S-token sequence: each query chunk
    sees its window slice [a-W+1, b) and all S // ratio compressed entries (masked, but materialised)."""
    pairs = 0
    for a in range(0, S, cfg.attn_chunk):
        b = min(a + cfg.attn_chunk, S)
        pairs += (b - a) * ((b - max(a - cfg.window_size + 1, 0)) + (S // ratio if ratio else 0))
    return pairs


def layer_act_bytes(cfg, ratio: int, tokens: int, fit: dict, seq_len: int | None = None) -> float:
    """Saved activations of one layer for `tokens` tokens in sequences of `seq_len` (None: one sequence)."""
    a, b = fit[ratio]
    s = min(seq_len or tokens, tokens)
    return a * tokens + b * attention_pairs(cfg, ratio, s) * tokens / s


def _count_params(model, cfg, par, train_mtp: bool) -> dict:
    """{(stage, ep_rank): param / grad-able / optimizer counts and the largest real tensor it holds}."""
    rows = {(s, e): dict(pp_rank=s, ep_rank=e, params=0, param_bytes=0, trainable=0, trainable_bytes=0,
                         optim_bytes=0, dtypes=set(), largest=0) for s in range(par.pp) for e in range(par.ep)}
    for name, p in official_parameters(model):  # stacked experts by their official per-expert names
        stage, ep_rank = owner(name, cfg, par.pp, par.ep, par.layer_split)
        for e in ([ep_rank] if ep_rank is not None else range(par.ep)):
            r = rows[(stage, e)]
            r["params"] += p.numel()
            r["param_bytes"] += p.numel() * p.element_size()
            if not is_frozen(name, train_mtp):
                r["dtypes"].add(p.dtype)
                r["trainable"] += p.numel()
                r["trainable_bytes"] += p.numel() * p.element_size()
                r["optim_bytes"] += p.numel() * (8 if p.dtype == torch.float32 else 12)
    for name, p in model.named_parameters():  # the real tensors (an EP rank's expert stack is E/ep of one)
        if is_frozen(name, train_mtp):
            continue
        key = ".".join(name.split(".")[:2]) + ".w" if name.startswith("layers.") else name  # its stage only
        stage, _ = owner(key, cfg, par.pp, 1, par.layer_split)
        n = p.numel() // par.ep if ".experts." in name else p.numel()
        for e in range(par.ep):
            rows[(stage, e)]["largest"] = max(rows[(stage, e)]["largest"], n)
    return rows


def stage_act_bytes(cfg, recompute, layers, T: int, fit: dict, recompute_fit: dict | None = None,
                    seq_len: int | None = None, elem: int = 2) -> tuple[float, float]:
    """(bytes one micro-batch keeps after the forward of `layers`, the most backward rebuilds at once) under a
    `ParallelConfig.recompute` value. `fit`: the layers' full activations (no recompute); `recompute_fit`: the
    fit measured under the sub-block policy (`measure_layer_bytes(..., recompute=)`), needed for one."""
    blocks = recompute_blocks(recompute)
    full = [layer_act_bytes(cfg, cfg.compress_ratios[i], T, fit, seq_len) for i in layers]
    if "layer" in blocks:   # checkpointed layers keep their input h [T,M,D]; backward rebuilds one layer
        return len(layers) * T * cfg.hc_mult * cfg.dim * elem, max(full)
    if not blocks:
        return sum(full), 0.0
    if recompute_fit is None:
        raise ValueError(f"planner: recompute={recompute!r} needs the activation fit measured under it "
                         f"(measure_layer_bytes(cfg, recompute={recompute!r}))")
    kept = [layer_act_bytes(cfg, cfg.compress_ratios[i], T, recompute_fit, seq_len) for i in layers]
    return sum(kept), max(max(f - k for f, k in zip(full, kept)), 0.0)


def _activations(cfg, par, setup: Setup, fit: dict, s: int, layers, dtype, recompute_fit=None) -> dict:
    """GPU activation terms of stage s: stored / recomputed layers, routing imbalance, a2a, backward."""
    T, M, D, K, elem = par.micro_batch_tokens, cfg.hc_mult, cfg.dim, cfg.n_activated_experts, dtype.itemsize
    in_flight = par.pp - s  # 1F1B, assuming at least pp micro-batches per step
    kept, rebuilt = stage_act_bytes(cfg, par.recompute, layers, T, fit, recompute_fit, setup.seq_len, elem)
    blocks, routed = recompute_blocks(par.recompute), K * (D + 3 * cfg.moe_inter_dim) * elem   # per token
    if "layer" in blocks:
        extra_rows = routed                                            # the one layer being recomputed
    elif "experts" in blocks:
        extra_rows = in_flight * len(layers) * K * D * elem + routed   # kept inputs + one layer's experts rebuilt
    else:
        extra_rows = in_flight * len(layers) * routed
    ep_extra = par.ep > 1
    out = {"activations": in_flight * kept + rebuilt,
           "imbalance": (setup.imbalance - 1) * T * extra_rows * ep_extra,
           "a2a": (1 + setup.imbalance) * T * K * (D * elem + 4) * ep_extra,
           "backward": 2 * T * M * D * elem + ((min(T, HEAD_CHUNK) + D) * cfg.vocab_size * 4 if s == par.pp - 1 else 0)}
    return out


def _communicators(par, source: bool, push: str) -> int:
    """NCCL communicators a rank joins: the world; PP neighbours (send + recv); EP; DP; the stage's data
    group (when it is neither EP nor DP alone); the weight-update group of a push source."""
    dp = par.dp or 1
    return (1 + 2 * (par.pp > 1) + (par.ep > 1) + (dp > 1) + (dp > 1 and par.ep > 1)
            + (source and push == "nccl"))


def live_budget(bucket_bytes: int, ep: int, scratch: int) -> int:
    """Bytes a rank may hold beyond its own shard during a push: bucket k on the wire, bucket k+1 being built
    (with EP: the gather buffer plus this rank's own sub-bucket, 1 + 1/ep buckets), the verification copy of
    one bucket; plus the quantizer's scratch (`quant.quant_scratch_bytes`: bounded, 0 on the GPU).
    `bucket_bytes` is the largest bucket (a unit larger than the configured size travels alone). The pusher
    (`sglang.push`) holds itself to this bound; its tests measure it."""
    return int((LIVE_BUCKETS + 1 / ep) * bucket_bytes) + scratch


def _push_gpu(bucket: int, ep: int) -> int:
    """Buckets a rank holds during a push (built and quantized on its GPU for every transport)."""
    return live_budget(bucket, ep, 0)


def _engine(cfg, setup: Setup, full_params: int, push_bytes: float) -> tuple[float, float]:
    """(model copy + decode cache + batched-eval logits, loader store) of an embedded engine, bytes."""
    model = full_params * (2 if setup.engine == "bf16" else 4)
    store = push_bytes if setup.engine == "fp8" else model
    kv = setup.engine_tokens * cfg.n_layers * (cfg.head_dim + cfg.index_head_dim) * 4
    return model + kv + setup.eval_logit_rows * cfg.vocab_size * 4, store


def plan(cfg, par: ParallelConfig, fit: dict, dtype=torch.bfloat16, train_mtp: bool = False,
         model=None, setup: Setup | None = None, recompute_fit: dict | None = None) -> list[dict]:
    """One row per (pp_rank, ep_rank): every GPU term (`gpu_terms`, summed in `gpu_bytes`) and host term
    (`host_terms`, `host_bytes`) in bytes. `model`: a built full meta model of `cfg` to reuse (cast to `dtype`).
    `fit`: the activation fit without recompute; `recompute_fit`: under par.recompute's sub-block policy."""
    setup = setup or Setup()
    if model is None:
        with torch.device("meta"):
            model = Transformer(cfg)
    model.cast_(dtype)
    rows = _count_params(model, cfg, par, train_mtp)
    full = sum(p.numel() for p in model.parameters())
    push_bytes = _push_bytes(cfg) if setup.engine == "fp8" else 0
    layers = split_layers(cfg.n_layers, par.pp, par.layer_split)
    world = par.pp * par.ep * (par.dp or 1)
    for (s, e), r in rows.items():
        g_elem = (setup.grad_dtype or dtype).itemsize  # most gradients' element size
        grads = r["trainable"] * g_elem if setup.grad_dtype else r["trainable_bytes"]
        bucket = min(setup.bucket_bytes, r["param_bytes"])  # a bucket never exceeds what the rank sends
        chunk = min(setup.chunk_elems, r["trainable"])  # offload: one piece cast at a time; on device: a batch
        casts = 0 if g_elem == 4 else 4 * (min(chunk, r["largest"]) if par.offload_optimizer else chunk + r["largest"])
        gpu = {"weights": r["param_bytes"], "grads": grads,
               "optimizer": 0 if par.offload_optimizer else r["optim_bytes"],
               **_activations(cfg, par, setup, fit, s, layers[s], dtype, recompute_fit),
               "clip": r["largest"] * 4 * (1 if g_elem == 4 else 2), "opt_step": casts,
               "nccl": NCCL_COMM_BYTES * _communicators(par, e == 0, setup.push) * (world > 1)
               * (not par.colocate_ranks),   # colocated ranks run gloo: no NCCL communicator
               "push": _push_gpu(bucket, par.ep)}
        slot = min(setup.chunk_elems, max(ALIGN, -(-r["trainable"] // ALIGN) * ALIGN))  # as AdamW sizes it
        pinned = 2 * slot * (4 + sum(d.itemsize for d in r["dtypes"])) if par.offload_optimizer else 0
        host = {"optimizer": r["optim_bytes"] if par.offload_optimizer else 0, "pinned": pinned,
                "push": PUSH_HOST_FACTOR[setup.push] * bucket * (e == 0),
                "process": HOST_PROCESS_BYTES}
        if (s, e) == (0, 0):  # rank 0: the embedded engine, the TEMPORARY full copy
            model_b, store = _engine(cfg, setup, full, push_bytes) if setup.engine else (0, 0)
            shadow = 4 * full if setup.full_copy and setup.shadow_on_gpu else 0   # colocated: the shadow model
            gpu["engine"] = (model_b + store) * setup.engine_on_gpu + shadow     # sits on the shared GPU (train.py)
            lands_on_host = setup.push != "local" or not setup.engine_on_gpu  # local keeps the GPU tensors
            host["engine"] = store * lands_on_host + (0 if setup.engine_on_gpu else model_b)
            host["full_copy"] = (2 * 4 * full - shadow) if setup.full_copy else 0
            host["rollout"] = sum(rollout_bytes(cfg, setup.rollout).values()) if setup.rollout else 0
        once = host["push"] + host.get("engine", 0) + host.get("full_copy", 0) + host.get("rollout", 0)  # rank 0
        r.update(grad_bytes=grads, act_bytes=gpu["activations"], gpu_terms=gpu, host_terms=host, dp=par.dp or 1,
                 gpu_bytes=sum(gpu.values()), host_bytes=sum(host.values()),
                 replica_host_bytes=sum(host.values()) - once)
    return list(rows.values())


def rollout_weight_bytes(mcfg, push: bool = False) -> float:
    """Bytes of the released checkpoint's tensors (FP8 linears, FP4 experts, BF16/F32 rest; scales ignored),
    counted on a meta-built model: what one rollout engine must hold, split over its GPUs. push=True counts
    what a weight push sends instead: experts re-packed FP8 (one byte, as Miles on Hopper), no MTP block."""
    with torch.device("meta"):
        model = Transformer(mcfg)
    per = dict(STORAGE_BYTES, fp4=STORAGE_BYTES["fp8"] if push else STORAGE_BYTES["fp4"])
    return sum(t.numel() * per.get(storage_kind(n, mcfg), 2.0) for n, t in model.state_dict().items()
               if not (push and n.startswith("mtp.")))


def _push_bytes(cfg) -> float:
    return rollout_weight_bytes(cfg, push=True)   # FP8 blocks, experts FP8, no MTP: one push


def node_host_bytes(rows: list, par: ParallelConfig, gpus_per_host: int) -> list[float]:
    """Host bytes of each node: global rank r = grid[pp, dp, ep] lives on node r // gpus_per_host."""
    by = {(r["pp_rank"], r["ep_rank"]): r for r in rows}
    dp, nodes = par.dp or 1, {}
    for rank, (s, d, e) in enumerate((s, d, e) for s in range(par.pp) for d in range(dp) for e in range(par.ep)):
        r = by[(s, e)]  # a DP replica d > 0 holds no push payload, engine or full copy
        nodes[rank // gpus_per_host] = nodes.get(rank // gpus_per_host, 0) + (r["host_bytes"] if d == 0
                                                                              else r["replica_host_bytes"])
    return [nodes[k] for k in sorted(nodes)]


class Allocations(TorchDispatchMode):
    """Every storage the ops allocate while the mode is on (an output sharing an input's storage, a view or an
    in-place result, allocates none), held weakly with its size. `kept(*outputs)` sums the ones still alive but
    the outputs': what the autograd graph (saved tensors, checkpoint inputs) and module state hold after a
    forward -- on any device, the CPU's stand-in for `torch.cuda.memory_allocated`."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given:
                s = t.untyped_storage()
                self.storages[s._cdata] = (StorageWeakRef(s), s.nbytes())  # a weak ref pins the address
        return out

    def kept(self, *outputs) -> int:
        skip = {t.untyped_storage()._cdata for t in outputs}
        return sum(n for k, (ref, n) in self.storages.items() if k not in skip and not ref.expired())


def block_kept_bytes(block, h_in: torch.Tensor, ids: torch.Tensor) -> int:
    """Bytes one Block keeps for backward after its forward on `h_in` [B,S,M,D] (a leaf that requires grad):
    its input counted only if kept (it is made a fresh non-leaf inside), its output never."""
    with Allocations() as mem:
        h = h_in * 1                 # the graph holds the leaf h_in, not this copy, unless the block keeps it
        out = block(h, ids)
        del h
    return mem.kept(out)


def measure_layer_bytes(cfg, seq_lens=(128, 256), dtype=torch.bfloat16, device="cpu", recompute="none"
                        ) -> dict[int, tuple]:
    """Fit bytes(S) = a S + b pairs(S) of what one Block keeps for backward (`block_kept_bytes`) under the
    `recompute` sub-block policy (a `ParallelConfig.recompute` value), per compress ratio."""
    small = dataclasses.replace(cfg, n_routed_experts=cfg.n_activated_experts + 2, n_hash_layers=0)
    fit = {}
    for ratio in sorted(set(cfg.compress_ratios)):
        layer_id = cfg.compress_ratios.index(ratio)
        with torch.device(device):
            block = Block(layer_id, small)
        g = torch.Generator(device=device).manual_seed(ratio)  # seeded per ratio and per S: a measurement at
        with torch.no_grad():  # one S is the same in every call (routing decides the MoE's saved bytes)
            for name, p in block.named_parameters():
                init_param_(name, p, g)
        for name, p in block.named_parameters():   # as `Transformer.cast_`: fp32 where the official model keeps it
            if not any(k in name for k in FP32_KEYS):
                p.data = p.data.to(dtype)
        set_recompute(block, recompute)
        with torch.no_grad():  # first calls fill caches (rope frequencies) that must not count as activations
            block(torch.zeros(1, 8, cfg.hc_mult, cfg.dim, device=device, dtype=dtype),
                  torch.zeros(1, 8, dtype=torch.long, device=device))
        measured = []
        for S in seq_lens:
            g.manual_seed(S)
            h = torch.randn(1, S, cfg.hc_mult, cfg.dim, device=device, generator=g).to(dtype).requires_grad_()  # [B,S,M,D]
            measured.append(block_kept_bytes(block, h, torch.zeros(1, S, dtype=torch.long, device=device)))
        (s1, s2), (m1, m2) = seq_lens, measured  # solve m = a S + b pairs(S) at both lengths
        p1, p2 = attention_pairs(cfg, ratio, s1), attention_pairs(cfg, ratio, s2)
        b = (m2 * s1 - m1 * s2) / (p2 * s1 - p1 * s2)
        fit[ratio] = ((m1 - b * p1) / s1, b)
    return fit


# (term, column header, legend): every header is whole (no cut names) and explained under its table
GPU_COLS = (("weights", "weights", "the stage's parameters in the training dtype"),
            ("grads", "grads", "their gradients"),
            ("optimizer", "optim", "fp32 master + Adam m, v (0: offloaded to the host)"),
            ("activations", "acts", "kept for backward by the in-flight micro-batches (1F1B; recompute=full: "
                                    "layer inputs)"),
            ("imbalance", "imbal", "the busiest EP rank's extra routed rows"),
            ("a2a", "a2a", "one MoE all-to-all in flight"),
            ("backward", "bwd", "stream gradients of backward, the head's fp32 logits and weight gradient on the "
                                "last stage"),
            ("clip", "clip", "the gradient norm's fp32 square of the largest gradient"),
            ("opt_step", "step", "fp32 gradient casts of the optimizer step"),
            ("nccl", "nccl", "NCCL communicators"),
            ("push", "push", "weight-push buckets"),
            ("engine", "engine", "an embedded rollout engine on this GPU"))
HOST_COLS = (("optimizer", "optim", "the offloaded optimizer state"),
             ("pinned", "pinned", "its pinned staging"),
             ("push", "push", "push payloads"),
             ("engine", "engine", "an embedded engine's loader store or CPU model"),
             ("full_copy", "full", "rank 0's temporary full fp32 copy (world > 1)"),
             ("rollout", "rollout", "rank 0's rollout data of a step (episodes, R3 records, the packed batch)"),
             ("process", "proc", "Python / torch / CUDA runtime"))
LEGEND_WIDTH = 120


def legend(title: str, cols: tuple, total: str) -> list[str]:
    """The lines under a table that say what each column counts (module docstring: the exact terms)."""
    text = f"{title}: " + "; ".join(f"{h} = {what}" for _, h, what in cols) + f"; {total} = their sum"
    return textwrap.wrap(text, LEGEND_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _report(rows, cfg_name: str, par: ParallelConfig, setup: Setup) -> str:
    g = lambda b: f"{b / GIB:>7.1f}"  # noqa: E731
    grad = str(setup.grad_dtype or "the parameter dtype").replace("torch.", "")
    lines = [f"{cfg_name}: PP{par.pp} x EP{par.ep} x DP{par.dp or 1}, {par.micro_batch_tokens} tokens/micro-batch "
             f"(sequences of {setup.seq_len or par.micro_batch_tokens}), recompute={par.recompute}, "
             f"offload={par.offload_optimizer}, grads in {grad}, push via {setup.push}, embedded engine: "
             f"{setup.engine or 'none'}", "GPU per rank (GiB; params in billions):",
             f"{'pp':>3} {'ep':>3} {'params':>7}" + "".join(f"{h:>8}" for _, h, _ in GPU_COLS) + f"{'GPU':>8}"]
    for r in rows:
        t = r["gpu_terms"]
        lines.append(f"{r['pp_rank']:>3} {r['ep_rank']:>3} {r['params'] / 1e9:>7.2f}"
                     + "".join(" " + g(t.get(c, 0)) for c, _, _ in GPU_COLS) + " " + g(r["gpu_bytes"]))
    lines += legend("columns", (("params", "params", "this rank's parameters (billions)"),) + GPU_COLS, "GPU")
    lines += ["host per rank (GiB):",
              f"{'pp':>3} {'ep':>3}" + "".join(f"{h:>8}" for _, h, _ in HOST_COLS) + f"{'host':>8}"]
    for r in rows:
        t = r["host_terms"]
        lines.append(f"{r['pp_rank']:>3} {r['ep_rank']:>3}" + "".join(" " + g(t.get(c, 0)) for c, _, _ in HOST_COLS)
                     + " " + g(r["host_bytes"]))
    lines += legend("columns", HOST_COLS, "host")
    nodes = node_host_bytes(rows, par, setup.gpus_per_host)
    lines.append(f"max per GPU: {max(r['gpu_bytes'] for r in rows) / GIB:.1f} GiB (+ {CUDA_CONTEXT_BYTES / GIB:.1f} "
                 f"GiB CUDA context, + fragmentation); host per node ({setup.gpus_per_host} GPUs): "
                 + ", ".join(f"{b / GIB:.0f}" for b in nodes) + " GiB")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: one of T)")
    ap.add_argument("--recompute", nargs="?", const="full", default="none",
                    help="none | full (the bare flag) | selective | a comma list of config.RECOMPUTE_BLOCKS")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--grad-dtype", choices=("param", "fp32"), default="param")
    ap.add_argument("--push", choices=sorted(PUSH_HOST_FACTOR), default="nccl")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--imbalance", type=float, default=ROUTING_IMBALANCE)
    ap.add_argument("--gpus-per-host", type=int, default=4)
    ap.add_argument("--measure", action="store_true", help="measure the activation fit instead of MEASURED_FLASH")
    a = ap.parse_args(argv)
    cfg = preset(a.preset)
    par = ParallelConfig(pp=a.pp, ep=a.ep, dp=a.dp, micro_batch_tokens=a.micro_batch_tokens,
                         recompute=a.recompute, offload_optimizer=a.offload)
    setup = Setup(grad_dtype=torch.float32 if a.grad_dtype == "fp32" else None, seq_len=a.seq_len,
                  imbalance=a.imbalance, push=a.push, bucket_bytes=a.bucket_bytes, gpus_per_host=a.gpus_per_host)
    text = report(cfg, a.preset, par, setup, measure=a.measure)
    print(text)
    return text


def report(cfg, name: str, par: ParallelConfig, setup: Setup, measure: bool = False) -> str:
    """The planner's tables for a model config `cfg` (preset `name`) under `par` and `setup`: flash from
    MEASURED_FLASH, any other preset (or `measure`) from an activation fit measured here on the CPU; a sub-block
    recompute policy always from a fit measured here under it."""
    fit = MEASURED_FLASH if (name == "flash" and MEASURED_FLASH and not measure) else measure_layer_bytes(cfg)
    blocks = recompute_blocks(par.recompute)
    rfit = measure_layer_bytes(cfg, recompute=par.recompute) if blocks and "layer" not in blocks else None
    if measure:
        print("activation fit bytes(S) = a*S + b*pairs(S) per ratio:", {k: (round(x), round(y, 2)) for k, (x, y) in fit.items()})
    return _report(plan(cfg, par, fit, setup=setup, recompute_fit=rfit), name, par, setup)


if __name__ == "__main__":
    main()
