"""One optimizer step of the engine: pipeline forward/backward -> gradient reduction -> global clip -> AdamW.

Loss scaling. The objective of a step is L = (1/Z) * sum over the global batch of per-token (or per-sample)
losses l_i, where Z is the *global* normaliser (number of loss tokens, or of samples). Every rank backprops
`loss_sum(micro-batch) / Z`; gradients are then SUMMED (not averaged) over the ranks that hold different data.
Since d/dtheta of a sum is the sum of the d/dtheta, the result is the same for any split of the same global
batch into micro-batches, DP replicas or EP shards (up to the floating-point summation order).

Gradient reduction (after the pipeline has accumulated every micro-batch):
    dense parameter   replicated on all (dp, ep) ranks of a stage -> all-reduce SUM over `data_group`
    routed expert     one EP shard, replicated over DP           -> all-reduce SUM over `dp_group`
A trainable parameter that got no gradient on some rank (an expert no token chose) joins with zeros.

Global norm for clipping: ||g||^2 = sum over *distinct* parameters. After the reduction every replica holds the
same gradient, so a dense gradient is counted only on (dp=0, ep=0) of its stage and an expert gradient only on
dp=0; the partial sums are then all-reduced over the world. g <- g * min(1, clip / (||g|| + 1e-6)).

How this differs from production: no overlap of the gradient all-reduce with backward (Megatron / FSDP bucket
and overlap), no reduce-scatter of optimizer state (ZeRO-1). Tests: `pytest tests/test_parallel_parity.py -q`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from nanoflash.parallel.comm import all_reduce_
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.expert import apply_expert_parallel, expert_param_names
from nanoflash.parallel.optim import AdamW, trainable_parameters
from nanoflash.parallel.pipeline import build_stage, forward_backward

CLIP_EPS = 1e-6  # added to the norm in the clip factor (as torch.nn.utils.clip_grad_norm_)


def stage_logprobs(model: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, mask=None):
    """log softmax(logits / T)[targets] from the last stage's streams (the pipeline form of
    `Transformer.token_logprobs`, chunked so full-vocabulary logits never exist); `mask` [B,S]: the head runs
    only where it is > 0, the other positions are 0 (`Transformer.head_logprobs`). h [B,S,M,D] -> [B,S] fp32"""
    return model.head_logprobs(h, targets, temperature, mask)


def token_nll_loss(model: nn.Module, h: torch.Tensor, mb: dict) -> torch.Tensor:
    """Sum over tokens of -log p(targets) * loss_mask on the last stage (the pretraining / SFT loss).

    Shapes: h [B,S,M,D], mb["targets"] [B,S] int64, mb["loss_mask"] [B,S] (optional) -> scalar
    """
    mask = mb.get("loss_mask")
    logp = stage_logprobs(model, h, mb["targets"], mask=mask)  # [B,S] fp32, 0 off the mask
    return -(logp if mask is None else logp * mask.float()).sum()


def global_count(x: torch.Tensor, dims: ParallelDims) -> float:
    """Sum of a per-rank count over the data shards of one pipeline (e.g. loss tokens in the global batch).
    Every stage of a pipeline must pass the same value; only the data group (DP x EP) is summed."""
    t = torch.as_tensor(x, dtype=torch.float64, device=dims.device).clone()
    if dims.data_group is not None:
        dist.all_reduce(t, group=dims.data_group)
    return float(t)


def reduce_gradients(model: nn.Module, dims: ParallelDims) -> None:
    """SUM dense grads over DP x EP and expert grads over DP (see module docstring)."""
    dense, expert, experts = [], [], expert_param_names(model)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (expert if name in experts else dense).append(p.grad)
    all_reduce_(dense, dims.data_group)
    all_reduce_(expert, dims.dp_group)


def grad_norm(model: nn.Module, dims: ParallelDims) -> torch.Tensor:
    """Global L2 norm of all distinct gradients over all ranks (fp32)."""
    grads, experts = [p.grad for p in model.parameters() if p.grad is not None], expert_param_names(model)
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else dims.device)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        owner = dims.dp_rank == 0 and (name in experts or dims.ep_rank == 0)
        if owner:
            sq += p.grad.float().square().sum()
    if dims.world_size > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def clip_gradients_(model: nn.Module, dims: ParallelDims, max_norm: float) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (||g|| + eps)); returns ||g|| before clipping."""
    norm = grad_norm(model, dims)
    if max_norm > 0:
        factor = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.device, p.grad.dtype))
    return norm


def parallelize(model: nn.Module, dims: ParallelDims, par, train_mtp: bool = False) -> nn.Module:
    """Apply a `ParallelConfig` to a built model (meta or real), in place: freeze the RL-frozen parameters,
    keep this EP rank's experts, keep this PP stage's layers, set the recompute switch. Materialise / load
    weights afterwards (`to_empty` + `load_hf_checkpoint` or `load_checkpoint`), then `make_optimizer`."""
    trainable_parameters(model, train_mtp)
    apply_expert_parallel(model, dims)
    build_stage(model, dims, par.layer_split)
    model.recompute = par.recompute
    return model


def make_optimizer(model: nn.Module, opt, offload: bool = False) -> AdamW:
    """AdamW (an `OptimConfig`) over the trainable parameters this rank holds; call after weights are real."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert not any(p.is_meta for _, p in params), "make_optimizer needs materialised weights (still on meta)"
    return AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                 offload=offload)


def train_step(model, dims: ParallelDims, microbatches, optimizer, loss_scale: float | None,
               loss_fn=token_nll_loss, grad_clip: float = 1.0) -> dict:
    """forward_backward -> reduce -> clip -> optimizer.step. Returns {"loss", "grad_norm", "skipped"} (global
    values). A non-finite loss or gradient norm skips the optimizer step on every rank (`skipped` True).

    `loss_scale` = 1 / global normaliser (e.g. 1 / global_count(loss tokens) over the first stage's data
    group); like `microbatches` it is only read on the first pipeline stage. The returned loss is the global
    objective sum(loss_fn) * loss_scale, identical on every rank; metrics returned by `loss_fn` (as a
    (loss, {name: scalar}) pair) are scaled the same way: sum over micro-batches and data shards x loss_scale.
    GRPO fits as `loss_fn = lambda m, h, mb: grpo.policy_loss(stage_logprobs(m, h, mb["targets"]), ...,
    denom=1.0)` with loss_scale = 1 / the global `grpo.loss_denominator` (`nanoflash.rl.trainer.Trainer.train`).
    """
    optimizer.zero_grad()
    loss, metrics = forward_backward(model, dims, microbatches, loss_fn, loss_scale)
    reduce_gradients(model, dims)
    norm = clip_gradients_(model, dims, grad_clip)
    out = sum_over_data({"loss": loss, **metrics}, dims)
    out["grad_norm"] = float(norm)
    # Guard: the loss and the norm are global values, identical on every rank, so every rank takes the same
    # decision without another collective. A non-finite one skips the update everywhere.
    out["skipped"] = not (math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"]))
    if out["skipped"]:
        optimizer.zero_grad()
    else:
        optimizer.step()
    return out


def sum_over_data(values: dict, dims: ParallelDims) -> dict:
    """Last stage's {name: scalar} -> the same dict on every rank, summed over the data shards (DP x EP).
    (Broadcast along the pipeline first: only last stages hold the values, and only they know the names.)"""
    if dims.pp > 1:
        box = [{k: float(v) for k, v in values.items()} if dims.is_last_stage else None]
        dist.broadcast_object_list(box, src=dims.pp_ranks[-1], group=dims.pp_group, device=dims.object_device)
        values = box[0]
    names = sorted(values)
    vals = [torch.as_tensor(values[k]).detach().double().reshape(()) for k in names]   # device scalars: no sync yet
    t = torch.stack([v.to(vals[0].device) for v in vals]).to(dims.device)             # one copy, not one per metric
    if dims.data_group is not None:
        dist.all_reduce(t, group=dims.data_group)
    return dict(zip(names, t.tolist()))
