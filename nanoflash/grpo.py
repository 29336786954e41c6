"""GRPO as Miles runs it: pure functions over two small dataclasses.

The algorithm, one rollout step (rl_notes §2):
1. Sample `n` responses for each of `G` prompts (a *group* per prompt) and score each with a verifiable reward
   `r_i`. Dynamic sampling drops groups whose rewards are all equal (they carry no signal) and over-samples
   prompts until `G` informative groups are kept (`filter_groups`, `prompts_to_request`).
2. Group-normalised advantage, broadcast to every response token (`group_advantages`):
       A_i = (r_i - mean_g(r)) / (std_g(r) + eps),   std unbiased (n-1), as `torch.Tensor.std`
3. Clipped surrogate with asymmetric "clip-higher" bounds (DAPO), per response token t (`policy_loss`):
       rho_t = exp(logp_t - old_logp_t)
       l_t   = max(-rho_t A, -clip(rho_t, 1 - eps_low, 1 + eps_high) A)          eps_low 0.2, eps_high 0.28
   optionally times a truncated importance weight for the train/rollout engine mismatch (TIS)
       w_t = clip(exp(old_logp_t - rollout_logp_t), 0, C)                         C = 2
   plus `kl_coef * k3(logp || ref_logp)` and `- entropy_coef * H_t`.
4. Aggregate: Miles' default is the mean over samples of each sample's token mean ("seq-mean-token-mean", every
   sequence weighs the same); `aggregation="token-mean"` is DAPO's global token mean. Both are written as
   `sum / denom` with `denom` passed in, so a trainer splitting a global batch into micro-batches passes the
   global denominator (`loss_denominator` summed over micro-batches and ranks) and gets the full-batch gradient.

Layout: `pack` right-pads episodes into `[B,S]` tensors where position `t` predicts token `t+1` (inputs are
`tokens[:-1]`, targets `tokens[1:]`); `mask` marks the positions whose target is a response token. Every
log-prob tensor below is `[B,S]` in that layout; `cu_seqlens` describes the same batch without padding.

vs Miles on Megatron: no context-parallel gathers, no GSPO/OPSM/IcePop/MIS, one rollout = one sample (no
`rollout_mask_sums`), advantages in fp64. No `torch.distributed`, no rollout imports: all of it runs on a CPU.

Tests: `pytest tests/test_grpo.py -q`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # |log ratio| cap before exp (Miles `_safe_clamp_log_ratio`): e^20 ~ 5e8 stays finite in fp32
LOW_VAR_KL_CLAMP = 10.0  # per-token cap of the `low_var_kl` estimator (Miles `compute_approx_kl`)
FILTER_MIN_STD = 1e-8  # a group is kept iff std(rewards) > this (Miles `check_reward_nonzero_std`)
ESS_MIN_SUM_SQ = 1e-8  # floor of sum(w^2) in the ESS ratio, as Miles, so an all-masked sample gives 0 not NaN
AGGREGATIONS = ("seq-mean-token-mean", "token-mean")
ADAPTIVE_MIN_RATE = 0.05  # adaptive over-sampling never assumes a keep rate below this (k <= 20 m + ...; then the cap)
FINISH_REASONS = ("stop", "length", "abort")  # SGLang `meta_info.finish_reason.type`; "length" = truncated


# ---------------------------------------------------------------------------------------------- data
@dataclass
class Episode:
    """One sampled response to one prompt, as the rollout engine returns it.

    rollout_logprobs[j] = log pi_rollout(response_ids[j] | prompt_ids, response_ids[:j]) at the sampling
    temperature (SGLang `output_token_logprobs`). Episodes of one prompt share `group_id`.

    Shapes: prompt_ids [P], response_ids [R], rollout_logprobs [R] (python lists);
    routed_experts [P+R-1, n_moe_layers, topk] int (optional, R3 routing replay: the experts the engine picked
    at every input position of the trainer's forward);
    indexer_topk [P+R-1, n_c4_layers, index_topk] int (optional, indexer replay: the C4 entries the engine kept
    at every input position, stored entry + 1 so that 0 is "none" and zero padding keeps nothing, the form
    `Transformer.run_layers(indexed=)` takes).
    """
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    group_id: int
    finish_reason: str = "stop"
    routed_experts: Tensor | None = None
    indexer_topk: Tensor | None = None

    def __post_init__(self):
        P, R = len(self.prompt_ids), len(self.response_ids)
        rx, kx = self.routed_experts, self.indexer_topk
        problems = {
            f"need >= 1 prompt and response token, got P={P} R={R}": P < 1 or R < 1,
            f"{len(self.rollout_logprobs)} rollout logprobs for {R} response tokens": len(self.rollout_logprobs) != R,
            f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}": self.finish_reason not in FINISH_REASONS,
            f"routed_experts shape {None if rx is None else tuple(rx.shape)}, expected [{P + R - 1}, n_moe_layers, "
            f"topk]": rx is not None and (rx.ndim != 3 or len(rx) != P + R - 1),
            f"indexer_topk shape {None if kx is None else tuple(kx.shape)}, expected [{P + R - 1}, n_c4_layers, "
            f"index_topk]": kx is not None and (kx.ndim != 3 or len(kx) != P + R - 1),
        }
        bad = [msg for msg, failed in problems.items() if failed]
        if bad:
            raise ValueError(f"episode of group {self.group_id}: " + "; ".join(bad))

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class RolloutBatch:
    """Episodes packed for training; position t of row b predicts targets[b, t] = tokens_b[t+1].

    mask[b, t] = 1 iff targets[b, t] is a response token; advantages and log-probs are 0 off the mask.
    old_logprobs is None until the trainer's forward-only pass fills it (None: use rollout_logprobs, Miles'
    `--use-rollout-logprobs`). cu_seqlens[b] = sum_{c<b} (P_c + R_c - 1): the pad-free (varlen) view.

    Shapes: input_ids, targets [B,S] int64; mask, rollout_logprobs, advantages, old_logprobs [B,S] fp32;
    prompt_lens, response_lens [B] int64; cu_seqlens [B+1] int32; routed_experts [B,S,n_moe_layers,topk] or None;
    indexer_topk [B,S,n_c4_layers,index_topk] (entry + 1, 0 = none) or None.
    """
    input_ids: Tensor
    targets: Tensor
    mask: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    prompt_lens: Tensor
    response_lens: Tensor
    cu_seqlens: Tensor
    old_logprobs: Tensor | None = None
    routed_experts: Tensor | None = None
    indexer_topk: Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> RolloutBatch:
        """Samples start..stop-1 as their own batch (same S; cu_seqlens rebased to 0)."""
        cut = {k: v[start:stop] for k, v in vars(self).items() if isinstance(v, Tensor) and k != "cu_seqlens"}
        cu = self.cu_seqlens[start:stop + 1]
        return replace(self, **cut, cu_seqlens=cu - cu[0])

    def split(self, micro_batch_size: int) -> list[RolloutBatch]:
        """Consecutive micro-batches of `micro_batch_size` samples (the last may be smaller)."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [self.rows(i, min(i + micro_batch_size, len(self))) for i in range(0, len(self), micro_batch_size)]


def pack(episodes: list[Episode], advantages, pad_id: int = 0) -> RolloutBatch:
    """Right-pad episodes into a RolloutBatch, broadcasting each sample's scalar advantage to its tokens.

    With tokens x_b = prompt + response (length L_b = P_b + R_b) and S = max_b (L_b - 1):
        input_ids[b, :L_b-1] = x_b[:-1],   targets[b, :L_b-1] = x_b[1:]
        mask[b, t] = 1  iff  P_b - 1 <= t < L_b - 1,   advantages[b, t] = A_b mask[b, t]
        rollout_logprobs[b, P_b-1+j] = episode.rollout_logprobs[j]
    Shapes: advantages [B] -> RolloutBatch of [B,S] tensors.
    """
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    if not episodes or adv.shape != (len(episodes),):
        raise ValueError(f"pack: need >= 1 episode and one advantage each, got {len(episodes)} episodes, "
                         f"advantages of shape {tuple(adv.shape)}")
    P = torch.tensor([len(e.prompt_ids) for e in episodes])  # [B]
    R = torch.tensor([len(e.response_ids) for e in episodes])  # [B]
    B, S = len(episodes), int((P + R).max()) - 1
    input_ids = torch.full((B, S + 1), pad_id, dtype=torch.long)  # [B,S+1] the full token rows
    rollout_lp = torch.zeros(B, S)
    for b, e in enumerate(episodes):
        input_ids[b, :P[b] + R[b]] = torch.tensor(e.prompt_ids + e.response_ids)
        rollout_lp[b, P[b] - 1:P[b] + R[b] - 1] = torch.tensor(e.rollout_logprobs)
    t = torch.arange(S)[None, :]  # [1,S]
    mask = ((t >= P[:, None] - 1) & (t < (P + R)[:, None] - 1)).float()  # [B,S]
    targets = torch.where(t < (P + R)[:, None] - 1, input_ids[:, 1:], pad_id)  # [B,S]
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(P + R - 1, 0)
    return RolloutBatch(input_ids[:, :S], targets, mask, rollout_lp, adv[:, None] * mask, P, R, cu,
                        routed_experts=_pack_record(episodes, "routed_experts", S),
                        indexer_topk=_pack_record(episodes, "indexer_topk", S))


def expert_id_dtype(n_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert id: an R3 record is [tokens, n_layers, K] per sample
    (flash: 43 x 6 ids a token, held on rank 0 for every kept sample of a round), 8x smaller in uint8 than int64."""
    return torch.uint8 if n_experts <= 256 else torch.int16 if n_experts <= 2 ** 15 else torch.int32


def entry_record(kept: Tensor) -> Tensor:
    """An indexer record as the engine reports it ([T, n_c4, K] entries, -1 = none) -> entry + 1 in the smallest
    integer type that holds it (0 = none): a flash record is 21 C4 layers x 512 entries a token."""
    top = int(kept.max()) + 1 if kept.numel() else 0
    return (kept + 1).to(torch.int16 if top < 2 ** 15 else torch.int32)


def _pack_record(episodes: list[Episode], name: str, S: int) -> Tensor | None:
    """Stack the episodes' replay records `name` (R3's routed_experts, the indexer's indexer_topk) into
    [B,S,n_layers,K], zero-padded; None if no episode has one."""
    recs = [getattr(e, name) for e in episodes]
    if all(r is None for r in recs):
        return None
    if any(r is None for r in recs):
        raise ValueError(f"pack: {name} missing for episodes {[i for i, r in enumerate(recs) if r is None]}")
    L, K = recs[0].shape[1:]
    dtype = max((r.dtype for r in recs), key=lambda d: torch.iinfo(d).bits)   # the widest record's type
    out = torch.zeros(len(episodes), S, L, K, dtype=dtype)  # [B,S,L,K]
    for b, r in enumerate(recs):
        out[b, :len(r)] = r
    return out


# ---------------------------------------------------------------------------------------------- advantages
def group_advantages(rewards, group_size: int | None = None, eps: float = 1e-6,
                     std_normalize: bool = True) -> Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps) per group of samples of one prompt.

    Variant (Miles `train_data_conversion.py`): std is the unbiased (n-1) estimator (`torch.Tensor.std`); the
    division happens only where std > 0, so an all-equal group (or a group of one sample) gets A = 0;
    `std_normalize=False` is Dr.GRPO (A_i = r_i - mean). The KL term is not folded into the reward for GRPO.
    Shapes: rewards [G,n] -> [G,n], or flat [G*n] with `group_size` n -> [G*n]; fp32 out.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)  # fp64: keeps near-equal groups at zero mean
    flat = r.ndim == 1
    if flat and (group_size is None or group_size < 1 or r.numel() % group_size):
        raise ValueError(f"group_advantages: rewards shape {tuple(r.shape)} do not split into groups of {group_size}")
    if not flat and r.ndim != 2:
        raise ValueError(f"group_advantages: rewards must be [groups, samples] or flat, got {tuple(r.shape)}")
    g = r.view(-1, group_size) if flat else r  # [G,n]
    centered = g - g.mean(dim=1, keepdim=True)  # [G,n]
    if std_normalize and g.shape[1] > 1:
        std = g.std(dim=1, keepdim=True)  # [G,1] unbiased
        centered = torch.where(std > 0, centered / (std + eps), centered)
    return (centered.reshape(-1) if flat else centered).float()


def episode_advantages(episodes: list[Episode], group_size: int, **kwargs) -> Tensor:
    """`group_advantages` of the episodes' rewards, checking each run of `group_size` is one group. [B] -> [B]."""
    ids = [e.group_id for e in episodes]
    if len(ids) % group_size:
        raise ValueError(f"{len(ids)} episodes do not split into groups of {group_size}")
    for i in range(0, len(ids), group_size):
        run = ids[i:i + group_size]
        if len(set(run)) != 1 or run[0] in ids[:i]:
            raise ValueError(f"episodes {i}..{i + group_size - 1} have group ids {run}: groups must be "
                             f"contiguous runs of {group_size}")
    return group_advantages([e.reward for e in episodes], group_size, **kwargs)


# ---------------------------------------------------------------------------------------------- reduction
def loss_denominator(mask: Tensor, aggregation: str = "seq-mean-token-mean") -> float:
    """The normaliser of `masked_reduce` for this (micro-)batch: B samples (seq-mean-token-mean) or sum(mask) tokens.
    Sum it over every micro-batch and data-parallel rank of the global batch and pass the sum as `denom` to
    each `policy_loss` call: the micro-batch losses then add up to the global-batch loss, and so do the
    gradients (Miles' `num_microbatches / global_batch_size` scaling). Shapes: mask [B,S].
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return float(mask.shape[0]) if aggregation == "seq-mean-token-mean" else float((mask > 0).sum())


def masked_reduce(x: Tensor, mask: Tensor, aggregation: str = "seq-mean-token-mean", denom: float | None = None) -> Tensor:
    """Reduce per-token values over the mask.
        seq-mean-token-mean:  (1/denom) sum_b [ sum_t m_bt x_bt / max(sum_t m_bt, 1) ]     (Miles `sum_of_sample_mean`)
        token-mean:   (1/denom) sum_bt m_bt x_bt                                   (`--calculate-per-token-loss`)
    denom defaults to `loss_denominator(mask, aggregation)` (clamped to >= 1): the plain mean over this batch.
    Off-mask values never reach the result, even if NaN. Shapes: x, mask [B,S] -> scalar.
    """
    d = loss_denominator(mask, aggregation) if denom is None else float(denom)
    on = mask > 0
    xm = torch.where(on, x, torch.zeros((), dtype=x.dtype, device=x.device))  # [B,S]
    if aggregation == "seq-mean-token-mean":
        per_sample = xm.sum(1) / on.sum(1).clamp(min=1)  # [B]
        return per_sample.sum() / max(d, 1.0)
    return xm.sum() / max(d, 1.0)


# ---------------------------------------------------------------------------------------------- loss
def approx_kl(logp: Tensor, base_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimators of KL(pi || pi_base) at tokens drawn from pi, with d = logp - base_logp (Schulman):
        k1 = d,   k2 = d^2 / 2,   k3 = exp(-d) - 1 + d,
        low_var_kl = k3 with d clamped to +-20 and the result to +-10          (Miles `compute_approx_kl`)
    Shapes: logp, base_logp [B,S] -> [B,S] fp32.
    """
    d = logp.float() - base_logp.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2
    if kind not in ("k3", "low_var_kl"):
        raise ValueError(f"unknown KL estimator {kind!r}; choose k1, k2, k3, low_var_kl")
    if kind == "low_var_kl":
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = torch.exp(-d) - 1 + d
    return kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP) if kind == "low_var_kl" else kl


def clipped_surrogate(log_ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float,
                      clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss with asymmetric clipping, and where the clipped branch wins.
        rho = exp(clamp(log_ratio, +-20)),   l = max(-rho A, -clip(rho, 1 - clip_low, 1 + clip_high) A)
        dual clip (clip_c > 1): l = min(l, -clip_c A) where A < 0;   clipped = [clip branch > rho branch]
    Shapes: log_ratio, adv [B,S] -> (l [B,S], clipped [B,S] float).
    """
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B,S]
    unclipped = -rho * adv
    clipped_branch = -rho.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = torch.maximum(unclipped, clipped_branch)
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"dual-clip clip_c must be > 1, got {clip_c}")
        loss = torch.where(adv < 0, torch.minimum(loss, -clip_c * adv), loss)
    return loss, (clipped_branch > unclipped).float()


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, tis_cap: float | None) -> tuple[Tensor, dict]:
    """Truncated importance weight for the train/rollout engine mismatch, and its per-token stats.
        tis = exp(old_logp - rollout_logp),   w = clip(tis, 0, tis_cap)   (w = 1 when tis_cap is None)
    Stats use the pre-clamp ratio: tis, tis_clipfrac = [w != tis], tis_abs = |tis - 1| (Miles `vanilla_tis`).
    Shapes: [B,S] -> (w [B,S] without grad, {name: [B,S]}).
    """
    tis = torch.exp(old_logprobs.detach().float() - rollout_logprobs.float())  # [B,S]
    w = torch.ones_like(tis) if tis_cap is None else tis.clamp(0.0, tis_cap)
    return w, {"tis": tis, "tis_clipfrac": (w != tis).float() if tis_cap is not None else torch.zeros_like(tis),
               "tis_abs": (tis - 1).abs()}


def ess_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Effective-sample-size ratio of the per-token weights w = exp(log_ratio) within each sample:
        ess_b = (sum_t w)^2 / (n_b sum_t w^2)     (1 = on-policy, -> 0 = weight piled on few tokens)
    Shapes: log_ratio, mask [B,S] -> [B,S] (ess_b broadcast over the row, so `masked_reduce` can average it).
    """
    on = mask > 0
    w = torch.where(on, torch.exp(log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 0.0)  # [B,S]
    n = on.sum(1).clamp(min=1)  # [B]
    ess = w.sum(1) ** 2 / (n * (w * w).sum(1).clamp(min=ESS_MIN_SUM_SQ))  # [B]
    return ess[:, None].expand_as(w)


def logprob_mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                             aggregation: str = "seq-mean-token-mean", denom: float | None = None) -> dict[str, Tensor]:
    """How far the trainer's log-probs are from the rollout engine's at the sampled tokens (rl_notes §3 metrics).
        train_rollout_logprob_abs_diff = reduce |t - r|               (Miles CI gate; 0 when "true on-policy")
        train_rollout_kl    = reduce low_var_kl(r || t) = reduce [exp(t - r) - 1 - (t - r)]   ~ KL(rollout||train)
        train_rollout_kl_k1 = reduce (r - t)                          (unbiased, high-variance estimator of the same)
    with t = train log-prob, r = rollout log-prob, reduce = `masked_reduce(., mask, aggregation, denom)`.
    Shapes: [B,S] -> {name: scalar (detached)}.
    """
    t, r = train_logprobs.detach().float(), rollout_logprobs.detach().float()
    return {
        "train_rollout_logprob_abs_diff": masked_reduce((t - r).abs(), mask, aggregation, denom),
        "train_rollout_kl": masked_reduce(approx_kl(r, t, "low_var_kl"), mask, aggregation, denom),
        "train_rollout_kl_k1": masked_reduce(r - t, mask, aggregation, denom),
    }


@dataclass(frozen=True)
class LossConfig:
    """The knobs of `policy_loss` (rl_notes §2.2-2.5); `LossConfig.of(run.grpo)` is a run's."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None             # dual clip for A < 0; None = off
    tis_cap: float | None = 2.0             # TIS clamp; None = no TIS weight (rollout log-probs: metrics only)
    kl_coef: float = 0.0                    # acts only when ref_logp is passed
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0               # acts only when entropy is passed
    aggregation: str = "seq-mean-token-mean"

    @classmethod
    def of(cls, gc) -> LossConfig:
        """The loss of a run's `GRPOConfig` (TIS only with `use_tis`)."""
        return cls(gc.clip_low, gc.clip_high, gc.clip_c, gc.tis_cap if gc.use_tis else None, gc.kl_coef, gc.kl_type,
                   gc.entropy_coef, gc.aggregation)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, lc: LossConfig = LossConfig(), *,
                rollout_logp: Tensor | None = None, ref_logp: Tensor | None = None, entropy: Tensor | None = None,
                denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO/PPO policy loss (Miles `policy_loss_function`), reduced by `masked_reduce(., mask, lc.aggregation, denom)`:
        L = reduce[w_t * clipped_surrogate(logp - old_logp, A)] + kl_coef reduce[KL(logp||ref)] - entropy_coef reduce[H]
    w_t = the TIS weight (`tis_weights`) when rollout_logp is given and lc.tis_cap is set. Off-mask: ratio 1, A = 0.
    Metrics (detached scalars, reduced like the loss, so they sum over micro-batches when `denom` is global):
    loss, pg_loss, pg_clipfrac, ppo_kl (= reduce[old - logp]), ess_ratio, ois, tis, tis_clipfrac, tis_abs,
    train_rollout_*, kl_loss, entropy. Shapes: every tensor [B,S] (advantages [B] or [B,S]) -> (scalar loss, metrics).
    """
    on = mask > 0
    if advantages.dim() == 1:                       # per-sample advantages [B] -> every token of the sample
        advantages = advantages[:, None].expand_as(mask)
    log_ratio = torch.where(on, logp.float() - old_logp.float(), 0.0)  # [B,S] = -ppo_kl
    adv = torch.where(on, advantages.float(), 0.0)  # [B,S]
    pg, clipped = clipped_surrogate(log_ratio, adv, lc.clip_low, lc.clip_high, lc.clip_c)
    red = lambda x: masked_reduce(x, mask, lc.aggregation, denom)  # noqa: E731
    m = {"pg_clipfrac": red(clipped), "ppo_kl": red(-log_ratio.detach()), "ess_ratio": red(ess_ratio(log_ratio, mask))}
    if rollout_logp is not None:
        w, tis_stats = tis_weights(old_logp, rollout_logp, lc.tis_cap)
        pg = pg * w
        m["ois"] = red(torch.exp(log_ratio.detach()))
        m.update({k: red(v) for k, v in tis_stats.items()})
        m.update(logprob_mismatch_metrics(old_logp, rollout_logp, mask, lc.aggregation, denom))
    loss = red(pg)
    m["pg_loss"] = loss
    if entropy is not None:
        m["entropy"] = red(entropy.float())
        loss = loss - lc.entropy_coef * m["entropy"]
    if ref_logp is not None:
        m["kl_loss"] = red(approx_kl(logp, ref_logp, lc.kl_type))
        loss = loss + lc.kl_coef * m["kl_loss"]
    m["loss"] = loss
    return loss, {k: v.detach() for k, v in m.items()}


# ---------------------------------------------------------------------------------------------- sampling
def filter_groups(episodes: list[Episode], group_size: int, min_std: float = FILTER_MIN_STD) -> list[Episode]:
    """Dynamic sampling: keep the groups whose rewards are not all equal, i.e. std_g(r) > min_std.
    All-correct and all-wrong groups have A = 0 for every token and only dilute the batch (DAPO; Miles
    `check_reward_nonzero_std`). Groups are keyed by `group_id` and kept in first-seen order; every group must
    hold exactly `group_size` episodes. Shapes: list of G*n episodes -> list of G'*n episodes.
    """
    groups: dict[int, list[Episode]] = {}
    for e in episodes:
        groups.setdefault(e.group_id, []).append(e)
    bad = {gid: len(g) for gid, g in groups.items() if len(g) != group_size}
    if bad:
        raise ValueError(f"filter_groups: groups {bad} (id: size) do not have group_size={group_size} episodes")
    kept = []
    for g in groups.values():
        r = torch.tensor([e.reward for e in g], dtype=torch.float64)
        if group_size > 1 and float(r.std()) > min_std:
            kept.extend(g)
    return kept


def prompts_to_request(n_kept: int, n_target: int, n_pending: int, over_sampling_batch_size: int) -> int:
    """How many more prompts (groups) to submit now, as Miles' dynamic-sampling loop does.
    Miles submits chunks of `over_sampling_batch_size` prompts while pending groups < groups still needed
    (`n_target - n_kept`), so it asks for k chunks with k = ceil((n_target - n_kept - n_pending) / chunk), or 0.
    When n_kept reaches n_target the caller aborts what is still pending.
    """
    if over_sampling_batch_size < 1 or min(n_kept, n_target, n_pending) < 0:
        raise ValueError(f"prompts_to_request: bad counts kept={n_kept} target={n_target} pending={n_pending} "
                         f"chunk={over_sampling_batch_size}")
    missing = n_target - n_kept - n_pending
    return 0 if missing <= 0 else over_sampling_batch_size * math.ceil(missing / over_sampling_batch_size)


def prompts_for_rate(missing: int, keep_rate: float, cap: int) -> int:
    """Adaptive over-sampling: prompts to submit for `missing` more groups when a group is kept with probability
    `keep_rate` (dynamic sampling's yield, estimated from the rounds seen). The kept count of k prompts is
    Binomial(k, p); k = (m + 2 sqrt(m (1 - p))) / p is its mean plus two standard deviations of the prompts needed,
    so one round suffices most of the time, without Miles' whole chunk when a few groups are missing. At most
    `cap` (grpo.over_sampling_batch_size), at least `missing`."""
    if missing <= 0:
        return 0
    p = min(max(keep_rate, ADAPTIVE_MIN_RATE), 1.0)
    return max(missing, min(cap, math.ceil((missing + 2 * math.sqrt(missing * (1 - p))) / p)))
