"""The training side of the GRPO loop: the `Trainer`, which owns this rank's model stage, grid and optimizer.

Placement. Every rank builds the full model on the meta device (no memory), applies the parallel layout
through the engine's one seam (`nanoflash.parallel.parallelize`: freeze list, this EP rank's experts, this PP
stage's layers, recompute), casts to the training dtype and only then materialises what it kept directly on
its device (`cuda:LOCAL_RANK` under NCCL, the CPU under gloo). Weights come from a seeded init that is
layout-independent (`Transformer.init_weights` seeds every tensor by its official name) or from a checkpoint
(HF layout or DCP), of which each rank reads only its own tensors. The optimizer is created last
(`start_optimizer`), after the checkpoint load and any supervised warm-up, because AdamW copies its fp32
master from the weights as they are at that moment. With FP8 pushes (`rollout.weights=fp8`, and
`optim.round_to_served`) the fp32 weights the push sends in bf16 -- norms, head, compressors, kept fp32 for
their arithmetic as in the official model -- hold bf16 values from then on (`served_storage`): the trainer
scores and steps the very weights the servers run, and the updates accumulate in the fp32 master. Which
weights those are is SGLang's rule, not the trainer's: the loop hands it in (`Trainer(served_storage=)`,
`sglang.buckets.optimizer_storage`).

One GRPO step on this rank's data shard (`grpo.RolloutBatch` rows [d B / D, (d+1) B / D) of data rank d of
D = DP x EP, held only by first pipeline stages; later stages receive everything through the pipeline):

    1. samples -> token-budget micro-batches (`parallel.microbatch.pack_microbatches`, B x S_max <= budget)
       whose count is equalised over the data group (`equalize_count`: every MoE layer is an EP collective)
    2. `logprobs`: old_logp = log_softmax(f_theta(x) / T)[target], `parallel.pipeline.forward_only` at any PP,
       the head at the scored positions only (the mask: no head and log-softmax over the prompt).
       In matched-precision mode (fp32 trainer, fp32 engine) every sample is scored alone without padding and
       the head over every position, the exact call the embedded engine makes, so
       train_rollout_logprob_abs_diff is exactly 0
    3. `train`: GRPO loss (`grpo.policy_loss`, summed per micro-batch, denom 1) through the engine's
       `train_step` with loss_scale = 1 / Z, Z the global normaliser (samples for seq-mean-token-mean,
       response tokens for token-mean, summed over the data group): 1F1B -> gradient all-reduce -> clip -> AdamW.
       The loss metrics come back from `train_step` already summed over shards and divided by Z.

Routing replay (R3) is data: the rollout's experts `routed_experts` [B,S,n_layers,K] are a micro-batch field,
travel through the pipeline with the other fields and reach every gate (`Transformer.run_layers(routed=)`),
so it works at any PP and with activation recompute. Indexer replay likewise: `indexer_topk` [B,S,n_c4,K]
(entry + 1, 0 = none: zero padding keeps nothing) reaches every C4 layer (`run_layers(indexed=)`).

Weights for the rollout engines: `state_iter()` yields this rank's (official name, device tensor) pairs.
TEMPORARY (until per-stage weight sync): `gather_full_state` merges every rank's pieces on rank 0, refused
above `MAX_GATHER_PARAMS`.

Tests: `pytest tests/test_trainer.py tests/test_train_e2e.py -q`.
"""
from __future__ import annotations

import datetime
import math
import time

import torch
import torch.distributed as dist

from nanoflash import grpo
from nanoflash.checkpoint import load_hf_checkpoint
from nanoflash.model import Transformer
from nanoflash.parallel.dcp import latest_checkpoint, load_checkpoint, load_latest, save_checkpoint
from nanoflash.parallel.microbatch import equalize_count, pack_microbatches
from nanoflash.parallel.optim import AdamW
from nanoflash.parallel.pipeline import forward_only
from nanoflash.parallel.train_step import global_count, parallelize, stage_logprobs, train_step

LOSS_KEYS = ("pg_loss", "pg_clipfrac", "ppo_kl", "ess_ratio", "ois", "tis", "tis_clipfrac", "tis_abs",
             "train_rollout_logprob_abs_diff", "train_rollout_kl", "train_rollout_kl_k1")
FIELDS = ("input_ids", "targets", "mask", "advantages", "rollout_logprobs")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# TEMPORARY rank-0 gather for the weight push: a full fp32 copy on one host is fine for tiny / small (2.1B),
# not for flash (284B: ~1.1 TiB). The per-stage push of the weight-sync issue replaces it.
MAX_GATHER_PARAMS = 4_000_000_000


# ---------------------------------------------------------------------------------------------- placement
def resolve_device(name: str, dims) -> torch.device:
    """`ParallelConfig.device` -> this rank's device: auto = cuda:LOCAL_RANK under nccl (cuda:0 for colocated
    ranks), else the CPU."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("parallel.device=cuda but no CUDA device is visible")
        if dims.world_size > 1 and dist.get_backend() != "nccl" and not dims.colocate:
            raise ValueError("parallel.device=cuda with several ranks needs the nccl backend, or "
                             "parallel.colocate_ranks (every rank on one GPU over gloo)")
        return torch.device("cuda", torch.cuda.current_device())
    return dims.device


def cap_gpu_memory(device: torch.device, fraction: float) -> float | None:
    """`ParallelConfig.gpu_memory_fraction` on this rank's GPU (torch.cuda.set_per_process_memory_fraction): the
    caching allocator then stays under fraction x the GPU's memory, freeing its cache and retrying before it
    raises. Colocated with a rollout server (SGLang sizes its pool once, at start, from what is free), a trainer
    that grows its cache into the memory the server allocates per batch kills the server, not itself (one H200,
    2026-12-03: the one-step-off run's trainer and SGLang's prefill met at 142,960 of 143,771 MiB). Returns the
    cap in GiB, None when there is none (fraction 0, or not a CUDA device)."""
    if not fraction or device.type != "cuda":
        return None
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction * torch.cuda.get_device_properties(device).total_memory / 2 ** 30


def build_model(mcfg, dims, par, dtype: torch.dtype, device, seed: int | None = 0, train_mtp: bool = False,
                materialize: bool = True):
    """Meta -> parallelize -> cast -> materialise on `device` -> seeded init (seed=None: leave the storage for a
    checkpoint load, which must overwrite every tensor; materialize=False: leave it on meta for a loader that
    checks the checkpoint first, `load_hf_checkpoint`). Returns this rank's stage, experts and buffers."""
    with torch.device("meta"):
        model = Transformer(mcfg)
    model.full_params = sum(p.numel() for p in model.parameters())  # before the cut: the whole model
    parallelize(model, dims, par, train_mtp)
    if dtype != torch.float32:
        model.cast_(dtype)
    if not materialize:
        return model
    model.to_empty(device=device)
    if seed is not None:
        model.init_weights(seed)
    return model


def make_optimizer(model, oc, lr: float | None = None, offload: bool = False, storage: dict | None = None) -> AdamW:
    """AdamW over the trainable parameters the rank holds; its fp32 master is copied from the weights NOW
    (`storage`: `served_storage`, parameters rounded to what the servers hold)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return AdamW(params, lr=oc.lr if lr is None else lr, weight_decay=oc.weight_decay, betas=(oc.beta1, oc.beta2),
                 eps=oc.eps, offload=offload, storage=storage)


# ---------------------------------------------------------------------------------------------- micro-batches
def shard_rows(n: int, dims) -> tuple[int, int]:
    """Rows [a, b) of an n-row global batch that data shard `dims.data_rank` trains on."""
    D, d = dims.data_world, dims.data_rank
    return n * d // D, n * (d + 1) // D


def batch_samples(batch: grpo.RolloutBatch, fields) -> list[dict]:
    """Row b of `batch` -> {field: [L_b,...]} trimmed to its real length L_b = P_b + R_b - 1."""
    lens = (batch.prompt_lens + batch.response_lens - 1).tolist()
    cols = {k: getattr(batch, k) for k in fields if getattr(batch, k, None) is not None}
    return [{k: v[b, :L] for k, v in cols.items()} for b, L in enumerate(lens)]


def _template(batch: grpo.RolloutBatch, fields) -> dict:
    """A one-token all-zero sample with `batch`'s fields (a dummy for a shard that holds no rows)."""
    return {k: getattr(batch, k).new_zeros((1, *getattr(batch, k).shape[2:])) for k in fields
            if getattr(batch, k, None) is not None}


class Trainer:
    """This rank's trainer: model stage on its device, the `ParallelDims` grid, the optimizer.

        trainer.step(batch, step) -> metrics             scatter -> old log-probs -> the GRPO step at lr_at(step)
        trainer.logprobs(shard)   -> old_logp [b,S]      trainer.train(shard) -> global metrics
        trainer.state_iter()      -> (official name, device tensor) of what this rank holds

    `shard` is this data rank's `grpo.RolloutBatch` on first pipeline stages and None on the others.
    Shapes: [b,S] rows of the shard; S its padded length.
    """

    def __init__(self, cfg, mcfg, dims, checkpoint: str = "", checkpoint_is_dcp: bool = False, served_storage=None):
        tc, par = cfg.train, cfg.parallel
        self.cfg, self.dims, self.par, self.oc, self.gc = cfg, dims, par, cfg.optim, cfg.grpo
        self.device, self.dtype = resolve_device(par.device, dims), DTYPES[tc.dtype]
        self.memory_cap_gib = cap_gpu_memory(self.device, par.gpu_memory_fraction)
        self.temperature, self.replay = cfg.rollout.temperature, cfg.rollout.routing_replay
        self.indexer_replay = cfg.rollout.indexer_replay
        self.matched = cfg.rollout.weights == "fp32" and tc.dtype == "fp32"  # batch-invariant scoring
        hf = bool(checkpoint) and not checkpoint_is_dcp   # the HF loader checks every header, then materialises
        self.model = build_model(mcfg, dims, par, self.dtype, self.device, None if checkpoint else tc.seed,
                                 cfg.optim.train_mtp, materialize=not hf)
        if checkpoint and checkpoint_is_dcp:
            load_checkpoint(checkpoint, self.model, None, dims)
        elif checkpoint:
            load_hf_checkpoint(self.model, checkpoint, device=self.device)
        self.optimizer: AdamW | None = None
        self.pending_save, self.save_group = None, None   # an async checkpoint in flight; the gloo group it writes on
        self.served_storage = served_storage  # model -> {name: dtype the servers hold}, or None (the loop's choice)

    # ------------------------------------------------------------------ state
    def start_optimizer(self) -> AdamW:
        """Create the GRPO optimizer from the weights as they are now (after load and warm-up)."""
        storage = self.served_storage(self.model) if self.served_storage is not None else None
        self.optimizer = make_optimizer(self.model, self.oc, offload=self.par.offload_optimizer, storage=storage)
        return self.optimizer

    def state_iter(self):
        """(official name, tensor on this rank's device) for every parameter and buffer this rank holds."""
        yield from self.model.state_dict().items()

    def save(self, root: str, step: int, extra: dict, keep: int, async_save: bool = False,
             files: dict | None = None) -> None:
        """DCP save of model + optimizer (+ rank 0's `files`: parallel.dcp). The ranks first meet on the gloo side group (long timeout): rank 0
        may still be evaluating or pushing, and the save's own collectives run under the training timeout.
        `async_save`: written by a thread on a gloo group of its own while the next step's rollout runs;
        `finish_save` (called by `step` before anything changes the weights) waits for it."""
        self.finish_save()
        if self.dims.side_group is not None:
            dist.barrier(group=self.dims.side_group)
        self.require_finite("at a checkpoint save")
        if async_save and self.dims.world_size > 1 and self.save_group is None:  # every rank, same point: collective
            self.save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.par.wait_timeout_s))
        out = save_checkpoint(root, step, self.model, self.optimizer, self.dims, extra=extra, keep=keep,
                              async_save=async_save, group=self.save_group if async_save else None,
                              files=files)
        self.pending_save = out if async_save else None

    def finish_save(self) -> str | None:
        """Wait for an asynchronous save in flight; every rank learns whether every rank's part succeeded (one
        all-reduce on the side group) and all stop together, naming the failed ranks, if one did not. The
        uncommitted `step_N.tmp` stays behind; the last committed checkpoint is the one a restart resumes."""
        pending, self.pending_save = self.pending_save, None
        if pending is None:
            return None
        err = ""
        try:
            pending.wait()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        bad = torch.tensor([float(bool(err))])
        if self.dims.world_size > 1:
            dist.all_reduce(bad, group=self.dims.side_group)
        if int(bad):
            where = f"rank {self.dims.rank}: {err}" if err else "another rank"
            raise SystemExit(f"checkpoint {pending.path} failed on {int(bad)} rank(s) ({where}); not committed, "
                             f"a restart resumes from the last committed checkpoint")
        return pending.path

    def resume(self, root: str) -> tuple[str | None, dict | None]:
        """Model + optimizer state (and RNG) from the newest checkpoint under `root` that verifies (a corrupt
        one is reported and the previous one used). Returns (path, meta), (None, None) when there is none."""
        if latest_checkpoint(root) is None:  # a fresh run: the optimizer is taken after any warm-up instead
            return load_latest(root, None, None, self.dims)  # loads nothing; moves aside a step_N without meta
        if self.optimizer is None:
            self.start_optimizer()
        return load_latest(root, self.model, self.optimizer, self.dims)

    # ------------------------------------------------------------------ micro-batches
    def micro_batches(self, shard, fields, per_sample: bool = False):
        """This shard's samples packed by token budget, the count equalised over the data group.
        -> (list of {field: [b,s,...]}, sample indices of each) on first stages; (None, None) elsewhere."""
        if not self.dims.is_first_stage:
            return None, None
        samples = batch_samples(shard, fields)
        mbs, groups = pack_microbatches(samples, self.par.micro_batch_tokens, 1 if per_sample else None)
        return equalize_count(mbs, groups, self.dims, template=_template(shard, fields))

    def _fields(self, *extra) -> tuple:
        return FIELDS + extra + (("routed_experts",) if self.replay else ()) + (
            ("indexer_topk",) if self.indexer_replay else ())

    # ------------------------------------------------------------------ GRPO
    def lr_at(self, step: int) -> float:
        """The schedule: linear warm-up over `train.lr_warmup_steps`, then constant (the V4 recipe)."""
        w = self.cfg.train.lr_warmup_steps
        return self.oc.lr * min(1.0, step / w) if w else self.oc.lr

    def step(self, batch, step: int, before_update=None) -> dict:
        """One GRPO step on every rank: rank 0's packed global `batch` is scattered (each data rank's first
        stage gets its shard), the old log-probs are taken, `before_update(batch, old)` (rank 0: the loop's
        hooks) sees them, and one optimizer step runs at `lr_at(step)`. -> metrics. With no rows, no step."""
        self.finish_save()   # a checkpoint written meanwhile (the rollout) is done before the weights change
        shard, head = scatter_shards(batch, self.dims, {})
        if not head["rows"]:
            return {}
        t0 = time.time()
        old = self.logprobs(shard)
        m = {"logprobs_s": time.time() - t0}
        if shard is not None:
            shard.old_logprobs = old
        if before_update is not None and batch is not None:
            m.update(before_update(batch, old))
        self.optimizer.lr = self.lr_at(step)
        m.update(lr=self.optimizer.lr, **self.train(shard))
        n_tok = float(batch.mask.sum()) if batch is not None else 0.0
        m.update(train_s=time.time() - t0, train_tokens_per_s=n_tok / (time.time() - t0),
                 optim_s=self.optimizer.last_step_s)
        return m

    @torch.no_grad()
    def logprobs(self, shard) -> torch.Tensor | None:
        """The trainer's log-probs of the shard's scored positions (`mask`; no grad), through the pipeline.
        -> [b,S] fp32 on the CPU on first stages (0 off the mask), None elsewhere. Matched precision scores
        every position, the embedded engine's exact call (the head's GEMMs over other rows may differ in ulps)."""
        mbs, groups = self.micro_batches(shard, self._fields(), per_sample=self.matched)
        T, matched = self.temperature, self.matched
        lps = forward_only(self.model, self.dims, mbs, lambda m, h, mb: stage_logprobs(
            m, h, mb["targets"], T, None if matched else mb["mask"]))
        if mbs is None:
            return None
        old = torch.zeros_like(shard.rollout_logprobs)
        lens = (shard.prompt_lens + shard.response_lens - 1).tolist()
        for lp, g in zip(lps, groups):
            for j, i in enumerate(g):
                old[i, :lens[i]] = lp[j, :lens[i]].float()
        return torch.where(shard.mask > 0, old, 0.0)

    def train(self, shard) -> dict:
        """One optimizer step of the GRPO loss on the shard (`shard.old_logprobs` filled). -> global metrics."""
        gc, first = self.gc, self.dims.is_first_stage
        mbs, _ = self.micro_batches(shard, self._fields("old_logprobs"))
        Z = global_count(grpo.loss_denominator(shard.mask, gc.aggregation), self.dims) if first else None
        T, lc = self.temperature, grpo.LossConfig.of(gc)

        def loss_fn(m, h, mb):
            lp = stage_logprobs(m, h, mb["targets"], T, mb["mask"])   # the head at the response tokens only
            loss, met = grpo.policy_loss(lp, mb["old_logprobs"], mb["advantages"], mb["mask"], lc,
                                         rollout_logp=mb["rollout_logprobs"], denom=1.0)
            return loss, {k: met[k] for k in LOSS_KEYS if k in met}
        out = train_step(self.model, self.dims, mbs, self.optimizer, 1.0 / max(Z, 1.0) if first else None,
                         loss_fn=loss_fn, grad_clip=self.oc.grad_clip)
        if not out["skipped"]:
            self.require_finite(f"after the optimizer update (lr {self.optimizer.lr:g})")
        return out

    def require_finite(self, when: str) -> None:
        """Stop the run, on every rank, if any weight of any rank is NaN/inf or larger in magnitude than
        `train.max_abs_weight` (an exploded update: finite, but no model any more); nothing such is ever
        pushed or saved. One |w| max per tensor (NaN propagates through it), read in one host sync, all-reduced once."""
        limit, bad, big = self.cfg.train.max_abs_weight, [], []
        held = [(n, t) for n, t in self.state_iter() if t.is_floating_point() and t.numel()]
        amax = torch.stack([t.detach().abs().amax().float() for _, t in held]).tolist() if held else []  # 1 sync
        for (n, _), a in zip(held, amax):
            if not math.isfinite(a):
                bad.append(n)
            elif a > limit:
                big.append(f"{n} |w| {a:.3g}")
        n = torch.tensor([len(bad), len(big)], device=self.dims.device)
        if self.dims.world_size > 1:
            dist.all_reduce(n)
        if int(n.sum()):
            what = (f"{int(n[0])} weight tensors are non-finite" if int(n[0]) else
                    f"{int(n[1])} weight tensors exploded past |w| {limit:g} (train.max_abs_weight)")
            where = f"rank {self.dims.rank}: {(bad or big)[:3]}" if bad or big else "another rank"
            raise SystemExit(f"diverged: {what} {when} ({where}); nothing was pushed or saved, the last "
                             f"checkpoint is the last good state -- lower --optim.lr")

    def sft_step(self, problems: list, task, optimizer) -> float:
        """One supervised step on reference answers: -mean log p(answer + eos | prompt) over answer tokens.
        Every rank of the data group passes the same problems; each trains its own shard of them."""
        answers = [_answer_ids(task, p) for p in problems]
        eps = [grpo.Episode(task.encode(p), a, [0.0] * len(a), 0.0, i) for i, (p, a) in enumerate(zip(problems, answers))]
        batch = grpo.pack(eps, torch.zeros(len(eps)), task.pad_id)
        shard = batch.rows(*shard_rows(len(batch), self.dims))
        mbs, _ = self.micro_batches(shard, ("input_ids", "targets", "mask"))
        if mbs is not None:
            mbs = [{"input_ids": mb["input_ids"], "targets": mb["targets"], "loss_mask": mb["mask"]} for mb in mbs]
        n_tok = global_count(float(shard.mask.sum()), self.dims)
        return train_step(self.model, self.dims, mbs, optimizer, 1.0 / n_tok, grad_clip=self.oc.grad_clip)["loss"]


def _answer_ids(task, problem) -> list:
    """Token ids of the reference response: the answer text, then the first stop id."""
    full = task.encode(problem.__class__(problem.id, problem.prompt + problem.answer, problem.answer))
    return full[len(task.encode(problem)):] + [task.stop_ids[0]]


# ---------------------------------------------------------------------------------------------- data
def scatter_shards(batch: grpo.RolloutBatch | None, dims, header: dict) -> tuple[grpo.RolloutBatch | None, dict]:
    """Rank 0's global batch -> each first-stage rank receives only its data shard's rows, as tensors, over
    the gloo side group (whose long timeout lets the others wait out a minutes-long rollout). `header` (a
    small dict) reaches every rank. Returns (this rank's shard or None, header)."""
    header = dict(header, rows=len(batch) if batch is not None else 0)
    if dims.world_size == 1:
        return batch, header
    box = [header] if dims.rank == 0 else [None]
    dist.broadcast_object_list(box, src=0, group=dims.side_group)
    header = box[0]
    if not header["rows"] or not dims.is_first_stage:  # rank 0 is always on the first stage
        return None, header
    first = dims.grid[0].flatten().tolist()  # global ranks of the first stage, data rank order
    if dims.rank == 0:
        for d, dst in enumerate(first[1:], start=1):
            a, b = header["rows"] * d // len(first), header["rows"] * (d + 1) // len(first)
            _send_batch(batch.rows(a, b), dst, dims.side_group)
        return (batch.rows(*shard_rows(len(batch), dims)) if dims.is_first_stage else None), header
    return _recv_batch(dims.side_group), header


def _send_batch(part: grpo.RolloutBatch, dst: int, group) -> None:
    tensors = {k: v.contiguous() for k, v in vars(part).items() if torch.is_tensor(v)}
    dist.send_object_list([{k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}], dst=dst, group=group)
    for k in sorted(tensors):
        dist.send(tensors[k], dst=dst, group=group)


def _recv_batch(group) -> grpo.RolloutBatch:
    box = [None]
    dist.recv_object_list(box, src=0, group=group)
    tensors = {}
    for k in sorted(box[0]):
        shape, dtype = box[0][k]
        tensors[k] = torch.empty(shape, dtype=dtype)
        dist.recv(tensors[k], src=0, group=group)
    return grpo.RolloutBatch(**tensors)


def gather_full_state(actor: Trainer) -> dict | None:
    """TEMPORARY: every rank's `state_iter()` merged on rank 0 (CPU tensors; None elsewhere), over the side
    group. Refused above MAX_GATHER_PARAMS: at flash scale each stage must push its own slice."""
    dims, model = actor.dims, actor.model
    if dims.world_size > 1 and model.full_params > MAX_GATHER_PARAMS:
        raise SystemExit(f"the weight push still gathers the whole model on rank 0 ({model.full_params / 1e9:.0f}B "
                         f"parameters > {MAX_GATHER_PARAMS / 1e9:.0f}B): not possible for this preset until the "
                         f"per-stage weight sync lands; use tiny/small, or a single process")
    sd = {k: v.detach().cpu() for k, v in actor.state_iter()}
    if dims.world_size == 1:
        return sd
    parts = [None] * dims.world_size if dims.rank == 0 else None
    dist.gather_object(sd, parts, dst=0, group=dims.side_group)
    return {k: v for part in parts for k, v in part.items()} if dims.rank == 0 else None
