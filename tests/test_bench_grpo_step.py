"""bench/bench_grpo_step.py keeps running: the tiny CPU form of the H200 measurement of train.py's GRPO step
(old log-probs, forward + backward, optimizer, profile), its numbers consistent with each other.

Run: pytest tests/test_bench_grpo_step.py -q   (a few seconds)
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_grpo_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny forwards: latency-bound (conftest.one_thread)
ARGS = ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--prompt-len", "20,40", "--response-len", "2,8",
        "--prompts", "2", "--samples", "2", "--steps", "1", "--warmup", "0", "--micro-batch-tokens", "64"]


def test_bench_grpo_step_runs_on_cpu(capsys):
    """A bench that no longer runs (a renamed trainer method, a field the batch lost) or adds up wrong (step
    != its parts, the scored tokens not the responses); a trainer pass that scores every position again (the
    head's host sync missing from it)."""
    res = bench_grpo_step.main(ARGS)
    assert res["sequences"] == 4 and 4 * 2 <= res["scored_tokens"] <= 4 * 8
    assert res["micro_batches"] > 1 and res["padded_tokens"] >= res["tokens"]
    t = res["time_s"]
    assert all(t[k] > 0 for k in ("old_logprobs_s", "train_s", "optimizer_s", "fwd_bwd_s", "packing_s"))
    assert t["step_s"] == pytest.approx(t["old_logprobs_s"] + t["train_s"])
    assert all(0 < v < 1 for v in res["mfu"].values()) and res["mfu_6nd_fwd_bwd"] > 0
    prof = res["profile"]
    assert isinstance(prof, dict) and prof["top_self_cpu_ms"], prof
    # the head's one host sync (the count of scored positions) per micro-batch, in each of the two passes
    assert prof["syncs"]["aten::nonzero"] == 2 * res["micro_batches"], prof["syncs"]
    assert '"time_s"' in capsys.readouterr().out
