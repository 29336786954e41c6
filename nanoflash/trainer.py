"""The training side of the GRPO loop: build, micro-batches, log-prob recompute, the GRPO step, warm-up, state.

One GRPO step on a packed batch (`grpo.RolloutBatch`, every rank holds the whole batch; data rank d of D
trains rows [d B / D, (d+1) B / D)):

    1. micro-batches by token budget: consecutive rows while rows x longest row <= micro_batch_tokens
    2. recompute  old_logp = log_softmax(f_theta(x) / T)[target], no gradient. In matched-precision mode
       (fp32 trainer, fp32 engine) it runs one sequence at a time without padding, the exact call the
       embedded engine makes when it scores a sample, so train_rollout_logprob_abs_diff is exactly 0
    3. GRPO loss (`grpo.policy_loss`) summed per micro-batch (denom 1), scaled by 1 / Z with Z the global
       normaliser (samples for seq-mean-token-mean, response tokens for token-mean), through the parallel engine's
       `train_step`: 1F1B forward/backward -> gradient all-reduce -> global-norm clip -> AdamW
    4. metrics: the policy-loss sums / Z, all-reduced over the world (only last stages contribute)

Routing replay (R3): `ReplayView` wraps the model for the pipeline schedule; before each micro-batch's
layers run it loads that micro-batch's recorded experts into every score-routed `Gate.replay` (hash layers
route by token id anyway). The 1F1B schedule runs forwards in micro-batch order, so a FIFO per stage is
enough. Replay with activation recompute is only correct at PP=1 (the recomputed forward runs inside the
backward of the same micro-batch, after which the next one is armed); the trainer refuses PP>1 with both.

Weights for the rollout engines live in one process: with PP/EP, rank 0 gathers every rank's state dict
(`gather_full_state`, names are global FQNs so a dict merge rebuilds the full model) into a full-size
shadow model. Fine for tiny/small; at flash scale Miles streams per-stage buckets instead.

Tests: `pytest tests/test_train_e2e.py -q`.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from nanoflash import grpo
from nanoflash.model import Transformer, chunked_logprobs
from nanoflash.parallel.expert import apply_expert_parallel
from nanoflash.parallel.optim import AdamW, trainable_parameters
from nanoflash.parallel.pipeline import build_stage, forward_backward
from nanoflash.parallel.train_step import global_count, train_step

LOSS_KEYS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "ess_ratio", "ois", "tis", "tis_clipfrac", "tis_abs",
             "train_rollout_logprob_abs_diff", "train_rollout_kl", "train_rollout_kl_k1")
FIELDS = ("input_ids", "targets", "mask", "advantages", "rollout_logprobs")


# ---------------------------------------------------------------------------------------------- build
def build_model(mcfg, dims, par, seed: int, dtype: torch.dtype, init: bool = True):
    """Full model -> this rank's stage and experts. init=True: seeded random init (same on every layout);
    init=False: built on meta and materialised empty (a checkpoint load overwrites every tensor)."""
    if init:
        model = Transformer(mcfg).init_weights(seed)
    else:
        with torch.device("meta"):
            model = Transformer(mcfg)
    model = apply_expert_parallel(build_stage(model, dims, par.layer_split), dims)
    if not init:
        model = model.to_empty(device="cpu")
    if dtype != torch.float32:
        model.cast_(dtype)
    model.recompute = par.recompute
    return model


def make_optimizer(model, oc, lr: float | None = None, offload: bool = False) -> AdamW:
    return AdamW(trainable_parameters(model, oc.train_mtp), lr=oc.lr if lr is None else lr,
                 weight_decay=oc.weight_decay, betas=(oc.beta1, oc.beta2), eps=oc.eps, offload=offload)


def gather_full_state(model, dims) -> dict | None:
    """Every rank's state dict merged on rank 0 (None elsewhere); the rank's own dict when world size is 1."""
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if dims.world_size == 1:
        return sd
    parts = [None] * dims.world_size if dims.rank == 0 else None
    dist.gather_object(sd, parts, dst=0)
    if dims.rank != 0:
        return None
    return {k: v for part in parts for k, v in part.items()}


def broadcast(obj, dims, src: int = 0):
    """Python object from `src` to every rank (the rollout happens on rank 0 only)."""
    if dims.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ---------------------------------------------------------------------------------------------- replay
def set_replay(model, rx: torch.Tensor | None) -> None:
    """Arm (rx [B,S,n_layers,K]) or disarm (None) routing replay on every score-routed gate of `model`."""
    for key, layer in model.layers.items():
        gate = layer.ffn.gate
        if not gate.hash:
            gate.replay = None if rx is None else rx[:, :, int(key)].reshape(-1, rx.shape[-1])  # [B*S,K]


class ReplayView:
    """The model as the pipeline schedule sees it, arming each micro-batch's replay before its layers run."""

    def __init__(self, model, replays: list):
        self._model, self._queue = model, deque(replays)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def run_layers(self, h, input_ids, *args):
        set_replay(self._model, self._queue.popleft())
        return self._model.run_layers(h, input_ids, *args)


# ---------------------------------------------------------------------------------------------- batches
def shard_rows(n: int, dims) -> tuple[int, int]:
    """Rows [a, b) of an n-row batch that this rank's data shard trains on."""
    D, d = dims.data_world, dims.data_rank
    return n * d // D, n * (d + 1) // D


def micro_batches(batch: grpo.RolloutBatch, budget: int, start: int, stop: int, per_sample: bool = False) -> list:
    """Consecutive rows of [start, stop) grouped while rows x longest <= budget (>= 1 row), each trimmed to its
    longest row. -> list of dicts of [b,s] tensors (+ routed_experts [b,s,L,K], old_logprobs when present)"""
    lens = (batch.prompt_lens + batch.response_lens - 1).tolist()
    out, a = [], start
    while a < stop:
        b = a + 1
        while not per_sample and b < stop and (b + 1 - a) * max(lens[a:b + 1]) <= budget:
            b += 1
        S, part = max(lens[a:b]), batch.rows(a, b)
        mb = {k: getattr(part, k)[:, :S] for k in FIELDS}
        for k in ("routed_experts", "old_logprobs"):
            if getattr(part, k) is not None:
                mb[k] = getattr(part, k)[:, :S]
        mb["rows"] = torch.arange(a, b)
        out.append(mb)
        a = b
    return out


def _replays(mbs, on: bool) -> list:
    return [mb.get("routed_experts") if on else None for mb in mbs]


@torch.no_grad()
def _local_logprobs(model, mbs, temperature: float, replay: bool) -> list:
    out = []
    for mb in mbs:
        set_replay(model, mb.get("routed_experts") if replay else None)
        out.append(model.token_logprobs(mb["input_ids"], mb["targets"], temperature=temperature))
    set_replay(model, None)
    return out


def recompute_logprobs(model, dims, batch, par, temperature: float, matched: bool, replay: bool) -> torch.Tensor:
    """The trainer's log-probs of every response token of this rank's shard (no grad). -> [B,S] fp32
    (rows of other shards stay 0). PP>1: a pipeline pass whose loss is 0 x logp; the last stage's values are
    then broadcast over the pipeline group."""
    a, b = shard_rows(len(batch), dims)
    mbs = micro_batches(batch, par.micro_batch_tokens, a, b, per_sample=matched)
    old = torch.zeros_like(batch.rollout_logprobs)
    if dims.pp == 1:
        lps = _local_logprobs(model, mbs, temperature, replay)
    else:
        lps = []

        def capture(m, h, mb):
            lp = chunked_logprobs(m.hidden(h), m.head.weight, mb["targets"], temperature)
            lps.append(lp.detach())
            return lp.sum() * 0.0
        forward_backward(ReplayView(model, _replays(mbs, replay)), dims, mbs, capture, loss_scale=0.0)
        set_replay(model, None)
        for p in model.parameters():
            p.grad = None
        box = [lps]
        dist.broadcast_object_list(box, src=dims.pp_ranks[-1], group=dims.pp_group)
        lps = box[0]
    for mb, lp in zip(mbs, lps):
        old[mb["rows"], :lp.shape[1]] = lp.float()
    return old


def grpo_step(model, dims, batch, optimizer, gc, oc, par, temperature: float, replay: bool) -> dict:
    """One optimizer step of the GRPO loss on `batch` (old_logprobs filled). Returns global metrics."""
    a, b = shard_rows(len(batch), dims)
    mbs = micro_batches(batch, par.micro_batch_tokens, a, b)
    Z = grpo.loss_denominator(batch.mask, gc.aggregation)  # every rank holds the whole batch: Z is already global
    sums = torch.zeros(len(LOSS_KEYS), dtype=torch.float64)

    def loss_fn(m, h, mb):
        lp = chunked_logprobs(m.hidden(h), m.head.weight, mb["targets"], temperature)
        loss, met = grpo.policy_loss(
            lp, mb["old_logprobs"], mb["advantages"], mb["mask"], clip_low=gc.clip_low, clip_high=gc.clip_high,
            clip_c=gc.clip_c, rollout_logp=mb["rollout_logprobs"], tis_cap=gc.tis_cap if gc.use_tis else None,
            aggregation=gc.aggregation, denom=1.0)
        sums.add_(torch.tensor([float(met.get(k, 0.0)) for k in LOSS_KEYS], dtype=torch.float64))
        return loss
    out = train_step(ReplayView(model, _replays(mbs, replay)), dims, mbs, optimizer, 1.0 / max(Z, 1.0),
                     loss_fn=loss_fn, grad_clip=oc.grad_clip)
    set_replay(model, None)
    if dims.world_size > 1:
        dist.all_reduce(sums)
    m = {k: float(v) / max(Z, 1.0) for k, v in zip(LOSS_KEYS, sums)}
    m.update(grad_norm=out["grad_norm"], loss=out["loss"])
    return m


# ---------------------------------------------------------------------------------------------- warm-up
def sft_step(model, dims, optimizer, problems: list, task, par, oc) -> float:
    """One supervised step on reference answers: -mean log p(answer + eos | prompt) over answer tokens."""
    answers = [_answer_ids(task, p) for p in problems]
    eps = [grpo.Episode(task.encode(p), a, [0.0] * len(a), 0.0, i) for i, (p, a) in enumerate(zip(problems, answers))]
    batch = grpo.pack(eps, torch.zeros(len(eps)), task.pad_id)
    a, b = shard_rows(len(batch), dims)
    mbs = [{"input_ids": mb["input_ids"], "targets": mb["targets"], "loss_mask": mb["mask"]}
           for mb in micro_batches(batch, par.micro_batch_tokens, a, b)]
    n_tok = global_count(sum(float(mb["loss_mask"].sum()) for mb in mbs), dims)
    return train_step(model, dims, mbs, optimizer, 1.0 / n_tok, grad_clip=oc.grad_clip)["loss"]


def _answer_ids(task, problem) -> list:
    """Token ids of the reference response: the answer text, then the first stop id."""
    full = task.encode(problem.__class__(problem.id, problem.prompt + problem.answer, problem.answer))
    return full[len(task.encode(problem)):] + [task.stop_ids[0]]
