"""The serving checkpoint SGLang loads with SGLANG_DSV4_FP4_EXPERTS=0: FP8 routed experts (issue 36, item 3).

`python -m nanoflash.export --from-release DIR OUT --experts fp8` re-packs the official release's FP4 experts
(`checkpoint.repack_release_fp8_experts`), and `python -m nanoflash.export RUN OUT --weights fp8 --experts fp8`
writes a training checkpoint in the same layout. The bugs these catch:

* a re-pack that is not exact (a wrong tile scale, a lossy tile passed silently, the old FP4 scale kept beside
  the new payload): the dequantized model must equal the release's tensor for tensor, bit for bit;
* a re-pack that holds the model in memory: every output shard holds exactly one input shard's tensors;
* a config.json SGLang does not read as an FP8 checkpoint, or experts SGLang's own probe does not find FP8.

SGLang's side, transcribed from the sglang 0.5.16 wheel (never nanoflash's code):

* `probe_routed_expert_weight_dtype` (srt/model_loader/weight_utils.py L82-129): the first weight-map key matching
  `_ROUTED_EXPERT_KEY_RE` (L82-84), its dtype from the shard's safetensors header;
* `try_detect_fp4_experts` (srt/configs/deepseek_v4.py L13-44): U8/I8/F4 -> FP4, F8_E4M3 -> FP8, else None;
  `ModelConfig.__init__` (srt/configs/model_config.py L339-359) uses it when SGLANG_DSV4_FP4_EXPERTS is unset;
* `Fp8Config.from_config` (srt/layers/quantization/fp8.py L299-334): `quant_method` must contain "fp8"
  (is_checkpoint_fp8_serialized), `activation_scheme` is required (get_from_keys raises without it),
  `weight_block_size` gives the block quantization; `ModelConfig._parse_quant_hf_config` (model_config.py
  L1096-1100) reads `quantization_config` from config.json, and `is_deepseek_v4` (L123-128) the architecture.

Run: pytest tests/test_export_fp8_experts.py -q
"""
import json
import os
import re
import struct

import pytest
import torch
from safetensors import safe_open

from nanoflash import checkpoint, export, quant
from nanoflash.checkpoint import CheckpointError, load_hf_checkpoint, read_weight_map, save_hf_checkpoint
from nanoflash.config import ModelConfig, preset
from nanoflash.model import Transformer
from nanoflash.names import release_kind
from test_export import make_run

SHARD_BYTES = 60_000   # tiny's release in ~20 shards: the streaming is visible


# ---------------------------------------------------------------------------------------------- SGLang, transcribed
_ROUTED_EXPERT_KEY_RE = re.compile(r"\.experts\.\d+\.(?:w[123]|down_proj|up_proj|gate_proj)\.weight$")


def sglang_probe_routed_expert_dtype(model_path: str):
    """`probe_routed_expert_weight_dtype`, the index branch, line for line."""
    with open(os.path.join(model_path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f).get("weight_map", {}) or {}
    for k, shard in weight_map.items():
        if _ROUTED_EXPERT_KEY_RE.search(k):
            target_key, target_shard_path = k, os.path.join(model_path, shard)
            break
    else:
        return None
    with open(target_shard_path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    meta = header.get(target_key)
    return meta.get("dtype") if meta else None


def sglang_is_fp4_experts(model_path: str):
    """`try_detect_fp4_experts`: True (FP4), False (FP8) or None (unknown)."""
    dtype = sglang_probe_routed_expert_dtype(model_path)
    return True if dtype in ("U8", "I8", "F4") else False if dtype == "F8_E4M3" else None


def assert_sglang_reads_fp8(path: str):
    hf = json.load(open(os.path.join(path, "config.json")))
    assert hf["architectures"][0] == "DeepseekV4ForCausalLM"                    # is_deepseek_v4
    qc = hf["quantization_config"]                                              # _parse_quant_hf_config
    assert "fp8" in qc["quant_method"] and qc["activation_scheme"] == "dynamic"   # Fp8Config.from_config
    assert qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3" and qc["scale_fmt"] == "ue8m0"
    assert sglang_is_fp4_experts(path) is False


# ---------------------------------------------------------------------------------------------- helpers
def release(path: str, seed: int = 0) -> Transformer:
    """The official layout of a tiny model (FP8 linears, FP4 experts, MTP included), in many small shards."""
    model = Transformer(preset("tiny")).init_weights(seed)
    save_hf_checkpoint(model, path, weights="fp8", experts="fp4", shard_bytes=SHARD_BYTES)
    (open(os.path.join(path, "tokenizer.json"), "w")).write('{"not": "read"}')   # other files travel along
    return model


def loaded(path: str) -> dict:
    m = Transformer(ModelConfig.from_hf_config(path))
    assert load_hf_checkpoint(m, path)["skipped"] == 0
    return m.state_dict()


def raw(path: str) -> dict:
    """name -> (safetensors dtype, bytes) of every stored tensor."""
    out = {}
    for name, file in read_weight_map(path).items():
        with safe_open(file, "pt") as f:
            out[name] = (f.get_slice(name).get_dtype(), f.get_tensor(name).view(-1).view(torch.uint8))
    return out


def is_expert(name: str) -> bool:
    stem = name.rsplit(".", 1)[0] + ".weight"
    return ".experts." in name and release_kind(stem) == "fp4"


# ---------------------------------------------------------------------------------------------- tests
def test_release_repack_is_exact_and_everything_else_is_copied(tmp_path):
    src, dst = str(tmp_path / "release"), str(tmp_path / "fp8e")
    release(src)
    assert sglang_is_fp4_experts(src) is True                  # the release itself: SGLang would serve FP4
    assert export.main(["--from-release", src, dst, "--experts", "fp8"]) == 0
    a, b = loaded(src), loaded(dst)
    assert a.keys() == b.keys()
    for name in a:                                             # FP4 -> FP8 is lossless: the same values
        assert torch.equal(a[name], b[name]), name
    before, after = raw(src), raw(dst)
    assert before.keys() == after.keys()                       # same names: the scale keeps its name
    n_experts = 0
    for name, (dtype, data) in after.items():
        if is_expert(name):
            n_experts += name.endswith(".weight")
            assert dtype == ("F8_E4M3" if name.endswith(".weight") else "F8_E8M0"), name
        else:
            assert before[name][0] == dtype and torch.equal(before[name][1], data), name   # byte for byte
    cfg = ModelConfig.from_hf_config(dst)
    assert n_experts == 3 * cfg.n_routed_experts * (cfg.n_layers + cfg.n_mtp_layers)
    with safe_open(read_weight_map(dst)["layers.1.ffn.experts.2.w2.weight"], "pt") as f:   # 128x128 scale blocks
        assert list(f.get_slice("layers.1.ffn.experts.2.w2.scale").get_shape()) == [1, 1]
    assert cfg.expert_dtype == "fp8" and open(os.path.join(dst, "tokenizer.json")).read() == '{"not": "read"}'
    assert_sglang_reads_fp8(dst)


def test_repack_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    """Each shard written holds the tensors of exactly one release shard: the model is never in memory whole."""
    src, dst = str(tmp_path / "release"), str(tmp_path / "fp8e")
    release(src)
    shards = {}
    for name, file in read_weight_map(src).items():
        shards.setdefault(file, set()).add(name)
    written, real = [], checkpoint._write_shard
    monkeypatch.setattr(checkpoint, "_write_shard", lambda p, k, t: written.append(set(t)) or real(p, k, t))
    checkpoint.repack_release_fp8_experts(src, dst)
    assert len(shards) > 10 and sorted(map(sorted, written)) == sorted(map(sorted, shards.values()))


def test_a_lossy_tile_is_refused_naming_the_tensor(tmp_path):
    """A 128x128 tile whose 1x32 scales span more than 2^14 cannot be re-packed exactly (quant.py's bound): the
    re-pack must stop rather than write rounded experts."""
    src = str(tmp_path / "release")
    release(src)
    name = "layers.2.ffn.experts.5.w1.weight"
    file = read_weight_map(src)[name]
    with safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    s = tensors[name[: -len("weight")] + "scale"]
    b = s.view(torch.uint8).clone()
    b[0, 0], b[1, 0] = 127 + 10, 127 - 10                      # 2^10 and 2^-10 in one tile: a span of 2^20
    tensors[name[: -len("weight")] + "scale"] = b.view(s.dtype)
    tensors[name] = torch.full_like(tensors[name], 0x11)       # every value 0.5: the small block is not zero
    from safetensors.torch import save_file
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.5\.w1\.weight.*not exact"):
        checkpoint.repack_release_fp8_experts(src, str(tmp_path / "out"))


def test_training_export_with_fp8_experts_is_what_sglang_reads(tmp_path):
    make_run(str(tmp_path / "run"))
    out = str(tmp_path / "hf")
    assert export.main([str(tmp_path / "run"), out, "--weights", "fp8", "--experts", "fp8"]) == 0
    assert_sglang_reads_fp8(out)
    assert ModelConfig.from_hf_config(out).expert_dtype == "fp8"


@pytest.mark.parametrize("argv, says", [
    (["--from-release", "REL", "OUT", "--experts", "fp4"], "pass --experts fp8"),
    (["--from-release", "MISSING", "OUT", "--experts", "fp8"], "holds neither"),
    (["--from-release", "REL", "REL", "--experts", "fp8"], "not empty"),
])
def test_from_release_errors_are_one_line_exit_2(tmp_path, capsys, argv, says):
    release(str(tmp_path / "rel"))
    subs = {"REL": str(tmp_path / "rel"), "OUT": str(tmp_path / "out"), "MISSING": str(tmp_path / "missing")}
    assert export.main([subs.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_fp4_to_fp8_is_exact_at_the_bound():
    """quant.fp4_to_fp8 on random FP4 experts with scales spread over 2^14 within each tile: still exact."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (256, 128), dtype=torch.int8, generator=g)     # [out, in/2]
    s = torch.randint(127 - 7, 127 + 8, (256, 8), dtype=torch.uint8, generator=g)   # span 2^14 at most
    s = s.view(quant.E8M0_DTYPE)
    q, s8 = quant.fp4_to_fp8(packed, s)
    assert torch.equal(quant.dequantize_fp8_block(q, s8, torch.float32), quant.dequantize_fp4(packed, s, torch.float32))
