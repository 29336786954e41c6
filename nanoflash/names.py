"""The one name table: nanoflash FQN <-> official DeepSeek-V4 name <-> transformers name <-> SGLang name, plus storage.

A nanoflash `state_dict()` key is the official checkpoint name (`layers.3.attn.wq_a.weight`), so the difference
between a model's `state_dict()` and the release is storage: the release keeps most linears
as FP8 E4M3 (128x128 blocks) or packed FP4 (1x32 blocks) with a `.scale` sibling, the model keeps them
dequantized. `NAME_TABLE` holds every tensor once, in four spellings and one storage kind:

    nanoflash = official       transformers 5.24                 SGLang                          storage
    (block rows: suffixes of   layers.L.  /  model.layers.L.  /  model.layers.L.)
    attn.wq_a.weight           self_attn.q_a_proj.weight         self_attn.wq_a.weight           fp8
    ffn.gate.tid2eid           mlp.gate.tid2eid                  mlp.topk.tid2eid                int64
    ffn.experts.E.w1.weight    mlp.experts.gate_up_proj [E, :I]  mlp.experts.E.gate_proj.weight  fp4
    (whole names)
    embed.weight               model.embed_tokens.weight         model.embed_tokens.weight       bf16
    mtp.K.e_proj.weight        mtp.K.e_proj.weight               (not pushed)                    fp8

The nanoflash column is the state_dict key; routed experts are *stored* stacked (`EXPERT_STACKS`: one
`ffn.experts.w13` / `w2` parameter per layer), and `official_views` maps a stack (or its gradient / optimizer
moment) back to these rows, so no consumer sees the stacks. The SGLang column is the HF-style spelling of Miles'
`convert_deepseekv4_to_hf`, which SGLang's `DeepseekV4ForCausalLM.load_weights` accepts (rl_notes §4.4);
MTP has none: SGLang's main model skips `mtp.*`. An FP8 weight's scale travels as `<X>.weight_scale_inv` (fp32).

Routed experts are the one many-to-one entry on the transformers side: it stacks them into `gate_up_proj
[E, 2I, D]` (gate half first, `nn.Linear` orientation [out, in]) and `down_proj [E, D, I]`, so `official_to_hf`
returns an `HFName(name, expert, half)` slot and `hf_to_official` takes that slot back. transformers builds no
MTP module and ignores `mtp.*` on load; MTP names therefore keep their native spelling on the HF side.

Lookup is exact, not regex surgery: every numeric path segment is replaced by `#` (`name_pattern`) and the
resulting pattern is a dict key (`layers.#.attn.wq_a.weight`); `fill_pattern` puts the numbers back in order.
Every module that renames (checkpoint I/O, the weight stream, the embedded server) goes through these two.

Block sizes of the two quantized storages live here and only here (`FP8_BLOCK`, `FP4_BLOCK`); `quant.py` and
the weight stream import them.

`official_inventory(cfg)` lists every tensor the full model described by `cfg` holds, with its logical
shape (the v4_notes §3.2 tables, computed); `checkpoint_keys` adds the `.scale` siblings (69,187 names for the
flash release).

Tests: `pytest tests/test_checkpoint.py tests/test_weight_sync.py -q`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8_BLOCK = 128  # FP8 weights: one scale per 128x128 block (v4_notes §3.3; SGLang's weight_block_size [128, 128])
FP4_BLOCK = 32   # FP4 experts: one E8M0 scale per 1x32 block of inputs (v4_notes §3.3)


class Row(NamedTuple):
    """One tensor in four spellings. Block rows are suffixes under `layers.{L}.` (nanoflash, official),
    `model.layers.{L}.` (transformers, SGLang); `#` stands for an expert index. `sglang` None: not pushed."""
    nanoflash: str
    official: str
    hf: str
    sglang: str | None
    kind: str


def _row(official: str, hf: str, sglang: str | None, kind: str, nanoflash: str | None = None) -> Row:
    """A row whose nanoflash spelling is the official one unless given."""
    return Row(nanoflash or official, official, hf, sglang, kind)


BLOCK_TABLE = [  # official suffix, transformers suffix, SGLang suffix, release storage
    _row("attn_norm.weight", "input_layernorm.weight", "input_layernorm.weight", "bf16"),
    _row("ffn_norm.weight", "post_attention_layernorm.weight", "post_attention_layernorm.weight", "bf16"),
    _row("hc_attn_fn", "attn_hc.fn", "hc_attn_fn", "fp32"),
    _row("hc_attn_base", "attn_hc.base", "hc_attn_base", "fp32"),
    _row("hc_attn_scale", "attn_hc.scale", "hc_attn_scale", "fp32"),
    _row("hc_ffn_fn", "ffn_hc.fn", "hc_ffn_fn", "fp32"),
    _row("hc_ffn_base", "ffn_hc.base", "hc_ffn_base", "fp32"),
    _row("hc_ffn_scale", "ffn_hc.scale", "hc_ffn_scale", "fp32"),
    _row("attn.attn_sink", "self_attn.sinks", "self_attn.attn_sink", "fp32"),
    _row("attn.wq_a.weight", "self_attn.q_a_proj.weight", "self_attn.wq_a.weight", "fp8"),
    _row("attn.q_norm.weight", "self_attn.q_a_norm.weight", "self_attn.q_norm.weight", "bf16"),
    _row("attn.wq_b.weight", "self_attn.q_b_proj.weight", "self_attn.wq_b.weight", "fp8"),
    _row("attn.wkv.weight", "self_attn.kv_proj.weight", "self_attn.wkv.weight", "fp8"),
    _row("attn.kv_norm.weight", "self_attn.kv_norm.weight", "self_attn.kv_norm.weight", "bf16"),
    _row("attn.wo_a.weight", "self_attn.o_a_proj.weight", "self_attn.wo_a.weight", "fp8"),  # see checkpoint.py
    _row("attn.wo_b.weight", "self_attn.o_b_proj.weight", "self_attn.wo_b.weight", "fp8"),
    _row("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight",
         "self_attn.compressor.wkv.weight", "bf16"),
    _row("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight",
         "self_attn.compressor.wgate.weight", "bf16"),
    _row("attn.compressor.ape", "self_attn.compressor.position_bias", "self_attn.compressor.ape", "fp32"),
    _row("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight",
         "self_attn.compressor.norm.weight", "bf16"),
    _row("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight",
         "self_attn.indexer.wq_b.weight", "fp8"),
    _row("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight",
         "self_attn.indexer.weights_proj.weight", "bf16"),
    _row("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight",
         "self_attn.indexer.compressor.wkv.weight", "bf16"),
    _row("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight",
         "self_attn.indexer.compressor.wgate.weight", "bf16"),
    _row("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias",
         "self_attn.indexer.compressor.ape", "fp32"),
    _row("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight",
         "self_attn.indexer.compressor.norm.weight", "bf16"),
    _row("ffn.gate.weight", "mlp.gate.weight", "mlp.gate.weight", "bf16"),
    _row("ffn.gate.bias", "mlp.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias", "fp32"),
    _row("ffn.gate.tid2eid", "mlp.gate.tid2eid", "mlp.topk.tid2eid", "int64"),
    _row("ffn.experts.#.w1.weight", "mlp.experts.gate_up_proj", "mlp.experts.#.gate_proj.weight", "fp4"),  # HF half 0
    _row("ffn.experts.#.w3.weight", "mlp.experts.gate_up_proj", "mlp.experts.#.up_proj.weight", "fp4"),    # HF half 1
    _row("ffn.experts.#.w2.weight", "mlp.experts.down_proj", "mlp.experts.#.down_proj.weight", "fp4"),
    _row("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight",
         "mlp.shared_experts.gate_proj.weight", "fp8"),
    _row("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight",
         "mlp.shared_experts.down_proj.weight", "fp8"),
    _row("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight",
         "mlp.shared_experts.up_proj.weight", "fp8"),
]
TOP_TABLE = [  # whole names
    _row("embed.weight", "model.embed_tokens.weight", "model.embed_tokens.weight", "bf16"),
    _row("head.weight", "lm_head.weight", "lm_head.weight", "bf16"),
    _row("norm.weight", "model.norm.weight", "model.norm.weight", "bf16"),
    _row("hc_head_fn", "model.hc_head.hc_fn", "model.hc_head_fn", "fp32"),
    _row("hc_head_base", "model.hc_head.hc_base", "model.hc_head_base", "fp32"),
    _row("hc_head_scale", "model.hc_head.hc_scale", "model.hc_head_scale", "fp32"),
]
# The extra tensors of an MTP block (prefix `mtp.{K}.`), same spelling on the HF side, never pushed.
MTP_EXTRA = [_row(o, o, None, k) for o, k in [
    ("e_proj.weight", "fp8"), ("h_proj.weight", "fp8"), ("enorm.weight", "bf16"), ("hnorm.weight", "bf16"),
    ("norm.weight", "bf16"), ("hc_head_fn", "fp32"), ("hc_head_base", "fp32"), ("hc_head_scale", "fp32")]]
_HALF = {"w1": 0, "w3": 1}  # position of each expert matrix inside transformers' gate_up_proj rows
EXPERT_STACKS = {"w13": ("w1", "w3"), "w2": ("w2",)}  # model.RoutedExperts' stacks -> official leaves along the rows


def official_views(name: str, p: torch.Tensor, t: torch.Tensor) -> list:
    """(official name, view) pieces of parameter `name` = p, or of `t` shaped like it (gradient, moment). A stack
    (`expert_ids` tagged by RoutedExperts) splits per expert: `..experts.w13` [i] -> `..experts.{e}.w1.weight`
    (rows :I), `.w3.weight` (rows I:); `..experts.w2` [i] -> `..experts.{e}.w2.weight`. Else t itself."""
    ids = getattr(p, "expert_ids", None)
    if ids is None:
        return [(name, t)]
    prefix, parts = name[: name.rfind(".") + 1], EXPERT_STACKS[name[name.rfind(".") + 1:]]
    rows = t.shape[1] // len(parts)
    return [(f"{prefix}{e}.{w}.weight", t[i, j * rows:(j + 1) * rows]) for i, e in enumerate(ids)
            for j, w in enumerate(parts)]


def official_parameters(model: torch.nn.Module) -> list:
    """(official name, view) of every parameter of `model`, stacked experts split per expert."""
    return [piece for n, p in model.named_parameters() for piece in official_views(n, p, p)]


def _whole(r: Row, mine: str, hf: str, sglang: str | None) -> Row:
    return Row(mine + r.nanoflash, mine + r.official, hf + r.hf, None if sglang is None else sglang + r.sglang,
               r.kind)


def _table() -> list[Row]:
    """NAME_TABLE: every row with whole-name patterns; `#` stands for a layer / expert / MTP index."""
    rows = list(TOP_TABLE)
    rows += [_whole(r, "layers.#.", "model.layers.#.", "model.layers.#.") for r in BLOCK_TABLE]
    rows += [_whole(Row(r.nanoflash, r.official, r.official, None, r.kind), "mtp.#.", "mtp.#.", None)
             for r in BLOCK_TABLE + MTP_EXTRA]
    return rows


NAME_TABLE = _table()
_BY_OFFICIAL = {r.official: r for r in NAME_TABLE}
_BY_NANOFLASH = {r.nanoflash: r for r in NAME_TABLE}
_BY_SGLANG = {r.sglang: r for r in NAME_TABLE if r.sglang is not None}
_TO_OFFICIAL = {}
for _r in NAME_TABLE:
    _TO_OFFICIAL.setdefault(_r.hf, []).append(_r.official)  # gate_up_proj has two official patterns (w1, w3)
assert len(_BY_OFFICIAL) == len(_BY_NANOFLASH) == len(NAME_TABLE), "NAME_TABLE spells a tensor twice"
assert len(_BY_SGLANG) == sum(r.sglang is not None for r in NAME_TABLE), "two rows share an SGLang name"


class HFName(NamedTuple):
    """A transformers tensor name; for a merged expert tensor also which expert and which half it is."""
    name: str
    expert: int | None = None  # index into dim 0 of gate_up_proj / down_proj
    half: int | None = None    # gate_up_proj only: 0 = gate (w1), 1 = up (w3)


def name_pattern(name: str) -> tuple[str, list[str]]:
    """`layers.3.ffn.experts.7.w1.weight` -> (`layers.#.ffn.experts.#.w1.weight`, ["3", "7"])."""
    parts = name.split(".")
    nums = [p for p in parts if p.isdigit()]
    return ".".join("#" if p.isdigit() else p for p in parts), nums


def fill_pattern(pattern: str, nums: list[str]) -> str:
    """Inverse of `name_pattern`: put the numbers back into the `#` slots, in order."""
    nums = list(nums)
    if pattern.split(".").count("#") != len(nums):
        raise ValueError(f"pattern {pattern!r} has {pattern.split('.').count('#')} index slots, got numbers {nums}")
    return ".".join(nums.pop(0) if p == "#" else p for p in pattern.split("."))


def _lookup(name: str) -> tuple[str, list[str]]:
    pat, nums = name_pattern(name)
    if pat not in _BY_OFFICIAL:
        raise KeyError(f"{name!r} is not a DeepSeek-V4 checkpoint name (pattern {pat!r} is not in the table)")
    return pat, nums


def official_name(nanoflash_name: str) -> str:
    """nanoflash FQN -> official checkpoint name (the nanoflash column -> the official column)."""
    pat, nums = name_pattern(nanoflash_name)
    if pat not in _BY_NANOFLASH:
        raise KeyError(f"{nanoflash_name!r} is not a nanoflash parameter name (pattern {pat!r} not in the table)")
    return fill_pattern(_BY_NANOFLASH[pat].official, nums)


def nanoflash_name(official: str) -> str:
    """Official checkpoint name -> nanoflash FQN (inverse of `official_name`)."""
    pat, nums = _lookup(official)
    return fill_pattern(_BY_OFFICIAL[pat].nanoflash, nums)


SCALE_INV = "_scale_inv"  # SGLang's FP8 scale sibling of X.weight is X.weight_scale_inv


def to_sglang(name: str) -> str:
    """Official name -> SGLang HF-style name; `X.weight_scale_inv` (the scale of official X.weight) stays one."""
    scale = name.endswith(".weight" + SCALE_INV)
    pat, nums = name_pattern(name[: -len(SCALE_INV)] if scale else name)
    row = _BY_OFFICIAL.get(pat)
    if row is None or row.sglang is None:
        raise KeyError(f"{name!r} has no SGLang name (not a backbone tensor; MTP is not pushed)")
    return fill_pattern(row.sglang, nums) + (SCALE_INV if scale else "")


def from_sglang(name: str) -> str:
    """SGLang HF-style name -> official name (inverse of `to_sglang`)."""
    scale = name.endswith(".weight" + SCALE_INV)
    pat, nums = name_pattern(name[: -len(SCALE_INV)] if scale else name)
    if pat not in _BY_SGLANG:
        raise KeyError(f"{name!r} is not a DeepSeek-V4 SGLang weight name")
    return fill_pattern(_BY_SGLANG[pat].official, nums) + (SCALE_INV if scale else "")


def official_to_hf(name: str) -> HFName:
    """Official/nanoflash name -> transformers name (+ expert slot for routed experts)."""
    pat, nums = _lookup(name)
    hf_pat = _BY_OFFICIAL[pat].hf
    if pat.startswith("layers.") and ".experts.#." in pat:  # merged on the HF side (MTP is not)
        layer, expert = nums
        leaf = pat.split(".")[-2]
        return HFName(fill_pattern(hf_pat, [layer]), int(expert), _HALF.get(leaf))
    return HFName(fill_pattern(hf_pat, nums))


def hf_to_official(hf: HFName | str) -> str:
    """transformers name (an `HFName` slot for merged experts) -> official/nanoflash name."""
    hf = HFName(hf) if isinstance(hf, str) else hf
    pat, nums = name_pattern(hf.name)
    if pat not in _TO_OFFICIAL:
        raise KeyError(f"{hf.name!r} is not a transformers DeepseekV4ForCausalLM tensor name")
    cands = _TO_OFFICIAL[pat]
    if hf.name.endswith((".gate_up_proj", ".down_proj")) and ".experts." in hf.name:
        if hf.expert is None or (hf.name.endswith("gate_up_proj") and hf.half not in (0, 1)):
            raise KeyError(f"{hf.name!r} is a merged expert tensor: give expert (and half for gate_up_proj), got {hf}")
        leaf = "w2" if hf.name.endswith("down_proj") else ("w1", "w3")[hf.half]
        (off,) = [c for c in cands if c.split(".")[-2] == leaf]
        return fill_pattern(off, nums + [str(hf.expert)])
    return fill_pattern(cands[0], nums)


def release_kind(name: str) -> str:
    """Storage of `name` in the official FP8+FP4 release: fp8 | fp4 | bf16 | fp32 | int64."""
    pat, _ = _lookup(name)
    return _BY_OFFICIAL[pat].kind


def storage_kind(name: str, cfg) -> str:
    """How the release stores `name`: fp8 | fp4 | bf16 | fp32 | int64 (`e8m0` for a `.scale` sibling).

    Follows v4_notes §3.2 inventory, adjusted by the config's release fields: `cfg.dtype == "bf16"` turns
    the FP8 linears into BF16, `cfg.expert_dtype == "fp8"` stores routed experts as FP8 (the SGLang re-pack).
    """
    if name.endswith(".scale"):  # `hc_*_scale` parameters are spelled with an underscore
        return "e8m0"
    kind = release_kind(name)
    if kind == "fp8" and getattr(cfg, "dtype", "fp8") == "bf16":
        return "bf16"
    if kind == "fp4" and getattr(cfg, "expert_dtype", "fp4") in ("fp8", "bf16"):
        return cfg.expert_dtype
    return kind


def _block_shapes(cfg, layer_id: int) -> dict[str, tuple]:
    """Logical shape of every tensor of block `layer_id` (official suffixes), per v4_notes §3.2."""
    D, H, hd, rq = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    M, I, E = cfg.hc_mult, cfg.moe_inter_dim, cfg.n_routed_experts
    mix, ratio = (2 + M) * M, cfg.compress_ratios[layer_id]
    s = {"attn_norm.weight": (D,), "ffn_norm.weight": (D,)}
    for site in ("attn", "ffn"):
        s.update({f"hc_{site}_fn": (mix, M * D), f"hc_{site}_base": (mix,), f"hc_{site}_scale": (3,)})
    s.update({"attn.attn_sink": (H,), "attn.wq_a.weight": (rq, D), "attn.q_norm.weight": (rq,),
              "attn.wq_b.weight": (H * hd, rq), "attn.wkv.weight": (hd, D), "attn.kv_norm.weight": (hd,),
              "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups),
              "attn.wo_b.weight": (D, cfg.o_groups * cfg.o_lora_rank)})
    if ratio:
        coff = 2 if ratio == 4 else 1  # ratio 4 compresses overlapping windows: two halves
        s.update({"attn.compressor.wkv.weight": (coff * hd, D), "attn.compressor.wgate.weight": (coff * hd, D),
                  "attn.compressor.ape": (ratio, coff * hd), "attn.compressor.norm.weight": (hd,)})
    if ratio == 4:
        dI = cfg.index_head_dim
        s.update({"attn.indexer.wq_b.weight": (cfg.index_n_heads * dI, rq),
                  "attn.indexer.weights_proj.weight": (cfg.index_n_heads, D),
                  "attn.indexer.compressor.wkv.weight": (2 * dI, D),
                  "attn.indexer.compressor.wgate.weight": (2 * dI, D),
                  "attn.indexer.compressor.ape": (4, 2 * dI), "attn.indexer.compressor.norm.weight": (dI,)})
    s["ffn.gate.weight"] = (E, D)
    if layer_id < cfg.n_layers and cfg.is_hash_layer(layer_id):
        s["ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.n_activated_experts)
    else:
        s["ffn.gate.bias"] = (E,)
    for e in range(E):
        s.update({f"ffn.experts.{e}.w1.weight": (I, D), f"ffn.experts.{e}.w3.weight": (I, D),
                  f"ffn.experts.{e}.w2.weight": (D, I)})
    s.update({"ffn.shared_experts.w1.weight": (I, D), "ffn.shared_experts.w3.weight": (I, D),
              "ffn.shared_experts.w2.weight": (D, I)})
    return s


def official_inventory(cfg) -> dict[str, tuple]:
    """Every tensor of the FULL model described by `cfg` (no scales): official name -> logical shape."""
    D, M = cfg.dim, cfg.hc_mult
    inv = {"embed.weight": (cfg.vocab_size, D), "head.weight": (cfg.vocab_size, D), "norm.weight": (D,),
           "hc_head_fn": (M, M * D), "hc_head_base": (M,), "hc_head_scale": (1,)}
    for i in range(cfg.n_layers):
        inv.update({f"layers.{i}.{k}": v for k, v in _block_shapes(cfg, i).items()})
    for k in range(cfg.n_mtp_layers):
        blk = dict(_block_shapes(cfg, cfg.n_layers + k))
        blk.update({"e_proj.weight": (D, D), "h_proj.weight": (D, D), "enorm.weight": (D,),
                    "hnorm.weight": (D,), "norm.weight": (D,), "hc_head_fn": (M, M * D),
                    "hc_head_base": (M,), "hc_head_scale": (1,)})
        inv.update({f"mtp.{k}.{n}": v for n, v in blk.items()})
    return inv


def scale_shape(kind: str, shape: tuple) -> tuple:
    """Shape of the `.scale` sibling of a 2-D weight stored as `kind` (fp8: 128x128 blocks, fp4: 1x32)."""
    out, inp = shape
    if kind == "fp4":
        return (out, -(-inp // FP4_BLOCK))
    return (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))


def checkpoint_keys(cfg) -> list[str]:
    """All tensor names of a release laid out as `cfg.dtype` / `cfg.expert_dtype` say, scales included."""
    keys = []
    for name in official_inventory(cfg):
        keys.append(name)
        if storage_kind(name, cfg) in ("fp8", "fp4"):
            keys.append(name[: -len("weight")] + "scale")
    return keys


# ---------------------------------------------------------------------------- transformers state dicts
def hf_state_dict_to_nanoflash(hf_sd: dict, cfg) -> dict:
    """transformers `DeepseekV4ForCausalLM.state_dict()` -> nanoflash/official names.

    Merged experts are split: gate_up_proj [E, 2I, D] -> w1 = [e, :I], w3 = [e, I:]; down_proj [E, D, I] -> w2 = [e].
    Keys transformers holds but the checkpoint does not (none in 5.24) raise a KeyError naming them.
    """
    out = {}
    for name, t in hf_sd.items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            if t.shape[0] != cfg.n_routed_experts:
                raise ValueError(f"{name}: {t.shape[0]} experts in dim 0, config says {cfg.n_routed_experts}")
            halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
            for e in range(t.shape[0]):
                for half in halves:
                    rows = t[e] if half is None else t[e].chunk(2, dim=0)[half]  # [I, D] or [D, I]
                    out[hf_to_official(HFName(name, e, half))] = rows
        else:
            out[hf_to_official(name)] = t
    return out


def nanoflash_state_dict_to_hf(sd: dict, cfg) -> dict:
    """nanoflash/official names -> transformers names; routed experts are stacked (all E must be present).

    MTP tensors keep their native names (transformers has no MTP module and ignores `mtp.*` on load).
    """
    out, stacks = {}, {}
    for name, t in sd.items():
        hf = official_to_hf(name)
        if hf.expert is None:
            out[hf.name] = t
        else:
            stacks.setdefault(hf.name, {})[(hf.expert, hf.half)] = t
    for name, parts in stacks.items():
        halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
        missing = [(e, h) for e in range(cfg.n_routed_experts) for h in halves if (e, h) not in parts]
        if missing:
            raise KeyError(f"{name}: cannot stack experts, missing (expert, half) {missing[:8]}")
        per_expert = [torch.cat([parts[(e, h)] for h in halves], dim=0) for e in range(cfg.n_routed_experts)]
        out[name] = torch.stack(per_expert)  # [E, 2I, D] or [E, D, I]
    return out
