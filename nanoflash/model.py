"""DeepSeek-V4-Flash in pure PyTorch: every block of the published model, in the official names.

    tokens -> embed -> copy into M=4 mHC streams -> 43 x Block -> hc_head -> norm -> head -> logits
    Block(h) = hc_post( MoE( ffn_norm( hc_pre(h') ) ) ),  h' = hc_post( Attention( attn_norm( hc_pre(h) ) ) )

Reading order, top to bottom: RMSNorm, RoPE/YaRN, Linear, DecodeStep (a decode step's per-row position data, for
the decode seam's `decode_step` methods), Compressor (token-level KV compression), Indexer
(lightning indexer, C4 layers), Attention (sliding window 128 + compressed keys, one softmax with a per-head
sink, inverse RoPE, grouped low-rank output), Gate (sqrt-softplus, hash routing), Expert, LocalDispatcher, MoE,
mHC (Sinkhorn, hc_pre / hc_post / hc_head), Block, MTPBlock, Transformer. Equations and porting traps are in
`docs/v4_notes.md` (`v4_notes §X.Y` below).

How this differs from the official inference code (`inference/model.py`):
* Training forward for every position; the official forward computes the last position only.
* No FP8/FP4 storage inside the model: weights are dequantized (bf16 or fp32) at load time
  (`nanoflash.checkpoint`). The official numerics (FP8 1x128 activation quantization before FP8 GEMMs, FP8 on
  kv nope dims, Hadamard + FP4 on indexer q/k) are simulated with straight-through gradients when
  `cfg.qat` is on; off by default, giving a "clean" reference.
* Attention is a dense masked softmax over [window keys | compressed keys] computed in query chunks; the
  official code gathers the selected keys in a TileLang kernel. Same set of keys, same single softmax.
  `cfg.kernels` (`use_kernels`) hands training forwards on CUDA to `nanoflash.kernels` (Triton), which
  gathers the same keys and computes the indexer's top-k without the [S,heads,C] tensor.
* Decoding: `new_cache()` + `forward(ids, start_pos, cache)` feeds the same functions with the kept window,
  compressor remainder and compressed entries; the readable path has no decode-only math. Rows at
  different lengths decode in one call with per-row start_pos (a cache joined by `cat_caches`): the same
  functions, with per-row positions and masks (the rollout engine's continuous batching). On a GPU the decode
  seam (`decode_kernels`) swaps launch-bound pieces for few-launch equivalents: mHC in Triton, a one-token
  step's routed experts as dense batched GEMMs (`RoutedExperts.dense`), and a step of rows at their own
  positions through `Block.decode_step` (`DecodeStep`: the position data once per forward; norms, rope, the
  attention and the compressors' update in `nanoflash.kernels.decode`) -- the same math in ~9% of the
  reference's ops (`small`, 64 rows), each piece tested against the readable path it replaces
  (tests/test_decode_kernels.py).
* No distributed code: expert / pipeline parallelism are applied to a built model by `nanoflash.parallel`.
* Activation recomputation (`Transformer.recompute`, set from `ParallelConfig.recompute`): "full" runs every
  layer under torch.utils.checkpoint (only its input kept, the whole layer run again in backward); a sub-block
  policy (`config.RECOMPUTE_BLOCKS`; "selective" = mhc, norm, swiglu) wraps only those sub-blocks
  (`recomputed`), so the expensive ones -- the attention kernel, whose outputs and LSE stay saved, and the
  routed experts, whose dispatched inputs stay saved -- never run twice. Gradients are bit-equal to no
  recomputation on the CPU (tests/test_recompute.py).

Shape legend: B batch, S sequence, D dim, H heads, Dh head dim, R rope dims, C compressed entries,
M hc streams, E experts, K top-k, N tokens (B*S), T routed token slots.

Tests: `pytest tests/test_model_blocks.py tests/test_model.py tests/test_hf_parity.py tests/test_decode_kernels.py`.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanoflash.names import EXPERT_STACKS, official_parameters, official_views
from nanoflash.config import ModelConfig, recompute_blocks
from nanoflash.quant import ACT_QAT_BLOCK, fp4_sim, fp8_index_sim, fp8_sim, hadamard, qat_block

KV_QAT_BLOCK = 64      # official act_quant block on kv nope dims
FP4_QAT_BLOCK = 32     # official FP4 simulation block on indexer q / keys
# Dense decode experts (`MoE.dense_pays`): at most this many times the routed FLOPs of the per-expert loop. A
# decode step of 8-256 rows hits nearly every expert of a small layer (64 rows x 6 of 16), so both read every
# expert's weights once and the extra FLOPs cost little next to ~8 launches per expert and a host sync per layer;
# `small` (16 / 6 = 2.7x) and `tiny` (8 / 2 = 4x) qualify, V4-Flash (256 / 6 = 43x) does not.
DENSE_MAX_FLOPS = 4


def fp8_sim_nope(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """FP8-simulate the nope dims of kv (per 64 channels); the rope dims stay in the activation dtype."""
    nope = x[..., :-rope_dim]
    return torch.cat([fp8_sim(nope, qat_block(nope.shape[-1], KV_QAT_BLOCK)), x[..., -rope_dim:]], -1)


def index_sim(cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """The indexer's q or keys (after rope) as the engine `cfg.indexer_quant` names scores them: "fp4" (and
    "qat" with cfg.qat on) the official Hadamard + FP4 QAT (x.dtype); "fp8" SGLang 0.5.16's Hadamard + FP8 row
    with an fp32 scale (`quant.fp8_index_sim`, fp32 out); "none" (and "qat" with qat off) x unchanged.
    Shapes: [..., dI] -> [..., dI]"""
    mode = cfg.indexer_quant if cfg.indexer_quant != "qat" else ("fp4" if cfg.qat else "none")
    if mode == "fp4":
        return fp4_sim(hadamard(x), qat_block(x.shape[-1], FP4_QAT_BLOCK))
    if mode == "fp8":
        return fp8_index_sim(x)
    return x


def recomputed(on: bool, fn, *args):
    """fn(*args); when `on`, under torch.utils.checkpoint (non-reentrant): autograd keeps only the inputs, and
    backward runs fn again for its inner activations. The output is whatever its consumers save."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False) if on else fn(*args)  # no RNG here


def set_recompute(module: nn.Module, value) -> frozenset:
    """Give every submodule holding recomputable sub-blocks (a `recompute_blocks` attribute) the set that
    `value` (a `ParallelConfig.recompute` value) names. -> the set"""
    blocks = recompute_blocks(value)
    for m in module.modules():
        if hasattr(m, "recompute_blocks"):
            m.recompute_blocks = blocks
    return blocks


def active_recompute(module: nn.Module) -> frozenset:
    """The sub-blocks `module` recomputes (its `recompute_blocks`) in a training forward that autograd records;
    none otherwise (evaluation, no_grad scoring, decoding)."""
    return module.recompute_blocks if module.training and torch.is_grad_enabled() else frozenset()


# ---------------------------------------------------------------------------------------------- norms, rope
class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (v4_notes §2.0).

    Shapes: x [..., D] -> [..., D]
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


@functools.lru_cache(maxsize=16)
def rope_inv_freq(rope_dim: int, base: float, factor: float, original_seq_len: int,
                  beta_fast: int, beta_slow: int) -> torch.Tensor:
    """inv_freq_i = base^(-2i/R); with YaRN (original_seq_len > 0) the low frequencies are divided by
    `factor` through a linear ramp between the beta_fast / beta_slow correction dims (v4_notes §2.3.3).

    Shapes: -> [R/2] fp32
    """
    inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def corr_dim(n_rot):
            return rope_dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)
    return inv


def token_positions(start_pos, S: int, device) -> torch.Tensor:
    """Absolute positions of a call's S tokens: from one start for every row (an int), or from each row's own
    start (an int64 tensor [B] on the host: the rows of a decode batch, at different lengths).

    Shapes: -> [S] (int start) or [B,S] (per-row starts) int64 on `device`
    """
    if torch.is_tensor(start_pos):
        return host_to(start_pos, device)[:, None] + torch.arange(S, device=device)
    return torch.arange(start_pos, start_pos + S, device=device)


def host_to(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device` without a host sync: a copy from pageable memory waits for every kernel
    queued before it (a decode step would stall on each), one from pinned memory is queued like a kernel."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def rope_angles(cfg: ModelConfig, compressed: bool, positions: torch.Tensor):
    """cos, sin of the layer's rotary angles at integer `positions`: theta=rope_theta without YaRN on
    sliding-only layers, compress_rope_theta with YaRN on compressed layers.

    Shapes: positions [S] or [B,S] -> cos, sin [S, R/2] or [B,S,R/2] fp32
    """
    ang = positions.to(torch.float32)[..., None] * layer_inv_freq(cfg, compressed).to(positions.device)  # [(B,)S,R/2]
    return ang.cos(), ang.sin()


def layer_inv_freq(cfg: ModelConfig, compressed: bool) -> torch.Tensor:
    """`rope_inv_freq` of a compressed (YaRN, compress_rope_theta) or sliding-only (rope_theta) layer. -> [R/2] fp32"""
    if compressed:
        return rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_seq_len,
                             cfg.beta_fast, cfg.beta_slow)
    return rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, 1.0, 0, 0, 0)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the LAST R dims by the angle of their position
    (GPT-J style, official `apply_rotary_emb`); `inverse` rotates back. Other dims pass through.

    Shapes: x [B,S,(H,)Dh], cos/sin [(B,)S,R/2] -> same as x
    """
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:].float()
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)          # [(B,)S,1,R/2]
    x1, x2 = rot[..., 0::2], rot[..., 1::2]                       # [...,R/2]
    sin = -sin if inverse else sin
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)   # [...,R]
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


class Linear(nn.Linear):
    """y = x W^T (no bias). With `qat_input` the input is FP8-quantized per 1x128 block first, as the
    official FP8 / FP4 GEMMs do (straight-through gradient).

    Shapes: x [..., in] -> [..., out]
    """

    def __init__(self, in_features: int, out_features: int, qat_input: bool = False):
        super().__init__(in_features, out_features, bias=False)
        self.qat_input = qat_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.qat_input:
            x = fp8_sim(x, qat_block(x.shape[-1], ACT_QAT_BLOCK))
        return F.linear(x, self.weight)


# ---------------------------------------------------------------------------------------------- decode step
@dataclass
class WindowEnds:
    """Where a decode step's rows stand in a ratio-m compressor's windows (`DecodeStep.windows`): row b's token
    at position p is slot p mod m of its window; the window ends, and entry (p+1)//m - 1 is written, where
    (p+1) mod m = 0."""
    any: bool                     # some row's window ends here (host)
    rows: torch.Tensor            # [n] int64: the rows whose window ends
    entries: torch.Tensor         # [n] int64: the entry each of them writes
    n_entries: int                # 1 + the largest of those entries (host; 0 if none)
    cos: Optional[torch.Tensor]   # [B,1,R/2] fp32: the compressed rope at each row's entry position (p+1)//m*m - m
    sin: Optional[torch.Tensor]   # (None when no window ends)


class DecodeStep:
    """One decode step over rows at their own positions (per-row start_pos, one token each), on the decode seam:
    what every layer needs from the positions, computed on first use and shared by all layers of the forward.

    The reference recomputes these in every layer and module -- the positions on the device, the rope angles,
    which rows end a compressor window and the entry each writes -- tens of small ops and, per rope, a host sync
    (its inverse frequencies copied from pageable memory). `Transformer.run_layers` builds one per forward
    (`DecodeStep.of`) and hands it to `Block.decode_step`; every host copy goes through pinned memory (`host_to`).

    Shapes: start_pos [B] int64 on the host
    """

    def __init__(self, cfg: ModelConfig, start_pos: torch.Tensor, device):
        self.cfg, self.host = cfg, start_pos
        self.pos = host_to(start_pos, device)                                            # [B]
        self._memo: dict = {}

    @staticmethod
    def of(cfg: ModelConfig, h: torch.Tensor, start_pos, cache) -> Optional["DecodeStep"]:
        """The step of a forward that takes the decode seam's one-token path (`decode_kernels`, per-row start_pos,
        one token per row, autograd off: its kernels have no backward), else None.  h [B,S,M,D]"""
        if (cache is None or not torch.is_tensor(start_pos) or h.shape[1] != 1 or torch.is_grad_enabled()
                or not decode_kernels(cfg, h, cache)):
            return None
        return DecodeStep(cfg, start_pos, h.device)

    def _memoized(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def angles(self, compressed: bool, positions: torch.Tensor):
        """`rope_angles` at device positions [B], the frequencies copied through pinned memory. -> cos, sin
        [B,1,R/2] fp32"""
        inv = self._memoized(("inv", compressed),
                             lambda: host_to(layer_inv_freq(self.cfg, compressed), self.pos.device))    # [R/2]
        ang = positions.to(torch.float32)[:, None, None] * inv                             # [B,1,R/2]
        return ang.cos(), ang.sin()

    def rope(self, compressed: bool):
        """cos, sin [B,1,R/2] at the rows' positions, for a compressed or a sliding-only layer."""
        return self._memoized(("rope", compressed), lambda: self.angles(compressed, self.pos))

    def windows(self, m: int) -> WindowEnds:
        """The rows' place in a ratio-m compressor's windows (`WindowEnds`)."""
        return self._memoized(("windows", m), lambda: self._windows(m))

    def _windows(self, m: int) -> WindowEnds:
        dev, rows = self.pos.device, ((self.host + 1) % m == 0).nonzero()[:, 0]           # [n] host
        if not len(rows):
            return WindowEnds(False, rows, rows, 0, None, None)
        entries = (self.host[rows] + 1) // m - 1
        cos, sin = self.angles(True, ((self.pos + 1) // m - 1) * m)
        return WindowEnds(True, host_to(rows, dev), host_to(entries, dev), int(entries.max()) + 1, cos, sin)


def step_entries(before: Optional[torch.Tensor], new: Optional[torch.Tensor], w: WindowEnds) -> torch.Tensor:
    """`add_entries` for a decode step (per-row positions), from its `WindowEnds`: row b's new entry written to its
    slot where its window ended, the cache widened to `n_entries` if it is short. new [B,1,d] or None -> [B,C,d]"""
    if new is None:
        return before
    if before is None:
        before = new[:, :0]
    if w.n_entries > before.shape[1]:
        before = F.pad(before, (0, 0, 0, w.n_entries - before.shape[1]))
    return before.index_put((w.rows, w.entries), new[w.rows, 0])


# ---------------------------------------------------------------------------------------------- compressor
@dataclass
class CompressorState:
    """Decode-time remainder of a Compressor: projected tokens of the incomplete window (from position
    `start`, a multiple of m) and, for the overlapping C4 compressor, the last complete window.

    Per-row form (`Compressor.rowwise`, a decode batch whose rows stand at different positions): kv / score
    hold each row's last m-1 tokens, right-aligned (row b's incomplete window is its last p_b mod m; the
    columns before are older tokens or zeros, never pooled), prev_* are always set (zeros / -inf before a
    row's first complete window, as `pool` assumes), and `start` is unused."""
    kv: torch.Tensor                      # [B,r,coff*d] fp32, r < m
    score: torch.Tensor                   # [B,r,coff*d] fp32, ape already added
    start: int = 0
    prev_kv: Optional[torch.Tensor] = None     # [B,m,2d]
    prev_score: Optional[torch.Tensor] = None  # [B,m,2d]


class Compressor(nn.Module):
    """Token-level KV compression (v4_notes §2.3.5). Each complete window w of m tokens becomes one entry

        c_w = sum_slots softmax_slots(wgate x + ape[t mod m]) * (wkv x)        (per channel, fp32)
        c_w = rope(norm(c_w), position w*m)

    C4 (m = 4) overlaps: the first half of the 2d features of window w-1 ("Ca") and the second half of window
    w ("Cb") are pooled together (8 slots). Other ratios pool the m slots of their window.
    Only complete windows are emitted; an entry w is visible to query t iff w < (t+1)//m.
    Decoding rows at their own positions (per-row start_pos, one token each): `step_rows`.

    Shapes: x [B,S,D] -> entries [B,S//m,d] (+ the remainder state for decoding)
    """

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, rotate: bool = False):
        super().__init__()
        self.cfg, self.ratio, self.head_dim, self.rotate = cfg, ratio, head_dim, rotate
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.wkv = Linear(cfg.dim, coff * head_dim)
        self.wgate = Linear(cfg.dim, coff * head_dim)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)

    def project(self, x: torch.Tensor, start_pos):
        """Per-token kv and gate scores in fp32, the absolute-position bias `ape[t mod m]` added to the score."""
        kv = fp32_linear(x, self.wkv.weight, self.cfg)                              # [B,S,coff*d]
        pos = token_positions(start_pos, x.shape[1], x.device) % self.ratio          # [S] or [B,S]
        score = fp32_linear(x, self.wgate.weight, self.cfg) + self.ape.float()[pos]  # [B,S,coff*d]
        return kv, score

    def pool(self, kv: torch.Tensor, score: torch.Tensor, prev_kv=None, prev_score=None) -> torch.Tensor:
        """Softmax-pool complete windows. kv/score [B,n*m,coff*d] -> [B,n,d] fp32."""
        B, m, d = kv.shape[0], self.ratio, self.head_dim
        if kv.shape[1] == 0:
            return kv.new_zeros(B, 0, d)
        kv, score = kv.unflatten(1, (-1, m)), score.unflatten(1, (-1, m))          # [B,n,m,coff*d]
        if self.overlap:
            if prev_kv is None:
                prev_kv = kv.new_zeros(B, m, 2 * d)
                prev_score = score.new_full((B, m, 2 * d), float("-inf"))
            ca_kv = torch.cat([prev_kv[:, None], kv[:, :-1]], 1)[..., :d]            # [B,n,m,d] window w-1
            ca_score = torch.cat([prev_score[:, None], score[:, :-1]], 1)[..., :d]
            kv = torch.cat([ca_kv, kv[..., d:]], dim=2)                               # [B,n,2m,d]
            score = torch.cat([ca_score, score[..., d:]], dim=2)                      # [B,n,2m,d]
        return (kv * score.softmax(dim=2)).sum(dim=2)                                 # [B,n,d]

    def forward(self, x: torch.Tensor, start_pos, state: Optional[CompressorState] = None):
        if torch.is_tensor(start_pos):
            return self.step_rows(x, start_pos, state)
        kv, score = self.project(x, start_pos)
        start = start_pos
        prev_kv = prev_score = None
        if state is not None:
            kv, score = torch.cat([state.kv, kv], 1), torch.cat([state.score, score], 1)
            start, prev_kv, prev_score = state.start, state.prev_kv, state.prev_score
        assert start % self.ratio == 0, f"compressor windows must start at a multiple of {self.ratio}, got {start}"
        n = kv.shape[1] // self.ratio
        cut = n * self.ratio
        c = self.pool(kv[:, :cut], score[:, :cut], prev_kv, prev_score)             # [B,n,d]
        if n > 0 and self.overlap:
            prev_kv, prev_score = kv[:, cut - self.ratio:cut], score[:, cut - self.ratio:cut]
        new_state = CompressorState(kv[:, cut:], score[:, cut:], start + cut, prev_kv, prev_score)
        return self.finish(c, start // self.ratio, x.dtype), new_state

    def step_rows(self, x: torch.Tensor, start_pos: torch.Tensor, state: CompressorState):
        """One token per row at the row's own position p (start_pos [B], host). Every row's last m tokens (its
        state's m-1, then this one) are pooled when any row's window ends here; the entry is real for the rows
        with (p + 1) % m == 0 and is entry (p+1)//m - 1 (`add_entries` keeps only those). -> entries [B,1,d]
        (or [B,0,d]: no window ends), the state in per-row form"""
        m, state = self.ratio, self.rowwise(state)
        kv, score = self.project(x, start_pos)                                      # [B,1,coff*d]
        kv, score = torch.cat([state.kv, kv], 1), torch.cat([state.score, score], 1)   # [B,m,coff*d]
        ends = (start_pos + 1) % m == 0                                              # [B] host
        prev_kv, prev_score, c = state.prev_kv, state.prev_score, kv.new_zeros(kv.shape[0], 0, self.head_dim)
        if bool(ends.any()):
            c = self.finish(self.pool(kv, score, prev_kv, prev_score), (start_pos + 1) // m - 1, x.dtype)
            if self.overlap:                     # the window that ended is the next one's "Ca"
                e = host_to(ends, x.device)[:, None, None]
                prev_kv, prev_score = torch.where(e, kv, prev_kv), torch.where(e, score, prev_score)
        return c, CompressorState(kv[:, 1:], score[:, 1:], 0, prev_kv, prev_score)

    def rowwise(self, state: CompressorState) -> CompressorState:
        """`state` in the per-row form (see CompressorState); unchanged if it is already."""
        m, B, (kv, score) = self.ratio, state.kv.shape[0], (state.kv, state.score)
        if kv.shape[1] < m - 1:                              # left-pad the remainder to m-1 columns
            kv, score = (F.pad(t, (0, 0, m - 1 - t.shape[1], 0)) for t in (kv, score))
        prev_kv, prev_score = state.prev_kv, state.prev_score
        if self.overlap and prev_kv is None:
            prev_kv = kv.new_zeros(B, m, 2 * self.head_dim)
            prev_score = kv.new_full((B, m, 2 * self.head_dim), float("-inf"))
        return CompressorState(kv, score, 0, prev_kv, prev_score)

    def finish(self, c: torch.Tensor, w0, dtype: torch.dtype) -> torch.Tensor:
        """norm, rope at position w*m (entries w0, w0+1, ...; w0 an int or per row [B] on the host), then the QAT
        simulation (FP8 nope dims, or Hadamard + FP4)."""
        c = self.norm(c.to(dtype))
        pos = token_positions(w0, c.shape[1], c.device) * self.ratio
        return self.entry_sim(apply_rope(c, *rope_angles(self.cfg, True, pos)))

    def entry_sim(self, c: torch.Tensor) -> torch.Tensor:
        """The official storage of finished entries: the indexer's keys FP4 QAT, SGLang's FP8 or exact
        (`index_sim`); the attention's entries FP8 on the nope dims under QAT."""
        if self.rotate:
            return index_sim(self.cfg, c)
        return fp8_sim_nope(c, self.cfg.rope_head_dim) if self.cfg.qat else c

    def decode_step(self, x: torch.Tensor, step: DecodeStep, state: CompressorState):
        """`step_rows` on the decode seam (`DecodeStep`): the same projections, then the state's update, `ape` and
        the pooling in one launch (`kernels.decode.compress_step`; no pooling while no row's window ends), the
        entry's norm + rope in another (`kernels.decode.rms_rope`).
        x [B,1,D] -> entries [B,1,d] or None (no window ends), the state in per-row form"""
        from nanoflash.kernels.decode import compress_step, rms_rope
        w, state = step.windows(self.ratio), self.rowwise(state)
        kv = fp32_linear(x, self.wkv.weight, self.cfg)                                       # [B,1,coff*d]
        score = fp32_linear(x, self.wgate.weight, self.cfg)
        kv, score, c, prev_kv, prev_score = compress_step(state.kv, state.score, kv, score, self.ape, step.pos,
                                                          state.prev_kv, state.prev_score, pool=w.any)
        if c is not None:
            c = self.entry_sim(rms_rope(c.to(x.dtype), self.norm.weight, self.norm.eps, w.cos, w.sin))
        return c, CompressorState(kv, score, 0, prev_kv, prev_score)


# ---------------------------------------------------------------------------------------------- indexer
class Indexer(nn.Module):
    """Lightning indexer of C4 layers (v4_notes §2.3.6): each query keeps the top-k visible compressed entries

        score[t,u] = sum_h relu(qI[t,h] . KI[u]) * w[t,h],   qI = rope(wq_b(qr)),  w = weights_proj(x)/sqrt(dI*HI)
        keep top-min(index_topk, C) of score over u < (t+1)//m

    Top-k is not differentiable: the indexer gets no gradient (as in every V4 trainer).

    Shapes: x [B,S,D], qr [B,S,q_lora_rank] -> keep mask [B,S,C] bool (+ keys [B,C,dI] for the cache);
            with fast=True the kept entries as an index list [B,S,min(k,C)] int32, -1 = none
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, qat_input=cfg.qat)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads)
        self.compressor = Compressor(cfg, 4, cfg.index_head_dim, rotate=True)

    def query(self, qr: torch.Tensor, start_pos) -> torch.Tensor:
        """qI: wq_b(qr) per head, rope at the query positions, then `index_sim`. [B,S,q_lora] -> [B,S,HI,dI]"""
        cfg = self.cfg
        pos = token_positions(start_pos, qr.shape[1], qr.device)
        q = self.wq_b(qr).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))    # [B,S,HI,dI]
        return index_sim(cfg, apply_rope(q, *rope_angles(cfg, True, pos)))

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """w = weights_proj(x) / sqrt(dI * HI), fp32. [B,S,D] -> [B,S,HI]"""
        return self.weights_proj(x).float() * (self.cfg.index_head_dim ** -0.5 * self.cfg.index_n_heads ** -0.5)

    def forward(self, x, qr, start_pos, keys_before: Optional[torch.Tensor], state=None, fast=False, kept=None):
        """kept [B,S,K] int (optional): indexer replay, the entries the rollout engine kept per query (-1
        padded); they replace this indexer's top-k (its keys are still built, for the cache)."""
        new_keys, state = self.compressor(x, start_pos, state)
        keys = add_entries(keys_before, new_keys, start_pos, 4)                       # [B,C,dI]
        if kept is not None:
            return replayed_entries(kept, keys.shape[1], self.cfg.index_topk, start_pos, fast), keys, state
        q = self.query(qr, start_pos)                                                 # [B,S,HI,dI]
        w = self.head_weights(x)                                                      # [B,S,HI]
        if fast:   # nanoflash.kernels: fused scores, torch.topk on [B,S,C], the same tie-break
            from nanoflash.kernels import indexer_topk
            return indexer_topk(q, keys.to(q.dtype), w.detach(), start_pos, self.cfg.index_topk), keys, state
        return self.top_k(q, keys, w, start_pos), keys, state

    @torch.no_grad()
    def top_k(self, q, keys, w, start_pos) -> torch.Tensor:
        """The kept entries: top-min(index_topk, C) of `index_scores` among the visible ones. -> [B,S,C] bool"""
        score = index_scores(q, keys, w.detach(), start_pos)                           # [B,S,C]
        k = min(self.cfg.index_topk, keys.shape[1])
        # A stable sort breaks ties (ReLU zeros) by the lower entry index, the same in prefill and decode.
        top = score.sort(dim=-1, descending=True, stable=True).indices[..., :k]         # [B,S,k]
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True) & (score > float("-inf"))

    def decode_step(self, x, qr, step: DecodeStep, keys_before, state):
        """`forward` for a one-token step on the decode seam: the compressor's `decode_step`, then the top-k only once
        the row batch holds more than index_topk entries. Until then every visible entry is kept -- the top-k of
        C <= k entries is all of them, `score > -inf` drops the invisible ones -- which `kernels.decode_attention`
        reads off the positions: keep None, and no query, weights or scores computed.
        -> keep [B,1,C] bool or None, keys [B,C,dI], state"""
        new_keys, state = self.compressor.decode_step(x, step, state)
        keys = step_entries(keys_before, new_keys, step.windows(self.compressor.ratio))    # [B,C,dI]
        if keys.shape[1] <= self.cfg.index_topk:
            return None, keys, state
        return self.top_k(self.query(qr, step.host), keys, self.head_weights(x), step.host), keys, state


def check_replay_record(kept: torch.Tensor, topk: int) -> None:
    """An indexer-replay record of one sequence, [T, n_c4, K] entries (-1 padded), row t the query at position t:
    an entry the query cannot see (u >= (t+1)//4), or more entries than the top-k keeps, is a record of another
    sequence or model -- an error naming the first such query. Checked once, where the record enters (the
    collector), not in every forward that replays it."""
    n_visible = (torch.arange(kept.shape[0], device=kept.device) + 1) // 4                 # [T]
    bad = (kept >= n_visible[:, None, None]) | ((kept >= 0).sum(-1) > topk)[..., None]
    if bad.any():
        t, j, _ = bad.nonzero()[0].tolist()
        raise ValueError(f"indexer replay: query {t} keeps an entry beyond its {int(n_visible[t])} visible ones "
                         f"or more than top-{topk} in C4 layer {j}: not this sequence's record")


def replayed_entries(kept: torch.Tensor, C: int, topk: int, start_pos, fast: bool) -> torch.Tensor:
    """Indexer replay: the rollout engine's kept entries [B,S,K] (-1 padded, any order; `check_replay_record`)
    in the form the indexer returns: the keep mask [B,S,C] bool, or (fast) the index list [B,S,min(topk, C)]
    int32, -1 last."""
    kept = kept.to(torch.int64)
    if fast:
        k = min(topk, C)
        return kept.sort(-1, descending=True).values[..., :k].to(torch.int32).contiguous()
    mask = torch.zeros(*kept.shape[:2], C + 1, dtype=torch.bool, device=kept.device)
    return mask.scatter_(-1, torch.where(kept >= 0, kept, C), True)[..., :C]


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, start_pos) -> torch.Tensor:
    """score[b,t,u] = sum_h relu(qI[b,t,h] . KI[b,u]) * w[b,t,h] in fp32, -inf where entry u is not yet visible
    to query t (u >= (start_pos + t + 1) // 4). q [B,S,HI,dI], keys [B,C,dI], w [B,S,HI] -> [B,S,C] fp32"""
    pos = token_positions(start_pos, q.shape[1], q.device)
    score = torch.einsum("bshd,bcd->bshc", q.float(), keys.float()).relu()             # [B,S,HI,C]
    score = (score * w.float()[..., None]).sum(2)                                      # [B,S,C]
    return score.masked_fill(~visible_entries(keys.shape[1], pos, 4), float("-inf"))


def c4_layers(cfg) -> list:
    """The layers with a lightning indexer (compress ratio 4), in order: SGLang numbers its C4 layers so
    (`compress_layer_id`), and an indexer-replay record holds one slice per layer of this list."""
    return [i for i in range(cfg.n_layers) if cfg.compress_ratios[i] == 4]


def visible_entries(C: int, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """Entry u of a ratio-m compressor is visible to the query at position t iff u < (t+1)//m (its window has
    ended). pos [S] or [B,S] -> [1,S,C] or [B,S,C] bool"""
    v = torch.arange(C, device=pos.device) < (pos[..., None] + 1) // ratio
    return v if v.dim() == 3 else v[None]


def add_entries(before: Optional[torch.Tensor], new: torch.Tensor, start_pos, ratio: int) -> torch.Tensor:
    """A compressor's entries so far plus this call's `new`: appended when every row has one start (each row
    ended the same windows), else written per row -- row b's entry (p_b+1)//m - 1 where its window ended at
    p_b (start_pos [B] on the host), the other rows' `new` dropped. Slots past a row's own count are zeros
    from rows that have more, invisible to its queries (`visible_entries`). -> [B,C,d]"""
    if before is None or not torch.is_tensor(start_pos):
        return new if before is None else torch.cat([before, new], 1)
    ends = ((start_pos + 1) % ratio == 0).nonzero()[:, 0]                             # host
    if new.shape[1] == 0 or len(ends) == 0:
        return before
    slots = (start_pos[ends] + 1) // ratio - 1
    out = F.pad(before, (0, 0, 0, max(int(slots.max()) + 1 - before.shape[1], 0)))   # [B,C',d]
    rows, slots = host_to(ends, new.device), host_to(slots, new.device)
    return out.index_put((rows, slots), new[rows, 0])


# ---------------------------------------------------------------------------------------------- attention
@dataclass
class LayerCache:
    """What one attention layer keeps between decode calls: the last W-1 window keys, the compressed
    entries so far, and the compressors' remainders (all fp32/activation dtype). In a decode batch of rows at
    different positions (`Transformer.cat_caches`) the window is right-aligned (a shorter row left-padded
    with zeros, which `attend` masks as positions < 0) and the entries are per-row slots (`add_entries`)."""
    window: Optional[torch.Tensor] = None        # [B,<W,Dh]
    comp: Optional[torch.Tensor] = None          # [B,C,Dh]
    comp_state: Optional[CompressorState] = None
    index_keys: Optional[torch.Tensor] = None    # [B,C,dI]
    index_state: Optional[CompressorState] = None


def sink_attention(q, keys, key_mask, sink, scale):
    """One softmax over the selected keys plus a per-head sink logit that only adds to the denominator:
        p_j = exp(l_j) / (sum_j exp(l_j) + exp(sink_h)),   l_j = (q . k_j) * scale,   o = sum_j p_j k_j   (V = K)

    Shapes: q [B,s,H,Dh], keys [B,L,Dh], key_mask [B or 1,s,L] bool, sink [H] -> o [B,s,H,Dh]
    """
    logits = torch.einsum("bshd,bld->bhsl", q.float(), keys.float()) * scale           # [B,H,s,L]
    logits = logits.masked_fill(~key_mask[:, None], float("-inf"))
    sink_col = sink.float()[None, :, None, None].expand(*logits.shape[:3], 1)         # [B,H,s,1]
    p = torch.cat([logits, sink_col], -1).softmax(-1)[..., :-1]                        # [B,H,s,L]
    return torch.einsum("bhsl,bld->bshd", p, keys.float()).to(q.dtype)


def fp32_linear(x: torch.Tensor, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """x W^T with an fp32 result, as the official head / gate / compressor run it (fp32 inputs). kernels="triton"
    on CUDA: bf16 inputs, fp32 accumulation and output (nanoflash.kernels.matmul). [..., K] -> [..., N] fp32"""
    if cfg.kernels == "triton" and x.is_cuda:
        from nanoflash.kernels.matmul import linear_fp32
        return linear_fp32(x, w)
    return F.linear(x.float(), w.float())


def decode_kernels(cfg: ModelConfig, h: torch.Tensor, cache) -> bool:
    """The decode seam (a forward with a cache -- a layer's `LayerCache` or the model's dict: the rollout engine's
    prefills and steps): True runs mHC in Triton (`nanoflash.kernels.mhc`) and a one-token step's routed experts
    as batched GEMMs (`RoutedExperts.dense`), and a step of rows at their own positions (the engine's decode
    forward) through `Block.decode_step` -- norms, rope and attention in few launches (`nanoflash.kernels.decode`),
    the position data built once per forward (`DecodeStep`) -- so a step issues ~55 ops per block instead of ~600
    (the reference's 20 Sinkhorn iterations on [B,4,4] tensors, one GEMM chain per expert and a host sync per
    layer, ~70 ops per attention: `bench_rollout.py --part launches`). cfg.kernels "auto": on
    CUDA; "triton": also on the CPU (under TRITON_INTERPRET=1: the tests, the launch count); "reference": never.
    Without a cache (training, scoring) nothing changes here."""
    if cache is None or cfg.kernels == "reference":
        return False
    return cfg.kernels == "triton" or h.is_cuda


def use_kernels(cfg: ModelConfig, q: torch.Tensor, cache: Optional[LayerCache]) -> bool:
    """The attention seam: True hands the indexer top-k and the attention to `nanoflash.kernels` (Triton).
    cfg.kernels "auto": bf16/fp16 on CUDA without a decode cache (training forward and backward);
    "triton": wherever there is no decode cache (the CPU tests run it under TRITON_INTERPRET=1);
    "reference": never (matched precision; deterministic backward). Decoding always keeps the reference."""
    if cfg.kernels == "reference" or cache is not None:
        return False
    return cfg.kernels == "triton" or (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16))


class Attention(nn.Module):
    """V4 attention (v4_notes §2.3): low-rank q with per-head unweighted RMS, one shared K=V head, a sliding window
    of W keys [t-W+1, t], and in compressed layers the entries of a Compressor (C4: the indexer's top-k;
    C128: every visible entry), all in ONE softmax with a per-head sink; inverse RoPE on the output, then the
    grouped low-rank output projection  out = wo_b( concat_g( wo_a[g] . o[heads of g] ) ).

    Shapes: x [B,S,D] -> [B,S,D]
    """

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.ratio = cfg.compress_ratios[layer_id]
        H, Dh, q8 = cfg.n_heads, cfg.head_dim, cfg.qat
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, qat_input=q8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * Dh, qat_input=q8)
        self.wkv = Linear(cfg.dim, Dh, qat_input=q8)
        self.kv_norm = RMSNorm(Dh, cfg.norm_eps)
        self.wo_a = Linear(H * Dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, qat_input=q8)
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, Dh)
        if self.ratio == 4:
            self.indexer = Indexer(cfg)
        self.recompute_blocks = frozenset()   # attn_q / attn_out: `Transformer.recompute`

    def forward(self, x: torch.Tensor, start_pos=0, cache: Optional[LayerCache] = None, kept=None) -> torch.Tensor:
        cfg, (B, S, _), rc = self.cfg, x.shape, active_recompute(self)
        pos = token_positions(start_pos, S, x.device)                                  # [S] or [B,S]
        cos, sin = rope_angles(cfg, self.ratio > 0, pos)
        qr = self.q_norm(self.wq_a(x))                                                  # [B,S,q_lora]
        q = recomputed("attn_q" in rc, self.query_heads, qr, cos, sin)                 # [B,S,H,Dh]
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)                            # [B,S,Dh]
        if cfg.qat:
            kv = fp8_sim_nope(kv, cfg.rope_head_dim)
        fast = use_kernels(cfg, q, cache)
        cache = cache if cache is not None else LayerCache()
        window = kv if cache.window is None else torch.cat([cache.window, kv], 1)      # [B,Lw,Dh]
        comp, keep = self.compressed_keys(x, qr, start_pos, cache, fast, kept)
        o = self.attend(q, start_pos, window, comp, keep, fast)                         # [B,S,H,Dh]
        cache.window = window[:, -(cfg.window_size - 1):] if cfg.window_size > 1 else window[:, :0]
        return recomputed("attn_out" in rc, self.project_out, o, cos, sin)

    def query_heads(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q = rope(unweighted RMS per head of wq_b(qr)). [B,S,q_lora] -> [B,S,H,Dh]"""
        q = self.wq_b(qr).unflatten(-1, (self.cfg.n_heads, self.cfg.head_dim))         # [B,S,H,Dh]
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.cfg.norm_eps)
        return apply_rope(q, cos, sin)

    def project_out(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Inverse rope, then out = wo_b( concat_g( wo_a[g] . o[heads of g] ) ). [B,S,H,Dh] -> [B,S,D]"""
        return self.grouped_out(apply_rope(o, cos, sin, inverse=True))

    def grouped_out(self, o: torch.Tensor) -> torch.Tensor:
        """out = wo_b( concat_g( wo_a[g] . o[heads of g] ) ). [B,S,H,Dh] -> [B,S,D]"""
        cfg = self.cfg
        o = o.flatten(2).unflatten(-1, (cfg.o_groups, -1))                              # [B,S,G,H*Dh/G]
        wo_a = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)                 # [G,r_o,H*Dh/G]
        z = torch.einsum("bsgd,grd->bsgr", o.to(wo_a.dtype), wo_a)                     # [B,S,G,r_o]
        return self.wo_b(z.flatten(2))

    def decode_step(self, x: torch.Tensor, step: DecodeStep, cache: LayerCache) -> torch.Tensor:
        """`forward` for one token per row at the rows' own positions, on the decode seam (`DecodeStep`): the same
        math and cache in ~12 launches a sliding layer instead of ~70 -- each norm and rope one
        `kernels.decode.rms_rope`, the window and the kept entries one `kernels.decode.decode_attention`, the
        position data shared by every layer, the compressors' and the indexer's `decode_step`.
        x [B,1,D] -> [B,1,D]"""
        from nanoflash.kernels.decode import decode_attention, rms_rope
        cfg = self.cfg
        cos, sin = step.rope(self.ratio > 0)                                               # [B,1,R/2]
        qr = rms_rope(self.wq_a(x), self.q_norm.weight, self.q_norm.eps)                  # [B,1,q_lora]
        q = rms_rope(self.wq_b(qr).unflatten(-1, (cfg.n_heads, cfg.head_dim)), None, cfg.norm_eps, cos, sin)
        kv = rms_rope(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps, cos, sin)       # [B,1,Dh]
        if cfg.qat:
            kv = fp8_sim_nope(kv, cfg.rope_head_dim)
        window = kv if cache.window is None else torch.cat([cache.window, kv], 1)          # [B,Lw,Dh]
        comp = keep = None
        if self.ratio:
            new, cache.comp_state = self.compressor.decode_step(x, step, cache.comp_state)
            comp = cache.comp = step_entries(cache.comp, new, step.windows(self.ratio))    # [B,C,Dh]
            if self.ratio == 4:
                keep, cache.index_keys, cache.index_state = self.indexer.decode_step(
                    x, qr, step, cache.index_keys, cache.index_state)
        o = decode_attention(q[:, 0], window, step.pos, self.attn_sink, cfg.head_dim ** -0.5, cfg.window_size,
                             comp, None if keep is None else keep[:, 0], self.ratio)      # [B,H,Dh]
        cache.window = window[:, -(cfg.window_size - 1):] if cfg.window_size > 1 else window[:, :0]
        return self.grouped_out(rms_rope(o, cos=cos, sin=sin, inverse=True, norm=False)[:, None])

    def compressed_keys(self, x, qr, start_pos, cache: LayerCache, fast=False, kept=None):
        """Compressed entries (cached + new) and which of them each query keeps (a C4 layer: its indexer's top-k,
        or `kept`, the rollout engine's, in indexer replay). -> [B,C,Dh], [B|1,S,C] bool (fast: the kept entries
        as an index list [B|1,S,K], -1 padded)"""
        if not self.ratio:
            return None, None
        new, cache.comp_state = self.compressor(x, start_pos, cache.comp_state)
        comp = cache.comp = add_entries(cache.comp, new, start_pos, self.ratio)       # [B,C,Dh]
        if self.ratio == 4:
            keep, cache.index_keys, cache.index_state = self.indexer(
                x, qr, start_pos, cache.index_keys, cache.index_state, fast, kept)
        else:
            keep = visible_entries(comp.shape[1], token_positions(start_pos, x.shape[1], x.device), self.ratio)
            if fast:
                keep = torch.where(keep, torch.arange(comp.shape[1], device=x.device), -1)   # [1,S,C]
        return comp, keep

    def attend(self, q, start_pos, window, comp, keep, fast=False):
        """Chunk the queries; each chunk sees its window slice and the compressed entries it keeps.
        fast (no decode cache, so window = this call's kv): the kernel gathers the same keys instead.
        The window ends at each row's last query (right-aligned); a key at a position < 0 is a shorter row's
        padding in a decode batch (per-row start_pos) and is masked."""
        if fast:   # the kernel takes one dtype (q's) for q, kv and the entries
            from nanoflash.kernels import sparse_attention
            comp = comp.to(q.dtype) if comp is not None else None
            return sparse_attention(q, window.to(q.dtype), self.attn_sink, self.cfg.head_dim ** -0.5,
                                    self.cfg.window_size, comp, keep, prefix=True)
        W, S, Lw, out = self.cfg.window_size, q.shape[1], window.shape[1], []
        pos = token_positions(start_pos, S, q.device)                 # [S] or [B,S]
        first = pos[..., -1:] - (Lw - 1)                              # position of window[:, 0]: [1] or [B,1]
        for a in range(0, S, self.cfg.attn_chunk):
            b = min(a + self.cfg.attn_chunk, S)
            lo, hi = max(a - W + 1 + Lw - S, 0), b + Lw - S           # the window columns this chunk can see
            kpos = first + torch.arange(lo, hi, device=q.device)                      # [(B,)L]
            dist = pos[..., a:b, None] - kpos[..., None, :]                           # [(B,)s,L]
            mask = (dist >= 0) & (dist < W) & (kpos[..., None, :] >= 0)
            mask = mask if mask.dim() == 3 else mask[None]                            # [1|B,s,L]
            keys = window[:, lo:hi]
            if comp is not None:
                keys = torch.cat([keys, comp], 1)
                mask = torch.cat([mask.expand(keep.shape[0], -1, -1), keep[:, a:b]], -1)
            out.append(sink_attention(q[:, a:b], keys, mask, self.attn_sink, self.cfg.head_dim ** -0.5))
        return torch.cat(out, 1)


# ---------------------------------------------------------------------------------------------- MoE
class Gate(nn.Module):
    """Router (v4_notes §2.4.1): s = sqrt(softplus(x W^T)) in fp32; experts = tid2eid[token id] on hash layers,
    else top-k of (s + bias) (bias for selection only); weights = route_scale * s[idx] / sum s[idx].
    Routing replay (R3): `replay` [N,K], the experts the rollout engine chose, replaces the top-k on
    score-routed layers (the weights still come from this model's scores); it arrives as data with the
    micro-batch (`Transformer.run_layers(..., routed=)`), never as module state.

    Shapes: x [N,D], ids [N], replay [N,K] or None -> weights [N,K] fp32, indices [N,K] int64
    """

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.hash = cfg, cfg.is_hash_layer(layer_id)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, replay: Optional[torch.Tensor] = None):
        logits = fp32_linear(x, self.weight, self.cfg)                                  # [N,E]
        if self.cfg.score_func == "softmax":
            s = logits.softmax(-1)
        elif self.cfg.score_func == "sigmoid":
            s = logits.sigmoid()
        else:
            s = F.softplus(logits).sqrt()
        if self.hash:
            idx = self.tid2eid[ids]
        elif replay is not None:
            idx = replay.to(x.device, torch.int64)
        else:
            idx = (s + self.bias.float()).topk(self.cfg.n_activated_experts, dim=-1).indices
        w = s.gather(1, idx)                                                            # [N,K]
        if self.cfg.score_func != "softmax":
            w = w / w.sum(-1, keepdim=True)
        return w * self.cfg.route_scale, idx


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, rw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a = silu(min(g, L)) * clamp(u, -L, L) [* rw] in fp32 (L = 0: no clamp).  g, u [T,I], rw [T,1] -> [T,I]"""
    g, u = g.float(), u.float()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u if rw is None else F.silu(g) * u * rw


def swiglu_as(g, u, limit: float, rw: Optional[torch.Tensor], dtype: torch.dtype, w_dtype: torch.dtype):
    """`swiglu` rounded to the activation dtype, then to the next GEMM's weight dtype (the recompute sub-block
    "swiglu": its fp32 intermediates are what recomputation drops).  g, u [T,I] -> [T,I]"""
    return swiglu(g, u, limit, rw).to(dtype).to(w_dtype)


def expert_ffn(x, w1, w3, w2, limit: float, rw: Optional[torch.Tensor] = None, qat: bool = False,
               recompute_act: bool = False) -> torch.Tensor:
    """One SwiGLU expert from its official matrices: w2( swiglu(w1 x, w3 x) * rw ), rw before w2 in fp32; `qat`
    FP8-simulates both GEMM inputs per 1x128 block, as `Linear(qat_input=True)`; `recompute_act`: the SwiGLU
    under `recomputed`. x [T,D], w1/w3 [I,D], w2 [D,I], rw [T,1] or None -> [T,D]"""
    h = x.to(w1.dtype)
    h = fp8_sim(h, qat_block(h.shape[-1], ACT_QAT_BLOCK)) if qat else h
    a = recomputed(recompute_act, swiglu_as, F.linear(h, w1), F.linear(h, w3), limit, rw, x.dtype, w2.dtype)
    return F.linear(fp8_sim(a, qat_block(a.shape[-1], ACT_QAT_BLOCK)) if qat else a, w2)


class Expert(nn.Module):
    """SwiGLU expert: y = w2( rw * silu(min(w1 x, L)) * clamp(w3 x, -L, L) ) with the routing weight rw applied
    before w2 in fp32 (v4_notes §2.4.2); the shared expert (dense matmuls) has no rw and, as published, no clamp
    (L = 0; `ModelConfig.shared_expert_clamp` gives it the routed experts' L, as SGLang 0.5.16 serves it).

    Shapes: x [T,D], rw [T,1] or None -> [T,D]
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 0.0, qat: bool = False):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, qat_input=qat)
        self.w2 = Linear(inter_dim, dim, qat_input=qat)
        self.w3 = Linear(dim, inter_dim, qat_input=qat)
        self.swiglu_limit = swiglu_limit
        self.recompute_blocks = frozenset()   # swiglu: `Transformer.recompute`

    def forward(self, x: torch.Tensor, rw: Optional[torch.Tensor] = None) -> torch.Tensor:
        a = recomputed("swiglu" in active_recompute(self), swiglu_as, self.w1(x), self.w3(x), self.swiglu_limit, rw,
                       x.dtype, x.dtype)
        return self.w2(a)   # = expert_ffn


class RoutedExperts(nn.Module):
    """The routed experts of one layer as two stacked parameters (an EP rank holds a contiguous block `ids`):

        w13 [E_l, 2I, D] = per expert cat(w1, w3) (rows),    w2 [E_l, D, I]
        y_t = w2_e( swiglu(w13_e x_t) * rw_t )       for the rows t of expert e (rows sorted by expert)

    Outside, only official per-expert tensors exist: `state_dict` / `load_state_dict` use `{e}.w1.weight`,
    `{e}.w2.weight`, `{e}.w3.weight` (views into the stacks, in the former per-expert modules' order) and
    `names.official_views` splits a gradient or an optimizer moment the same way.
    `cfg.kernels` "triton", and "auto" in bf16 on CUDA: `kernels.moe.grouped_experts` (grouped GEMMs, fused SwiGLU,
    no host sync; 0.69x of a dense GEMM on the H200, B13); else the `expert_ffn` loop (counts read on the host).

    Shapes: x [T,D] sorted by expert, rw [T,1] fp32, counts [E_l] int64 -> [T,D]
    """

    def __init__(self, cfg: ModelConfig, ids):
        super().__init__()
        self.cfg, self.ids, D, I = cfg, list(ids), cfg.dim, cfg.moe_inter_dim
        self.w13 = nn.Parameter(torch.empty(len(self.ids), 2 * I, D).uniform_(-D ** -0.5, D ** -0.5))  # as nn.Linear
        self.w2 = nn.Parameter(torch.empty(len(self.ids), D, I).uniform_(-I ** -0.5, I ** -0.5))
        self.recompute_blocks = frozenset()   # swiglu (the per-expert loop): `Transformer.recompute`
        self._tag()

    def _tag(self):   # the layout `official_views` reads off a parameter (the optimizer sees only parameters)
        self.w13.expert_ids = self.w2.expert_ids = tuple(self.ids)

    def _apply(self, fn, recurse=True):   # .to() / to_empty() may build new Parameter objects: tag them again
        super()._apply(fn, recurse)
        self._tag()
        return self

    def __setstate__(self, state):        # deepcopy / unpickling builds new Parameter objects too
        super().__setstate__(state)
        self._tag()

    def keep(self, ids):
        """Hold only experts `ids`, a contiguous block of the held ones (EP sharding slices the stacks)."""
        ids = list(ids)
        if not ids or not set(ids) <= set(self.ids) or ids != list(range(ids[0], ids[0] + len(ids))):
            raise ValueError(f"RoutedExperts.keep: {ids} is not a contiguous block of the held experts {self.ids}")
        a = self.ids.index(ids[0])
        for leaf in EXPERT_STACKS:
            p = getattr(self, leaf)
            setattr(self, leaf, nn.Parameter(p.detach()[a:a + len(ids)].clone(), requires_grad=p.requires_grad))
        self.ids = ids
        self._tag()

    def _official(self, prefix: str, keep_vars: bool) -> dict:
        views = {n: t for leaf in EXPERT_STACKS for n, t in official_views(
            prefix + leaf, getattr(self, leaf), getattr(self, leaf) if keep_vars else getattr(self, leaf).detach())}
        return {k: views[k] for k in (f"{prefix}{e}.{w}.weight" for e in self.ids for w in ("w1", "w2", "w3"))}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination.update(self._official(prefix, keep_vars))

    def _load_from_state_dict(self, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        mine = self._official(prefix, keep_vars=False)
        for key, dst in mine.items():
            if key not in sd:
                missing_keys.append(key)
            elif tuple(sd[key].shape) != tuple(dst.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(sd[key].shape)}, "
                                  f"the shape in current model is {tuple(dst.shape)}")
            else:
                with torch.no_grad():
                    dst.copy_(sd[key])
        if strict:
            unexpected_keys.extend(k for k in sd if k.startswith(prefix) and k not in mine)

    def dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`forward`'s sum without sorting slots: EVERY expert on every token in three batched GEMMs (no launch
        per expert, no host sync), the routing weight 0 off the token's top-k, so those terms add exact zeros:

            y_n = sum_e w2_e( swiglu(w13_e x_n) * rw[n,e] ),   rw[n,e] = sum_k weights[n,k] [indices[n,k] = e]

        The same rounding steps per (token, expert) as `expert_ffn`, summed over experts instead of over k. Where
        Triton runs (CUDA, or kernels="triton") and x has the weights' dtype, the SwiGLU is one launch
        (`kernels.moe.fused_swiglu`, as `grouped_experts`) instead of five ops.

        Shapes: x [N,D], weights [N,K] fp32, indices [N,K] -> [N,D] fp32
        """
        (N, _), E, I, qat = x.shape, self.w13.shape[0], self.w2.shape[2], self.cfg.qat
        rw = weights.new_zeros(N, E).scatter_add_(1, indices, weights)                      # [N,E]
        h = x.to(self.w13.dtype)
        h = fp8_sim(h, qat_block(h.shape[-1], ACT_QAT_BLOCK)) if qat else h
        gu = F.linear(h, self.w13.flatten(0, 1)).unflatten(-1, (E, 2 * I))                 # [N,E,2I]
        if (x.is_cuda or self.cfg.kernels == "triton") and x.dtype == gu.dtype:
            from nanoflash.kernels.moe import fused_swiglu
            a = fused_swiglu(gu.flatten(0, 1), rw.view(-1, 1), self.cfg.swiglu_limit).view(N, E, I).to(self.w2.dtype)
        else:
            a = swiglu_as(gu[..., :I], gu[..., I:], self.cfg.swiglu_limit, rw[..., None], x.dtype, self.w2.dtype)
        a = fp8_sim(a, qat_block(I, ACT_QAT_BLOCK)) if qat else a                           # [N,E,I]
        y = torch.bmm(a.transpose(0, 1), self.w2.transpose(1, 2))                           # [E,N,D]
        return y.sum(0, dtype=torch.float32)

    def forward(self, x: torch.Tensor, rw: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        k = self.cfg.kernels
        if k == "triton" or (k == "auto" and x.is_cuda and x.dtype == self.w13.dtype == torch.bfloat16):
            from nanoflash.kernels.moe import grouped_experts
            return grouped_experts(x, rw, counts, self.w13, self.w2, self.cfg.swiglu_limit, self.cfg.qat, act=swiglu)
        I, out, a, act = self.w2.shape[2], [], 0, "swiglu" in active_recompute(self)
        for w13, w2, n in zip(self.w13.unbind(0), self.w2.unbind(0), counts.tolist()):   # host sync
            if n:
                out.append(expert_ffn(x[a:a + n], w13[:I], w13[I:], w2, self.cfg.swiglu_limit, rw[a:a + n],
                                      self.cfg.qat, act))
            a += n
        return torch.cat(out) if out else x[:0]   # x[:0]: a rank with no rows still runs the exchange's backward


class LocalDispatcher:
    """Token dispatcher for EP = 1: the N*K (token, expert) slots sorted by expert; combine sums them back in
    fp32. The slot permutation (`nanoflash.kernels.moe`, plain torch: stable sort, deterministic gather and
    sum, counts on the device, no host sync) is the EP dispatcher's too, on every `kernels` path.

    Shapes: dispatch x [N,D], indices/weights [N,K] -> x_sorted [T,D], w_sorted [T,1], counts [E] (device);
            combine y_sorted [T,D] -> [N,D] fp32      (T = N*K)
    """

    def __init__(self, local_experts: list):
        self.local_experts = list(local_experts)

    def dispatch(self, x, indices, weights):
        from nanoflash.kernels.moe import GatherSlots, expert_counts, sort_slots
        order, inv = sort_slots(indices)
        ws = weights.flatten().index_select(0, order)[:, None]                         # [T,1]
        counts = expert_counts(indices, len(self.local_experts))
        return GatherSlots.apply(x, order, inv, indices.shape[1]), ws, counts, (inv, indices.shape[1])

    def combine(self, y, ctx):
        from nanoflash.kernels.moe import combine_slots
        return combine_slots(y, *ctx)


class MoE(nn.Module):
    """y = sum_{e in top-k} w_e * Expert_e(x) + SharedExpert(x), summed in fp32 (v4_notes §2.4):
    Gate -> dispatch (slots sorted by expert) -> RoutedExperts -> combine, plus the shared expert.

    Shapes: x [B,S,D], ids [B,S], replay [B*S,K] or None -> [B,S,D]
    """

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.gate = Gate(layer_id, cfg)
        self.experts = RoutedExperts(cfg, range(cfg.n_routed_experts))
        limit = cfg.swiglu_limit if cfg.shared_expert_clamp else 0.0   # official: no clamp (SGLang's: config)
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, limit, cfg.qat)
        self.dispatcher = LocalDispatcher(list(range(cfg.n_routed_experts)))
        self.last_indices: Optional[torch.Tensor] = None   # [N,K] experts of the last forward (routing replay)
        self.recompute_blocks = frozenset()   # experts: `Transformer.recompute`

    def forward(self, x: torch.Tensor, ids: torch.Tensor, replay: Optional[torch.Tensor] = None,
                dense: bool = False) -> torch.Tensor:
        """dense (a decode step, `decode_kernels`): every expert on every token (`RoutedExperts.dense`) where
        that pays (`dense_pays`)."""
        xf = x.flatten(0, 1)                                                            # [N,D]
        weights, indices = self.gate(xf, ids.flatten(), replay)
        self.last_indices = indices.detach()
        if dense and self.dense_pays():
            y = self.experts.dense(xf, weights, indices)                               # [N,D] fp32
        else:
            xs, ws, counts, ctx = self.dispatcher.dispatch(xf, indices, weights)      # [T,D], [T,1], [E_l]
            ys = recomputed("experts" in active_recompute(self), self.experts, xs, ws, counts)   # [T,D]
            y = self.dispatcher.combine(ys, ctx)                                       # [N,D] fp32
        y = y + self.shared_experts(xf).float()
        return y.to(x.dtype).view_as(x)

    def dense_pays(self) -> bool:
        """Every expert on every token costs E/K times the routed FLOPs: worth it for a decode step of a layer
        holding all its experts locally (EP = 1) with E <= DENSE_MAX_FLOPS * K (module constant's comment)."""
        cfg = self.experts.cfg
        return (isinstance(self.dispatcher, LocalDispatcher) and len(self.experts.ids) == cfg.n_routed_experts
                and cfg.n_routed_experts <= DENSE_MAX_FLOPS * cfg.n_activated_experts)


# ---------------------------------------------------------------------------------------------- mHC
def hc_split_sinkhorn(mixes, scale, base, M: int, iters: int, eps: float):
    """mixes [..., (2+M)*M] -> pre [...,M] = sigmoid(.)+eps, post [...,M] = 2 sigmoid(.),
    comb [...,M,M] = Sinkhorn(softmax(.)+eps): column-normalize, then (iters-1) x (rows, columns) (v4_notes §2.2.1)."""
    pre = torch.sigmoid(mixes[..., :M] * scale[0] + base[:M]) + eps
    post = 2 * torch.sigmoid(mixes[..., M:2 * M] * scale[1] + base[M:2 * M])
    c = (mixes[..., 2 * M:] * scale[2] + base[2 * M:]).unflatten(-1, (M, M))            # [...,M,M] row-major
    comb = c.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """(flatten(h) . fn^T) * rsqrt(mean(flatten(h)^2) + eps) in fp32.  h [B,S,M,D] -> [B,S,rows(fn)]"""
    hf = h.flatten(2).float()                                                          # [B,S,M*D]
    return F.linear(hf, fn.float()) * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """y = sum_j pre_j h_j in fp32, cast back.  h [B,S,M,D], pre [B,S,M] -> [B,S,D]"""
    return (pre.unsqueeze(-1) * h.float()).sum(2).to(h.dtype)


def hc_post(x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k x + sum_j comb[j,k] res_j  -- comb applied TRANSPOSED (v4_notes §2.2.2), fp32 then cast.

    Shapes: x [B,S,D], res [B,S,M,D], post [B,S,M], comb [B,S,M,M] -> [B,S,M,D]
    """
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, res.float())                         # [B,S,M,D]
    return (post.unsqueeze(-1) * x.float().unsqueeze(-2) + mixed).to(x.dtype)


def hc_pre_reference(h, fn, scale, base, M: int, iters: int, eps: float, norm_eps: float):
    """hc_pre of one sublayer: mixes -> Sinkhorn split -> collapse (v4_notes §2.2.1, §2.2.3).
    h [B,S,M,D] -> (x [B,S,D], post [B,S,M], comb [B,S,M,M])"""
    pre, post, comb = hc_split_sinkhorn(hc_mixes(h, fn, norm_eps), scale.float(), base.float(), M, iters, eps)
    return hc_collapse(h, pre), post, comb


def hc_head(h, fn, scale, base, cfg: ModelConfig) -> torch.Tensor:
    """Final collapse of the streams: pre = sigmoid(mixes*scale + base) + hc_eps (no Sinkhorn, no post).
    h [B,S,M,D] -> [B,S,D]"""
    pre = torch.sigmoid(hc_mixes(h, fn, cfg.norm_eps) * scale.float() + base.float()) + cfg.hc_eps
    return hc_collapse(h, pre)


# ---------------------------------------------------------------------------------------------- blocks
class Block(nn.Module):
    """One V4 layer with manifold-constrained hyper-connections (v4_notes §2.1-2.2):

        x1, post, comb = hc_pre(h);   h = hc_post(Attention(attn_norm(x1)), h, post, comb)
        x2, post, comb = hc_pre(h);   h = hc_post(MoE(ffn_norm(x2)),        h, post, comb)

    Shapes: h [B,S,M,D], ids [B,S], replay [B*S,K] or None (R3 experts for the MoE) -> [B,S,M,D]
    """

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        M, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        self.attn = Attention(layer_id, cfg)
        self.ffn = MoE(layer_id, cfg)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_attn_fn = nn.Parameter(torch.empty(mix, M * cfg.dim))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix, M * cfg.dim))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))
        self.recompute_blocks = frozenset()   # mhc / norm: `Transformer.recompute`

    def hc_pre(self, h, fn, scale, base, fused: bool = False):
        """Collapse the M streams into one sublayer input; return the post / comb coefficients."""
        cfg = self.cfg
        if fused:  # nanoflash.kernels.mhc: the same function in Triton
            from nanoflash.kernels.mhc import hc_pre_fused
            return hc_pre_fused(h, fn, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        return hc_pre_reference(h, fn, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def forward(self, h, ids, start_pos: int = 0, cache: Optional[LayerCache] = None, replay=None, kept=None):
        # fused mHC (Triton) in training forwards: opt-in ("triton") on GPUs; in decoding: `decode_kernels`
        # replay: the MoE's experts (R3); kept: a C4 layer's entries (indexer replay), both the rollout engine's
        decode = decode_kernels(self.cfg, h, cache)
        fused = decode or (h.is_cuda and self.cfg.kernels == "triton" and cache is None)
        post_fn = hc_post
        if fused:
            from nanoflash.kernels.mhc import hc_post_fused as post_fn
        mhc = "mhc" in active_recompute(self)
        x, post, comb = self.sublayer_input(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base,
                                            self.attn_norm, fused)
        h = recomputed(mhc, post_fn, self.attn(x, start_pos, cache, kept), h, post, comb)
        x, post, comb = self.sublayer_input(h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base,
                                            self.ffn_norm, fused)
        dense = decode and h.shape[1] == 1          # a decode step: one token per row
        return recomputed(mhc, post_fn, self.ffn(x, ids, replay, dense), h, post, comb)

    def decode_step(self, h, ids, step: DecodeStep, cache: LayerCache, replay=None):
        """`forward` for one token per row at the rows' own positions, on the decode seam (`DecodeStep`): fused mHC,
        each norm one launch (`kernels.decode.rms_rope`), `Attention.decode_step`, dense experts."""
        from nanoflash.kernels.decode import rms_rope
        from nanoflash.kernels.mhc import hc_post_fused
        x, post, comb = self.hc_pre(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, fused=True)
        a = self.attn.decode_step(rms_rope(x, self.attn_norm.weight, self.attn_norm.eps), step, cache)
        h = hc_post_fused(a, h, post, comb)
        x, post, comb = self.hc_pre(h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, fused=True)
        y = self.ffn(rms_rope(x, self.ffn_norm.weight, self.ffn_norm.eps), ids, replay, dense=True)
        return hc_post_fused(y, h, post, comb)

    def sublayer_input(self, h, fn, scale, base, norm: RMSNorm, fused: bool):
        """norm(hc_pre(h)) and hc_pre's post / comb. Recompute "mhc" and "norm": one region, only h kept;
        either alone: its own region.  h [B,S,M,D] -> x [B,S,D], post [B,S,M], comb [B,S,M,M]"""
        rc = active_recompute(self)
        if {"mhc", "norm"} <= rc:
            def pre_norm(h):
                x, post, comb = self.hc_pre(h, fn, scale, base, fused)
                return norm(x), post, comb
            return recomputed(True, pre_norm, h)
        x, post, comb = recomputed("mhc" in rc, self.hc_pre, h, fn, scale, base, fused)
        return recomputed("norm" in rc, norm, x), post, comb


class MTPBlock(Block):
    """Multi-token prediction (v4_notes §2.7): predicts token s+2 from the main streams at s and token s+1.

        x = e_proj(enorm(embed[next_ids])) + h_proj(hnorm(h))   (per stream);  x = Block_43(x)
        logits = head(norm(hc_head(x)))       (embed and head shared with the main model)

    Shapes: h [B,S,M,D], next_ids [B,S] -> streams [B,S,M,D]
    """

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__(layer_id, cfg)
        self.e_proj = Linear(cfg.dim, cfg.dim, qat_input=cfg.qat)
        self.h_proj = Linear(cfg.dim, cfg.dim, qat_input=cfg.qat)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def forward(self, h, next_ids, embed: nn.Embedding):
        e = self.enorm(embed(next_ids))                                                 # [B,S,D]
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(h))                    # [B,S,M,D]
        return super().forward(x, next_ids)


# ---------------------------------------------------------------------------------------------- transformer
class Transformer(nn.Module):
    """DeepSeek-V4: embed -> M copies -> blocks -> hc_head -> norm -> head (fp32 logits), plus MTP.

    Stage seams (pipeline parallelism keeps a subset of `layers`, and embed / head only where needed):
    embed_streams -> run_layers -> logits | token_logprobs.

    Shapes: input_ids [B,S] -> logits [B,S,V] fp32
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = Linear(cfg.dim, cfg.vocab_size)
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.mtp = nn.ModuleDict({str(i): MTPBlock(cfg.n_layers + i, cfg) for i in range(cfg.n_mtp_layers)})
        self.recompute = "none"

    # ------------------------------------------------------------------ recomputation
    @property
    def recompute(self) -> frozenset:
        """What a training forward recomputes in backward: {"layer"} (every layer, `run_layers`), sub-blocks of
        `config.RECOMPUTE_BLOCKS`, or nothing. Set it from a `ParallelConfig.recompute` value (none | full |
        selective | a comma list; a bool = full / none): every module holding sub-blocks gets the set."""
        return self._recompute

    @recompute.setter
    def recompute(self, value):
        self._recompute = set_recompute(self, value)

    # ------------------------------------------------------------------ stage seams
    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B,S] -> [B,S,M,D]: the M streams start as copies of the embedding."""
        e = self.embed(input_ids)
        return e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def run_layers(self, h, input_ids, start_pos: int = 0, cache: Optional[dict] = None, routed=None,
                   indexed=None):
        """Run the layers this module holds, in id order. [B,S,M,D] -> [B,S,M,D]

        routed [B,S,n_layers,K] (optional): routing replay, the experts the rollout engine chose per position
        and layer; layer i's slice is an input of that layer, so a recomputed forward replays it too.
        indexed [B,S,n_c4,index_topk] (optional): indexer replay, the entries the rollout engine's C4 layers kept
        per position, stored entry + 1 (0 = none: a zero-padded row or micro-batch keeps nothing), the j-th C4
        layer of the model (`c4_layers`) its slice j, the same way.
        A decode step on the decode seam (per-row start_pos, one token per row) runs `Block.decode_step`, its
        position data built once here (`DecodeStep`)."""
        step = DecodeStep.of(self.cfg, h, start_pos, cache)
        c4 = {layer: j for j, layer in enumerate(c4_layers(self.cfg))}
        for key in sorted(self.layers, key=int):
            layer = self.layers[key]
            c = None if cache is None else cache.setdefault(key, LayerCache())
            rx = None if routed is None else routed[:, :, int(key)].flatten(0, 1)     # [B*S,K]
            kx = None if indexed is None or int(key) not in c4 else indexed[:, :, c4[int(key)]].long() - 1   # [B,S,K]
            if step is not None:
                h = layer.decode_step(h, input_ids, step, c, rx)
            elif "layer" in self.recompute and self.training and torch.is_grad_enabled():
                h = checkpoint(layer, h, input_ids, start_pos, c, rx, kx, use_reentrant=False)
            else:
                h = layer(h, input_ids, start_pos, c, rx, kx)
        return h

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Final streams -> normed hidden state. [B,S,M,D] -> [B,S,D]"""
        return self.norm(hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.cfg))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B,S,M,D] -> [B,S,V] fp32"""
        return fp32_linear(self.hidden(h), self.head.weight, self.cfg)

    def forward(self, input_ids, start_pos=0, cache: Optional[dict] = None) -> torch.Tensor:
        """start_pos: the position of input_ids[:, 0] (an int), or each row's own (an int64 tensor [B] on the
        host) for one decode step over rows at different lengths (a cache from `cat_caches`)."""
        if torch.is_tensor(start_pos) and (cache is None or input_ids.shape[1] != 1
                                           or tuple(start_pos.shape) != (input_ids.shape[0],)
                                           or start_pos.device.type != "cpu"):
            raise ValueError(f"per-row start_pos (shape {tuple(start_pos.shape)}, {start_pos.device}) needs a decode "
                             f"cache and one token per row, on the host; got input_ids {tuple(input_ids.shape)}")
        return self.logits(self.run_layers(self.embed_streams(input_ids), input_ids, start_pos, cache))

    def new_cache(self) -> dict:
        """An empty decode cache; pass it to `forward` for a prefill, then for one-token steps."""
        return {}

    def cat_caches(self, caches: list) -> dict:
        """The rows of several decode caches as one, in order (requests joining a decode batch): windows
        left-padded to one width, entries right-padded with zero slots, compressor remainders in per-row form.
        Decode it with per-row start_pos (each row's length)."""
        out = {}
        for key in caches[0]:
            attn, parts = self.layers[key].attn, [c[key] for c in caches]
            out[key] = LayerCache(window=_cat_padded([p.window for p in parts], left=True))
            if attn.ratio:
                out[key].comp = _cat_padded([p.comp for p in parts], left=False)
                out[key].comp_state = _cat_states([attn.compressor.rowwise(p.comp_state) for p in parts])
            if attn.ratio == 4:
                out[key].index_keys = _cat_padded([p.index_keys for p in parts], left=False)
                out[key].index_state = _cat_states([attn.indexer.compressor.rowwise(p.index_state) for p in parts])
        return out

    @staticmethod
    def cache_rows(cache: dict, rows: torch.Tensor) -> dict:
        """Rows `rows` [n] (int64, on the cache's device) of a decode cache (requests leaving a batch)."""
        def pick(t):
            return None if t is None else t.index_select(0, rows)

        def pick_state(s):
            return None if s is None else CompressorState(pick(s.kv), pick(s.score), s.start, pick(s.prev_kv),
                                                          pick(s.prev_score))
        return {k: LayerCache(pick(c.window), pick(c.comp), pick_state(c.comp_state), pick(c.index_keys),
                              pick_state(c.index_state)) for k, c in cache.items()}

    # ------------------------------------------------------------------ RL / MTP heads
    def token_logprobs(self, input_ids, targets, temperature: float = 1.0, chunk: int = 1024, mask=None):
        """log softmax(logits / T)[target] per position, in sequence chunks whose logits are recomputed in
        backward, so full-vocabulary logits never exist for the whole sequence; `mask`: only where it is > 0
        (`head_logprobs`). [B,S] -> [B,S] fp32"""
        h = self.run_layers(self.embed_streams(input_ids), input_ids)
        fast = self.cfg.kernels == "triton" and h.is_cuda   # bf16 GEMMs, fp32 logits (kernels.matmul)
        return self.head_logprobs(h, targets, temperature, mask, chunk, fast)

    def head_logprobs(self, h, targets, temperature: float = 1.0, mask=None, chunk: int = 1024, fast=False):
        """log softmax(head(hidden(h)) / T)[targets] per position (`chunked_logprobs`). With `mask` [B,S] only
        the positions where it is > 0 are scored -- hc_head, norm, the head GEMM and the log-softmax run on those
        rows alone, the values there the same as without a mask -- and the rest are 0: RL scores the response
        tokens only, and at 2-4K-token prompts the fp32 head over the prompt is most of the head's work.
        One host sync (the count of scored positions). h [B,S,M,D], targets [B,S] -> [B,S] fp32"""
        if mask is None:
            return chunked_logprobs(self.hidden(h), self.head.weight, targets, temperature, chunk, fast)
        idx = (mask.flatten() > 0).nonzero()[:, 0]                                         # [n]
        y = self.hidden(h.flatten(0, 1).index_select(0, idx)[None])                        # [1,n,D]
        lp = chunked_logprobs(y, self.head.weight, targets.flatten()[idx][None], temperature, chunk, fast)[0]
        return lp.new_zeros(targets.numel()).index_copy(0, idx, lp).view(targets.shape)   # [B,S]

    def mtp_logits(self, h: torch.Tensor, next_ids: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP logits from the main streams h (before hc_head) and the next tokens. -> [B,S,V] fp32"""
        blk = self.mtp[str(depth)]
        x = blk(h, next_ids, self.embed)
        y = blk.norm(hc_head(x, blk.hc_head_fn, blk.hc_head_scale, blk.hc_head_base, self.cfg))
        return fp32_linear(y, self.head.weight, self.cfg)

    # ------------------------------------------------------------------ init / dtype
    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02, generator: torch.Generator | None = None):
        """Deterministic random init (tests, from-scratch runs). Layout-independent: each parameter draws from a
        CPU generator seeded by (seed, its official name), so a stage or EP rank holding some tensors gets the
        full model's values. `generator` (e.g. CUDA): one stream of draws on its device instead (fast, bench)."""
        for name, p in official_parameters(self):   # stacked experts: one draw per official expert tensor
            if not p.is_meta:
                init_param_(name, p, generator or torch.Generator().manual_seed(param_seed(seed, name)), std)
        for name, b in self.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(round_robin_tid2eid(*b.shape, self.cfg.n_routed_experts).to(b.device))
        return self

    def cast_(self, dtype: torch.dtype):
        """Cast matmul weights to `dtype`; keep fp32 what the official model keeps fp32 (mHC, sinks, ape,
        gate bias, norms, compressor projections, head)."""
        for name, p in self.named_parameters():
            if not any(k in name for k in FP32_KEYS):
                p.data = p.data.to(dtype)
        return self


def _cat_padded(ts: list, left: bool) -> torch.Tensor:
    """Concatenate [B_i, L_i, d] along rows, zero-padding each to the longest L (on the left or right)."""
    L = max(t.shape[1] for t in ts)
    return torch.cat([F.pad(t, (0, 0, L - t.shape[1], 0) if left else (0, 0, 0, L - t.shape[1])) for t in ts])


def _cat_states(states: list) -> CompressorState:
    """Per-row compressor states (`Compressor.rowwise`) of several caches as one."""
    def cat(name):
        ts = [getattr(s, name) for s in states]
        return None if ts[0] is None else torch.cat(ts)
    return CompressorState(cat("kv"), cat("score"), 0, cat("prev_kv"), cat("prev_score"))


def init_param_(name: str, p: torch.Tensor, generator: torch.Generator, std: float = 0.02):
    """`init_weights`' rule: norms / scales 1, biases / sinks / ape 0, else N(0, std) by `generator` on its device."""
    if name.endswith(("norm.weight", "_scale")):
        p.fill_(1.0)
    elif name.endswith(("_base", "attn_sink", "ape", "gate.bias")):
        p.zero_()
    else:
        p.copy_(torch.randn(p.shape, generator=generator, device=generator.device) * std)


def param_seed(seed: int, name: str) -> int:
    """Seed of parameter `name`'s init draw: stable across processes (crc32, not Python's salted hash)."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


FP32_KEYS = ("hc_", "attn_sink", "ape", "gate.bias", "norm.weight", "compressor.wkv", "compressor.wgate", "head.weight")


def round_robin_tid2eid(vocab: int, k: int, n_experts: int) -> torch.Tensor:
    """Placeholder hash table (Megatron's round-robin) for models not loaded from a checkpoint:
    token t -> experts (t*k + j) mod E, j < k. [V,K] int64"""
    return (torch.arange(vocab, device="cpu")[:, None] * k + torch.arange(k, device="cpu")[None]) % n_experts


class _ChunkLogprob(torch.autograd.Function):
    """log softmax(y W^T / T)[target] for one chunk, recomputing the logits in backward."""

    @staticmethod
    def forward(ctx, y, w, tgt, temperature):
        logits = F.linear(y.float(), w.float()) / temperature                          # [n,V]
        lse = logits.logsumexp(-1)
        ctx.save_for_backward(y, w, tgt, lse)
        ctx.temperature = temperature
        return logits.gather(-1, tgt[:, None])[:, 0] - lse

    @staticmethod
    def backward(ctx, g):
        y, w, tgt, lse = ctx.saved_tensors
        # one [n,V] fp32 buffer, in place from the logits to their gradient: at n = 1024 and V = 129,280 each
        # out-of-place step held another 505 MiB (the second long hold's GRPO died in this backward on an 80 GB card)
        yf, wf = y.float(), w.float()                            # once each (no copy for the fp32 head weight)
        dlogits = F.linear(yf, wf).div_(ctx.temperature)                                 # logits
        dlogits.sub_(lse[:, None]).exp_().neg_()                                        # -softmax
        dlogits.scatter_add_(-1, tgt[:, None], torch.ones_like(lse)[:, None])
        dlogits.mul_(g[:, None] / ctx.temperature)                                       # [n,V]
        return (dlogits @ wf).to(y.dtype), (dlogits.t() @ yf).to(w.dtype), None, None


def chunked_logprobs(y, weight, targets, temperature=1.0, chunk=1024, fast=False):
    """Per-token log-probs of `targets` under head `weight` by chunks (fast: kernels.matmul). y [B,S,D] -> [B,S] fp32
    (no rows: one empty chunk, so the result still hangs on y's graph: an EP rank's dummy micro-batch)"""
    yf, tf = y.flatten(0, 1), targets.flatten()                                        # [N,D], [N]
    starts = range(0, max(yf.shape[0], 1), chunk)
    if fast:
        from nanoflash.kernels.matmul import ChunkLogprobBf16
        wb = weight.detach().to(torch.bfloat16)
        return torch.cat([ChunkLogprobBf16.apply(yf[a:a + chunk], weight, wb, tf[a:a + chunk], temperature)
                          for a in starts]).view(targets.shape)
    out = [_ChunkLogprob.apply(yf[a:a + chunk], weight, tf[a:a + chunk], temperature) for a in starts]
    return torch.cat(out).view(targets.shape)
