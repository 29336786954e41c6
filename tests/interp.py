"""Triton's interpreter for the kernel tests: one subprocess per test file, every case of the file run in it.

The CPU has no Triton backend, but `TRITON_INTERPRET=1` runs the same kernels in numpy, so the fast paths are
tested on every CI run against `model.py`'s readable reference. The variable must be set before Triton is
imported, hence a subprocess per file: the file re-runs itself as `python <file> <out.json>`, its `__main__`
calls `run_cases(CASES, out_path)`, and the pytest side reads back {case: "ok" | traceback} through
`interpreted(__file__, timeout_s)`, one parametrized test per case.

`patch_interpreter()` fixes two bugs of Triton 3.6's interpreter (tests only; the GPU compiler is unaffected):
* it converts its one-element scalar arrays with int(), which numpy >= 2.4 rejects, so every loop with a
  run-time bound fails (triton-lang/triton#9171, fixed after 3.6): index through the element instead;
* its dot multiplies bf16's uint16 storage as integers: widen bf16 operands to fp32 first (exact, as the
  tensor cores' bf16 products are), then accumulate in fp32 as before.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback

import pytest
import torch


def patch_interpreter():
    """Patch Triton 3.6's interpreter in this process (see the module docstring)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti
    patch_tensor, dot = ti._patch_lang_tensor, ti.InterpreterBuilder.create_dot

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    ti._patch_lang_tensor = patch_lang_tensor
    ti.InterpreterBuilder.create_dot = lambda self, a, b, d, *args: dot(self, widen(a), widen(b), d, *args)


def run_cases(cases: dict, out_path: str):
    """Subprocess side: run each `case(gen)` with a generator seeded by its name; write {name: "ok" | traceback}."""
    patch_interpreter()
    torch.set_num_threads(1)
    results = {}
    for name, fn in cases.items():
        try:
            fn(torch.Generator().manual_seed(sum(map(ord, name))))
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(results, f)


def interpreted(test_file: str, timeout_s: float) -> dict:
    """Pytest side: run `test_file` as a script under TRITON_INTERPRET=1 and return its results."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "results.json")
        # the repository root first: a script's sys.path starts at tests/, and an editable install of another
        # checkout (a git worktree's main tree) would otherwise be the nanoflash the cases import
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        proc = subprocess.run([sys.executable, os.path.abspath(test_file), path], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(path):
            pytest.fail(f"interpreter subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)
