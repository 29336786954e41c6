"""The GRPO actor (`nanoflash.rl.trainer.Trainer`) at PP x EP x DP on gloo against the single process.

The path under test is exactly what train.py runs: rank 0 holds the global batch, `scatter_shards` sends
each first-stage rank its rows, `actor.logprobs` (forward_only at any PP) and `actor.train` (train_step with
the GRPO loss) run on token-budget micro-batches whose counts differ across data shards before
`equalize_count`. Checked per layout: the layout-independent init, the shard rows each rank receives, old
log-probs, loss and grad norm at both steps, every weight after two steps; routing replay at PP2 with
recompute reaches every gate call (the recomputed ones included) and changes the result.

Run: pytest tests/test_trainer.py -q   (about a minute on 2 cores)
"""
import pytest
import torch

from conftest import run_ranks
from nanoflash import grpo
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.microbatch import pack_microbatches
from nanoflash.sglang.buckets import optimizer_storage, served_storage
from nanoflash.rl.trainer import FIELDS, Trainer, batch_samples, build_model, make_optimizer, scatter_shards

# Response lengths chosen so shards pack into different micro-batch counts at a 40-token budget
# (PP2xEP2: 3 vs 2 micro-batches; DP2xEP2: 2, 1, 2, 1).
LENGTHS = [(6, 22), (5, 23), (4, 4), (3, 5), (6, 8), (5, 9), (4, 3), (3, 4)]  # (prompt, response)
BUDGET = 40
LR, ADAM_EPS = 1e-3, 1e-6  # eps 1e-6 as in test_parallel_parity: keeps the update's error bound meaningful
# fp32 everywhere; layouts differ only in summation order (micro-batching, gradient all-reduce, EP combine).
# Observed: loss / grad-norm rel. diff <= 3e-7, log-probs <= 2e-6, weights after two AdamW steps <= 3e-6
# absolute. Bounds: the parity tests' RTOL for scalars; log-probs as in test_parallel_parity; weights: two
# steps of the parity tests' per-step AdamW bound, lr * (1e-9 / eps + 1e-5), plus the second step's gradient
# taken at slightly different weights, hence 5e-6.
RTOL, LOGP_ATOL, WEIGHT_ATOL = 1e-5, 1e-5, 5e-6
# The step-1 GRPO loss is ~0 (ratio 1, group-normalised advantages cancel), so scalars also get an absolute
# floor: fp32 rounding of a sum of O(1) per-sample terms (observed 7e-9).
SCALAR_ATOL = 1e-6


def run_cfg(pp=1, ep=1, replay=False, recompute=False):
    return parse_args(["--recipe", "smoke", "--parallel.pp", str(pp), "--parallel.ep", str(ep),
                       "--parallel.micro_batch_tokens", str(BUDGET), "--parallel.recompute", str(recompute).lower(),
                       "--rollout.routing_replay", str(replay).lower(), "--optim.lr", str(LR),
                       "--optim.eps", str(ADAM_EPS), "--rollout.weights", "fp8"])


def global_batch(cfg) -> grpo.RolloutBatch:
    """8 episodes of unequal lengths (seeded), advantages of both signs, optional R3 records."""
    mcfg = preset("tiny", **cfg.model)
    g = torch.Generator().manual_seed(7)
    eps = []
    for i, (P, R) in enumerate(LENGTHS):
        ids = torch.randint(1, mcfg.vocab_size, (P + R,), generator=g).tolist()
        lp = (-torch.rand(R, generator=g) * 3).tolist()
        rx = torch.rand(P + R - 1, mcfg.n_layers, mcfg.n_routed_experts, generator=g).argsort(-1)[..., :mcfg.n_activated_experts]
        eps.append(grpo.Episode(ids[:P], ids[P:], lp, float(i % 3 == 0), i // 2, "stop",
                                rx if cfg.rollout.routing_replay else None))
    return grpo.pack(eps, grpo.episode_advantages(eps, 2), pad_id=0)


def two_steps(actor, batch, dims):
    """What train.py's loop does with one batch, twice. -> per-step (rows, old log-probs, metrics)"""
    out = []
    for step in range(2):
        shard, head = scatter_shards(batch, dims, {"pos": step})
        old = actor.logprobs(shard)
        if shard is not None:
            shard.old_logprobs = old
        m = actor.train(shard)
        n_mbs = None if shard is None else len(pack_microbatches(batch_samples(shard, FIELDS), BUDGET)[0])
        out.append({"head": head, "old": old, "m": m, "shard_ids": None if shard is None else shard.input_ids,
                    "n_mbs": n_mbs})  # micro-batches this shard packs into before equalize_count
    return out


def _rank_fn(rank, world, pp, ep, replay, recompute):
    cfg = run_cfg(pp, ep, replay, recompute)
    dims = ParallelDims(pp=pp, ep=ep)
    actor = Trainer(cfg, preset("tiny", **cfg.model), dims)
    actor.start_optimizer()
    init = {k: v.clone() for k, v in actor.state_iter()}
    calls = _record_gates(actor.model) if replay else None
    batch = global_batch(cfg) if rank == 0 else None
    steps = two_steps(actor, batch, dims)
    return {"dims": (dims.pp_rank, dims.data_rank), "init": init, "final": dict(actor.state_iter()),
            "steps": steps, "n_mbs": steps[0]["n_mbs"], "gate_calls": calls}


def _record_gates(model):
    """Wrap every score-routed gate: record whether it got a replay and returned exactly those experts."""
    calls = []
    for layer in model.layers.values():
        gate = layer.ffn.gate
        if gate.hash:
            continue

        def wrapped(x, ids, replay=None, _f=gate.forward):
            w, idx = _f(x, ids, replay)
            calls.append(replay is not None and torch.equal(idx, replay.to(idx.dtype)))
            return w, idx
        gate.forward = wrapped
    return calls


@pytest.fixture(scope="module")
def reference():
    """Single process, the same two steps on the whole batch: no replay, and with replay."""
    out = {}
    for replay in (False, True):
        cfg = run_cfg(replay=replay)
        actor = Trainer(cfg, preset("tiny", **cfg.model), ParallelDims())
        actor.start_optimizer()
        init = {k: v.clone() for k, v in actor.state_iter()}
        out[replay] = {"init": init, "steps": two_steps(actor, global_batch(cfg), ParallelDims()),
                       "final": dict(actor.state_iter())}
    return out


def _compare(ref, results, world):
    B = len(LENGTHS)
    for r in results:
        pp_rank, d = r["dims"]
        for k, v in r["init"].items():  # layout-independent init: the same tensor under the same name
            assert torch.equal(v, ref["init"][k]), f"init of {k} differs on stage {pp_rank}"
        for k, v in r["final"].items():
            assert torch.allclose(v.float(), ref["final"][k].float(), rtol=0, atol=WEIGHT_ATOL), k
        for s, (mine, want) in enumerate(zip(r["steps"], ref["steps"])):
            for key in ("loss", "grad_norm", "pg_loss", "train_rollout_logprob_abs_diff"):
                assert mine["m"][key] == pytest.approx(want["m"][key], rel=RTOL, abs=SCALAR_ATOL), (s, key)
            if pp_rank == 0:  # first stages hold their shard: rows and old log-probs
                D = world // results_pp(results)
                a, b = B * d // D, B * (d + 1) // D
                assert torch.equal(mine["shard_ids"], want["shard_ids"][a:b])
                assert (mine["old"] - want["old"][a:b]).abs().max() <= LOGP_ATOL
    counts = [r["n_mbs"] for r in results if r["n_mbs"] is not None]
    assert len(set(counts)) > 1, f"shards should pack into unequal micro-batch counts, got {counts}"


def results_pp(results):
    return max(r["dims"][0] for r in results) + 1


# dp2xep2 under -m slow (suite time): the engine's DP2xEP2 is in test_parallel_parity and train.py's dp2xep2 in
# test_train_e2e, both in the default suite; PP2xEP2 here keeps the Trainer's sharding checks in it.
@pytest.mark.parametrize("pp,ep", [(2, 2), pytest.param(1, 2, marks=pytest.mark.slow)], ids=["pp2xep2", "dp2xep2"])
def test_actor_layouts_match_single_process(reference, pp, ep):
    results = run_ranks(_rank_fn, 4, pp, ep, False, False)
    _compare(reference[False], results, 4)


def test_pp2_recompute_routing_replay(reference):
    """PP2 + recompute + R3: every gate call on both stages (forward-only, 1F1B forward, recomputed forward)
    got the rollout's experts and used exactly them; results equal the single process with replay and
    differ from the run without it (so the records are not ignored)."""
    results = run_ranks(_rank_fn, 2, 2, 1, True, True)
    _compare_replay(reference, results)


def _compare_replay(reference, results):
    ref = reference[True]
    assert any(r["gate_calls"] for r in results), "no score-routed gate ran"  # tiny: hash layers first
    for r in results:
        assert all(r["gate_calls"]), f"stage {r['dims'][0]}: a gate call ignored the replay"
        for k, v in r["final"].items():
            assert torch.allclose(v.float(), ref["final"][k].float(), rtol=0, atol=WEIGHT_ATOL), k
    first = next(r for r in results if r["dims"][0] == 0)
    assert (first["steps"][0]["old"] - ref["steps"][0]["old"]).abs().max() <= LOGP_ATOL
    assert (ref["steps"][0]["old"] - reference[False]["steps"][0]["old"]).abs().max() > 1e-3


def test_placement_meta_build_materialises_on_the_device():
    """Built on meta, materialised for the CPU: no meta tensor left, params / grads / optimizer state on it."""
    _check_placement(torch.device("cpu"), offload=False)


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_placement_on_cuda(offload):
    _check_placement(torch.device("cuda", 0), offload=offload)


def _check_placement(device, offload):
    cfg = run_cfg()
    model = build_model(preset("tiny", **cfg.model), ParallelDims(), cfg.parallel, torch.bfloat16, device, seed=0)
    opt = make_optimizer(model, cfg.optim, offload=offload)
    ids = torch.randint(0, 18, (2, 9), device=device)
    model.token_logprobs(ids[:, :-1], ids[:, 1:]).sum().backward()
    opt.step()
    state_dev = torch.device("cpu") if offload else device
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.device == device and not t.is_meta, n
    for n, p in model.named_parameters():
        assert p.grad is None or p.grad.device == device, n
    for n, st in opt.state.items():
        for k, v in st.items():
            assert v.device == state_dev and v.dtype == torch.float32, (n, k)
            if offload and device.type == "cuda":  # pageable state; only the bounded staging slots are pinned
                slots = [t for way in ("down", "up") for ts in opt._staging[way].values() for t in ts if t is not None]
                assert not v.is_pinned() and slots and all(t.is_pinned() for t in slots), (n, k)
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())


def _nan_step_rank(rank, world):
    """PP2: a NaN advantage (a NaN reward upstream) poisons step 1's loss; then a clean step."""
    cfg = run_cfg(pp=2)
    dims = ParallelDims(pp=2)
    actor = Trainer(cfg, preset("tiny", **cfg.model), dims)
    actor.start_optimizer()
    before = {k: v.clone() for k, v in actor.state_iter()}
    out = []
    for poison in (True, False):
        batch = global_batch(cfg) if rank == 0 else None
        if batch is not None and poison:
            batch.advantages[0, -1] = float("nan")
        shard, _ = scatter_shards(batch, dims, {})
        old = actor.logprobs(shard)
        if shard is not None:
            shard.old_logprobs = old
        m = actor.train(shard)
        out.append({"skipped": m["skipped"], "same": all(torch.equal(v, before[k]) for k, v in actor.state_iter()),
                    "finite": all(torch.isfinite(v).all() for _, v in actor.state_iter() if v.is_floating_point()),
                    "adam_step": actor.optimizer.step_count})
    return out


def test_nonfinite_step_is_skipped_on_every_rank():
    """The poisoned step is skipped on both stages (no update, Adam's step count unchanged, weights bit-equal
    and finite); the next clean step trains normally."""
    results = run_ranks(_nan_step_rank, 2)
    for r in results:
        assert r[0] == {"skipped": True, "same": True, "finite": True, "adam_step": 0}, r
        assert r[1]["skipped"] is False and not r[1]["same"] and r[1]["finite"] and r[1]["adam_step"] == 1, r


@pytest.mark.parametrize("round_to_served", [True, False])
def test_weights_the_fp8_push_sends_bf16_hold_bf16_values(round_to_served):
    """rollout.weights=fp8: the fp32 parameters the push sends in bf16 (norms, head, compressors, ...:
    `served_storage`) hold exactly the bf16 values the servers run, before and after a GRPO step whose update
    lives in the fp32 master; with optim.round_to_served=false they keep their fp32 values (a seeded fp32
    init is not bf16-exact)."""
    cfg = parse_args(["--recipe", "smoke", "--rollout.weights", "fp8", "--optim.lr", "1e-3",
                      "--optim.round_to_served", str(round_to_served).lower()])
    mcfg = preset("tiny", **cfg.model)
    actor = Trainer(cfg, mcfg, ParallelDims(), served_storage=optimizer_storage(cfg, mcfg))
    rounded = served_storage(actor.model, actor.model.cfg)
    assert {"head.weight", "norm.weight"} <= set(rounded) and not any("experts" in n for n in rounded)
    opt = actor.start_optimizer()
    exact = lambda: [torch.equal(t, t.to(torch.bfloat16).float())  # noqa: E731
                     for n, t in actor.model.named_parameters() if n in rounded]
    assert all(exact()) == round_to_served and set(opt.storage) == (set(rounded) if round_to_served else set())
    batch = global_batch(cfg)
    batch.old_logprobs = actor.logprobs(batch)
    actor.train(batch)
    assert all(exact()) == round_to_served and opt.step_count == 1


def test_nonfinite_weights_are_never_saved(tmp_path):
    cfg = run_cfg()
    actor = Trainer(cfg, preset("tiny", **cfg.model), ParallelDims())
    actor.start_optimizer()
    with torch.no_grad():
        actor.model.layers["1"].attn.wo_b.weight[0, 0] = float("inf")
    with pytest.raises(SystemExit, match=r"diverged: 1 weight tensors are non-finite at a checkpoint save.*wo_b"):
        actor.save(str(tmp_path / "ckpt"), 1, {}, keep=2)
    assert not (tmp_path / "ckpt").exists()


def test_gpu_memory_fraction_is_validated_and_applied_to_the_rank_device(monkeypatch):
    """Catches: the colocated trainer's memory cap never reaching the allocator (the one-step-off H200 run of
    2026-12-03 grew into SGLang's memory and killed the server), or a fraction outside [0, 1] accepted."""
    import types

    from nanoflash.config import ParallelConfig
    from nanoflash.rl.trainer import cap_gpu_memory
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_fraction"):
            ParallelConfig(gpu_memory_fraction=bad)
    assert cap_gpu_memory(torch.device("cpu"), 0.5) is None          # the CPU has no allocator cap
    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=2 ** 34))
    dev = torch.device("cuda", 0)
    assert cap_gpu_memory(dev, 0.0) is None and calls == []          # 0: no cap
    assert cap_gpu_memory(dev, 0.55) == pytest.approx(0.55 * 16) and calls == [(0.55, dev)]
