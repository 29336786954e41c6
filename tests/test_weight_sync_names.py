"""The one name table (`names.NAME_TABLE`): four spellings per tensor, block sizes defined once.

Run: `pytest tests/test_weight_sync_names.py -q`.
"""
from __future__ import annotations

import pathlib
import re

import pytest

from nanoflash import names as cn
from nanoflash import quant
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.sglang import layout


@pytest.fixture(scope="module")
def names():
    return list(Transformer(preset("tiny")).init_weights(0).state_dict())  # tiny keeps MTP and both routings


def test_every_model_tensor_has_one_row_in_all_four_columns(names):
    assert any(n.startswith("mtp.") for n in names) and any("tid2eid" in n for n in names)
    for n in names:
        off = cn.official_name(n)
        assert cn.nanoflash_name(off) == n
        assert cn.hf_to_official(cn.official_to_hf(off)) == off
        if n.startswith("mtp."):
            with pytest.raises(KeyError, match="MTP is not pushed"):
                cn.to_sglang(off)
        else:
            assert cn.from_sglang(cn.to_sglang(off)) == off
            if off.endswith(".weight"):  # only a weight can have a scale sibling
                assert cn.from_sglang(cn.to_sglang(off) + "_scale_inv") == off + "_scale_inv"
    with pytest.raises(KeyError, match="not a nanoflash parameter name"):
        cn.official_name("layers.0.attn.nonexistent.weight")
    with pytest.raises(KeyError, match="not a DeepSeek-V4 SGLang weight name"):
        cn.from_sglang("model.layers.0.self_attn.q_a_proj.weight")  # a transformers spelling, not SGLang's


def test_layout_reads_the_same_table():
    assert layout.to_sglang is cn.to_sglang and layout.from_sglang is cn.from_sglang
    assert cn.to_sglang("layers.4.ffn.experts.7.w2.weight_scale_inv") == \
        "model.layers.4.mlp.experts.7.down_proj.weight_scale_inv"
    assert cn.to_sglang("hc_head_fn") == "model.hc_head_fn" and cn.official_to_hf("hc_head_fn").name == \
        "model.hc_head.hc_fn"


def test_block_sizes_and_name_tables_are_defined_once():
    assert quant.FP8_BLOCK is cn.FP8_BLOCK == 128 and quant.FP4_BLOCK is cn.FP4_BLOCK == 32
    root = pathlib.Path(cn.__file__).parent
    defines = re.compile(r"^(FP8_BLOCK|FP4_BLOCK|SGLANG_BLOCK|SGLANG_TOP)\s*=", re.M)
    where = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if defines.search(p.read_text()))
    assert where == ["names.py"], f"block sizes / name tables defined outside the one table: {where}"
