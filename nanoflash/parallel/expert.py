"""Expert parallelism: shard the routed experts over the EP group and exchange tokens with all-to-all.

With E routed experts and an EP group of P ranks, rank r keeps experts [r*E/P, (r+1)*E/P) (contiguous
blocks, so the rows for one peer are one contiguous slice of the expert-sorted buffer). The MoE code is
unchanged: it calls `dispatcher.dispatch`, runs `experts[str(e)]` for its `local_experts` on consecutive
slices, then `dispatcher.combine`. Only the dispatcher differs from EP=1 (`model.LocalDispatcher`):

    dispatch(x [N,D], idx [N,K], w [N,K]):
      1. sort the N*K (token, expert) slots by global expert id         -> x[token] [T_send,D] (peer-major)
      2. counts [P, E/P] per (peer, expert); exchange them (all_to_all)  -> recv counts [P, E/P]
      3. all_to_all_single of the rows and of their routing weights     -> [T_recv,D] ordered (src, expert)
      4. local permute (src, expert) -> (expert, src)                   -> x_sorted, w_sorted, counts[E/P]
    combine(y_sorted [T_recv,D]):
      the inverse: un-permute, reverse all_to_all, then y[n] = sum_k y_slot(n,k) in fp32 (index_add).

The routing weight w travels with the token because the V4 expert multiplies it in before `w2` (spec §2.4.2).
Token rows and weights go in ONE differentiable exchange (`comm.all_to_all_many`, packed as bytes, so the
fp32 weights stay exact next to bf16 rows): a rank whose experts got no rows never uses the weights, and a
separate exchange for them would skip its backward there and deadlock the others. Expert order inside one expert is (source rank, token), which is exactly the
order the single-process dispatcher produces for the concatenated batch of the EP group.

Gradient reduction rule (used by `train_step.reduce_gradients`): dense parameters are replicated over the
whole data group (DP x EP) of a stage, expert parameters only over DP.

How this differs from production: DeepEP / Megatron overlap the exchange with compute, dispatch FP8, and
fuse the permutation into kernels; here the count exchange costs one host sync (`.tolist()`) per layer.
Tests: `pytest tests/test_parallel_expert.py -q`.
"""
from __future__ import annotations

import torch
from torch import nn

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


def _expert_major_perm(recv: torch.Tensor) -> torch.Tensor:
    """recv [P,El] counts laid out src-major -> index that reorders rows to expert-major. [T_recv]"""
    P, El = recv.shape
    starts = (recv.flatten().cumsum(0) - recv.flatten()).view(P, El).t().flatten()  # [El*P] segment starts
    lens = recv.t().flatten()                                                        # [El*P] in expert-major order
    out_starts = lens.cumsum(0) - lens
    total = int(lens.sum())
    return torch.repeat_interleave(starts - out_starts, lens, output_size=total) + torch.arange(total, device=recv.device)


class AllToAllDispatcher:
    """Token dispatcher for EP > 1 (same interface as `LocalDispatcher`).

    Shapes: dispatch x [N,D], indices/weights [N,K] -> x_sorted [T,D], w_sorted [T,1], counts [E_local];
            combine y_sorted [T,D] -> [N,D] fp32   (T = rows this rank's experts receive from the group)
    """

    def __init__(self, local_experts: list[int], n_experts: int, ep: int, group):
        self.local_experts, self.n_experts, self.ep, self.group = list(local_experts), n_experts, ep, group

    def dispatch(self, x, indices, weights):
        N, K = indices.shape
        flat = indices.flatten()                                                  # [N*K]
        order = flat.argsort(stable=True)                                         # slots by global expert
        token = order // K
        send = torch.bincount(flat, minlength=self.n_experts).view(self.ep, -1)   # [P,El] rows per (peer, expert)
        recv = exchange_counts(send, self.group)                                  # [P,El] rows from each src
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()        # host sync
        x_recv, w_recv = all_to_all_many([x[token], weights.flatten()[order, None]],  # [T,D], [T,1]
                                         out_splits, in_splits, self.group)         # (src, expert) order
        perm = _expert_major_perm(recv)
        ctx = (token, N, perm, in_splits, out_splits)
        return x_recv[perm], w_recv[perm], recv.sum(0).tolist(), ctx

    def combine(self, y, ctx):
        token, n, perm, in_splits, out_splits = ctx
        y_src = y[torch.argsort(perm)]                                            # [T,D] back to (src, expert)
        y_back = all_to_all(y_src, in_splits, out_splits, self.group)             # [N*K,D] my slots, sorted
        return y_back.new_zeros(n, y.shape[1], dtype=torch.float32).index_add_(0, token, y_back.float())


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
    """Keep this EP rank's experts (names unchanged) and install the all-to-all dispatcher, in place."""
    if dims.ep == 1:
        return model
    for _, moe in moe_modules(model):
        n_experts = moe.gate.weight.shape[0]
        assert len(moe.experts) == n_experts, f"{len(moe.experts)} of {n_experts} experts left: EP applied twice?"
        keep = expert_range(n_experts, dims.ep, dims.ep_rank)
        for e in list(moe.experts.keys()):
            if int(e) not in keep:
                del moe.experts[e]
        moe.local_experts = keep
        moe.dispatcher = AllToAllDispatcher(keep, n_experts, dims.ep, dims.ep_group)
    return model
