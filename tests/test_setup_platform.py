"""scripts/platform.sh, the torch / triton decision of scripts/setup.sh, on stubbed machines (installs nothing).

Each case runs the script with PATH holding only fake nvidia-smi / rocm-smi / amd-smi, PYTHONPATH holding a
fake `torch` (torch.version.hip / .cuda as a ROCm, CUDA or CPU build would report; or an import error for none),
and NANOFLASH_ROCM_DIR pointing at a directory that exists or not (the /opt/rocm signal).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASH = "/bin/bash"

FAKE_TORCH = {
    "rocm": "__version__ = '2.9.1+rocm6.4'\nclass version:\n    hip = '6.4'\n    cuda = None\n",
    "cuda": "__version__ = '2.11.0+cu128'\nclass version:\n    hip = None\n    cuda = '12.8'\n",
    "cpu": "__version__ = '2.13.0+cpu'\nclass version:\n    hip = None\n    cuda = None\n",
    "none": "raise ImportError('no torch here')\n",
}
SMI = {   # a tool that finds its GPU, as the real ones answer
    "nvidia-smi": "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n",
    "rocm-smi": "#!/bin/sh\nexit 0\n",
    "amd-smi": "#!/bin/sh\nexit 0\n",
    "nvidia-smi-broken": "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\n"
                         "exit 9\n",
}


def decide(tmp_path, torch_kind: str, tools=(), rocm_dir=False) -> dict:
    bin_dir, mod = tmp_path / "bin", tmp_path / "mods" / "torch"
    bin_dir.mkdir()
    mod.mkdir(parents=True)
    (mod / "__init__.py").write_text(FAKE_TORCH[torch_kind])
    for tool in tools:
        path = bin_dir / tool.replace("-broken", "")
        path.write_text(SMI[tool])
        path.chmod(0o755)
    rocm = tmp_path / "rocm"
    if rocm_dir:
        rocm.mkdir()
    env = {"PATH": str(bin_dir), "PYTHONPATH": str(tmp_path / "mods"), "NANOFLASH_ROCM_DIR": str(rocm),
           "HOME": str(tmp_path)}
    p = subprocess.run([BASH, os.path.join(ROOT, "scripts", "platform.sh"), sys.executable], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return dict(line.split("=", 1) for line in p.stdout.split())


@pytest.mark.parametrize("torch_kind,tools,rocm_dir,want", [
    # the issue-38 bug: a ROCm node with its ROCm torch got PyPI's torch (nvidia-smi absent -> "no GPU" -> the
    # CPU pin, replacing the ROCm build) and triton==3.6.0 over pytorch-triton-rocm
    ("rocm", ["rocm-smi"], True, dict(GPU="amd", TORCH="keep", TRITON="keep", SYSTEM_SITE="1")),
    ("rocm", [], False, dict(GPU="amd", TORCH="keep", TRITON="keep", SYSTEM_SITE="1")),   # torch.version.hip alone
    ("none", ["amd-smi"], False, dict(GPU="amd", TORCH="missing-rocm", TRITON="keep")),  # never a PyPI torch there
    ("none", [], True, dict(GPU="amd", TORCH="missing-rocm")),                            # /opt/rocm alone
    ("cuda", ["nvidia-smi"], False, dict(GPU="nvidia", TORCH="keep", TRITON="keep", SYSTEM_SITE="1")),
    ("none", ["nvidia-smi"], False, dict(GPU="nvidia", TORCH="install-cuda", TRITON="keep", SYSTEM_SITE="0")),
    # the CPU CI: a fresh clone, no torch, no GPU -> torch 2.13.0 + triton 3.6.0 (the interpreter tests)
    ("none", [], False, dict(GPU="none", TORCH="install-cpu", TRITON="install", SYSTEM_SITE="0",
                             TORCH_CPU_PIN="2.13.0", TRITON_CPU_PIN="3.6.0")),
    ("cpu", [], False, dict(GPU="none", TORCH="keep", TRITON="install", SYSTEM_SITE="0")),
    ("none", ["nvidia-smi-broken"], False, dict(GPU="none", TORCH="install-cpu")),       # a driverless smi
])
def test_platform_decision(tmp_path, torch_kind, tools, rocm_dir, want):
    got = decide(tmp_path, torch_kind, tools, rocm_dir)
    assert {k: got[k] for k in want} == want, got


def test_pyproject_does_not_pin_triton():
    """Bug caught: `triton==3.6.0` in the core dependencies makes `pip install -e .` replace a ROCm torch's
    pytorch-triton-rocm (the same `triton` module) with a CUDA-only build."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert not [d for d in deps if d.split("=")[0].split(">")[0].split("<")[0].strip() == "triton"], deps
