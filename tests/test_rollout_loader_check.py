"""Opt-in: nanoflash's weight stream through SGLang's real DeepSeek-V4 `load_weights` on a CPU.

Needs a separate ~6 GB environment; build it and run the check in one command:

    python -m instruments.loader_check --build-env .venv-sglang --sglang 0.5.23

This test runs the same check with the interpreter named by `NANOFLASH_SGLANG_PYTHON` (default
`.venv-sglang/bin/python`) and is skipped when that does not exist.
Run: `pytest -m sglang tests/test_rollout_loader_check.py`.
"""
from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.environ.get("NANOFLASH_SGLANG_PYTHON", os.path.join(ROOT, ".venv-sglang", "bin", "python"))


@pytest.mark.sglang
@pytest.mark.skipif(not os.path.exists(PY), reason=f"no SGLang environment at {PY}")
def test_every_sglang_parameter_is_what_nanoflash_meant():
    out = subprocess.run([PY, "-m", "instruments.loader_check"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=900)
    report = "\n".join(line for line in out.stdout.splitlines() if line.startswith(("[", "OK", "FAILED", "   ")))
    print(report)
    assert out.returncode == 0, report + out.stderr[-2000:]
    assert "OK: every SGLang parameter is what nanoflash meant" in out.stdout
    assert report.count("control] push without tid2eid -> caught") == 2
