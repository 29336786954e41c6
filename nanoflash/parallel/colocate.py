"""Several ranks on one GPU: the engine's collectives over gloo with CUDA tensors, P2P staged through the host.

Why. NCCL refuses two ranks of one communicator on the same GPU (`ncclInvalidUsage`, measured on one H200),
so a PP x EP layout can only run as ranks on one GPU over gloo. Gloo runs some collectives on CUDA tensors
itself -- it copies them to page-locked host memory, runs its CPU algorithm and copies back (torch
`ProcessGroupGloo.cpp`: `AsyncAllreduceCUDAWork`, `AsyncAlltoallCUDAWork`, ...) -- but not `send` / `recv`,
and so not `batch_isend_irecv`, which read the tensor's memory as host memory. Measured on one H200
(2026-12-03): `all_reduce` and `all_to_all_single` on CUDA tensors correct, `send` / `batch_isend_irecv`
refused.

The seam (`ParallelConfig.colocate_ranks`, `ParallelDims.staging`): every rank binds cuda:0, the process
group is gloo, and `ParallelDims.staging` is a `HostStaging`, which the engine's communication calls take
when it is set:

    comm.p2p_exchange(sends, recvs, staging)   pipeline activations and their gradients (1F1B, forward_only)
    staging.gather(t, parts, dst, group)       the push's EP gather of expert sub-buckets (`sglang.push`)

    send:  device tensor --copy--> pinned host buffer --gloo--> peer's pinned host buffer --copy--> device

Left on the device, as gloo runs them itself: all_reduce (gradients, counts, norms) and all_to_all_single
(the EP token exchange). Object collectives (`broadcast_object_list`: micro-batch shapes, metrics) always
travel on the CPU under gloo (`ParallelDims.object_device`).

Buffers are kept per (dtype, numel) and reused, so a step allocates pinned memory only the first time a
shape is seen; every copy is blocking (the host buffer is free again when the call returns). The same path
runs on CPU tensors (plain host buffers, no pinning): `colocate_ranks` on a CPU-only machine, which is how
the CPU tests run it (`tests/test_parallel_parity.py`, layout PP2xEP2+colocated).

How this differs from production: nothing runs several ranks on one GPU for speed; this is a way to run the
multi-rank engine -- Triton kernels, grouped GEMMs, EP dispatch with real routing, the per-stage push -- as
ranks on a single GPU. Tests: `pytest tests/test_parallel_comm.py tests/test_parallel_parity.py -q`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class HostStaging:
    """P2P and gathers of one process through reusable host buffers (pinned when CUDA is available).

    Shapes: any; a buffer is flat [numel] of the tensor's dtype, viewed back to the tensor's shape.
    `staged_bytes` counts what went through (both directions), for tests and logs.
    """

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.staged_bytes = 0

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.numel())
        pool = self.free.setdefault(key, [])
        return pool.pop() if pool else torch.empty(like.numel(), dtype=like.dtype, pin_memory=self.pin)

    def _give(self, bufs) -> None:
        for b in bufs:
            self.free[(b.dtype, b.numel())].append(b)

    @torch.no_grad()
    def _out(self, t: torch.Tensor) -> torch.Tensor:
        """A host buffer holding t's values (blocking copy: the values are there when this returns)."""
        buf = self._take(t)
        buf.copy_(t.reshape(-1))
        self.staged_bytes += buf.numel() * buf.element_size()
        return buf

    @torch.no_grad()   # a receive buffer may be a leaf that requires grad (a stage's input activations)
    def _back(self, dst: torch.Tensor, buf: torch.Tensor) -> None:
        dst.copy_(buf.view(dst.shape))
        self.staged_bytes += buf.numel() * buf.element_size()

    def p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """`comm.p2p_exchange` through host buffers: the same ops, in the same order, on host copies."""
        out = [(self._out(t), peer) for t, peer in sends]
        inc = [(self._take(t), t, peer) for t, peer in recvs]
        ops = [dist.P2POp(dist.isend, b, peer) for b, peer in out]
        ops += [dist.P2POp(dist.irecv, b, peer) for b, _, peer in inc]
        try:
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            for b, t, _ in inc:
                self._back(t, b)
        finally:
            self._give([b for b, _ in out] + [b for b, _, _ in inc])

    def gather(self, t: torch.Tensor, parts: list[torch.Tensor] | None, dst: int, group) -> None:
        """`dist.gather(t, parts, dst, group)` through host buffers (`parts` on the destination only)."""
        src = self._out(t)
        host = [self._take(p) for p in parts] if parts is not None else None
        try:
            dist.gather(src, host, dst=dst, group=group)
            for h, p in zip(host or [], parts or []):
                self._back(p, h)
        finally:
            self._give([src] + (host or []))
