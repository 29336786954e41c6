"""Micro-batching by a token budget: variable-length RL sequences -> padded [B,S] micro-batches.

RL batches mix sequences of very different lengths. Each micro-batch is padded to its longest sequence, so
its cost is B x S_max tokens; we require B x S_max <= max_tokens (the per-GPU budget) and minimise the
padding by sorting lengths in decreasing order and filling greedily (first-fit decreasing on one dimension):

    sort by length desc;  for each sequence: join the open micro-batch if (B+1) * S_max <= max_tokens,
                                             else open a new one.

Padding is on the right with zeros (and `loss_mask` 0), which changes nothing for the real tokens: attention,
the compressors and the indexer are causal (a padded position is later than every real one) and routing is
per token with no capacity limit. Packing several sequences into one row would waste nothing but needs
document masks in attention and positions restarting per document, which the model does not have.

Lock-step rule: under EP the ranks of an EP group (which hold different data) must run the same number of
micro-batches, because every MoE layer is a collective. `equalize_count` takes the maximum over the data
group and splits the largest micro-batches (or, if nothing can be split, appends a one-token dummy with
`loss_mask` 0, which contributes nothing to the loss or the gradients).

Tests: `pytest tests/test_parallel_microbatch.py -q`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanoflash.parallel.dims import ParallelDims


def _stack(samples: list[dict], idx: list[int]) -> dict:
    """Right-pad the [L,...] fields of samples[idx] to a common length. -> {field: [B,S_max,...]}"""
    S = max(len(samples[i]["input_ids"]) for i in idx)
    out = {}
    for k in samples[idx[0]]:
        rows = [samples[i][k] for i in idx]
        buf = rows[0].new_zeros((len(rows), S, *rows[0].shape[1:]))  # [B,S_max,...]
        for r, t in enumerate(rows):
            buf[r, : len(t)] = t
        out[k] = buf
    return out


def pack_microbatches(samples: list[dict], max_tokens: int, max_rows: int | None = None
                      ) -> tuple[list[dict], list[list[int]]]:
    """Greedy first-fit-decreasing under B * S_max <= max_tokens (and B <= max_rows; max_rows=1 scores every
    sample alone, unpadded). Returns (micro-batches, sample indices of each), so per-sample results (e.g.
    log-probs) can be mapped back to the input order."""
    for i, s in enumerate(samples):
        L = len(s["input_ids"])
        bad = {k: tuple(v.shape) for k, v in s.items() if v.dim() == 0 or len(v) != L}
        if bad:
            raise ValueError(f"sample {i}: every field must be [L,...] with L = len(input_ids) = {L}; got {bad}")
        if L > max_tokens:
            raise ValueError(f"sample {i} has {L} tokens, more than the micro-batch budget {max_tokens}")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["input_ids"]))
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        fits = g and (len(g) + 1) * len(samples[g[0]]["input_ids"]) <= max_tokens
        if fits and (max_rows is None or len(g) < max_rows):
            g.append(i)
        else:
            groups.append([i])
    return [_stack(samples, g) for g in groups], groups


def equalize_count(mbs: list[dict], groups: list[list[int]], dims: ParallelDims, template: dict | None = None):
    """Make every rank of the data group hold the same number of micro-batches (see module docstring).
    `template` ({field: [L,...] tensor}, e.g. one sample) gives the fields of a dummy micro-batch when this
    rank holds none (a data shard with no rows)."""
    n = torch.tensor([len(mbs)], device=dims.device)
    if dims.data_group is not None:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=dims.data_group)
    target = int(n)
    mbs, groups = list(mbs), list(groups)
    while len(mbs) < target:
        j = max(range(len(mbs)), key=lambda i: mbs[i]["input_ids"].shape[0]) if mbs else None
        if j is not None and mbs[j]["input_ids"].shape[0] > 1:
            half = mbs[j]["input_ids"].shape[0] // 2
            mb, g = mbs.pop(j), groups.pop(j)
            mbs += [{k: v[:half] for k, v in mb.items()}, {k: v[half:] for k, v in mb.items()}]
            groups += [g[:half], g[half:]]
        else:
            if mbs:
                template = mbs[0]
            elif template is not None:
                template = {k: v[None] for k, v in template.items()}                   # [1,L,...]
            else:
                template = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
            mbs.append({k: v.new_zeros((1, *(1 for _ in v.shape[1:2]), *v.shape[2:])) for k, v in template.items()})
            groups.append([])
    return mbs, groups
