"""Multi-rank parity on gloo: every layout of the engine against the single-process tiny model built from the
same weights. For each layout: the global loss, every trainable parameter's (clipped) gradient, the global
gradient norm, and every parameter after one AdamW step must match the single-process reference.

Run: pytest tests/test_parallel_parity.py -q   (about 1 min on 2 cores: one spawn of 2 and one of 4 ranks)
"""
import pytest
import torch

from conftest import run_ranks
from nanoflash.names import official_views
from nanoflash.config import OptimConfig, ParallelConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.optim import AdamW, trainable_parameters
from nanoflash.parallel.pipeline import forward_only
from nanoflash.parallel.train_step import global_count, make_optimizer, parallelize, stage_logprobs, train_step

N_SEQ, SEQ_LEN, SEED = 4, 16, 0
LR = 1e-3        # large enough that one step visibly moves every parameter
CLIP = 0.05      # below the tiny model's gradient norm (~0.2), so the global-norm clip is exercised
# fp32 everywhere. Distributed runs sum the same products in another order: the loss over data shards and
# micro-batches, dense grads over DP x EP ranks, expert grads over rows from different ranks, matmuls on
# smaller batches. Observed (EP2): loss rel. diff 1.2e-7; max |grad diff| 2e-11 absolute, and 2.6e-5 relative
# only on gradients of ~1e-7 that are sums of cancelling larger terms (hc_head_*). Hence a tight absolute
# floor (50x the observed) plus a relative part.
RTOL, ATOL = 1e-5, 1e-9
# AdamW's first update is lr * g / (|g| + eps): a gradient error dg moves it by at most
# lr * (dg_abs / eps + dg_rel / 4), so the parameter tolerance follows from the gradient tolerance. eps=1e-6
# (instead of 1e-8) keeps that bound meaningful for near-zero gradients.
ADAM_EPS = 1e-6
LOGP_ATOL = 1e-5  # log-probs of ~-5.5 from differently batched fp32 matmuls (observed < 1e-6)
PARAM_ATOL = LR * (ATOL / ADAM_EPS + RTOL)


def make_batch():
    g = torch.Generator().manual_seed(SEED + 1)
    cfg = preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (N_SEQ, SEQ_LEN + 1), generator=g)
    mask = (torch.rand(N_SEQ, SEQ_LEN, generator=g) > 0.2).float()
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask}


def fresh_model():
    return Transformer(preset("tiny")).init_weights(SEED)


def reference():
    """Single process: whole batch at once, same loss, clip and optimizer."""
    model = fresh_model()
    opt = AdamW(trainable_parameters(model), lr=LR, eps=ADAM_EPS)
    batch = make_batch()
    logprobs = model.token_logprobs(batch["input_ids"], batch["targets"]).detach()
    out = train_step(model, ParallelDims(), [batch], opt, 1.0 / float(batch["loss_mask"].sum()), grad_clip=CLIP)
    grads = {n: g.clone() for name, p in model.named_parameters() if p.requires_grad  # stacked experts by official name
             for n, g in official_views(name, p, p.grad)}
    out["logprobs"] = logprobs
    return out, grads, {n: p.detach().clone() for n, p in model.state_dict().items()}


def _rank_fn(rank, world, pp, ep, layer_split, mbs_per_rank, recompute, colocate=False):
    dims = ParallelDims(pp=pp, ep=ep, colocate=colocate)
    with torch.device("meta"):  # the production order: build on meta, parallelize, materialise, load
        model = parallelize(Transformer(preset("tiny")), dims, ParallelConfig(pp, ep, None, layer_split,
                                                                               recompute=recompute))
    model.to_empty(device="cpu")
    full = fresh_model()
    model.load_state_dict({k: v for k, v in full.state_dict().items() if k in model.state_dict()})
    opt = make_optimizer(model, OptimConfig(lr=LR, eps=ADAM_EPS))
    batch = make_batch()
    per = N_SEQ // dims.data_world
    shard = {k: v[dims.data_rank * per:(dims.data_rank + 1) * per] for k, v in batch.items()}
    mbs = [{k: v.chunk(mbs_per_rank)[i] for k, v in shard.items()} for i in range(mbs_per_rank)]
    z = global_count(shard["loss_mask"].sum(), dims)
    first = dims.is_first_stage  # data and loss scale only where the data is read; the rest travels
    logp = forward_only(model, dims, mbs if first else None, lambda m, h, mb: stage_logprobs(m, h, mb["targets"]))
    out = train_step(model, dims, mbs if first else None, opt, 1.0 / z if first else None, grad_clip=CLIP)
    grads = {n: g.clone() for name, p in model.named_parameters() if p.requires_grad  # stacked experts by official name
             for n, g in official_views(name, p, p.grad)}
    out["logprobs"] = (dims.data_rank, torch.cat(logp))
    out["staged_bytes"] = dims.staging.staged_bytes if dims.staging is not None else 0
    return out, grads, {n: p.detach().clone() for n, p in model.state_dict().items()}


def _many(rank, world, layouts):
    """Several layouts in one set of processes (spawning 2-4 ranks costs more than a tiny-model step)."""
    out = {}
    for name, (pp, ep, split, mbs, recompute, *colocate) in layouts.items():
        try:
            out[name] = _rank_fn(rank, world, pp, ep, split, mbs, recompute, *colocate)
        except Exception as e:  # name the layout in the traceback run_ranks reports
            raise RuntimeError(f"layout {name} failed on rank {rank}") from e
    return out


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def runs():
    """Every layout's per-rank results, one spawn per world size."""
    results = {}
    for world in sorted({v[0] for v in LAYOUTS.values()}):
        layouts = {k: v[1:] for k, v in LAYOUTS.items() if v[0] == world}
        per_rank = run_ranks(_many, world, layouts)
        results.update({k: [r[k] for r in per_rank] for k in layouts})
    return results


def world_of(layout: str) -> int:
    return LAYOUTS[layout][0]


LAYOUTS = {  # name: (world, pp, ep, layer_split, micro-batches per data rank, recompute)
    "EP2": (2, 1, 2, None, 2, False),
    "EP4+recompute": (4, 1, 4, None, 1, True),   # the all-to-all runs again inside the recomputed forward
    "PP2": (2, 2, 1, (1, 3), 4, False),          # uneven: hash layer 1 sits on stage 1, so the ids must travel
    "PP4": (4, 4, 1, None, 4, False),
    "PP2xEP2": (4, 2, 2, (1, 3), 2, False),
    "DP2": (2, 1, 1, None, 2, False),
    "DP2xEP2": (4, 1, 2, None, 1, False),        # expert grads summed over DP only, dense over DP x EP
    # ranks sharing one device (--parallel.colocate_ranks): every P2P through host buffers (parallel.colocate),
    # here on CPU tensors; on a GPU the same path carries CUDA tensors, which gloo's send/recv refuse
    "PP2xEP2+colocated": (4, 2, 2, (1, 3), 2, True, True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, ref, runs):
    ref_out, ref_grads, ref_params = ref
    results = runs[layout]
    seen = set()
    for rank, (out, grads, params) in enumerate(results):
        assert out["loss"] == pytest.approx(ref_out["loss"], rel=RTOL), f"{layout} rank {rank} loss"
        assert out["grad_norm"] == pytest.approx(ref_out["grad_norm"], rel=RTOL), f"{layout} rank {rank} norm"
        data_rank, logp = out["logprobs"]  # forward_only: the last stage's log-probs, on every stage
        per = N_SEQ // (world_of(layout) // LAYOUTS[layout][1])
        torch.testing.assert_close(logp, ref_out["logprobs"][data_rank * per:(data_rank + 1) * per],
                                   rtol=RTOL, atol=LOGP_ATOL)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
        seen |= set(params)
        # colocated: the activations really went through the staging buffers (and nothing else did)
        assert (out["staged_bytes"] > 0) == layout.endswith("+colocated"), (layout, rank, out["staged_bytes"])
    assert seen == set(ref_params), f"{layout}: names missing across ranks {sorted(set(ref_params) - seen)[:5]}"
