"""End to end: `python train.py --recipe smoke` on the tiny model through the embedded server.

One uninterrupted 3-step run in matched precision (fp32 trainer, fp32 engine) is compared with a run killed
with SIGKILL right after its step-2 checkpoint and resumed: same metrics, same weights and optimizer state,
bit for bit. The same
runs check that the train/rollout log-prob difference is exactly 0 in matched mode, and that the metrics
JSONL, checkpoints, eval records and plots are written. A last run checks FP8 rollouts with routing replay.

Run: `pytest tests/test_train_e2e.py -q` (about a minute on 2 cores).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.metrics import read_jsonl
from nanoflash.parallel.checkpoint import latest_checkpoint, load_checkpoint
from nanoflash.parallel.dims import ParallelDims
from nanoflash.plots import linear_fit, moving_average
from nanoflash import trainer

from conftest import free_port

GRAD_NORM_RTOL = 1e-5  # PP2 vs PP1: the same math, gradients summed in another order (fp32 rounding only)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING_KEYS = {"rollout_s", "train_s", "sync_s", "step_s", "eval_s", "time_s", "rollout_tokens_per_s",
               "train_tokens_per_s"}


def run_train(out: str, *extra: str) -> str:
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", out,
           "--train.progress", "false", "--train.plots", "false", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def kill_after_checkpoint(out: str, step: int, *extra: str) -> None:
    """Start the 3-step run and SIGKILL it as soon as checkpoint `step` is committed (kill -9 mid-run)."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", out,
           "--train.progress", "false", "--train.plots", "false", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = os.path.join(out, "checkpoints", f"step_{step:08d}", "meta.json")
    deadline = time.time() + 240
    while not os.path.exists(target) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.exists(target), f"checkpoint {step} never appeared (exit code {proc.returncode})"


def _state(out: str):
    cfg = parse_args(["--recipe", "smoke"])
    model = trainer.build_model(preset("tiny", **cfg.model), ParallelDims(), cfg.parallel, 0, torch.float32)
    opt = trainer.make_optimizer(model, cfg.optim)
    meta = load_checkpoint(latest_checkpoint(os.path.join(out, "checkpoints")), model, opt, ParallelDims())
    return meta, model.state_dict(), opt.state_dict()


def _no_timing(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING_KEYS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    full, split = str(base / "full"), str(base / "split")
    run_train(full, "--rollout.weights", "fp32")
    kill_after_checkpoint(split, 2, "--rollout.weights", "fp32")
    with open(os.path.join(split, "metrics.jsonl"), "a") as f:  # a record the crashed run wrote after its
        f.write(json.dumps({"kind": "train", "step": 3, "reward_mean": -1.0}) + "\n")  # last checkpoint
    resumed_out = run_train(split, "--rollout.weights", "fp32", "--steps", "3")
    return full, split, resumed_out


def test_metrics_checkpoints_and_eval_are_written(runs):
    full, _, _ = runs
    train = read_jsonl(os.path.join(full, "metrics.jsonl"), "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["groups_seen"] >= 4, r
    assert any(r["groups_kept"] > 0 and "grad_norm" in r for r in train), train  # at least one GRPO update
    assert [r["step"] for r in read_jsonl(os.path.join(full, "metrics.jsonl"), "eval")] == [0, 2, 3]
    assert [r["step"] for r in read_jsonl(os.path.join(full, "metrics.jsonl"), "warmup")][-1] == 19
    meta, _, _ = _state(full)
    assert meta["step"] == 3 and meta["extra"]["data_pos"] > 0
    assert sorted(os.listdir(os.path.join(full, "checkpoints"))) == ["step_00000002", "step_00000003"]


def test_matched_precision_logprob_diff_is_exactly_zero(runs):
    full, _, _ = runs
    trained = [r for r in read_jsonl(os.path.join(full, "metrics.jsonl"), "train") if "grad_norm" in r]
    assert trained
    for r in trained:
        assert r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["train_rollout_kl"] == 0.0, r


def test_resume_continues_from_the_right_step_with_identical_state(runs):
    full, split, resumed_out = runs
    assert "resumed from" in resumed_out and "step 2" in resumed_out
    a = read_jsonl(os.path.join(full, "metrics.jsonl"), "train")
    b = read_jsonl(os.path.join(split, "metrics.jsonl"), "train")
    assert [r["step"] for r in b] == [1, 2, 3]  # the stale step-3 record was dropped, step 3 redone once
    assert [_no_timing(r) for r in a] == [_no_timing(r) for r in b]
    meta_a, model_a, opt_a = _state(full)
    meta_b, model_b, opt_b = _state(split)
    assert meta_a["step"] == meta_b["step"] == 3 and meta_a["extra"] == meta_b["extra"]
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    assert set(opt_a) == set(opt_b) and opt_a["step"] == opt_b["step"] > 0
    for k, v in opt_a.items():
        assert torch.equal(v, opt_b[k]) if torch.is_tensor(v) else v == opt_b[k], k


def test_pipeline_parallel_pp2_matches_single_process(tmp_path):
    """torchrun with 2 gloo ranks at PP2: same rollouts (the warm-up and GRPO step give the same weights up
    to fp32 summation order), |dlogp| still exactly 0 (the recompute goes through the pipeline). Both runs
    use a 2-step warm-up: the smoke's 20 Adam steps amplify the summation-order rounding (Adam rescales tiny
    gradients; measured 1.9e-3 relative grad-norm difference at step 2) while 2 steps keep it at 2e-7."""
    short = ["--rollout.weights", "fp32", "--steps", "2", "--eval.every", "0", "--train.warmup_steps", "2"]
    full, out = str(tmp_path / "pp1"), str(tmp_path / "pp2")
    run_train(full, *short)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", out,
           "--parallel.pp", "2", "--train.progress", "false", "--train.plots", "false", *short]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"torchrun failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    a = read_jsonl(os.path.join(full, "metrics.jsonl"), "train")
    b = read_jsonl(os.path.join(out, "metrics.jsonl"), "train")
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    assert any("grad_norm" in r for r in a), a                    # at least one GRPO step was compared
    for ra, rb in zip(a, b):
        if "grad_norm" in ra:
            assert rb["train_rollout_logprob_abs_diff"] == 0.0
            assert abs(ra["grad_norm"] - rb["grad_norm"]) <= GRAD_NORM_RTOL * ra["grad_norm"], (ra, rb)


def test_fp8_rollout_with_routing_replay(tmp_path):
    """FP8 engine: the push quantizes, so |dlogp| > 0; R3 records travel and the step still trains."""
    out = str(tmp_path / "fp8")
    run_train(out, "--rollout.weights", "fp8", "--rollout.routing_replay", "true", "--steps", "2",
              "--eval.every", "0")
    trained = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl"), "train") if "grad_norm" in r]
    assert trained
    for r in trained:
        assert 0.0 < r["train_rollout_logprob_abs_diff"] < 0.5, r


def test_plot_helpers_against_hand_values():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    a, b = linear_fit([0.0, 1.0, 2.0], [1.0, 3.0, 5.0])
    assert (a, b) == (1.0, 2.0)


def test_write_plots_reads_metrics_back(tmp_path):
    """Three PNGs from a metrics file holding an exact-zero mismatch (linear axis) and a pass@1_se field."""
    pytest.importorskip("matplotlib")
    from nanoflash.plots import write_plots
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(3):
            f.write(json.dumps({"kind": "train", "step": s + 1, "reward_mean": 0.1 * s,
                                "train_rollout_logprob_abs_diff": 0.0}) + "\n")
            f.write(json.dumps({"kind": "eval", "step": s, "pass@1": 0.1, "pass@2": 0.2, "pass@1_se": 0.01}) + "\n")
    paths = write_plots(str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["reward.png", "logprob.png", "passk.png"]
    for p in paths:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
