"""`python -m nanoflash.export`: a training checkpoint (DCP, model config inside) -> HF-layout directory, read back
by `load_hf_checkpoint` (tensor for tensor equal to the checkpoint at the stored precision) and by transformers'
`DeepseekV4ForCausalLM.from_pretrained` (same logits).

Run: `pytest tests/test_export.py -q`.
"""
import dataclasses
import json
import os

import pytest
import torch

from nanoflash import export
from nanoflash.rl import trainer
from nanoflash.checkpoint import load_hf_checkpoint
from nanoflash.names import release_kind
from nanoflash.cli import parse_args, to_dict
from nanoflash.config import ModelConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dcp import save_checkpoint
from nanoflash.parallel.dims import ParallelDims

# transformers vs nanoflash on the same fp32 weights: association order only (tests/test_hf_parity.py measures
# ~1e-7 and uses the same bound)
PARITY_TOL = 1e-4
BF16_KINDS = ("fp8", "fp4", "bf16")  # stored BF16 by `--weights bf16`; the fp32 kinds stay FP32, int64 exact


def make_run(run_dir: str, with_model_config: bool = True, seed: int = 3):
    """A run directory as train.py leaves it: config.json and one committed checkpoint (model + optimizer)."""
    cfg = parse_args(["--recipe", "smoke", "--out", run_dir, "--model.n_mtp_layers", "0",
                      "--model.compress_ratios", "0,4,8,4"])
    mcfg = preset("tiny", **cfg.model)
    model = trainer.build_model(mcfg, ParallelDims(), cfg.parallel, torch.float32, "cpu", seed=seed)
    opt = trainer.make_optimizer(model, cfg.optim)
    extra = {"data_pos": 0, **({"model_config": dataclasses.asdict(mcfg)} if with_model_config else {})}
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f)
    save_checkpoint(os.path.join(run_dir, "checkpoints"), 5, model, opt, ParallelDims(), extra=extra)
    return mcfg, model


@pytest.mark.parametrize("with_model_config", [True, False])   # False: an older checkpoint -> the run's config.json
def test_export_then_load_round_trip_equal(tmp_path, with_model_config):
    mcfg, model = make_run(str(tmp_path / "run"), with_model_config)
    assert export.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    stored = dataclasses.replace(mcfg, dtype="bf16", expert_dtype="bf16")  # the storage fields say how it was written
    assert ModelConfig.from_hf_config(str(tmp_path / "hf")) == stored        # the rest travels along exactly
    back = Transformer(ModelConfig.from_hf_config(str(tmp_path / "hf")))
    info = load_hf_checkpoint(back, str(tmp_path / "hf"))
    assert info["skipped"] == 0
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for name, t in want.items():
        expect = t.to(torch.bfloat16).to(t.dtype) if release_kind(name) in BF16_KINDS else t
        assert torch.equal(got[name], expect), name


def test_export_is_read_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    make_run(str(tmp_path / "run"))
    assert export.main([str(tmp_path / "run" / "checkpoints" / "step_00000005"), str(tmp_path / "hf")]) == 0
    ours = Transformer(ModelConfig.from_hf_config(str(tmp_path / "hf")))
    load_hf_checkpoint(ours, str(tmp_path / "hf"))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, 18, (2, 15), generator=torch.Generator().manual_seed(0))  # < 16 tokens: every C4 entry kept
    with torch.no_grad():
        diff = (ours.eval()(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff < PARITY_TOL, diff


@pytest.mark.parametrize("source, says", [("missing", "neither a checkpoint"), ("run", "not empty")])
def test_export_errors_are_one_line_exit_2(tmp_path, capsys, source, says):
    make_run(str(tmp_path / "run"))
    os.makedirs(tmp_path / "full")
    (tmp_path / "full" / "x").write_text("taken")
    assert export.main([str(tmp_path / source), str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
