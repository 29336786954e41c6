"""AdamW with fp32 master weights, a streamed host-offload of the optimizer state, and the RL freeze list.

Update (decoupled weight decay, Loshchilov & Hutter; torch's fused AdamW kernel, `torch._fused_adamw_`, the
one `torch.optim.AdamW(fused=True)` calls, on CPU and CUDA alike), per parameter with fp32 master copy w,
gradient g (fp32), step t:

    w <- w * (1 - lr * wd)                               (wd only on matrices: ndim >= 2)
    m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
    w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    param <- w cast to the model dtype (bf16 in real runs)

State per trainable parameter: master w (when the model is not fp32, when offloading, or when the weight is
kept at a coarser `storage` dtype: param <- w rounded to it), m, v: 12 bytes per parameter in fp32, on the
parameter's device or, with `offload=True`, in ordinary (pageable) host memory.

The offloaded step streams the parameters through the host in chunks of at most `chunk_elems` elements
(a large tensor is cut at multiples of `ALIGN` elements, where the fused CPU kernel's vector lanes fall as
in one call, so the result is bitwise that of the unchunked update), through two pinned slots per direction:

    copy stream "down":  grad chunk i+1 cast to fp32 on the GPU -> pinned slot (i+1) % 2
    host, tile by tile:  fused AdamW on the tile (master, m, v pageable, the gradient from the slot);
                         the tile's masters cast to the model dtype -> pinned up slot i % 2
    copy stream "up":    up slot of chunk i -> parameters

(the three overlap; one CUDA event per slot and direction says when a slot may be reused), so only
2 x chunk_elems x (4 + bytes of each parameter dtype) of memory is pinned (48 MiB by default) however large
the model (the whole state pinned was ~221 GiB per rank at V4-Flash's PP4 x EP4 layout), and no full fp32
copy of the gradients exists.
Why tiles: the host step is bound by DRAM bandwidth. The fused kernel alone moves 28 bytes per parameter
(reads master, m, v, fp32 grad; writes master, m, v); casting the masters for the upload in a second pass
over the chunk re-reads them from DRAM (+4 B). Cutting each chunk into tiles of `tile_elems` (at ALIGN
multiples) lets the bf16 cast of a tile read the masters the kernel has just written, from cache (each of
the host threads gets the same slice of the tile in both calls). With `grad_cast="host"` the gradient
travels in its own dtype (2 bytes of DMA instead of 4) and each tile's bf16 gradient is cast into a
cache-resident fp32 scratch that the kernel reads (bf16 -> fp32 is exact: the same bits as the GPU cast).
Measured (B11): the step still reaches 0.6-0.9x of torch's fused CPU AdamW on host-resident gradients, not
1x: it adds the DMA's bytes and the upload cast to the kernel's 28, and issuing the copies costs the main
thread ~0.2 ms per chunk while the other cores wait. `last_breakdown` has the wall seconds of each phase
of the last step (kernel, casts, copy issue, waits on the copy events); `bench/bench_optim.py --sweep`
times chunk / tile / cast choices against torch's fused CPU AdamW in the same run.
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
import itertools
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
# Offload defaults from `bench/bench_optim.py --sweep`, two H200 hosts (docs/benchmarks.md B11, 2026-12-01):
# fastest of 18 in run 1 (0.263 s/B = 0.90x torch fused CPU AdamW; old 16M untiled 0.343), tied of 13 in run 2
# (0.368 vs 0.372); <= 2M chunks lose to copy-issue cost (~0.2 ms per chunk), 256K tiles to per-call cost.
HOST_CHUNK_ELEMS = 1 << 22  # 4M elements per offload chunk: 16 MiB fp32 gradients per pinned slot
HOST_TILE_ELEMS = 1 << 20  # 1M-element host tiles: 64K elements (256 KiB of master) per thread of 16, in L2
HOST_GRAD_CAST = "device"  # "host" (bf16 down, cast per tile) halves the down slot but measured 0.59x vs 0.61x


def is_frozen(name: str, train_mtp: bool = False) -> bool:
    return any(k in name for k in FROZEN_KEYS) or (not train_mtp and name.startswith(MTP_PREFIX))


def trainable_parameters(model: nn.Module, train_mtp: bool = False) -> list[tuple[str, nn.Parameter]]:
    """Freeze (requires_grad=False) the router, indexer and, unless asked, MTP; return the rest by name."""
    for name, p in model.named_parameters():
        p.requires_grad_(not is_frozen(name, train_mtp))
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


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


def plan_tiles(chunk: list[tuple[str, int, int, int]], tile_elems: int) -> list[list[tuple[str, int, int, int]]]:
    """Cut one chunk's pieces [(name, start, end, offset)] into tiles of <= tile_elems elements, in order
    (cuts inside a tensor at multiples of ALIGN from its start) -> per tile [(name, start, end, offset)]."""
    tiles = plan_chunks([(j, b - a) for j, (_, a, b, _) in enumerate(chunk)], tile_elems)
    return [[(chunk[j][0], chunk[j][1] + s, chunk[j][1] + e, chunk[j][3] + s) for j, s, e, _ in t] for t in tiles]


def merge_pieces(pieces: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int, int]]:
    """Join consecutive pieces of one tensor that a tile cut apart: one copy per tensor span of a chunk
    (measured on the H200: each copy call costs ~25 us of host time, 0.1 s per billion at 256K-element tiles)."""
    out: list[tuple[str, int, int, int]] = []
    for name, a, b, off in pieces:
        if out and out[-1][0] == name and out[-1][2] == a:
            out[-1] = (name, out[-1][1], b, out[-1][3])
        else:
            out.append((name, a, b, off))
    return out


class _Laps:
    """Wall time per phase: lap(key) adds the time since the previous lap (or the start) to s[key]."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, key: str) -> None:
        t = time.perf_counter()
        self.s[key] = self.s.get(key, 0.0) + t - self.t
        self.t = t


def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, step, lr: float, betas, eps: float, wd: float):
    """torch's fused AdamW kernel over lists of same-device fp32 tensors; step: a number or an fp32 scalar
    tensor on their device (read, not bumped)."""
    if not params:
        return
    if not torch.is_tensor(step):
        step = torch.tensor(float(step), dtype=torch.float32, device=params[0].device)
    steps = [step] * len(params)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=wd, eps=eps, amsgrad=False, maximize=False)


class AdamW:
    """AdamW over named parameters with fp32 master weights (see module docstring for the equations).

    Shapes: state tensors have their parameter's shape, fp32. Offloaded staging: 2 pinned slots of
    [chunk_elems] per direction and dtype (down: each gradient dtype, or fp32 with grad_cast="device"; up:
    each parameter dtype), one fp32 scratch [tile_elems].
    """

    def __init__(self, named_params, lr: float = 1e-6, weight_decay: float = 0.1, betas=(0.9, 0.98),
                 eps: float = 1e-8, offload: bool = False, chunk_elems: int = HOST_CHUNK_ELEMS,
                 host_threads: int | None = None, tile_elems: int = HOST_TILE_ELEMS, grad_cast: str = HOST_GRAD_CAST,
                 storage: dict | None = None):
        self.lr, self.weight_decay, self.betas, self.eps, self.offload = lr, weight_decay, tuple(betas), eps, offload
        self.params = dict(named_params)
        # name -> a coarser dtype the parameter's values are kept in (its master the fp32 sum of the updates)
        self.storage = {n: dt for n, dt in (storage or {}).items() if n in self.params}
        self.step_count, self.host_threads = 0, host_threads or default_host_threads()
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.params.items():
            dev = torch.device("cpu") if offload else p.device
            st = {"exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=dev),
                  "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=dev)}
            if offload or p.dtype != torch.float32 or name in self.storage:
                st["master"] = p.detach().to(dev, torch.float32, copy=True)
            if name in self.storage:   # rounded from now on, and after every step
                p.data.copy_(p.data.to(self.storage[name]))
            self.state[name] = st
        self.set_streaming(chunk_elems, tile_elems, grad_cast)
        self.last_step_s = 0.0  # wall time of the last step, weights back on their device
        self.last_breakdown: dict[str, float] = {}  # offloaded: wall seconds per phase of the last step

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
        for n, p, w in zip(names, ps, ws):
            if w is not p:
                p.copy_(w.to(self.storage[n]) if n in self.storage else w)

    # ------------------------------------------------------------------ offloaded step
    def set_streaming(self, chunk_elems: int = HOST_CHUNK_ELEMS, tile_elems: int = HOST_TILE_ELEMS,
                      grad_cast: str = HOST_GRAD_CAST) -> None:
        """(Re)plan the offloaded stream: chunks of <= chunk_elems per pinned slot, host tiles of <= tile_elems
        (module docstring); grad_cast "host" (gradients travel in their dtype) or "device" (cast to fp32 on
        the GPU). The state is kept; the staging is remade on the next step."""
        for key, v in (("chunk_elems", chunk_elems), ("tile_elems", tile_elems)):
            if v < ALIGN or v % ALIGN:
                raise ValueError(f"{key}={v} must be a positive multiple of ALIGN={ALIGN}")
        if grad_cast not in ("host", "device"):
            raise ValueError(f"grad_cast={grad_cast!r} must be 'host' or 'device'")
        sizes = [(n, p.numel()) for n, p in self.params.items()]
        self.chunk_elems = min(chunk_elems, max(ALIGN, -(-sum(n for _, n in sizes) // ALIGN) * ALIGN))
        self.tile_elems, self.grad_cast = min(tile_elems, self.chunk_elems), grad_cast
        chunks = plan_chunks(sizes, self.chunk_elems) if self.offload else []
        self.chunks = [plan_tiles(ch, self.tile_elems) for ch in chunks]  # [chunk][tile][piece]
        self._staging = None

    def _slot(self, way: str, dtype: torch.dtype, k: int) -> torch.Tensor:
        """Pinned slot k (of 2) of chunk_elems for `way` ("down" gradients / "up" weights) in `dtype`, made on
        first use: one pair per dtype that travels (bf16 and the few fp32 parameters of the official model)."""
        slots = self._staging[way].setdefault(dtype, [None, None])
        if slots[k] is None:
            slots[k] = torch.empty(self.chunk_elems, dtype=dtype, pin_memory=self._staging["cuda"])
        return slots[k]

    def _offload_step(self) -> None:
        """Grad chunk i+1 down || host math on chunk i, tile by tile || weights of chunk i-1 up."""
        cuda = any(p.is_cuda for p in self.params.values())
        if self._staging is None:
            self._staging = {"down": {}, "up": {}, "cuda": cuda, "scratch": torch.empty(self.tile_elems),
                             "streams": (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else None,
                             "events": ([torch.cuda.Event() for _ in range(2)], [torch.cuda.Event() for _ in range(2)])
                             if cuda else None, "key": None}
        S, threads, laps = self._staging, torch.get_num_threads(), _Laps()
        chunks, ops = self._live_plan()
        step = torch.tensor(float(self.step_count))
        if cuda:
            for s in S["streams"]:
                s.wait_stream(torch.cuda.current_stream())  # the gradients are final
        torch.set_num_threads(self.host_threads)
        try:
            laps.lap("setup_s")
            self._download(chunks, 0)
            for i in range(len(chunks)):
                if i + 1 < len(chunks):
                    self._download(chunks, i + 1)
                laps.lap("issue_down_s")
                if cuda:
                    S["events"][0][i % 2].synchronize()
                    laps.lap("wait_down_s")
                    S["events"][1][i % 2].synchronize()  # chunk i-2's upload has left this slot
                    laps.lap("wait_up_s")
                for tile_ops in ops[i]:
                    self._host_tile(tile_ops, step, laps)
                self._upload(chunks[i], i % 2)
                laps.lap("issue_up_s")
            if cuda:
                S["streams"][1].synchronize()  # every weight is on the GPU before the next forward
            laps.lap("tail_s")
        finally:
            torch.set_num_threads(threads)
        self.last_breakdown = laps.s

    def _live_plan(self):
        """The plan restricted to parameters with a gradient -> (per chunk its pieces, one per tensor span, for
        the copies; per chunk its tiles' prebuilt views for the host); remade only when which gradients exist
        (or their dtypes) changes."""
        S = self._staging
        key = tuple(None if p.grad is None else p.grad.dtype for p in self.params.values())
        if S["key"] != key:
            chunks = [[[pc for pc in t if self.params[pc[0]].grad is not None] for t in ch] for ch in self.chunks]
            chunks = [ch for ch in ([t for t in ch if t] for ch in chunks) if ch]
            S["key"], S["chunks"] = key, [merge_pieces([pc for t in ch for pc in t]) for ch in chunks]
            S["ops"] = [[self._tile_ops(t, i % 2) for t in ch] for i, ch in enumerate(chunks)]
        return S["chunks"], S["ops"]

    def _down_dtype(self, name: str) -> torch.dtype:
        return torch.float32 if self.grad_cast == "device" else self.params[name].grad.dtype

    def _download(self, chunks, i: int) -> None:
        S = self._staging
        with torch.cuda.stream(S["streams"][0]) if S["streams"] else contextlib.nullcontext():
            for name, a, b, off in chunks[i]:
                slot = self._slot("down", self._down_dtype(name), i % 2)
                slot[off:off + b - a].copy_(self.params[name].grad.reshape(-1)[a:b], non_blocking=True)
            if S["events"]:
                S["events"][0][i % 2].record()

    def _tile_ops(self, tile, k: int) -> tuple:
        """One tile's work as views -> (grad casts [(dst, src)], fused groups [(wd, masters, grads, m, v)],
        weight casts [(dst, src)]). Gradients: the down slot itself where it is fp32, else each run of
        same-dtype pieces (contiguous in the slot) cast into the scratch tile, read by the kernel from cache."""
        grads, gcasts, scratch, t0 = [], [], self._staging["scratch"], tile[0][3]
        for dt, run in itertools.groupby(tile, key=lambda pc: self._down_dtype(pc[0])):
            run = list(run)
            o0, o1 = run[0][3], run[-1][3] + run[-1][2] - run[-1][1]  # the run's span in the slot
            src, base = self._slot("down", dt, k), 0
            if dt != torch.float32:
                gcasts.append((scratch[o0 - t0:o1 - t0], src[o0:o1]))  # bf16 -> fp32 is exact: the GPU cast's bits
                src, base = scratch, t0
            grads += [src[off - base:off - base + b - a] for _, a, b, off in run]
        flat = lambda j, key: self.state[tile[j][0]][key].view(-1)[tile[j][1]:tile[j][2]]  # noqa: E731
        groups = []
        for wd in sorted({self._decay(n) for n, *_ in tile}):
            sel = [j for j, pc in enumerate(tile) if self._decay(pc[0]) == wd]
            groups.append((wd, [flat(j, "master") for j in sel], [grads[j] for j in sel],
                           [flat(j, "exp_avg") for j in sel], [flat(j, "exp_avg_sq") for j in sel]))
        wcasts = [(self._slot("up", self.params[n].dtype, k)[off:off + b - a], flat(j, "master"), self.storage.get(n))
                  for j, (n, a, b, off) in enumerate(tile)]
        return gcasts, groups, wcasts

    def _host_tile(self, ops, step: torch.Tensor, laps) -> None:
        """Fused AdamW on one tile, then its masters cast into the up slot while they are still in cache."""
        gcasts, groups, wcasts = ops
        for dst, src in gcasts:
            dst.copy_(src)
        laps.lap("grad_cast_s")
        for wd, masters, grads, ms, vs in groups:
            fused_adamw_(masters, grads, ms, vs, step, self.lr, self.betas, self.eps, wd)
        laps.lap("kernel_s")
        for dst, src, keep in wcasts:  # fp32 master -> the parameter's dtype (via its storage dtype), on the host
            dst.copy_(src if keep is None else src.to(keep))
        laps.lap("weight_cast_s")

    def _upload(self, chunk, k: int) -> None:
        S = self._staging
        with torch.cuda.stream(S["streams"][1]) if S["streams"] else contextlib.nullcontext():
            for name, a, b, off in chunk:
                p = self.params[name]
                p.view(-1)[a:b].copy_(self._slot("up", p.dtype, k)[off:off + b - a], non_blocking=True)
            if S["events"]:
                S["events"][1][k].record()

    def host_bytes(self) -> dict:
        """Host memory this optimizer holds: {"state": pageable fp32 state, "pinned": staging slots}."""
        state = sum(v.numel() * 4 for st in self.state.values() for v in st.values()) if self.offload else 0
        S = self._staging
        pinned = 0 if S is None else sum(t.numel() * t.element_size() for way in ("down", "up")
                                         for ts in S[way].values() for t in ts if t is not None)
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

