"""Planner: its ownership rules agree with what build_stage + apply_expert_parallel really keep, its byte
counts add up, and the flash PP4 x EP4 plan covers every parameter once. Run: pytest tests/test_parallel_planner.py -q"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from nanoflash.cli import parse_args
from nanoflash.parallel.planner import rollout_weight_bytes
from nanoflash.config import ParallelConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.expert import apply_expert_parallel
from nanoflash.parallel.optim import is_frozen, trainable_parameters
from nanoflash.parallel.pipeline import build_stage
from nanoflash.parallel import planner as pl
from nanoflash.parallel.planner import attention_pairs, layer_act_bytes, measure_layer_bytes, plan

ZERO_FIT = {r: (0.0, 0.0) for r in (0, 4, 8, 128)}


def _fake_dims(pp, pp_rank, ep, ep_rank):
    return SimpleNamespace(pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank, ep_group=None,
                           is_first_stage=pp_rank == 0, is_last_stage=pp_rank == pp - 1)


def test_plan_matches_real_stages_tiny():
    cfg, par = preset("tiny"), ParallelConfig(pp=2, ep=2, layer_split=(1, 3))
    rows = {(r["pp_rank"], r["ep_rank"]): r for r in plan(cfg, par, ZERO_FIT, dtype=torch.float32)}
    for s in range(2):
        for e in range(2):
            with torch.device("meta"):
                model = Transformer(cfg)
            build_stage(apply_expert_parallel(model, _fake_dims(2, s, 2, e)), _fake_dims(2, s, 2, e), (1, 3))
            n = sum(p.numel() for p in model.parameters())
            trainable = sum(p.numel() for name, p in model.named_parameters() if not is_frozen(name))
            assert rows[(s, e)]["params"] == n, (s, e)
            assert rows[(s, e)]["grad_bytes"] == 4 * trainable and rows[(s, e)]["optim_bytes"] == 8 * trainable


def test_flash_pp4_ep4_covers_every_parameter_once():
    cfg = preset("flash")
    with torch.device("meta"):
        full = Transformer(cfg)
    rows = plan(cfg, ParallelConfig(pp=4, ep=4, recompute=True, offload_optimizer=True), ZERO_FIT, model=full)
    expert = sum(p.numel() for n, p in full.named_parameters() if ".ffn.experts." in n)
    dense = sum(p.numel() for p in full.parameters()) - expert
    # every expert lives on one EP rank; every dense parameter on all 4 EP ranks of its stage
    assert sum(r["params"] for r in rows) == expert + 4 * dense
    assert all(r["host_terms"]["optimizer"] == r["optim_bytes"] > 0 for r in rows)       # offloaded
    assert all(r["gpu_terms"]["optimizer"] == 0 and r["host_bytes"] == sum(r["host_terms"].values()) for r in rows)
    # zero activation fit: only the recompute checkpoints remain, the layer inputs [T,M,D] bf16 of
    # (pp - stage) in-flight micro-batches; 43 layers split 11/11/11/10
    for r in rows:
        stored = (4 - r["pp_rank"]) * (10 if r["pp_rank"] == 3 else 11) * 8192 * cfg.hc_mult * cfg.dim * 2
        assert r["act_bytes"] == stored and r["gpu_bytes"] == sum(r["gpu_terms"].values())
        assert r["gpu_terms"]["weights"] == r["param_bytes"] and r["gpu_terms"]["grads"] == r["grad_bytes"]


# bytes(S) = a S + b pairs(S) fitted at (64, 128) and extrapolated to 256 on tiny: measured within 3.7% of the
# bytes measured there (the model ignores O(1) and per-chunk terms); the flash CPU and H200 fits agreed within 8%.
FIT_EXTRAPOLATION_RTOL = 0.10
# Two fits that share a length must reproduce the same measurement there: only fp64 rounding of the solve.
FIT_REPRODUCE_RTOL = 1e-9


def test_activation_fit_reproduces_its_measurements():
    cfg = preset("tiny")
    short, long = measure_layer_bytes(cfg, (64, 128)), measure_layer_bytes(cfg, (128, 256))
    assert set(short) == set(long) == set(cfg.compress_ratios)
    assert attention_pairs(cfg, 0, 16) == sum(min(q + 1, 16) for q in range(16)) + sum(16 - min(q + 1, 16) for q in range(16))
    for ratio in short:
        at128 = layer_act_bytes(cfg, ratio, 128, short), layer_act_bytes(cfg, ratio, 128, long)
        assert at128[0] == pytest.approx(at128[1], rel=FIT_REPRODUCE_RTOL), (ratio, at128)  # the shared point
        predicted, measured = layer_act_bytes(cfg, ratio, 256, short), layer_act_bytes(cfg, ratio, 256, long)
        assert predicted == pytest.approx(measured, rel=FIT_EXTRAPOLATION_RTOL), (ratio, predicted, measured)
        assert all(v > 0 for v in short[ratio] + long[ratio]), (ratio, short[ratio], long[ratio])


# ---------------------------------------------------------------------------------------------- every term
# tiny has T = 64-token micro-batches here; a made-up activation fit (a per token, b per attention pair)
# keeps the hand counts readable. Element sizes: bf16 2, fp32 4.
T_TINY, FIT = 64, {r: (100.0, 3.0) for r in (0, 4, 8)}


def _rows(par, setup=None, dtype=torch.bfloat16, cfg=None):
    return {(r["pp_rank"], r["ep_rank"]): r for r in plan(cfg or preset("tiny"), par, FIT, dtype=dtype, setup=setup)}


def test_gradients_in_the_dtype_autograd_accumulates_in():
    """bf16 weights: after two backwards (micro-batch accumulation) every .grad is bf16, and the planner's
    grads term is their bytes; grad_dtype=fp32 counts an fp32 main grad (twice that)."""
    cfg = preset("tiny")
    model = Transformer(cfg).init_weights(0)
    model.cast_(torch.bfloat16)
    trainable_parameters(model)
    ids = torch.arange(18).view(2, 9) % cfg.vocab_size
    for _ in range(2):
        model.token_logprobs(ids[:, :-1], ids[:, 1:]).sum().backward()
    real = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    par = ParallelConfig(micro_batch_tokens=T_TINY)
    assert _rows(par)[(0, 0)]["gpu_terms"]["grads"] == real
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert _rows(par, pl.Setup(grad_dtype=torch.float32))[(0, 0)]["gpu_terms"]["grads"] == 4 * trainable


def test_activation_terms_by_hand():
    cfg = preset("tiny")  # M = 4 streams, D = 64, K = 2 of 8 experts, inter 32, vocab 256, 4 layers
    M, D, K, inter, V = cfg.hc_mult, cfg.dim, cfg.n_activated_experts, cfg.moe_inter_dim, cfg.vocab_size
    pairs = lambda ratio, s: attention_pairs(cfg, ratio, s)  # noqa: E731
    par = ParallelConfig(pp=2, ep=2, layer_split=(1, 3), micro_batch_tokens=T_TINY, recompute=True)
    rows = _rows(par, pl.Setup(seq_len=16, imbalance=1.5))
    # stage 0: layer 0 (ratio 0), 2 micro-batches in flight; stage 1: layers 1-3 (ratios 4, 8, 4), 1 in flight
    one = {i: 100 * 64 + 3 * pairs(cfg.compress_ratios[i], 16) * 64 / 16 for i in range(4)}  # 4 sequences of 16
    t0, t1 = rows[(0, 0)]["gpu_terms"], rows[(1, 1)]["gpu_terms"]
    assert t0["activations"] == pytest.approx(2 * 1 * 64 * M * D * 2 + one[0])
    assert t1["activations"] == pytest.approx(1 * 3 * 64 * M * D * 2 + max(one[1], one[2], one[3]))
    assert t0["imbalance"] == pytest.approx(0.5 * 1 * 64 * K * (D + 3 * inter) * 2)  # one full (recomputed) layer
    assert t0["a2a"] == pytest.approx(2.5 * 64 * K * (D * 2 + 4))
    assert t0["backward"] == 2 * 64 * M * D * 2 and t1["backward"] == 2 * 64 * M * D * 2 + 2 * 64 * V * 4
    no_ep = _rows(ParallelConfig(micro_batch_tokens=T_TINY))[(0, 0)]["gpu_terms"]
    assert no_ep["imbalance"] == no_ep["a2a"] == 0 and no_ep["nccl"] == 0  # one rank: no exchange, no NCCL


def test_optimizer_clip_nccl_push_terms_by_hand():
    cfg = preset("tiny")
    par = ParallelConfig(pp=2, ep=2, layer_split=(1, 3), micro_batch_tokens=T_TINY)
    rows = _rows(par, pl.Setup(chunk_elems=128, bucket_bytes=1000))
    with torch.device("meta"):
        model = Transformer(cfg)
    trainable_parameters(model)
    # the largest gradient on stage 1 (layers 1-3 + head): the head [256, 64] or one layer's expert stack / 2
    largest1 = max([p.numel() for n, p in model.named_parameters() if p.requires_grad and not n.startswith(
        ("embed", "layers.0.")) and ".experts." not in n] + [p.numel() // 2 for n, p in model.named_parameters()
                                                             if ".experts." in n])
    t = rows[(1, 0)]["gpu_terms"]
    assert t["clip"] == largest1 * 4 * 2                       # g.float() and its square, fp32
    assert t["opt_step"] == 4 * (128 + largest1)               # on device: a 128-element batch + its last tensor
    assert t["nccl"] == 5 * pl.NCCL_COMM_BYTES                 # world, PP send + recv, EP, the push group
    assert rows[(1, 1)]["gpu_terms"]["nccl"] == 4 * pl.NCCL_COMM_BYTES
    assert t["push"] == int((3 + 1 / 2) * 1000)                # 3 live buckets + this rank's 1/ep sub-bucket
    whole = _rows(par, pl.Setup(bucket_bytes=1 << 40))[(1, 0)]  # a bucket is at most what the rank holds
    assert whole["gpu_terms"]["push"] == int(3.5 * whole["param_bytes"])
    off = _rows(ParallelConfig(micro_batch_tokens=T_TINY, offload_optimizer=True), pl.Setup(chunk_elems=128))
    h, held = off[(0, 0)]["host_terms"], [p for p in model.cast_(torch.bfloat16).parameters() if p.requires_grad]
    # fp32 master + m + v; a parameter the official model keeps in fp32 is its own master
    assert h["optimizer"] == sum(p.numel() * (8 if p.dtype == torch.float32 else 12) for p in held)
    assert off[(0, 0)]["gpu_terms"]["optimizer"] == 0
    dtypes = {p.dtype for p in held}
    assert h["pinned"] == 2 * 128 * (4 + sum(d.itemsize for d in dtypes))  # AdamW's slots (test_parallel_optim)


def test_engine_and_rank0_host_terms_by_hand():
    cfg = preset("tiny")
    with torch.device("meta"):
        full = sum(p.numel() for p in Transformer(cfg).parameters())
    setup = pl.Setup(engine="fp32", engine_tokens=40, eval_logit_rows=10, push="tensor", bucket_bytes=1000,
                     full_copy=True)
    rows = _rows(ParallelConfig(pp=2, micro_batch_tokens=T_TINY), setup)
    kv = 40 * cfg.n_layers * (cfg.head_dim + cfg.index_head_dim) * 4
    r0, r1 = rows[(0, 0)], rows[(1, 0)]
    assert r0["gpu_terms"]["engine"] == 4 * full + kv + 10 * cfg.vocab_size * 4 + 4 * full  # model + store
    assert r0["host_terms"]["engine"] == 4 * full              # the store after HTTP pushes
    assert r0["host_terms"]["full_copy"] == 8 * full           # gathered fp32 dict + shadow model
    assert r0["host_terms"]["push"] == r1["host_terms"]["push"] == 8 * 1000  # each stage's source posts
    assert "engine" not in r1["gpu_terms"] and r1["host_terms"]["process"] == pl.HOST_PROCESS_BYTES
    fp8 = _rows(ParallelConfig(micro_batch_tokens=T_TINY), pl.Setup(engine="fp8"))[(0, 0)]["host_terms"]["engine"]
    assert fp8 == rollout_weight_bytes(cfg, push=True)


def test_host_per_node_follows_the_grid():
    """PP2 x DP2 x EP2 on 4-GPU nodes: grid ranks 0-3 are stage 0 (d0 e0, d0 e1, d1 e0, d1 e1); a DP replica
    holds no push payload, engine or full copy."""
    par = ParallelConfig(pp=2, ep=2, dp=2, layer_split=(1, 3), micro_batch_tokens=T_TINY, offload_optimizer=True)
    rows = plan(preset("tiny"), par, FIT, setup=pl.Setup(push="tensor", engine="fp32", full_copy=True))
    by = {(r["pp_rank"], r["ep_rank"]): r for r in rows}
    nodes = pl.node_host_bytes(rows, par, 4)
    h = lambda s, e: by[(s, e)]["host_bytes"]  # noqa: E731
    rep = lambda s, e: by[(s, e)]["replica_host_bytes"]  # noqa: E731
    assert nodes == [h(0, 0) + h(0, 1) + rep(0, 0) + rep(0, 1), h(1, 0) + h(1, 1) + rep(1, 0) + rep(1, 1)]
    assert rep(0, 0) == h(0, 0) - sum(by[(0, 0)]["host_terms"][k] for k in ("push", "engine", "full_copy"))


def test_setup_from_run_reads_the_run_config():
    cfg = parse_args(["--recipe", "demo"])
    s = pl.setup_from_run(cfg, preset("tiny", **cfg.model), world=1)
    assert (s.engine, s.push, s.full_copy, s.engine_on_gpu) == ("fp8", "tensor", False, True)
    assert s.eval_logit_rows == min(500 * 8, 1024) * 32                  # demo: in-process batched eval
    cfg = parse_args(["--recipe", "flash", "--rollout.urls", "http://a:1", "--rollout.transport", "distributed"])
    s = pl.setup_from_run(cfg, preset("flash"), world=16)
    assert (s.engine, s.push, s.full_copy, s.eval_logit_rows) == ("", "nccl", True, 0)


def test_rank0_host_counts_the_rollout_data():
    """Bug (issue 37): the host estimate had no term for rank 0's rollout data -- every sample of a step's rounds
    as Python lists, the kept groups' R3 records ([T, n_layers, K] per sample; ~24 GiB a flash round as int64),
    the packed batch -- so the first training node's 1,767 GiB left out what rank 0 alone holds. The term is
    counted by hand here for a small shape, in uint8 (<= 256 experts) and int16 (more), on rank 0 only."""
    cfg = preset("tiny")   # 4 layers, top-2 of 8 experts, max_seq_len 256
    shape = dict(prompts=4, group_size=3, rounds=2, kept=2, prompt_tokens=10, response_tokens=6, replay=True,
                 in_flight=5)
    T, ids = 10 + 6 - 1, 4 * 2
    episodes = 2 * 4 * (10 * 36 + 3 * 6 * (36 + 32))
    for n_experts, id_bytes in ((8, 1), (300, 2)):
        c = dataclasses.replace(cfg, n_routed_experts=n_experts)
        got = pl.rollout_bytes(c, shape)
        assert got == {"episodes": episodes, "r3": (4 + 2) * 3 * T * ids * id_bytes, "indexer": 0,
                       "batch": 2 * 3 * T * (32 + ids * id_bytes), "decoding": 5 * 3 * T * ids * (16 / 3 + 12)}
    assert pl.rollout_bytes(cfg, dict(shape, replay=False))["r3"] == 0
    # indexer replay: tiny's 2 C4 layers x top-4 entries a position, stored int16 (max_seq_len 256: 64 entries)
    got = pl.rollout_bytes(cfg, dict(shape, replay=False, indexer_replay=True))
    assert got["indexer"] == (4 + 2) * 3 * T * 8 * 2 and got["batch"] == 2 * 3 * T * (32 + 8 * 2)
    assert got["decoding"] == 5 * 3 * T * 8 * (16 / 3 + 12)
    run = parse_args(["--recipe", "smoke", "--rollout.routing_replay", "true"])
    setup = pl.setup_from_run(run, cfg, world=4)
    assert setup.rollout["prompts"] == 4 and setup.rollout["rounds"] == run.rollout.max_rounds
    rows = plan(cfg, ParallelConfig(pp=2, ep=2), ZERO_FIT, setup=setup)
    rollout = {(r["pp_rank"], r["ep_rank"]): r["host_terms"].get("rollout", 0) for r in rows}
    assert rollout.pop((0, 0)) == sum(pl.rollout_bytes(cfg, setup.rollout).values()) > 0
    assert set(rollout.values()) == {0}     # rank 0 alone drives the servers and packs the batch


def test_colocated_ranks_plan_no_nccl_and_rank0s_shadow_on_the_gpu():
    """--parallel.colocate_ranks: the ranks run gloo (no NCCL communicator, push over gloo) and train.py builds
    rank 0's shadow model (fp32, the embedded server's source) on the shared GPU, not in host memory. Bug
    caught: the plan of a colocated run counting NCCL buffers and the shadow on the host (rank 0's GPU
    under-planned by 4 bytes a parameter)."""
    cfg = preset("tiny")
    plain = parse_args(["--recipe", "smoke", "--parallel.pp", "2", "--parallel.ep", "2"])
    coloc = parse_args(["--recipe", "smoke", "--parallel.pp", "2", "--parallel.ep", "2",
                        "--parallel.colocate_ranks", "true", "--rollout.transport", "distributed"])
    a = plan(cfg, plain.parallel, ZERO_FIT, setup=pl.setup_from_run(plain, cfg, world=4))
    b = plan(cfg, coloc.parallel, ZERO_FIT, setup=pl.setup_from_run(coloc, cfg, world=4))
    full = 4 * sum(p.numel() for p in Transformer(cfg).parameters())
    assert all(r["gpu_terms"]["nccl"] > 0 for r in a) and all(r["gpu_terms"]["nccl"] == 0 for r in b)
    assert b[0]["gpu_terms"]["engine"] - a[0]["gpu_terms"]["engine"] == full
    assert a[0]["host_terms"]["full_copy"] - b[0]["host_terms"]["full_copy"] == full
