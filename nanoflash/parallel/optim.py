"""AdamW with fp32 master weights, a streamed host-offload of the optimizer state, and the RL freeze list.

Update (decoupled weight decay, Loshchilov & Hutter; torch's fused AdamW kernel, `torch._fused_adamw_`, the
one `torch.optim.AdamW(fused=True)` calls, on CPU and CUDA alike), per parameter with fp32 master copy w,
gradient g (fp32), step t:

    w <- w * (1 - lr * wd)                               (wd only on matrices: ndim >= 2)
    m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
    w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    param <- w cast to the model dtype (bf16 in real runs)

State per trainable parameter: master w (only when the model is not fp32, or when offloading), m, v: 12 bytes
per parameter in fp32, on the parameter's device or, with `offload=True`, in ordinary (pageable) host memory.

The offloaded step streams the parameters through the host in chunks of at most `chunk_elems` elements
(a large tensor is cut at multiples of `ALIGN` elements, where the fused CPU kernel's vector lanes fall as
in one call, so the result is bitwise that of the unchunked update), through two pinned slots per direction:

    copy stream "down":  grad chunk i+1, cast to fp32 on the GPU -> pinned slot (i+1) % 2
    host:                fused AdamW on chunk i (master, m, v in pageable host memory)
    copy stream "up":    master chunk i cast to the model dtype -> pinned slot i % 2 -> parameter

(the three overlap; one CUDA event per slot and direction says when a slot may be reused), so only
2 x chunk_elems x (4 + bytes of each parameter dtype) of memory is pinned however large the model (the
whole state pinned was ~221 GiB per rank at V4-Flash's PP4 x EP4 layout), and no full fp32 copy of the
gradients exists.
The host math runs on `host_threads` intra-op threads, set for the step and restored after: torchrun
exports OMP_NUM_THREADS=1, which alone made the old per-parameter Python loop 5x slower (8.8 s per billion
parameters). Default: the CPUs this process may use divided by the ranks on the host (LOCAL_WORLD_SIZE).

What trains in V4 RL (Miles' recipe): everything except the router gate weight and bias (`ffn.gate.*`), the
lightning indexer (`attn.indexer.*`, which gets no gradient through its top-k anyway) and the MTP block
(unless `train_mtp`). `trainable_parameters` switches `requires_grad` off for those, so they get no gradient,
no optimizer state and no weight decay.

How this differs from production: no ZeRO sharding of the state over DP; the host step does not overlap
the next forward (DeepSpeed's ZeRO-Offload++ does). Measured: `bench/bench_optim.py`, docs/benchmarks.md.
Tests: `pytest tests/test_parallel_optim.py -q`.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
from torch import nn

from nanoflash.names import official_views

FROZEN_KEYS = (".ffn.gate.weight", ".ffn.gate.bias", ".attn.indexer.")  # frozen in V4 RL (Miles)
MTP_PREFIX = "mtp."
# Cuts inside one tensor fall on multiples of this many elements: the fused CPU kernel splits work into
# 64-byte units and vectorises from each tensor's start; a cut elsewhere moves elements between its vector
# body and its scalar tail, whose exp_avg_sq rounds differently (seen: 1 ulp). 64 covers AVX-512 fp32 twice.
ALIGN = 64
HOST_CHUNK_ELEMS = 1 << 24  # 16M elements per offload chunk: 64 MiB fp32 gradients per pinned slot


def is_frozen(name: str, train_mtp: bool = False) -> bool:
    return any(k in name for k in FROZEN_KEYS) or (not train_mtp and name.startswith(MTP_PREFIX))


def trainable_parameters(model: nn.Module, train_mtp: bool = False) -> list[tuple[str, nn.Parameter]]:
    """Freeze (requires_grad=False) the router, indexer and, unless asked, MTP; return the rest by name."""
    out = []
    for name, p in model.named_parameters():
        frozen = is_frozen(name, train_mtp)
        p.requires_grad_(not frozen)
        if not frozen:
            out.append((name, p))
    return out


def default_host_threads() -> int:
    """CPUs this process may run on, shared among the ranks of its host (torchrun's LOCAL_WORLD_SIZE)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def plan_chunks(sizes: list[tuple[str, int]], chunk_elems: int) -> list[list[tuple[str, int, int, int]]]:
    """Cut tensors of `sizes` [(name, numel)] into chunks of <= chunk_elems elements, in order.
    -> per chunk [(name, start, end, offset in the chunk)]; cuts inside a tensor at multiples of ALIGN."""
    if chunk_elems < ALIGN or chunk_elems % ALIGN:
        raise ValueError(f"chunk_elems={chunk_elems} must be a positive multiple of ALIGN={ALIGN}")
    chunks, cur, used = [], [], 0
    for name, n in sizes:
        a = 0
        while a < n:
            room = chunk_elems - used
            if room < min(ALIGN, n - a):  # not even one aligned unit fits: close this chunk
                chunks.append(cur)
                cur, used = [], 0
                continue
            b = n if n - a <= room else a + room // ALIGN * ALIGN
            cur.append((name, a, b, used))
            used += b - a
            a = b
    if cur:
        chunks.append(cur)
    return chunks


def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, step: float, lr: float, betas, eps: float, wd: float):
    """torch's fused AdamW kernel over lists of same-device fp32 tensors (the step count is read, not bumped)."""
    if not params:
        return
    steps = [torch.tensor(float(step), dtype=torch.float32, device=params[0].device)] * len(params)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=wd, eps=eps, amsgrad=False, maximize=False)


class AdamW:
    """AdamW over named parameters with fp32 master weights (see module docstring for the equations).

    Shapes: state tensors have their parameter's shape, fp32. Offloaded staging: 2 pinned slots per
    direction of [chunk_elems] (fp32 down, the model dtype up).
    """

    def __init__(self, named_params, lr: float = 1e-6, weight_decay: float = 0.1, betas=(0.9, 0.98),
                 eps: float = 1e-8, offload: bool = False, chunk_elems: int = HOST_CHUNK_ELEMS,
                 host_threads: int | None = None):
        self.lr, self.weight_decay, self.betas, self.eps, self.offload = lr, weight_decay, tuple(betas), eps, offload
        self.params = dict(named_params)
        self.step_count = 0
        self.host_threads = host_threads or default_host_threads()
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.params.items():
            dev = torch.device("cpu") if offload else p.device
            st = {"exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=dev),
                  "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=dev)}
            if offload or p.dtype != torch.float32:
                st["master"] = p.detach().to(dev, torch.float32, copy=True)
            self.state[name] = st
        if chunk_elems < ALIGN or chunk_elems % ALIGN:
            raise ValueError(f"chunk_elems={chunk_elems} must be a positive multiple of ALIGN={ALIGN}")
        sizes = [(n, p.numel()) for n, p in self.params.items()]
        self.chunk_elems = min(chunk_elems, max(ALIGN, -(-sum(n for _, n in sizes) // ALIGN) * ALIGN))
        self.chunks = plan_chunks(sizes, self.chunk_elems) if offload else []
        self._staging = None  # made on the first offloaded step: [down0, down1], [up0, up1], streams, events
        self.last_step_s = 0.0  # wall time of the last step, weights back on their device

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        t0 = time.perf_counter()
        (self._offload_step if self.offload else self._device_step)()
        if any(p.is_cuda for p in self.params.values()):
            torch.cuda.synchronize()
        self.last_step_s = time.perf_counter() - t0

    def _decay(self, name: str) -> float:
        return self.weight_decay if self.params[name].ndim >= 2 else 0.0

    def _device_step(self) -> None:
        """State beside the weights: one fused call per (device, decay) group, fp32 gradient casts bounded
        by chunk_elems at a time."""
        groups: dict = {}
        for name, p in self.params.items():
            if p.grad is not None:
                groups.setdefault((p.device, self._decay(name)), []).append(name)
        for (_, wd), names in groups.items():
            batch, size = [], 0
            for i, name in enumerate(names):
                batch.append(name)
                size += self.params[name].numel()
                if size >= self.chunk_elems or i == len(names) - 1:
                    self._device_batch(batch, wd)
                    batch, size = [], 0

    def _device_batch(self, names: list, wd: float) -> None:
        ps = [self.params[n] for n in names]
        ws = [self.state[n].get("master", p) for n, p in zip(names, ps)]
        fused_adamw_(ws, [p.grad.float() for p in ps], [self.state[n]["exp_avg"] for n in names],
                     [self.state[n]["exp_avg_sq"] for n in names], self.step_count, self.lr, self.betas,
                     self.eps, wd)
        for p, w in zip(ps, ws):
            if w is not p:
                p.copy_(w)

    # ------------------------------------------------------------------ offloaded step
    def _make_staging(self, cuda: bool) -> dict:
        """Two pinned slots of chunk_elems per direction: fp32 down; up one pair per parameter dtype (bf16
        weights, plus the few the official model keeps in fp32)."""
        C, dtypes = self.chunk_elems, sorted({p.dtype for p in self.params.values()}, key=str)
        return {"down": [torch.empty(C, dtype=torch.float32, pin_memory=cuda) for _ in range(2)],
                "up": {dt: [torch.empty(C, dtype=dt, pin_memory=cuda) for _ in range(2)] for dt in dtypes},
                "streams": (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else None,
                "events": ([torch.cuda.Event() for _ in range(2)], [torch.cuda.Event() for _ in range(2)])
                if cuda else None}

    def _offload_step(self) -> None:
        """Grad chunk i+1 down || host math on chunk i || weights of chunk i-1 up (module docstring)."""
        cuda = any(p.is_cuda for p in self.params.values())
        if self._staging is None:
            self._staging = self._make_staging(cuda)
        S, threads = self._staging, torch.get_num_threads()
        chunks = [[pc for pc in ch if self.params[pc[0]].grad is not None] for ch in self.chunks]
        chunks = [ch for ch in chunks if ch]
        if cuda:
            for s in S["streams"]:
                s.wait_stream(torch.cuda.current_stream())  # the gradients are final
        torch.set_num_threads(self.host_threads)
        try:
            self._download(chunks, 0)
            for i in range(len(chunks)):
                if i + 1 < len(chunks):
                    self._download(chunks, i + 1)
                if cuda:
                    S["events"][0][i % 2].synchronize()
                self._host_update(chunks[i], S["down"][i % 2])
                if cuda:
                    S["events"][1][i % 2].synchronize()  # chunk i-2's upload has left this slot
                self._upload(chunks[i], i % 2)
            if cuda:
                S["streams"][1].synchronize()  # every weight is on the GPU before the next forward
        finally:
            torch.set_num_threads(threads)

    def _download(self, chunks, i: int) -> None:
        S = self._staging
        slot = S["down"][i % 2]
        with torch.cuda.stream(S["streams"][0]) if S["streams"] else contextlib.nullcontext():
            for name, a, b, off in chunks[i]:
                slot[off:off + b - a].copy_(self.params[name].grad.reshape(-1)[a:b], non_blocking=True)
            if S["events"]:
                S["events"][0][i % 2].record()

    def _host_update(self, chunk, slot: torch.Tensor) -> None:
        for wd in {self._decay(n) for n, *_ in chunk}:
            sel = [pc for pc in chunk if self._decay(pc[0]) == wd]
            flat = lambda k: [self.state[n][k].view(-1)[a:b] for n, a, b, _ in sel]  # noqa: E731
            fused_adamw_(flat("master"), [slot[off:off + b - a] for _, a, b, off in sel], flat("exp_avg"),
                         flat("exp_avg_sq"), self.step_count, self.lr, self.betas, self.eps, wd)

    def _upload(self, chunk, k: int) -> None:
        S = self._staging
        for name, a, b, off in chunk:  # fp32 master -> the parameter's dtype, on the host
            S["up"][self.params[name].dtype][k][off:off + b - a].copy_(self.state[name]["master"].view(-1)[a:b])
        with torch.cuda.stream(S["streams"][1]) if S["streams"] else contextlib.nullcontext():
            for name, a, b, off in chunk:
                p = self.params[name]
                p.view(-1)[a:b].copy_(S["up"][p.dtype][k][off:off + b - a], non_blocking=True)
            if S["events"]:
                S["events"][1][k].record()

    def host_bytes(self) -> dict:
        """Host memory this optimizer holds: {"state": pageable fp32 state, "pinned": staging slots}."""
        state = sum(v.numel() * 4 for st in self.state.values() for v in st.values()) if self.offload else 0
        S = self._staging
        pinned = 0 if S is None else sum(t.numel() * t.element_size()
                                         for t in S["down"] + [t for ts in S["up"].values() for t in ts])
        return {"state": state, "pinned": pinned}

    # ------------------------------------------------------------------ checkpoint I/O (flat, by FQN)
    def state_dict(self) -> dict:
        """{"step": int, "<official fqn>.<exp_avg|exp_avg_sq|master>": tensor} - flat, so DCP can reshard it by
        name; a stacked expert parameter's state is its per-expert views (`names.official_views`)."""
        sd = {"step": self.step_count}
        sd.update(self._official_state())
        return sd

    def _official_state(self) -> dict:
        return {f"{n}.{k}": t for name, st in self.state.items() for k, v in st.items()
                for n, t in official_views(name, self.params[name], v)}

    def load_state_dict(self, sd: dict) -> None:
        mine = self._official_state()
        missing = [key for key in mine if key not in sd]
        if missing or "step" not in sd:
            raise ValueError(f"optimizer state lacks {missing[:5]}{'...' if len(missing) > 5 else ''}"
                             f"{' and step' if 'step' not in sd else ''}")
        self.step_count = int(sd["step"])
        for key, v in mine.items():
            v.copy_(sd[key])

