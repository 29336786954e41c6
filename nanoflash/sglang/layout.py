"""What SGLang's DeepSeek-V4 loader does with a pushed weight stream, written once for both sides.

Two jobs:

1. **Names.** nanoflash parameter names are the official DeepSeek names (`layers.3.attn.wq_a.weight`); the
   weight push uses the HF-style names of Miles' `convert_deepseekv4_to_hf` (rl_notes §4.4), which
   SGLang's `DeepseekV4ForCausalLM.load_weights` accepts:

       embed.weight -> model.embed_tokens.weight      head.weight -> lm_head.weight
       layers.L.attn.X -> model.layers.L.self_attn.X  layers.L.attn_norm -> model.layers.L.input_layernorm
       layers.L.ffn.gate.bias -> ...mlp.gate.e_score_correction_bias   ffn.gate.tid2eid -> mlp.topk.tid2eid
       layers.L.ffn.experts.E.w1|w3|w2 -> ...mlp.experts.E.gate_proj|up_proj|down_proj
       FP8 scale of X.weight -> X.weight_scale_inv (fp32, the dequant multiplier)

   The spellings are the SGLang column of the one name table, `names.NAME_TABLE`; `to_sglang` /
   `from_sglang` live there and are re-exported here. MTP (`mtp.*`) has no SGLang name and is not pushed:
   SGLang's main model skips those names silently (sglang_loader_check.md).

2. **The loader's internal layout** (`LoaderState.load`, one call = one `load_weights` call = one bucket):

       wq_a + wkv            -> self_attn.wqkv_a.weight = cat([wq_a, wkv], 0)   (scales: an independent pair)
       compressor.wkv + wgate -> compressor.wkv_gate.weight = cat([wkv, wgate], 0)  (indexer compressor too)
       compressor.ape (C4)   -> cat(chunk(ape, 2, -1), 0).view(4, -1)             ("ape hotfix" permutation)
       wo_a                  -> must be BF16 (an e4m3 wo_a is refused: SGLang would mis-scale it)
       experts E w1 + w3     -> mlp.experts.E.w13_weight = cat([w1, w3], 0); w2 -> mlp.experts.E.w2_weight
       shared w1 + w3        -> mlp.shared_experts.gate_up_proj.weight
       tid2eid int64         -> int32

   Pair halves are cached inside one call; a half left over at the end of the call raises, exactly where
   SGLang's loader asserts (so a bucket that splits an atomic pair fails here too). Expert halves are written
   into a persistent tensor, as SGLang's FusedMoE loader does, so they need no pairing. The embedded server
   keeps its weights in this layout, and `/weights_checker` hashes it (sha256 of the raw bytes); the trainer
   derives the same layout from what it sent (`expected_checksums`) and compares.

Differences from SGLang: routed experts are kept per expert (`mlp.experts.E.w13_weight`) instead of stacked
`[E, 2I, D]`, so a mismatch names the expert; SGLang 0.5.16's own `/weights_checker` hashes its real
parameters, whose names we do not reproduce for every tensor; a live comparison against SGLang therefore needs
`sglang_loader_check.md`'s opt-in environment.

Tests: `pytest tests/test_weight_sync.py -q`.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from nanoflash.names import from_sglang, name_pattern, storage_kind, to_sglang  # noqa: F401 (re-exported)

# SGLang keeps these BF16/F32 even in an FP8 deployment (rl_notes §4.5): only wo_a differs from the
# release's storage kinds (the release has it FP8; SGLang with SGLANG_OPT_FP8_WO_A_GEMM=0 builds it BF16).
KEEP_BF16_IN_FP8 = ("attn.wo_a.weight",)
HASH_THREADS = min(8, os.cpu_count() or 1)  # checksum threads: sha256 runs ~1-2 GB/s per core
# (first half, second half, fused name) of SGLang's atomic pairs, as HF-style suffixes
PAIRS = [("self_attn.wq_a.weight", "self_attn.wkv.weight", "self_attn.wqkv_a.weight"),
         ("self_attn.wq_a.weight_scale_inv", "self_attn.wkv.weight_scale_inv", "self_attn.wqkv_a.weight_scale_inv"),
         ("self_attn.compressor.wkv.weight", "self_attn.compressor.wgate.weight",
          "self_attn.compressor.wkv_gate.weight"),
         ("self_attn.indexer.compressor.wkv.weight", "self_attn.indexer.compressor.wgate.weight",
          "self_attn.indexer.compressor.wkv_gate.weight")]
_PAIR_OF = {}
for _a, _b, _f in PAIRS:
    _PAIR_OF[_a], _PAIR_OF[_b] = (_f, 0, _b), (_f, 1, _a)
# expert/shared halves written into a persistent fused tensor: suffix -> (fused suffix, half)
_STACKED = {"gate_proj.weight": ("w13_weight", 0), "up_proj.weight": ("w13_weight", 1),
            "down_proj.weight": ("w2_weight", None), "gate_proj.weight_scale_inv": ("w13_weight_scale_inv", 0),
            "up_proj.weight_scale_inv": ("w13_weight_scale_inv", 1),
            "down_proj.weight_scale_inv": ("w2_weight_scale_inv", None)}


def _split(name: str):
    """`model.layers.3.mlp.experts.5.gate_proj.weight` -> ("model.layers.3.", "mlp.experts.#.gate_proj.weight",
    ["5"]): the layer prefix kept, the other indices turned into `#` (official `layers.3.` names alike)."""
    pat, nums = name_pattern(name)
    for lead in ("layers.#.", "model.layers.#."):
        if pat.startswith(lead):
            return lead.replace("#", nums[0]), pat[len(lead):], nums[1:]
    return "", pat, nums


def sglang_fp8(name: str, cfg) -> bool:
    """Does SGLang serve this (official-named) weight as FP8 128x128 in an FP8 deployment?"""
    _, pat, _ = _split(name)
    if pat in KEEP_BF16_IN_FP8:
        return False
    return storage_kind(name, cfg) in ("fp8", "fp4")  # FP4 experts are served FP8 (SGLANG_DSV4_FP4_EXPERTS=0)


def permute_ape(ape: torch.Tensor) -> torch.Tensor:
    """SGLang's load-time ape hotfix for the overlapping C4 compressor: [4, 2d] -> [4, 2d] permuted."""
    m = ape.shape[0]
    return torch.cat(torch.chunk(ape, 2, dim=-1), 0).reshape(m, -1)            # [2m,d] -> [m,2d]


def unpermute_ape(p: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute_ape`."""
    m = p.shape[0]
    a, b = p.reshape(2 * m, -1).chunk(2, dim=0)                                  # [m,d] each
    return torch.cat([a, b], dim=-1)                                             # [m,2d]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (dtype and layout sensitive, like SGLang's weight checker); hashed from
    the host copy's own buffer (no second copy of the bytes)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def sha256_all(named: dict) -> dict:
    """{name: tensor_sha256} of many tensors, hashed on HASH_THREADS threads (hashlib and the device-to-host
    copies release the GIL: a 1.6 GB store hashes in a fraction of one core's ~3 s)."""
    items = sorted(named.items())
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, max(1, len(items)))) as pool:
        return dict(zip([n for n, _ in items], pool.map(tensor_sha256, [t for _, t in items])))


class LoaderState:
    """SGLang-like weight store: `load(bucket)` applies one `load_weights` call; `params` is the internal
    layout (name -> tensor). Shapes: whatever was sent; fused tensors concatenate along dim 0.

    Stricter than SGLang, on purpose: a call is all-or-nothing (staged, then committed), and a tensor whose
    shape or dtype differs from the one already held is refused (SGLang partly writes or silently casts)."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self._stage: dict[str, torch.Tensor] = {}
        self.frozen = False  # after `freeze()`: only tensors already held may be updated

    def freeze(self) -> None:
        """The store now holds the whole model: from here on a name it does not hold is refused (a tensor
        named like a real one but absent from this model, e.g. layers.99.*, would otherwise stay forever)."""
        self.frozen = True

    def load(self, named_tensors) -> list[str]:
        """One loader call. Returns the internal names written; raises (writing nothing) if an atomic pair is
        left half-sent, a name is unknown, or a shape/dtype differs from what is held."""
        self._stage, pending = {}, {}
        for name, t in named_tensors:
            if not name.startswith(("model.", "lm_head.")):
                name = to_sglang(name.replace(".scale", ".weight_scale_inv") if name.endswith(".scale") else name)
            from_sglang(name)  # unknown names are an error here (SGLang only warns, then keeps stale values)
            self._route(name, t.detach(), pending)
        left = sorted(prefix + k for prefix, d in pending.items() for k in d)
        if left:
            raise ValueError(f"atomic pair split across load calls: {left} arrived without their partner "
                             f"in the same bucket (SGLang's loader asserts the same)")
        unknown = sorted(n for n in self._stage if n not in self.params) if self.frozen else []
        if unknown:
            raise ValueError(f"{len(unknown)} tensor(s) this model does not have: {unknown[:4]} -- nothing of this "
                             f"update was applied")
        for n, t in self._stage.items():
            old = self.params.get(n)
            if old is not None and (old.shape != t.shape or old.dtype != t.dtype):
                raise ValueError(f"{n}: sent {tuple(t.shape)} {t.dtype}, the server holds {tuple(old.shape)} "
                                 f"{old.dtype} (wrong model, or fp8 push to a non-fp8 engine or vice versa)")
        self.params.update(self._stage)
        return sorted(self._stage)

    def _route(self, name: str, t: torch.Tensor, pending: dict):
        prefix, pat, nums = _split(name)
        if pat in _PAIR_OF:
            fused, half, other = _PAIR_OF[pat]
            if other in pending.get(prefix, {}):
                first = pending[prefix].pop(other)
                self._put(prefix + fused, torch.cat((t, first) if half == 0 else (first, t), 0))
            else:
                pending.setdefault(prefix, {})[pat] = t
        elif pat.startswith("mlp.experts.#.") or pat.startswith("mlp.shared_experts."):
            self._stacked(prefix, pat, nums, t)
        elif "wo_a." in pat and (t.dtype == torch.float8_e4m3fn or pat.endswith("scale_inv")):
            raise ValueError(f"{name}: wo_a must be sent BF16; an FP8 wo_a with an HF-named scale is "
                             "silently loaded as raw e4m3 by SGLang (sglang_loader_check.md)")
        elif pat.endswith("compressor.ape") and t.shape[0] == 4:
            self._put(name, permute_ape(t))
        elif pat == "mlp.topk.tid2eid":
            self._put(name, t.to(torch.int32))
        else:
            self._put(name, t)

    def _put(self, name: str, t: torch.Tensor):
        self._stage[name] = t.clone()

    def _stacked(self, prefix: str, pat: str, nums: list, t: torch.Tensor):
        owner = "mlp.experts." + nums[0] + "." if pat.startswith("mlp.experts.#.") else "mlp.shared_experts."
        leaf = pat[len("mlp.experts.#."):] if nums else pat[len("mlp.shared_experts."):]
        fused, half = _STACKED[leaf]
        if owner == "mlp.shared_experts.":
            fused = {"w13_weight": "gate_up_proj.weight", "w2_weight": "down_proj.weight",
                     "w13_weight_scale_inv": "gate_up_proj.weight_scale_inv",
                     "w2_weight_scale_inv": "down_proj.weight_scale_inv"}[fused]
        key = prefix + owner + fused
        if half is None:
            return self._put(key, t)
        rows, want = t.shape[0], (2 * t.shape[0], *t.shape[1:])
        cur = self._stage.get(key)
        if cur is None:  # halves land in the held tensor, as SGLang's FusedMoE loader writes them
            held = self.params.get(key)
            cur = held.clone() if held is not None and held.shape == want and held.dtype == t.dtype \
                else torch.zeros(want, dtype=t.dtype, device=t.device)
            self._stage[key] = cur
        if cur.shape != want or cur.dtype != t.dtype:
            raise ValueError(f"{prefix}{owner}{leaf}: shape {tuple(t.shape)} {t.dtype} does not fit the other half")
        cur[half * rows:(half + 1) * rows].copy_(t)

    def checksums(self) -> dict:
        return sha256_all(self.params)


def expected_checksums(buckets, base: LoaderState | None = None) -> dict:
    """What `/weights_checker` must answer after `buckets` landed (on top of `base`, if given)."""
    st = LoaderState()
    if base is not None:
        st.params = {k: v.clone() for k, v in base.params.items()}
    for bucket in buckets:
        st.load(bucket)
    return st.checksums()


def compare_checksums(expected: dict, actual: dict, server: str = "server", full_push: bool = True) -> None:
    """Raise naming every tensor that is missing or different on `server`; with `full_push`, also every
    tensor the server holds that the push never sent (it kept a stale value: the forgotten-`tid2eid` bug)."""
    missing = sorted(set(expected) - set(actual))
    differ = sorted(n for n in set(expected) & set(actual) if expected[n] != actual[n])
    unsent = sorted(set(actual) - set(expected)) if full_push else []
    if missing or differ or unsent:
        raise RuntimeError(f"weight push did not land on {server}: {len(differ)} tensor(s) differ "
                           f"{differ[:8]}, {len(missing)} missing {missing[:8]}, {len(unsent)} held but never "
                           f"sent {unsent[:8]} (of {len(expected)} expected)")


# ---------------------------------------------------------------------------------------------- SGLang's hash
# SGLang 0.5.16 `/weights_checker {"action": "checksum"}` (srt/utils/weight_checker.py): per parameter,
# f"{tensor_hash(w):016x}" with w = block_quant_dequant(Q, S, [128,128], bf16) for an FP8 weight with a
# `weight_scale_inv` sibling (the scale is not listed), else the raw parameter. On a GPU tensor_hash is
# `kernels/ops/memory/gpu_tensor_hash.py`: the bytes as uint32 words v_i (zero-padded), i the word index,
#     k1_i = fmix32(v_i ^ ((i*POS_A + s1) ^ rotl(i, 15)))   k2_i = fmix32(v_i ^ ((i*POS_B + s2) ^ rotl(i, 13)))
#     per tile t of 8192 words: h_t = fmix32((sum k1) ^ nbytes) << 32 | fmix32((sum k2) ^ nbytes)   (mod 2^32)
#     hash = splitmix64(sum_t h_t mod 2^64)
# Tiles only interact through that sum, so a stacked tensor (`mlp.experts.w13_weight` [E, 2I, D]) is hashed
# from its per-expert slabs wherever a slab is a whole number of tiles: each source adds its experts' tile
# sums, the coordinator adds the sources'. Transcribed from the 0.5.16 wheel; `tests/test_weight_sync_hash.py`
# checks it against a word-by-word transcription, and `loader_check.py` (opt-in) against SGLang's own Triton
# kernels run by Triton's interpreter on a CPU (equal, 2026-12-01); on a GPU the torch code gives the CPU values.
HASH_TILE_WORDS = 8192
_M32, _M64 = 0xFFFFFFFF, (1 << 64) - 1
_SEED = 0x243F6A88
_S1, _S2 = _SEED & _M32, ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
_FM1, _FM2, _POS_A, _POS_B = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2D, 0x165667B1
HASH_CHUNK_TILES = 64  # tiles hashed per torch call (~20 int64 temporaries of 64 x 8192 words each)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _FM1) & _M32
    x = x ^ (x >> 13)
    x = (x * _FM2) & _M32
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _words(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes as uint32 words held in int64 (little-endian, zero-padded to 4 bytes). [ceil(nbytes/4)]"""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    return b.view(torch.int32).to(torch.int64) & _M32


def sglang_tile_sum(t: torch.Tensor, word_offset: int, total_words: int) -> int:
    """sum over the tiles of `t` of h_t (mod 2^64), `t` being words [word_offset, +len) of a tensor of
    `total_words` words; `word_offset` must start a tile (whole tiles only; the last may end the tensor)."""
    if word_offset % HASH_TILE_WORDS:
        raise ValueError(f"a hashed piece must start a {HASH_TILE_WORDS}-word tile, got word offset {word_offset}")
    w, nbytes, total = _words(t), (total_words * 4) & _M32, 0
    step = HASH_CHUNK_TILES * HASH_TILE_WORDS
    for a in range(0, w.numel(), step):
        v = w[a:a + step]
        i = torch.arange(word_offset + a, word_offset + a + v.numel(), device=v.device, dtype=torch.int64) & _M32
        k1 = _fmix32(v ^ (((i * _POS_A + _S1) & _M32) ^ _rotl32(i, 15)))
        k2 = _fmix32(v ^ (((i * _POS_B + _S2) & _M32) ^ _rotl32(i, 13)))
        pad = -v.numel() % HASH_TILE_WORDS                                   # a tensor's last tile may be short
        k1, k2 = (torch.nn.functional.pad(k, (0, pad)).view(-1, HASH_TILE_WORDS).sum(1) & _M32 for k in (k1, k2))
        h = (_fmix32(k1 ^ nbytes) << 32) | _fmix32(k2 ^ nbytes)              # [tiles], wraps as uint64 bits
        total = (total + int(h.sum())) & _M64
    return total


def splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sglang_hash(t: torch.Tensor) -> str:
    """SGLang 0.5.16's GPU `tensor_hash` of one whole tensor, as `/weights_checker` prints it."""
    n = -(-t.numel() * t.element_size() // 4)
    return f"{splitmix64(sglang_tile_sum(t, 0, n)):016x}"


def _comparable(params: dict, name: str) -> torch.Tensor:
    """What SGLang's checker hashes for layout tensor `name`: FP8 dequantized to bf16 (its block_quant_dequant:
    q * S repeated over 128x128 blocks, in fp32, then bf16), else the tensor itself."""
    t, s = params[name], params.get(name + "_scale_inv")
    if t.dtype != torch.float8_e4m3fn or s is None:
        return t
    rep = s.float().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :t.shape[-2], :t.shape[-1]]
    return (t.float() * rep).to(torch.bfloat16)


def sglang_partials(params: dict, n_experts: int) -> dict:
    """One bucket's loader layout -> {key: (tile sum, total words, fp8, exact)} per SGLang parameter piece.
    Per-expert tensors are slabs of the stacked parameter (`mlp.experts.E.w13_weight` -> key
    `mlp.experts.w13_weight#E`, slab E); a slab that is not a whole number of tiles is hashed on its own
    (exact=False: a fingerprint for change sets, not SGLang's value)."""
    out = {}
    for name in params:
        if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in params:
            continue
        w = _comparable(params, name)
        fp8, words = w is not params[name], -(-w.numel() * w.element_size() // 4)
        prefix, pat, nums = _split(name)
        if pat.startswith("mlp.experts.#."):
            e, key = int(nums[0]), prefix + "mlp.experts." + pat[len("mlp.experts.#."):] + f"#{nums[0]}"
            exact = words % HASH_TILE_WORDS == 0 and w.numel() * w.element_size() % 4 == 0
            total = n_experts * words if exact else words
            out[key] = (sglang_tile_sum(w, e * words if exact else 0, total), total, fp8, exact)
        else:
            out[name] = (sglang_tile_sum(w, 0, words), words, fp8, True)
    return out


def sglang_checksums(partials: dict) -> dict:
    """Merge `sglang_partials` of every bucket of every source -> {SGLang name: (hex or None, fingerprint,
    fp8)}: hex is `/weights_checker`'s value (None where not reproducible), fingerprint changes with content."""
    sums = {}
    for key, (tile_sum, _, fp8, exact) in partials.items():
        name = key.split("#")[0]
        s, ok, f = sums.get(name, (0, True, fp8))
        sums[name] = ((s + tile_sum) & _M64, ok and exact, f)
    return {n: (f"{splitmix64(s):016x}" if ok else None, f"{splitmix64(s):016x}", f) for n, (s, ok, f) in sums.items()}

