"""Live checks of a GRPO run against its rollout server (issue 20's measurements), a loop hook:

    python train.py ... --train.hooks instruments.live:LiveChecks

Four things the loop's own metrics do not show, each a hook point of `nanoflash.rl.hooks` (rank 0, one process):

1. **The train-rollout gap at token level** (`before_update`, after the trainer's recompute, before the update): per
   response token d_t = |log p_train(y_t) - log p_rollout(y_t)| at the rollout temperature; mean, p99, max,
   and the served model's token entropy H_t = -sum_v p(v) log p(v) at the same positions (a gap is only large
   where the distribution is flat, so entropy is the context it needs).
2. **The FP8 noise floor on the same tokens, in the same step**: a second copy of the model (`sim`) holds the
   trainer's weights as the server holds them -- every weight SGLang serves FP8 rounded to FP8 128x128 blocks
   (`fp8_roundtrip_`), every other weight rounded to the dtype the push sends it in (`storage_roundtrip_`:
   the release's bf16 for the norms, head and compressors the trainer keeps fp32) -- and runs with the FP8
   activation simulation on (`ModelConfig.qat`). floor_t = |log p_sim(y_t) - log p_train(y_t)| is what the
   served format costs; gap/floor near 1 says the server adds nothing beyond it. `floor_fp8` is the same with
   the FP8 rounding only (the fp32 weights kept): runs 3-6 measured that one. The two agree while those weights
   hold bf16 values -- always with `optim.round_to_served` (the default: `buckets.served_storage`), and at a warm
   start read from a release-format checkpoint -- and part once training moves them off the bf16 grid.
   The same tokens are also scored again by the server in one prefill (`probe.prefill_logprobs`, SGLang's
   `logprob_start_len=0`, no prefix cache): prefill_t = |log p_train - log p_server_prefill|. The rollout's
   log-probs come from the server's decode (token by token, KV cache, compressor state carried); prefill
   recomputes everything at once, as the trainer does. prefill near floor while gap is above it puts the excess
   in the server's decode path; both above it, in what the two paths share (weights, kernels).
3. **A behavioural probe after every push** (`after_push`): `rollout.probe.probe` on one fixed held-out
   prompt (fixed sampling seed), scored by the trainer's new weights and by the warm start's; a probe gap above
   `probe.PROBE_MAX_MEAN`, or a server reporting another weight version than the push's (`StagePusher.tag`:
   the step and the launch's nonce), stops the run. The push's `/weights_checker` counts (exact hashes, change sets) are
   logged beside it.
4. **The warm start re-evaluated at each eval point** (`after_eval`, the `eval_warm` record): push the warm-start weights (verified),
   evaluate them with exactly the eval's seeds, push the current weights back (verified); the paired
   difference of per-problem accuracy gives pass@1 gain +- its standard error.

Each step's per-token values are also kept, one file a step (`<train.out_dir>/live_tokens/step_NNNN.pt`: gap,
floor, FP8-only floor, entropy, token id, position in the response, the scoring query's absolute position, prefill
gap; ~100 KB for 3,600 tokens), so a gap the floor does not explain can be traced to the tokens that carry it
(`runstats.excess_by_token`). Every step also splits gap and floor by position band (`bands.band_stats`: the
window, the C4 layers keeping every entry, the indexer's top-k selecting), with each band's share of the tokens.

`LiveChecksLong` (`--train.hooks instruments.live:LiveChecksLong`, the long-context run of issue 42) is the same
with the floor's model scoring its indexer in FP8 as SGLang does (`ModelConfig.indexer_quant="fp8"`: the floor
then measures what SGLang computes, not the official FP4 QAT), and, each step, the C4 entries the trainer's
indexer keeps against those SGLang's FP8 scores would keep, on the scored positions where the top-k selects
(`indexer_agreement`). Its forwards run in row chunks of LIVE_TOKENS tokens and score the entropy at the response
positions only, so 2-4K-token sequences never hold [rows, S, vocabulary] logits.

The entropy is the served model's -- the sim's, the weights as SGLang holds them, whose distribution the
rollout samples -- from the floor's own forward (`masked_scores`: log-probs and entropy together); until
2026-12-08 it was the trainer's, from a forward of its own (they differ by the FP8 rounding, ~the floor).

Costs per step: one forward pass over the batch (the sim's; a second when the weights the push sends bf16
do not hold bf16 values, i.e. without `optim.round_to_served`), one prefill request to the server and
one round trip of the weights to the served format on the GPU; per eval point two extra pushes and one extra eval.
Each step's record times them: `sim_copy_s` (the weights copied and rounded), `floor_s` (the sim's forwards)
and `prefill_s`, inside `live_s`; LiveChecksLong's agreement after it, `agree_s`.

Tests: `pytest experiments/h200/test_h200_pieces.py -q`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import torch

from instruments import bands
from nanoflash.model import check_replay_record, fp32_linear
from nanoflash.rl.evaluate import evaluate
from nanoflash.rl.hooks import Hook
from nanoflash.quant import dequantize_fp8_block, quantize_fp8_block
from nanoflash.sglang import probe as probe_lib
from nanoflash.sglang.client import decode_indexer_topk
from nanoflash.sglang.layout import sglang_fp8
from nanoflash.sglang.buckets import served_dtype

ENTROPY_ROWS = 16  # rows per entropy forward: [16, S, 129280] fp32 logits stay under 1 GiB at S <= 128
LIVE_TOKENS = 16384   # tokens per row chunk of the live forwards (the recipe's parallel.micro_batch_tokens)
HEAD_CHUNK = 1024     # response positions per head chunk of `masked_scores`: [1024, 129280] fp32 = 0.5 GiB
AGREEMENT_ROWS = 2    # LiveChecksLong: sequences a step whose scored positions the indexer agreement reads
PREFILL_ROWS = 32  # sequences per prefill request: the server's [tokens, 129280] fp32 logits stay ~1.5 GiB
WARM_VERSION = 1_000_000  # weight version of the warm start's re-evaluation push (+ the eval step)


@torch.no_grad()
def fp8_roundtrip_(model, cfg) -> None:
    """In place: every weight SGLang serves FP8 becomes dequant(quant(w)) (128x128 blocks, fp32 scales, as the
    push sends it); the rest is untouched."""
    for name, p in model.state_dict().items():   # official names; the stacked experts' views write through
        if p.is_floating_point() and sglang_fp8(name, cfg):
            q, s = quantize_fp8_block(p.float(), fmt="fp32")
            p.copy_(dequantize_fp8_block(q, s, dtype=torch.float32).to(p.dtype))


@torch.no_grad()
def storage_roundtrip_(model, cfg) -> bool:
    """In place: every weight the FP8 push sends unquantized is rounded to the dtype it is sent in (the
    release's storage, `buckets.served_dtype`: the trainer's fp32 norms, head and compressors become bf16 values);
    FP8-served weights are left to `fp8_roundtrip_`. After both, the model holds what the server holds.
    Returns whether any value changed (not with `optim.round_to_served`: they hold bf16 values already)."""
    changed = False
    for name, p in model.state_dict().items():
        if p.is_floating_point() and not sglang_fp8(name, cfg):
            r = p.to(served_dtype(name, p, cfg)).to(p.dtype)
            changed = changed or not torch.equal(r, p)
            p.copy_(r)
    return changed


@torch.no_grad()
def token_entropy(model, input_ids: torch.Tensor, temperature: float = 1.0, rows: int = ENTROPY_ROWS):
    """H[b, t] of softmax(logits[b, t] / T) over the whole vocabulary. Shapes: [B,S] -> [B,S] fp32."""
    out = []
    for a in range(0, input_ids.shape[0], rows):
        logp = torch.log_softmax(model(input_ids[a:a + rows]).float() / temperature, -1)  # [b,S,V]
        out.append(-(logp.exp() * logp).sum(-1))                                          # [b,S]
    return torch.cat(out)


def row_chunks(B: int, S: int, tokens: int = LIVE_TOKENS) -> list:
    """Row ranges [a, b) of at most `tokens` tokens each (at least one row) over a [B, S] batch."""
    n = max(1, tokens // max(S, 1))
    return [(a, min(a + n, B)) for a in range(0, B, n)]


@torch.no_grad()
def masked_scores(model, input_ids: torch.Tensor, targets: torch.Tensor, on: torch.Tensor,
                  temperature: float = 1.0, tokens: int = LIVE_TOKENS, indexed=None):
    """At the positions of `on`: `model.token_logprobs(...)` and `token_entropy(...)` from one forward, the head
    only there (the full-vocabulary fp32 head over every prompt position is most of a forward at 2-4K-token
    prompts), HEAD_CHUNK positions at a time, the layers in row chunks of `tokens` tokens. `indexed`: the
    batch's indexer-replay record, if it has one (the trainer's forward replays it too).
    [B,S] ids, targets, bool -> (log-probs [N], entropies [N]) fp32 on the CPU, in the row-major order of `on`."""
    lps, ents = [], []
    for a, b in row_chunks(*input_ids.shape, tokens):
        ids, m = input_ids[a:b], on[a:b].to(input_ids.device)
        y, t = model.hidden(_layers(model, ids, indexed, a, b))[m], targets[a:b].to(ids.device)[m]
        for c in range(0, y.shape[0], HEAD_CHUNK):
            logp = torch.log_softmax(fp32_linear(y[c:c + HEAD_CHUNK], model.head.weight, model.cfg) / temperature, -1)
            lps.append(logp.gather(-1, t[c:c + HEAD_CHUNK, None])[:, 0].float().cpu())
            ents.append(-(logp.exp() * logp).sum(-1).float().cpu())
    return (torch.cat(lps), torch.cat(ents)) if lps else (torch.zeros(0), torch.zeros(0))


def _layers(model, ids: torch.Tensor, indexed, a: int, b: int) -> torch.Tensor:
    """The layers over rows a..b-1 (`ids`), with rows a..b-1 of the indexer-replay record if there is one."""
    kx = None if indexed is None else indexed[a:b].to(ids.device)
    return model.run_layers(model.embed_streams(ids), ids, indexed=kx)


def full_tokens(batch, b: int) -> list:
    """Row b's whole sequence (prompt + response, L tokens) from a packed batch."""
    L = int(batch.prompt_lens[b] + batch.response_lens[b])
    return [int(batch.input_ids[b, 0])] + batch.targets[b, :L - 1].tolist()


def tail_stats(d: torch.Tensor, prefix: str) -> dict:
    """mean / p99 / max of a 1-D tensor of per-token values, keys prefixed."""
    d = d.double()
    return {f"{prefix}_mean": float(d.mean()), f"{prefix}_p99": float(d.quantile(0.99)),
            f"{prefix}_max": float(d.max()), f"{prefix}_tokens": int(d.numel())}


def token_stats(gap: torch.Tensor, floor: torch.Tensor, ent: torch.Tensor) -> dict:
    """One step's numbers from per-token values over its response tokens (1-D, same order): gap = log p_train -
    log p_rollout, floor = |log p_sim - log p_train|, ent = the served model's (sim's) entropy. Tails of |gap| and floor, the
    entropy's mean and p99, gap / floor, and both means over the tokens above the median entropy (where FP8
    noise is measurable: a near-deterministic token has almost none, so there the ratio shows what else differs;
    0 with a single token). Finer splits (by token, first token vs rest) come from the per-token files."""
    hi = ent > ent.median() if len(ent) > 1 else torch.zeros_like(ent, dtype=torch.bool)
    upper_mean = lambda x: float(x[hi].mean()) if hi.any() else 0.0                          # noqa: E731
    out = {**tail_stats(gap.abs(), "gap"), **tail_stats(floor, "floor"), "entropy_mean": float(ent.mean()),
           "entropy_p99": float(ent.double().quantile(0.99)),
           "gap_high_entropy_mean": upper_mean(gap.abs()), "floor_high_entropy_mean": upper_mean(floor)}
    out["gap_over_floor"] = out["gap_mean"] / max(out["floor_mean"], 1e-12)
    return out


def prefill_stats(prefill_gap: torch.Tensor, gap: torch.Tensor, floor: torch.Tensor) -> dict:
    """Decode against prefill on the server, over one step's response tokens (1-D, same order): prefill_gap =
    log p_train - log p_server_prefill, gap = log p_train - log p_rollout (the server's decode). Their
    difference is the server's decode path against its own prefill on the same weights and tokens."""
    return {"prefill_gap_mean": float(prefill_gap.abs().mean()),
            "prefill_over_floor": float(prefill_gap.abs().sum() / floor.sum().clamp_min(1e-12)),
            "decode_vs_prefill_mean": float((gap - prefill_gap).abs().mean())}


def verify_counts(summary: dict) -> dict:
    """The push summary's per-server verification -> flat numbers (embedded: checksums compared in full)."""
    out = {"verify_servers": 0, "verify_exact": 0, "verify_change_sets": 0, "verify_unchecked": 0,
           "verify_full_checksums": 0}
    for how in (summary.get("verified") or {}).values():
        out["verify_servers"] += 1
        if how == "checksums":
            out["verify_full_checksums"] += 1
        elif isinstance(how, dict):
            out["verify_exact"] += how.get("exact", 0)
            out["verify_change_sets"] += how.get("change_sets", 0)
            out["verify_unchecked"] += how.get("first_push_unchecked", 0)
    return out


class LiveChecks(Hook):
    """See the module docstring. Built by the loop after the first push, from the weights then held (the warm
    start), from a `HookContext`: its trainer, collector (the client), pusher (`sglang.push.StagePusher`), task."""

    name = "warm"   # the eval record: eval_warm
    SIM_INDEXER_QUANT = "qat"   # the floor model's indexer precision (ModelConfig.indexer_quant): qat = FP4 QAT

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, mcfg, actor, task = ctx.cfg, ctx.mcfg, ctx.trainer, ctx.task
        self.cfg, self.mcfg, self.actor, self.rollouts, self.pusher, self.task = (
            cfg, mcfg, actor, ctx.collector, ctx.pusher, task)
        self.warm = copy.deepcopy(actor.model).eval()           # the warm start, kept for probe and re-eval
        with torch.device(actor.device):   # built (not copied) with qat on: the flag is read at construction
            self.sim = type(actor.model)(dataclasses.replace(actor.model.cfg, qat=True,
                                                             indexer_quant=self.SIM_INDEXER_QUANT))
        self.sim.cast_(next(actor.model.parameters()).dtype).eval()
        self.probe_prompt = task.encode(task.heldout[0] if task.heldout else task.train[0])
        self.probe_seed = cfg.train.seed + 7
        self.prefill_errors = 0
        self.dump_dir = os.path.join(cfg.train.out_dir, "live_tokens")
        os.makedirs(self.dump_dir, exist_ok=True)

    # ------------------------------------------------------------------ per step
    @torch.no_grad()
    def before_update(self, batch, old: torch.Tensor, step: int) -> dict:
        """Gap, entropy and the FP8 floor on this step's tokens (`batch` a grpo.RolloutBatch, `old` [B,S] the
        trainer's recomputed log-probs of the weights that generated it); the per-token values to dump_dir."""
        t0, dev, T = time.time(), self.actor.device, self.cfg.rollout.temperature
        on = batch.mask > 0                                                       # [B,S]
        ids, tgt = batch.input_ids.to(dev), batch.targets.to(dev)
        gap = (old - batch.rollout_logprobs)[on]
        kx = batch.indexer_topk                  # indexer replay: the trainer's and the floor's forwards replay it
        self.sim.load_state_dict(self.actor.model.state_dict())
        fp8_roundtrip_(self.sim, self.mcfg)
        t_copy = time.time()   # not synced: the roundtrip's kernels may finish inside the next forward's time
        sim8, ent = masked_scores(self.sim, ids, tgt, on, T, indexed=kx)           # [N] FP8 weights only
        if storage_roundtrip_(self.sim, self.mcfg):                               # [N] as the server holds
            sim, ent = masked_scores(self.sim, ids, tgt, on, T, indexed=kx)
        else:
            sim = sim8
        t_floor = time.time()
        floor, floor_fp8 = (sim - old[on]).abs(), (sim8 - old[on]).abs()
        pos = on.cumsum(1) - 1                                    # [B,S] index in the response (one per row)
        qpos = torch.arange(on.shape[1], device=on.device).expand_as(on)[on]   # the scoring query's absolute position
        dump = {"gap": gap.float(), "floor": floor.float(), "floor_fp8": floor_fp8.float(),
                "entropy": ent.float(), "token": batch.targets[on].int(), "pos": pos[on].short(),
                "qpos": qpos.int(), "row": on.nonzero()[:, 0].short()}
        out = {**token_stats(gap, floor, ent), **bands.band_stats(gap, floor, qpos, self.mcfg),
               "floor_fp8_mean": float(floor_fp8.mean()),
               "gap_over_floor_fp8": float(gap.abs().sum() / floor_fp8.sum().clamp_min(1e-12)),
               "sim_vs_rollout_mean": float((sim - batch.rollout_logprobs[on]).abs().mean()),
               "sim_copy_s": t_copy - t0, "floor_s": t_floor - t_copy}
        t1 = time.time()
        pre = self._prefill(batch)                                # [B,S] the server's prefill scores, or None
        if pre is not None:
            dump["prefill_gap"] = (old - pre)[on].float()
            out.update(prefill_stats(dump["prefill_gap"], gap, floor), prefill_s=time.time() - t1)
        out["prefill_errors"] = self.prefill_errors
        torch.save(dump, os.path.join(self.dump_dir, f"step_{step:04d}.pt"))
        self.last_tokens = dump                                   # for a subclass's per-step checks
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            out["gpu_used_total_gib"] = (total - free) / 2 ** 30   # trainer + server (colocated) + everything else
        out["live_s"] = time.time() - t0
        return out

    def _prefill(self, batch):
        """The step's sequences scored again by the server in one prefill (`probe.prefill_logprobs`), aligned
        as batch.rollout_logprobs [B,S]; None (and `prefill_errors` counted) if the server refuses."""
        rows = [full_tokens(batch, b) for b in range(len(batch))]
        try:
            lps = self._prefill_rows(rows)
        except Exception as e:   # a diagnostic: the run goes on without it, the failure counted and named
            self.prefill_errors += 1
            print(f"live: prefill scoring failed ({self.prefill_errors}): {type(e).__name__}: {str(e)[:200]}")
            return None
        pre = torch.zeros_like(batch.rollout_logprobs)
        for b, lp in enumerate(lps):
            pre[b, :len(lp)] = torch.tensor(lp, dtype=pre.dtype, device=pre.device)
        return pre

    def _prefill_rows(self, rows: list) -> list:
        """`probe.prefill_logprobs` of the rows, PREFILL_ROWS a request."""
        T = self.cfg.rollout.temperature
        return [lp for a in range(0, len(rows), PREFILL_ROWS)
                for lp in probe_lib.prefill_logprobs(self.rollouts.client, rows[a:a + PREFILL_ROWS], T)]

    # ------------------------------------------------------------------ per push
    def after_push(self, version) -> dict:
        """Probe the server that was just pushed to, and the push's verification counts."""
        t0 = time.time()
        p = probe_lib.probe(self.rollouts.client, self.actor.model, self.probe_prompt, seed=self.probe_seed,
                            temperature=self.cfg.rollout.temperature, other=self.warm)
        probe_lib.require_landed(p, self.pusher.tag(version))
        return {**{f"probe_{k}": v for k, v in p.items() if k != "tokens"}, **verify_counts(self.pusher.summary),
                "probe_s": time.time() - t0}

    # ------------------------------------------------------------------ per eval point
    def after_eval(self, at: int, current_acc: torch.Tensor, gen_for) -> dict:
        """The warm start evaluated with the eval's seeds at step `at` (swap pushes around it, both verified);
        `current_acc` [P] per-problem accuracy of the current weights; `gen_for(at)` the eval's generate_fn."""
        ec, task, t0 = self.cfg.eval, self.task, time.time()
        if at == 0:   # the weights on the server are the warm start: the same samples, nothing to swap
            warm_acc, res = current_acc, {}
        else:
            res = {"swap_pushes": 2}
            self.pusher.push(lambda: self.warm.state_dict().items(), WARM_VERSION + at)
            res["swap_in_probe_mean"] = self._probe_swap(self.warm, WARM_VERSION + at)
            res.update(evaluate(task.heldout, gen_for(at), ec.k_samples, task.reward, ec.max_new_tokens, task.encode))
            warm_acc = torch.tensor(res.pop("per_problem_correct"), dtype=torch.float64) / ec.k_samples
            self.pusher.push(self.actor.state_iter, at)   # back to the current weights (version = the step)
            res["swap_back_probe_mean"] = self._probe_swap(self.actor.model, at)
            res["swap_pushes_verified"] = 2   # both pushes passed the checksums (push raises) and the probe
        diff = current_acc.double() - warm_acc                                    # [P] paired per problem
        se = float(diff.std() / len(diff) ** 0.5) if len(diff) > 1 else 0.0
        res = {(k if k.startswith("swap") else f"warm_{k}"): v for k, v in res.items()}
        return {**res, "warm_pass@1": float(warm_acc.mean()),
                "pass@1": float(current_acc.mean()), "gain_pass@1": float(diff.mean()), "gain_se": se,
                "gain_z": float(diff.mean()) / se if se > 0 else 0.0, "warm_eval_s": time.time() - t0}

    def _probe_swap(self, model, version) -> float:
        """The probe of a swap push, against the weights that were pushed (stops the run when it fails)."""
        p = probe_lib.probe(self.rollouts.client, model, self.probe_prompt, seed=self.probe_seed,
                            temperature=self.cfg.rollout.temperature)
        probe_lib.require_landed(p, self.pusher.tag(version))
        return p["mean"]


class LiveChecksLong(LiveChecks):
    """The long-context run's live checks (issue 42; the module docstring): the floor's indexer in FP8 as SGLang
    scores it, and each step the C4 top-k agreement (`indexer_agreement.agreement`: the trainer's exact scores
    against the FP8 reproduction, same weights) on the scored positions where the top-k selects, in the
    AGREEMENT_ROWS longest sequences and the one holding the step's largest excess (|gap| - floor) there.
    Records `agree_<layer>_{overlap_mean, overlap_min, identical_share, swapped_mean, positions}` per C4 layer
    (layer = its index), also written at once to `live_tokens/agree_NNNN.json` (a step that dies in its update
    keeps them).

    The rows it reads are scored by the server once more, in a prefill that asks for SGLang's own kept sets
    (`return_indexer_topk`; a server started with `--enable-return-indexer-topk` answers them, another leaves
    them out, one that refuses the field is not asked again): only those rows, since a record is 4 KiB a token
    and layer pair of base64 JSON (~0.4 GB for a step of 32 rows of 3K tokens). Where they came, the same
    positions are compared with them:
    `server_agree_<layer>_*` (nanoflash's exact sets against SGLang's) and `server_fp8_agree_<layer>_*` (the
    FP8 reproduction against SGLang's: 1.0 when the floor models SGLang's selection exactly), and the json
    lists every position whose exact set differs from SGLang's, `server_swaps` [row, query position, layer,
    entries swapped], to set beside the step's per-token file (its `row` and `qpos`)."""

    SIM_INDEXER_QUANT = "fp8"
    TOPK_FLAGS = {"return_indexer_topk": True}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.ask_topk = True   # until a server refuses the field
        self.server_topk_errors = self.server_topk_unreplayable = 0

    @torch.no_grad()
    def before_update(self, batch, old: torch.Tensor, step: int) -> dict:
        from instruments import indexer_agreement as ia
        out = super().before_update(batch, old, step)
        t0, sel, sets, server, swaps = time.time(), bands.edges(self.mcfg)[1], {}, {}, []
        lens = (batch.prompt_lens + batch.response_lens).tolist()
        rows = self._agreement_rows(lens, sel)
        metas = self._server_records(batch, rows)
        for b in rows:
            qpos = (batch.mask[b] > 0).nonzero()[:, 0]
            qpos = qpos[qpos >= sel]                      # scored positions where the top-k selects
            if not len(qpos):
                continue
            ids = batch.input_ids[b:b + 1, :lens[b] - 1].to(self.actor.device)
            found = ia.agreement_sets(self.actor.model, ids, qpos.to(self.actor.device))
            names = sorted(found, key=lambda n: int(n.split(".")[1]))   # C4 layers in order, as SGLang counts them
            theirs = self._server_topk(metas.get(b, {}), len(names), lens[b])   # [>= L-1, n_c4, K] or None
            for i, name in enumerate(names):
                sets.setdefault(name, []).append(found[name])
                if theirs is not None:
                    st = theirs[qpos, i]
                    server.setdefault(name, []).append((*found[name], st))
                    a = found[name][0]
                    n_swapped = ((1 - ia.overlap(a, st)) * (a >= 0).sum(-1)).round().long().tolist()
                    swaps += [[b, t, int(name.split(".")[1]), n] for t, n in zip(qpos.tolist(), n_swapped) if n]
        agree = {}
        for name, parts in sets.items():                  # layers.<L>.attn.indexer -> agree_<L>_...
            st = ia.overlap_stats(torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts]))
            agree.update({f"agree_{name.split('.')[1]}_{k}": v for k, v in st.items()})
        for name, parts in server.items():
            layer, theirs = name.split(".")[1], torch.cat([s for _, _, s in parts])
            for key, j in (("server_agree", 0), ("server_fp8_agree", 1)):
                st = ia.overlap_stats(torch.cat([p[j] for p in parts]), theirs)
                agree.update({f"{key}_{layer}_{k}": v for k, v in st.items()})
        agree["agree_s"] = time.time() - t0
        # kept now, beside the step's per-token file: the step's record is written after its update, and the
        # second long hold's step 1 died in that update (an OOM) with these values computed and never logged
        with open(os.path.join(self.dump_dir, f"agree_{step:04d}.json"), "w") as f:
            json.dump({**agree, "server_swaps": swaps}, f)
        return {**out, **agree, "server_topk_errors": self.server_topk_errors,
                "server_topk_unreplayable": self.server_topk_unreplayable}

    def _agreement_rows(self, lens: list, sel: int) -> list:
        """The AGREEMENT_ROWS longest rows, and the row holding the step's largest |gap| - floor among the
        tokens scored where the top-k selects (the third long hold's step-16 jump was one far prompt's)."""
        rows = sorted(range(len(lens)), key=lambda i: -lens[i])[:AGREEMENT_ROWS]
        d = self.last_tokens
        far = d["qpos"] >= sel
        if far.any():
            excess = d["gap"].abs() - d["floor"]
            worst = int(d["row"][far][int(excess[far].argmax())])
            rows += [worst] if worst not in rows else []
        return rows

    def _server_records(self, batch, rows: list) -> dict:
        """{row: meta_info} of one prefill of `rows` asking for SGLang's kept sets; {} once a server refused the
        field (named once: it is not asked again; `server_topk_errors` counts it)."""
        if not self.ask_topk or not rows:
            return {}
        metas = []
        try:
            probe_lib.prefill_logprobs(self.rollouts.client, [full_tokens(batch, b) for b in rows],
                                       self.cfg.rollout.temperature, flags=self.TOPK_FLAGS, metas=metas)
        except Exception as e:   # a diagnostic: the run goes on without SGLang's sets
            self.ask_topk, self.server_topk_errors = False, self.server_topk_errors + 1
            print(f"live: prefill with {sorted(self.TOPK_FLAGS)} failed ({type(e).__name__}: {str(e)[:200]}); "
                  f"not asked again")
            return {}
        return dict(zip(rows, metas))

    def _server_topk(self, meta: dict, n_layers: int, length: int):
        """SGLang's kept sets for a row of `length` tokens from its prefill answer `meta` ([>= length - 1,
        n_layers, index_topk] int64), or None (not answered, not decodable or too short: counted in
        `server_topk_errors`, named once). A record indexer replay would refuse (`model.check_replay_record`,
        the collector's check) is still compared, and counted in `server_topk_unreplayable`, named once."""
        if "indexer_topk" not in meta:
            return None
        try:
            kept = decode_indexer_topk(meta, n_layers, self.mcfg.index_topk)
            if kept.shape[0] < length - 1:
                raise ValueError(f"{kept.shape[0]} rows for a sequence of {length} tokens (want {length - 1})")
        except ValueError as e:
            self.server_topk_errors += 1
            if self.server_topk_errors == 1:
                print(f"live: SGLang's indexer_topk not read: {e}")
            return None
        try:
            check_replay_record(kept, self.mcfg.index_topk)
        except ValueError as e:
            self.server_topk_unreplayable += 1
            if self.server_topk_unreplayable == 1:
                print(f"live: SGLang's indexer_topk could not be replayed: {e}")
        return kept
