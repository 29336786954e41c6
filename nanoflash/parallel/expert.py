"""Expert parallelism: shard the routed experts over the EP group and exchange tokens with all-to-all.

With E routed experts and an EP group of P ranks, rank r keeps experts [r*E/P, (r+1)*E/P) (contiguous
blocks, so the rows for one peer are one contiguous slice of the expert-sorted buffer): `RoutedExperts.keep`
slices the stacked w13 / w2, the official per-expert names (`layers.L.ffn.experts.{e}.w1.weight`, global e)
stay what state_dict, checkpoints and the weight stream see. The MoE code is unchanged: it calls
`dispatcher.dispatch`, runs its `RoutedExperts` on the expert-sorted rows, then `dispatcher.combine`. Only the
dispatcher differs from EP=1 (`model.LocalDispatcher`); both use the slot helpers of `kernels.moe`:

    dispatch(x [N,D], idx [N,K], w [N,K]):
      1. sort the N*K (token, expert) slots by global expert id (`sort_slots`, `GatherSlots`) -> [T_send,D]
      2. counts [P, E/P] per (peer, expert) on the device; exchange them (all_to_all) -> recv counts [P, E/P]
      3. split sizes to the host: the ONE host sync of a dispatch (NCCL's all_to_all needs them)
      4. all_to_all_single of the rows and of their routing weights     -> [T_recv,D] ordered (src, expert)
      5. local permute (src, expert) -> (expert, src)                   -> x_sorted, w_sorted, counts[E/P]
    combine(y_sorted [T_recv,D]):
      the inverse: un-permute, reverse all_to_all, then y[n] = sum_k y_slot(n,k) in fp32 (`combine_slots`,
      a gather and a sum in k order: deterministic).

The routing weight w travels with the token because the V4 expert multiplies it in before `w2` (v4_notes §2.4.2).
Token rows and weights go in ONE differentiable exchange (`comm.all_to_all_many`, packed as bytes, so the
fp32 weights stay exact next to bf16 rows): a rank whose experts got no rows never uses the weights, and a
separate exchange for them would skip its backward there and deadlock the others. Expert order inside one
expert is (source rank, token), which is exactly the order the single-process dispatcher produces for the
concatenated batch of the EP group.

Gradient reduction rule (used by `train_step.reduce_gradients`): dense parameters are replicated over the
whole data group (DP x EP) of a stage, expert parameters (the stacks, found by module) only over DP.

How this differs from production: DeepEP / Megatron overlap the exchange with compute, dispatch FP8, and
fuse the permutation into kernels; here the split sizes cost one host sync per dispatch.
Tests: `pytest tests/test_parallel_expert.py -q`.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoflash.kernels.moe import GatherSlots, combine_slots, expert_counts, sort_slots
from nanoflash.parallel.comm import all_to_all, all_to_all_many, exchange_counts
from nanoflash.parallel.dims import ParallelDims

EXPERT_KEY = ".ffn.experts."  # FQN fragment of routed-expert parameters (sharded over EP)


def is_expert_param(name: str) -> bool:
    """Routed-expert weights of a full model (EP-sharded, DP-replicated) by name; everything else is dense.
    (The engine itself uses `expert_param_names`, which finds them by module.)"""
    return EXPERT_KEY in name


def expert_range(n_experts: int, ep: int, ep_rank: int) -> list[int]:
    """Global ids of the experts on EP rank `ep_rank`."""
    assert n_experts % ep == 0, f"n_routed_experts={n_experts} is not divisible by EP={ep}"
    per = n_experts // ep
    return list(range(ep_rank * per, (ep_rank + 1) * per))


def _expert_major_perm(recv: torch.Tensor, total: int) -> torch.Tensor:
    """recv [P,El] counts laid out src-major (total = their sum, known on the host) -> index that reorders
    rows to expert-major. [T_recv]"""
    P, El = recv.shape
    starts = (recv.flatten().cumsum(0) - recv.flatten()).view(P, El).t().flatten()  # [El*P] segment starts
    lens = recv.t().flatten()                                                        # [El*P] in expert-major order
    out_starts = lens.cumsum(0) - lens
    return torch.repeat_interleave(starts - out_starts, lens, output_size=total) + torch.arange(total, device=recv.device)


class AllToAllDispatcher:
    """Token dispatcher for EP > 1 (same interface as `LocalDispatcher`).

    Shapes: dispatch x [N,D], indices/weights [N,K] -> x_sorted [T,D], w_sorted [T,1], counts [E_local] (device);
            combine y_sorted [T,D] -> [N,D] fp32   (T = rows this rank's experts receive from the group)
    """

    def __init__(self, local_experts: list[int], n_experts: int, ep: int, group):
        self.local_experts, self.n_experts, self.ep, self.group = list(local_experts), n_experts, ep, group

    def dispatch(self, x, indices, weights):
        K = indices.shape[1]
        order, inv = sort_slots(indices)                                          # slots by global expert
        send = expert_counts(indices, self.n_experts).view(self.ep, -1)           # [P,El] rows per (peer, expert)
        recv = exchange_counts(send, self.group)                                  # [P,El] rows from each src
        in_splits, out_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one host sync
        rows, ws = GatherSlots.apply(x, order, inv, K), weights.flatten().index_select(0, order)[:, None]
        x_recv, w_recv = all_to_all_many([rows, ws], out_splits, in_splits, self.group)  # (src, expert) order
        perm = _expert_major_perm(recv, sum(out_splits))
        ctx = (inv, K, perm, in_splits, out_splits)
        return x_recv.index_select(0, perm), w_recv.index_select(0, perm), recv.sum(0), ctx

    def combine(self, y, ctx):
        inv, K, perm, in_splits, out_splits = ctx
        back = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        y_src = y.index_select(0, back)                                           # [T,D] back to (src, expert)
        y_back = all_to_all(y_src, in_splits, out_splits, self.group)             # [N*K,D] my slots, sorted
        return combine_slots(y_back, inv, K)


def moe_modules(model: nn.Module):
    """(name, MoE) for every module with a `dispatcher` and `experts` (backbone and MTP)."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "dispatcher") and hasattr(m, "experts")]


def expert_param_names(model: nn.Module) -> set[str]:
    """FQNs of the routed-expert parameters, found by module (not by name), so any root module works."""
    out = set()
    for name, moe in moe_modules(model):
        prefix = f"{name}.experts." if name else "experts."
        out |= {prefix + n for n, _ in moe.experts.named_parameters()}
    return out


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Keep this EP rank's experts (stacks sliced, official names unchanged) and install the all-to-all
    dispatcher, in place."""
    if dims.ep == 1:
        return model
    for name, moe in moe_modules(model):
        n_experts = moe.gate.weight.shape[0]
        if len(moe.experts.ids) != n_experts:
            raise ValueError(f"{name}: {len(moe.experts.ids)} of {n_experts} experts left: EP applied twice?")
        keep = expert_range(n_experts, dims.ep, dims.ep_rank)
        moe.experts.keep(keep)
        moe.dispatcher = AllToAllDispatcher(keep, n_experts, dims.ep, dims.ep_group)
    return model
