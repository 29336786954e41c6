"""Four ranks of the engine on one device (issue 37 item 1): `bench/colocated_gpu.py`, kept running.

The CPU mode (`-m slow`, ~2 min on 2 cores) runs the script's whole path on the tiny model: the PP2 x EP2 run
with `--parallel.colocate_ranks` (gloo, P2P through host buffers), its batches replayed through one process and a
re-split control, the bounds of `compare`, the memory table. The GPU mode (`-m gpu`) is the command the H200 run
uses; it writes docs/results/colocated_pp2ep2_h200.json.

Run: pytest tests/test_colocated.py -m slow -q   |   pytest tests/test_colocated.py -m gpu -q
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args) -> dict:
    out = str(tmp_path / "colocated.json")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "colocated_gpu.py"), "--out", out, *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    doc = json.load(open(out)) if os.path.exists(out) else {}
    assert p.returncode == 0 and doc.get("ok"), f"{p.stdout[-4000:]}\n{p.stderr[-3000:]}"
    return doc


@pytest.mark.slow
def test_colocated_pp2xep2_matches_one_process_on_the_cpu(tmp_path):
    """Bugs caught: a P2P that skips the host staging (gloo refuses CUDA tensors there), a receive buffer not
    copied back, dense gradients not all-reduced over EP -- each moves the first moments at O(1), far past the
    re-split control's bf16 difference; a run that does not finish its steps."""
    doc = _run(tmp_path, "--device", "cpu", "--sync-port", str(free_port(2)), "--timeout", "600")
    c = doc["compare"]
    assert doc["run"]["rc"] == 0 and c["weights"]["ok"] and c["masters"]["ok"] and c["first_moments"]["ok"]
    assert 0 < c["first_moments"]["rel_diff_control_vs_ref"] < 0.1, c   # bf16 reordering is not zero, and small
    assert [r["rank"] for r in doc["memory"]["per_rank"]] == [0, 1, 2, 3]


@pytest.mark.gpu
def test_colocated_pp2xep2_on_one_gpu(tmp_path):
    """The H200 run: 4 ranks on cuda:0, bf16, kernels=auto; every rank's GPU peak next to the planner's."""
    doc = _run(tmp_path, "--device", "cuda")
    assert all(r["measured_peak_gib"] for r in doc["memory"]["per_rank"])


def test_benchmarks_md_table_is_the_h200_result():
    """docs/benchmarks.md quotes the H200 run only through the table `--write-docs` renders from its JSON.
    Bugs caught: a number edited by hand or left from an older run; a result that no longer meets what the
    section says of it (every bound met, four ranks, >= 3 steps, each rank's peak under the planner's bytes)."""
    sys.path.insert(0, ROOT)
    from bench import colocated_gpu as cg
    doc = json.load(open(os.path.join(ROOT, "docs", "results", "colocated_pp2ep2_h200.json")))
    block = cg.read_block(cg.DOC, cg.TABLE)
    assert block.strip() == cg.table(doc), \
        "run bench/colocated_gpu.py --write-docs docs/results/colocated_pp2ep2_h200.json"
    assert doc["ok"] and doc["steps"] >= 3 and "H200" in doc["device"]
    assert [p["rank"] for p in doc["memory"]["per_rank"]] == [0, 1, 2, 3]
    assert all(p["measured_peak_gib"] <= p["planned_gib"] for p in doc["memory"]["per_rank"])
