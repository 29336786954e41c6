"""Pipeline parallelism: cut the model into stages and run the 1F1B schedule over micro-batches.

Stages (`build_stage`): stage s keeps backbone layers [start_s, start_s + n_s) of `model.layers` (an
`nn.ModuleDict` keyed by layer id, so every kept parameter keeps its full-model name), the first stage also
`embed`, the last stage `hc_head_*`, `norm`, `head` and `mtp`. The model's own seams run a stage:

    first:  h = embed_streams(ids)        every stage:  h = run_layers(h, ids)       last:  loss_fn(model, h, mb)

Splits may be uneven (`layer_split=(10, 11, 11, 11)`): the ends carry embedding / head / MTP, so they
usually get fewer layers (Miles: `--decoder-last-pipeline-num-layers`). Default: as even as possible, the
remainder going to the middle stages.

What travels between stages (`comm.p2p_exchange`): the M residual streams `h [B,S,M,D]` forward and their
gradient backward, plus every `[B,S,...]` field of the micro-batch. The input ids must travel because the
hash-routed layers index `tid2eid[input_ids]` on whichever stage holds them; the loss fields (targets,
masks, advantages) because the loss is computed on the last stage. The first stage, which holds the data,
broadcasts the micro-batch shapes once per step over the PP group, so every buffer is allocated exactly.

1F1B (PipeDream-flush, arXiv 2104.04473) on stage r of p with m micro-batches:

    warm-up:   min(p - r - 1, m) forwards           (fill the pipe)
    steady:    m - warm-up times  {forward i+w ; backward i}   (one forward, one backward)
    cool-down: the remaining warm-up backwards      (drain the pipe)

At most p - r micro-batches are alive on stage r; the bubble is (p-1)/m of the ideal step. Each
"send forward + receive backward" pair is posted as one batch of P2P ops, so neighbours never deadlock.

`forward_only` runs the same stages without backward (GRPO's old-policy log-probs) and broadcasts the last
stage's per-micro-batch results to the whole pipeline.

Loss scaling: `loss_fn` returns the *sum* of per-token (or per-sample) losses of one micro-batch; it is
multiplied by `loss_scale` (1 / global normaliser of the whole step) before backward, so gradients do not
depend on how the global batch is split across micro-batches, DP or EP ranks.

How this differs from production: no interleaved / zero-bubble / DualPipe schedule, no overlap of the EP
all-to-all with the other micro-batch's compute, and the stage output is kept (not freed) until its backward.
Tests: `pytest tests/test_parallel_schedule.py tests/test_parallel_parity.py -q`.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from nanoflash.parallel.comm import p2p_exchange
from nanoflash.parallel.dims import ParallelDims

LAST_STAGE_MODULES = ("norm", "head", "mtp")
ROUTED_FIELD = "routed_experts"  # micro-batch field [B,S,n_layers,K]: routing replay, handed to run_layers
INDEXED_FIELD = "indexer_topk"   # micro-batch field [B,S,n_c4,K], entry + 1: indexer replay, likewise
LAST_STAGE_PARAMS = ("hc_head_fn", "hc_head_base", "hc_head_scale")


def split_layers(n_layers: int, pp: int, layer_split=None) -> list[list[int]]:
    """Layer ids of every stage. Default: even, with the remainder on the middle stages."""
    if layer_split is None:
        base, extra = divmod(n_layers, pp)
        assert base >= 1, f"{n_layers} layers cannot fill {pp} pipeline stages"
        middle_first = sorted(range(pp), key=lambda s: (s in (0, pp - 1), s))
        layer_split = [base + (1 if s in middle_first[:extra] else 0) for s in range(pp)]
    layer_split = list(layer_split)
    assert len(layer_split) == pp and sum(layer_split) == n_layers and min(layer_split) >= 1, (
        f"layer_split {layer_split} must have {pp} entries >= 1 summing to n_layers={n_layers}")
    starts = [sum(layer_split[:s]) for s in range(pp)]
    return [list(range(a, a + n)) for a, n in zip(starts, layer_split)]


def build_stage(model: nn.Module, dims: ParallelDims, layer_split=None) -> nn.Module:
    """Delete, in place, everything this pipeline stage does not run; names of what is kept are unchanged."""
    if dims.pp == 1:
        return model
    keep = split_layers(model.cfg.n_layers, dims.pp, layer_split)[dims.pp_rank]
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    if not dims.is_first_stage:
        model.embed = None
    if not dims.is_last_stage:
        for name in LAST_STAGE_MODULES + LAST_STAGE_PARAMS:
            setattr(model, name, None)
    return model


# ---------------------------------------------------------------------------------------------- one step
def _share_meta(model, dims: ParallelDims, microbatches, loss_scale):
    """First stage -> all stages: per micro-batch {field: (shape, dtype)}, the activation dtype and the
    loss scale (so only the ranks that read the data need to know the global normaliser)."""
    meta = None
    if dims.is_first_stage:
        assert microbatches, "the first pipeline stage needs a non-empty list of micro-batches"
        for i, mb in enumerate(microbatches):
            assert "input_ids" in mb, f"micro-batch {i} has no 'input_ids' (fields: {sorted(mb)})"
        assert loss_scale is not None, "the first pipeline stage must pass loss_scale"
        meta = {"act_dtype": model.embed.weight.dtype, "loss_scale": float(loss_scale),
                "fields": [{k: (tuple(v.shape), v.dtype) for k, v in sorted(mb.items())} for mb in microbatches]}
    if dims.pp > 1:
        box = [meta]
        dist.broadcast_object_list(box, src=dims.pp_ranks[0], group=dims.pp_group, device=dims.object_device)
        meta = box[0]
    if dims.ep_group is not None:  # every MoE layer is an EP collective: the group must run the same count
        m = torch.tensor([len(meta["fields"]), -len(meta["fields"])], device=dims.device)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=dims.ep_group)
        if int(m[0]) != -int(m[1]):
            raise ValueError(f"EP ranks hold between {-int(m[1])} and {int(m[0])} micro-batches this step; they "
                             f"must agree (nanoflash.parallel.microbatch.equalize_count), else the all-to-alls deadlock")
    return meta


class _Schedule:
    """State of one 1F1B step on one stage: micro-batches in flight, their inputs and outputs.

    Shapes: activations and their gradients [B,S,M,D] in the model's dtype; micro-batch fields [B,S,...].
    """

    def __init__(self, model, dims: ParallelDims, microbatches, loss_fn, loss_scale):
        self.model, self.dims, self.loss_fn = model, dims, loss_fn
        self.meta = _share_meta(model, dims, microbatches, loss_scale)
        self.loss_scale = self.meta["loss_scale"]
        self.microbatches = microbatches
        self.device = dims.device if model.embed is None else model.embed.weight.device
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.metrics: dict[str, torch.Tensor] = {}   # summed over micro-batches (last stage)
        self.inflight = deque()   # (h_in, out, mb) in forward order

    def act_buffer(self, i: int, requires_grad: bool = False) -> torch.Tensor:
        B, S = self.meta["fields"][i]["input_ids"][0]
        cfg = self.model.cfg
        h = torch.empty(B, S, cfg.hc_mult, cfg.dim, dtype=self.meta["act_dtype"], device=self.device)  # [B,S,M,D]
        return h.requires_grad_(requires_grad)

    # -- communication (each returns the (tensor, peer) lists for one batched exchange)
    def recv_forward(self, i: int):
        """Input of micro-batch i: from the data on the first stage, else from the previous stage."""
        if self.dims.is_first_stage:
            mb = {k: v.to(self.device) for k, v in self.microbatches[i].items()}
            return None, mb, []
        h = self.act_buffer(i, requires_grad=True)
        mb = {k: torch.empty(shape, dtype=dtype, device=self.device)
              for k, (shape, dtype) in self.meta["fields"][i].items()}
        return h, mb, [(h, self.dims.prev_rank)] + [(mb[k], self.dims.prev_rank) for k in sorted(mb)]

    def send_forward(self, out, mb):
        if self.dims.is_last_stage:
            return []
        return [(out.detach(), self.dims.next_rank)] + [(mb[k], self.dims.next_rank) for k in sorted(mb)]

    def recv_backward(self, i: int):
        if self.dims.is_last_stage:
            return None, []
        dy = self.act_buffer(i)
        return dy, [(dy, self.dims.next_rank)]

    def send_backward(self, dx):
        return [] if self.dims.is_first_stage else [(dx, self.dims.prev_rank)]

    # -- compute
    def forward(self, h_in, mb):
        ids = mb["input_ids"]
        h = self.model.embed_streams(ids) if self.dims.is_first_stage else h_in
        out = self.model.run_layers(h, ids, routed=mb.get(ROUTED_FIELD), indexed=mb.get(INDEXED_FIELD))
        if self.dims.is_last_stage:
            loss = self.loss_fn(self.model, out, mb)
            loss, metrics = loss if isinstance(loss, tuple) else (loss, {})
            self.loss_sum += loss.detach().double()
            for k, v in metrics.items():
                self.metrics[k] = self.metrics.get(k, 0.0) + torch.as_tensor(v).detach().double() * self.loss_scale
            out = loss * self.loss_scale
        self.inflight.append((h_in, out, mb))
        return out, mb

    def backward(self, dy):
        h_in, out, _ = self.inflight.popleft()
        torch.autograd.backward(out, dy)
        return None if h_in is None else h_in.grad


def forward_backward(model: nn.Module, dims: ParallelDims, microbatches, loss_fn, loss_scale: float | None = 1.0):
    """Forward and backward of every micro-batch with 1F1B; gradients accumulate in `.grad`.

    `microbatches`: list of dicts of `[B,S,...]` tensors with at least `input_ids`, and `loss_scale`: both are
    needed on the first stage only (other stages may pass None; they receive them). `loss_fn(model,
    h [B,S,M,D], mb) -> scalar | (scalar, {name: scalar})` runs on the last stage. Returns (loss_scale * sum
    of the losses, {name: loss_scale * sum of the metrics}) over the micro-batches on the last stage; (0, {})
    elsewhere. A micro-batch field `routed_experts` [B,S,n_layers,K] is routing replay: it travels with the
    other fields and every stage hands it to `run_layers`, so replay works at any PP and with recompute; so
    does `indexer_topk` [B,S,n_c4,K] (indexer replay, entry + 1).
    """
    sch = _Schedule(model, dims, microbatches, loss_fn, loss_scale)
    m, p, r = len(sch.meta["fields"]), dims.pp, dims.pp_rank
    warmup = min(p - r - 1, m)
    for i in range(warmup):                                    # warm-up: forwards only
        h_in, mb, recvs = sch.recv_forward(i)
        p2p_exchange([], recvs, sch.dims.staging)
        out, mb = sch.forward(h_in, mb)
        p2p_exchange(sch.send_forward(out, mb), [], sch.dims.staging)
    if m > warmup:
        h_in, mb, recvs = sch.recv_forward(warmup)
        p2p_exchange([], recvs, sch.dims.staging)
    for i in range(m - warmup):                                # steady: one forward, one backward
        out, mb = sch.forward(h_in, mb)
        dy, recvs = sch.recv_backward(i)
        p2p_exchange(sch.send_forward(out, mb), recvs, sch.dims.staging)
        dx = sch.backward(dy)
        sends = sch.send_backward(dx)
        if warmup + i + 1 < m:
            h_in, mb, recvs = sch.recv_forward(warmup + i + 1)
        else:
            recvs = []
        p2p_exchange(sends, recvs, sch.dims.staging)
    for i in range(m - warmup, m):                             # cool-down: backwards only
        dy, recvs = sch.recv_backward(i)
        p2p_exchange([], recvs, sch.dims.staging)
        p2p_exchange(sch.send_backward(sch.backward(dy)), [], sch.dims.staging)
    return sch.loss_sum * sch.loss_scale, sch.metrics


@torch.no_grad()
def forward_only(model: nn.Module, dims: ParallelDims, microbatches, fn) -> list:
    """Inference through the pipeline (e.g. the old-policy log-probs of GRPO): each micro-batch flows
    stage to stage, `fn(model, h [B,S,M,D], mb)` runs on the last stage, and its per-micro-batch results are
    broadcast to every stage of the pipeline (they are small, e.g. [B,S] log-probs). Returns that list."""
    sch = _Schedule(model, dims, microbatches, loss_fn=None, loss_scale=1.0 if dims.is_first_stage else None)
    results = []
    for i in range(len(sch.meta["fields"])):
        h_in, mb, recvs = sch.recv_forward(i)
        p2p_exchange([], recvs, sch.dims.staging)
        ids = mb["input_ids"]
        h = model.run_layers(model.embed_streams(ids) if dims.is_first_stage else h_in, ids,
                             routed=mb.get(ROUTED_FIELD), indexed=mb.get(INDEXED_FIELD))
        p2p_exchange(sch.send_forward(h, mb), [], sch.dims.staging)
        if dims.is_last_stage:
            results.append(fn(model, h, mb).cpu())
    if dims.pp > 1:
        box = [results if dims.is_last_stage else None]
        dist.broadcast_object_list(box, src=dims.pp_ranks[-1], group=dims.pp_group, device=dims.object_device)
        results = box[0]
    return results

