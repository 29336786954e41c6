"""nanoflash's SGLang names and fused layout against SGLang's own loader, transcribed from its source.

The name table (`names.NAME_TABLE`) is read by the weight push (`rollout/stream.py`), the embedded server's
loader model (`rollout/layout.py`) and the checkpoint code, so a row with two spellings swapped (the shared
expert's w1 sent as `up_proj`, w3 as `gate_proj`) is consistent everywhere on our side and every round-trip
test passes; only SGLang would load the gate into the up half. The reference here is SGLang itself:

* `_sglang_remap` transcribes `DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format` (the non-MTP path),
  the function SGLang's `load_weights` applies to every name it receives;
* `SGLANG_FUSED` writes down where `load_weights` puts each (remapped) name inside a fused parameter:
  `stacked_params_mapping` (gate_proj -> shard 0 of gate_up_proj, up_proj -> shard 1), `FusedMoE.
  make_expert_params_mapping` (gate_proj -> shard "w1", up_proj -> "w3", down_proj -> w2_weight) with
  `FusedMoE._load_w13` ("w1, gate_proj: Load into first logical weight of w13"), and the cached pairs
  (`wqkv_a = cat([q, kv], 0)`, `compressor.wkv_gate = cat([kv, wgate], 0)`).

Source: sgl-project/sglang `python/sglang/srt/models/deepseek_v4.py` (snapshot 000328a8, read for issue 34;
the mapping docs/rl_notes.md §4.4 describes for the 0.5.16 release),
`DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format` and `.load_weights`; `python/sglang/srt/layers/moe/
fused_moe_triton/layer.py`, `FusedMoE.make_expert_params_mapping` and `FusedMoE._load_w13`.

Run: pytest tests/test_sglang_names_source.py -q
"""
import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.names import official_inventory, official_parameters, to_sglang
from nanoflash.sglang.layout import LoaderState


def _sglang_remap(name: str) -> str:
    """SGLang's `remap_weight_name_to_dpsk_hf_format(name, is_nextn=False)`, line for line."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "head.weight":
        return "lm_head.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name.startswith("hc_head_"):
        return "model." + name
    if name.startswith("layers."):
        name = "model." + name
    name = name.replace(".attn.", ".self_attn.")
    name = name.replace(".ffn.", ".mlp.")
    name = name.replace(".attn_norm.", ".input_layernorm.")
    name = name.replace(".ffn_norm.", ".post_attention_layernorm.")
    if "self_attn" in name:
        name = name.replace(".scale", ".weight_scale_inv")
    name = name.replace(".gate.tid2eid", ".topk.tid2eid")
    name = name.replace(".gate.bias", ".gate.e_score_correction_bias")
    name = name.replace(".w1.", ".gate_proj.")
    name = name.replace(".w2.", ".down_proj.")
    name = name.replace(".w3.", ".up_proj.")
    if "mlp" in name:
        name = name.replace(".scale", ".weight_scale_inv")
    return name


# (remapped name suffix under model.layers.L., E = expert) -> (SGLang parameter, which part along dim 0 of 2)
SGLANG_FUSED = {
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 0),   # stacked shard 0
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 1),     # stacked shard 1
    "mlp.shared_experts.down_proj.weight": ("mlp.shared_experts.down_proj.weight", None),
    "mlp.experts.E.gate_proj.weight": ("mlp.experts.w13_weight[E]", 0),                     # shard "w1"
    "mlp.experts.E.up_proj.weight": ("mlp.experts.w13_weight[E]", 1),                       # shard "w3"
    "mlp.experts.E.down_proj.weight": ("mlp.experts.w2_weight[E]", None),                   # shard "w2"
    "self_attn.wq_a.weight": ("self_attn.wqkv_a.weight", 0),                                # cat([q, kv])
    "self_attn.wkv.weight": ("self_attn.wqkv_a.weight", 1),
    "self_attn.compressor.wkv.weight": ("self_attn.compressor.wkv_gate.weight", 0),         # cat([kv, wgate])
    "self_attn.compressor.wgate.weight": ("self_attn.compressor.wkv_gate.weight", 1),
    "self_attn.indexer.compressor.wkv.weight": ("self_attn.indexer.compressor.wkv_gate.weight", 0),
    "self_attn.indexer.compressor.wgate.weight": ("self_attn.indexer.compressor.wkv_gate.weight", 1),
}


def _backbone(names):
    return [n for n in names if not n.startswith("mtp.")]   # SGLang's main model skips MTP; nanoflash never sends it


def test_every_pushed_name_is_what_sglang_remaps_the_official_name_to():
    """Bug caught: any SGLang spelling in the name table that SGLang's own remap of the official name does not
    produce -- the shared (or routed) experts' w1 / w3 swapped (`up_proj` for w1), w2 sent as `up_proj`, a
    norm or gate-bias spelling off. Every tensor of the Flash inventory, with the FP8 scale siblings."""
    names = _backbone(official_inventory(preset("flash")))
    assert any(".shared_experts.w1." in n for n in names) and any(".experts.255.w3." in n for n in names)
    bad = [(n, to_sglang(n), _sglang_remap(n)) for n in names if to_sglang(n) != _sglang_remap(n)]
    assert not bad, f"{len(bad)} names differ from SGLang's remap, e.g. (official, ours, SGLang's): {bad[:3]}"
    scaled = [n for n in names if n.endswith(".weight") and (".attn." in n or ".ffn." in n)]
    bad = [n for n in scaled if to_sglang(n + "_scale_inv") != _sglang_remap(n[:-len("weight")] + "scale")]
    assert not bad, f"scale names differ from SGLang's remap of the official `.scale`: {bad[:3]}"
    # and the names we send are already SGLang's: its remap leaves them unchanged
    assert all(_sglang_remap(to_sglang(n)) == to_sglang(n) for n in names[:5000])


def test_fused_halves_are_where_sglang_loads_them(gen):
    """Bug caught: a tensor written into the wrong half of a fused parameter on the embedded server (whose
    layout the weight checker compares against): shared w1/w3 swapped in the table (gate lands in the up half),
    routed experts' halves swapped, wq_a/wkv or compressor wkv/wgate concatenated the other way round."""
    model = Transformer(preset("tiny")).init_weights(0)
    sent = {n: torch.randn(v.shape, generator=gen) for n, v in official_parameters(model)
            if not n.startswith("mtp.") and v.ndim == 2}
    store = LoaderState()
    store.load(list(sent.items()))
    checked = set()
    for off, t in sent.items():
        remapped = _sglang_remap(off)                                      # model.layers.L.<suffix>
        if not remapped.startswith("model.layers."):
            continue
        layer, suffix = remapped[len("model.layers."):].split(".", 1)
        expert = None
        if suffix.startswith("mlp.experts."):
            expert, leaf = suffix[len("mlp.experts."):].split(".", 1)
            suffix = "mlp.experts.E." + leaf
        if suffix not in SGLANG_FUSED:
            continue
        param, part = SGLANG_FUSED[suffix]
        if expert is not None:   # the embedded server keeps SGLang's [E, ...] stack as one tensor per expert
            param = param.replace("experts.", f"experts.{expert}.").replace("[E]", "")
        held = store.params[f"model.layers.{layer}.{param}"]
        if part is not None:
            held = held[:t.shape[0]] if part == 0 else held[held.shape[0] - t.shape[0]:]
        assert torch.equal(held, t), f"{off} is not part {part} of SGLang's {param} on the embedded server"
        checked.add(suffix)
    assert checked == set(SGLANG_FUSED), f"kinds never checked: {set(SGLANG_FUSED) - checked}"


@torch.no_grad()
def test_w1_is_the_gated_matrix_in_the_model(gen):
    """Bug caught: the names right but the model's meaning swapped (silu on w3): SGLang's gate_up_proj feeds
    SiluAndMul, silu(first half) * second half, so the tensor sent as gate_proj (w1) must be the one under the
    silu in nanoflash's shared expert. Hand reference from the expert's own weights."""
    model = Transformer(preset("tiny")).init_weights(0)
    ex = model.layers["0"].ffn.shared_experts
    x = torch.randn(5, model.cfg.dim, generator=gen)
    w1, w2, w3 = ex.w1.weight.float(), ex.w2.weight.float(), ex.w3.weight.float()
    hand = (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    swapped = (torch.nn.functional.silu(x @ w3.T) * (x @ w1.T)) @ w2.T
    got = ex(x).float()
    tol = 1e-4 * float(hand.abs().max())   # fp32 matmuls in a different order: ~1e-6 relative, 100x margin
    assert (got - hand).abs().max() <= tol and (got - swapped).abs().max() > 10 * tol
