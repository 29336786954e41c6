"""Checkpoints: resume after SIGKILL (in the middle of a save) reproduces the uninterrupted run exactly;
PP2 and EP2 checkpoints load into a single-process (PP1, EP1) model and export to the HF layout; a malformed
checkpoint gives one clear error.

Run: pytest tests/test_parallel_dcp.py -q
"""
import os
import signal

import pytest
import torch

from conftest import run_ranks
from nanoflash.checkpoint import load_hf_checkpoint
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel import dcp as ckpt
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.expert import apply_expert_parallel
from nanoflash.parallel.optim import AdamW, trainable_parameters
from nanoflash.parallel.pipeline import build_stage
from nanoflash.parallel.train_step import token_nll_loss, train_step

N_STEPS, KILL_AT = 4, 2
BF16_RTOL = 2 ** -8  # the HF export stores bf16: half an ulp of relative rounding, with margin   # the kill hits the save of step 2, so the resume starts from step 1's checkpoint


def _batch(step: int):
    """Data position = step (ids from a step-seeded generator); the loss mask draws on the global RNG, so a
    resume that did not restore the RNG state would train on different masks."""
    cfg = preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(100 + step))
    mask = (torch.rand(2, 12) > 0.3).float()
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask}


def _train(rank, world, root, kill_at, resume):
    dims = ParallelDims(pp=2)
    torch.manual_seed(1234)
    model = Transformer(preset("tiny")).init_weights(0)
    params = trainable_parameters(model)
    build_stage(model, dims, (1, 3))
    opt = AdamW([(n, p) for n, p in params if n in dict(model.named_parameters())], lr=1e-3)
    start, losses = 0, {}
    if resume:
        meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(root), model, opt, dims)
        start = meta["extra"]["next_step"]
    for step in range(start, N_STEPS):
        batch = _batch(step)
        out = train_step(model, dims, [batch], opt, 1.0 / float(batch["loss_mask"].sum()), token_nll_loss)
        losses[step] = out["loss"]
        if step == kill_at:  # every rank dies after its DCP shards are written, before the atomic rename
            ckpt._fsync_path = lambda path: os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save_checkpoint(root, step, model, opt, dims, extra={"next_step": step + 1})
    return losses, {n: t.clone() for n, t in model.state_dict().items()}, opt.state_dict()


def test_resume_after_sigkill_matches_uninterrupted_and_pp2_loads_into_pp1(tmp_path):
    full = run_ranks(_train, 2, str(tmp_path / "full"), -1, False)
    killed_root = str(tmp_path / "killed")
    run_ranks(_train, 2, killed_root, KILL_AT, False, allow_killed=True)
    assert sorted(os.listdir(killed_root)) == ["step_00000000", "step_00000001", "step_00000002.tmp"]
    assert ckpt.latest_checkpoint(killed_root).endswith("step_00000001")
    resumed = run_ranks(_train, 2, killed_root, -1, True)
    for rank in range(2):
        assert sorted(resumed[rank][0]) == [2, 3]
        for step in (2, 3):
            assert resumed[rank][0][step] == full[rank][0][step], f"rank {rank} step {step} loss differs"
        for name, t in full[rank][1].items():
            assert torch.equal(resumed[rank][1][name], t), f"rank {rank} {name} differs after resume"
    # The PP2 checkpoint (written by two stages) loads into one full single-process model.
    model = Transformer(preset("tiny"))
    opt = AdamW(trainable_parameters(model), lr=1e-3)
    meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(str(tmp_path / "full")), model, opt, ParallelDims())
    assert meta["step"] == N_STEPS - 1 and meta["pp"] == 2 and meta["extra"] == {"next_step": N_STEPS}
    merged = {**full[0][1], **full[1][1]}
    assert set(merged) == set(model.state_dict()), "PP2 stages do not cover the full model's names"
    for name, t in model.state_dict().items():
        assert torch.equal(t, merged[name]), f"{name} differs after loading PP2 -> PP1"
    merged_opt = {**full[0][2], **full[1][2]}
    for key, v in opt.state_dict().items():
        assert (v == merged_opt[key]) if key == "step" else torch.equal(v, merged_opt[key]), key
    # ... and exports to the official HF layout, which the HF loader reads back (bf16 rounding only).
    ckpt.export_hf(ckpt.latest_checkpoint(str(tmp_path / "full")), preset("tiny"), str(tmp_path / "hf"))
    back = Transformer(preset("tiny"))
    load_hf_checkpoint(back, str(tmp_path / "hf"))
    for name, t in back.state_dict().items():
        torch.testing.assert_close(t, merged[name].to(t.dtype), rtol=BF16_RTOL, atol=0, msg=lambda m: f"{name}: {m}")


def test_load_rejects_uncommitted_and_mismatched(tmp_path):
    model = Transformer(preset("tiny")).init_weights(0)
    opt = AdamW(trainable_parameters(model), lr=1e-3)
    dims = ParallelDims()
    path = ckpt.save_checkpoint(str(tmp_path), 0, model, opt, dims)
    os.makedirs(tmp_path / "step_00000005.tmp")
    assert ckpt.latest_checkpoint(str(tmp_path)) == path
    with pytest.raises(ValueError, match="not a committed checkpoint"):
        ckpt.load_checkpoint(str(tmp_path / "step_00000005.tmp"), model, opt, dims)
    bigger = Transformer(preset("tiny", n_routed_experts=16))
    with pytest.raises(ValueError, match="cannot load .*step_00000000"):
        ckpt.load_checkpoint(path, bigger, None, dims)


def _train_ep2(rank, world, root):
    dims = ParallelDims(ep=2)
    model = apply_expert_parallel(Transformer(preset("tiny")).init_weights(0), dims)
    opt = AdamW([(n, p) for n, p in trainable_parameters(model)], lr=1e-3)
    batch = _batch(rank)
    train_step(model, dims, [batch], opt, 1.0 / float(batch["loss_mask"].sum()), token_nll_loss)
    ckpt.save_checkpoint(root, 0, model, opt, dims)
    return {n: t.clone() for n, t in model.state_dict().items()}, opt.state_dict()


def test_ep2_checkpoint_loads_into_one_process(tmp_path):
    parts = run_ranks(_train_ep2, 2, str(tmp_path))
    model = Transformer(preset("tiny"))
    opt = AdamW(trainable_parameters(model), lr=1e-3)
    ckpt.load_checkpoint(ckpt.latest_checkpoint(str(tmp_path)), model, opt, ParallelDims())
    for rank, (state, ostate) in enumerate(parts):
        for name, t in state.items():  # experts from their owner, dense weights from either replica
            assert torch.equal(model.state_dict()[name], t), f"{name} (rank {rank})"
        for key, v in ostate.items():
            assert (v == opt.state_dict()[key]) if key == "step" else torch.equal(v, opt.state_dict()[key]), key
    assert any(".experts.7." in n for n in parts[1][0]) and not any(".experts.7." in n for n in parts[0][0])



def test_single_process_save_and_load_print_no_warning(tmp_path):
    """Bug caught (issue 40): every checkpoint of a one-process run printed torch's UserWarning "torch.distributed
    is disabled, unavailable or uninitialized, assuming the intent is to save in a single process" (two lines of
    stderr a save, in the demo's output). A fresh interpreter, as train.py is, with Python's default filters."""
    import subprocess
    import sys
    code = ("import torch\n"
            "from nanoflash.config import preset\n"
            "from nanoflash.model import Transformer\n"
            "from nanoflash.parallel import dcp\n"
            "from nanoflash.parallel.dims import ParallelDims\n"
            "from nanoflash.parallel.optim import AdamW, trainable_parameters\n"
            "m = Transformer(preset('tiny')).init_weights(0)\n"
            "opt = AdamW(trainable_parameters(m), lr=1e-3)\n"
            f"path = dcp.save_checkpoint({str(tmp_path)!r}, 1, m, opt, ParallelDims())\n"
            "dcp.load_checkpoint(path, m, opt, ParallelDims())\n"
            "print('saved and loaded')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "saved and loaded", p.stderr[-2000:]
    assert "Warning" not in p.stderr, p.stderr
