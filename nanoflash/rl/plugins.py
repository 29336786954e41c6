"""Reward plug-ins: `--train.reward module:function` replaces a task's reward by your own function.

The contract (`PluginReward`):

    def my_reward(response: str, problem: nanoflash.rl.data.Problem) -> float

* inputs: the decoded response text (special tokens dropped; after the stop token nothing) and the `Problem`
  (`.prompt` the user message, `.answer` the reference answer string from the dataset's answer field, `.id`,
  `.source`); called once per sample, for rollouts and for the held-out eval alike;
* output: a finite real number (a bool counts as 0/1; numpy scalars such as np.float32 are numbers). pass@k and accuracy count a sample as correct when the
  reward equals REWARD_CORRECT (1.0); GRPO uses any value (advantages are normalised per group);
* where it runs: in `train.reward_workers` fresh worker processes (`VerifierPool`), so it may use
  `signal.alarm`, C extensions or subprocesses (a worker killed for a timeout takes its process group, the
  plug-in's children, with it); `module` must be importable from the current directory or PYTHONPATH, and is
  imported once per worker. It is also imported once at startup, before the model is built, in a fresh
  interpreter given at most `IMPORT_TIMEOUT_S` (`check_plugin`), so a typo in the name, an import error or a
  module that hangs at import is one line and exit code 2;
* timeouts: a call that runs past `train.reward_timeout_s` (default 10 s) has its worker killed and
  respawned and the sample scores REWARD_WRONG (0); each call batch that had one prints one line counting them;
* exceptions: a plug-in must score bad responses itself (return 0), so an exception, or a return value that is
  not a finite number, is a bug: the run stops with one line naming the plug-in, the problem and the error
  (`RewardPluginError`, exit code 1). Resuming after the fix redraws the same samples.

Differs from the anchor stacks: verl's `custom_reward_function` is `compute_score(data_source, solution_str,
ground_truth, extra_info)` in the trainer process; slime / Miles take an async `custom_rm(args, sample)`; TRL a
batched `reward_func(prompts, completions, **columns)`. Here one sample per call, in killable worker
processes, so a hanging checker costs one timeout, never the run.

Tests: `pytest tests/test_plugins.py -q`.
"""
from __future__ import annotations

import collections
import importlib
import inspect
import math
import numbers
import os
import subprocess
import sys
from typing import Callable, Sequence

from nanoflash.rl.rewards import DEFAULT_TIMEOUT_S, REWARD_WRONG, VerifierPool, kill_group


class RewardPluginError(SystemExit):
    """A reward plug-in raised or returned a non-number: stops the run with one line (exit code 1), no traceback."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


_PLUGINS: dict = {}
# start-up's check import of a plug-in (`check_plugin`): far above a heavy import (sympy, math-verify: seconds),
# so only a module that never finishes importing is stopped, with one line instead of a start-up that hangs
IMPORT_TIMEOUT_S = 120.0


def load_plugin(spec: str) -> Callable:
    """`"module:function"` -> the function (the current directory first on the import path). One ValueError
    naming the spec for a malformed spec, an import failure, a missing name or a wrong signature."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name or ":" in name:
        raise ValueError(f"train.reward={spec!r}: expected 'module:function', e.g. my_rewards:score")
    if spec in _PLUGINS:
        return _PLUGINS[spec]
    _cwd_on_path()
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or anything the module raises while importing
        raise ValueError(f"train.reward={spec!r}: cannot import {module!r} ({type(e).__name__}: {e}); it must be "
                         f"importable from the current directory or PYTHONPATH") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"train.reward={spec!r}: module {module!r} ({getattr(mod, '__file__', '?')}) has no "
                         f"function {name!r}")
    try:
        inspect.signature(fn).bind("response", None)
    except TypeError:
        raise ValueError(f"train.reward={spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                         f"{name}(response, problem)") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    _PLUGINS[spec] = fn
    return fn


def _cwd_on_path() -> None:
    """The directory train.py runs in comes first on the import path (here, and so in every worker's PYTHONPATH)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def check_plugin(spec: str, timeout_s: float = IMPORT_TIMEOUT_S) -> None:
    """`load_plugin(spec)` in a fresh interpreter (its own process group), given at most `timeout_s`: the
    trainer never calls the plug-in itself (its workers do), so a module that hangs at import costs one line
    (ValueError), not a start-up that never ends; load_plugin's own errors come back as they are."""
    code = ("import sys\nfrom nanoflash.rl.plugins import load_plugin\ntry:\n    load_plugin(sys.argv[1])\n"
            "except ValueError as e:\n    print(e, file=sys.stderr)\n    sys.exit(3)")
    _cwd_on_path()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", code, spec], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        err = proc.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise ValueError(f"train.reward={spec!r}: importing {spec.partition(':')[0]!r} did not finish in "
                         f"{timeout_s:g} s (does it run something at import?)") from None
    lines = err.strip().splitlines() or [f"exit code {proc.returncode}"]
    if proc.returncode == 3:
        raise ValueError(lines[-1])
    if proc.returncode:
        raise ValueError(f"train.reward={spec!r}: checking it failed: {lines[-1]}")


def _plugin_call(spec: str, response: str, problem) -> float:
    """Worker side: one plug-in call, its value checked (a bool is 0/1; anything else must be a finite number)."""
    value = load_plugin(spec)(response, problem)
    if isinstance(value, numbers.Real) and math.isfinite(value):   # bool, int, float, numpy scalars
        return float(value)
    raise TypeError(f"returned {value!r}, not a finite number")


class PluginReward:
    """A `module:function` plug-in run in worker processes with a per-call timeout (contract: module docstring).

    Shapes: __call__(responses [N] str, problems [N] Problem) -> [N] float. `counts` tallies ok|timeout|crash.
    """

    def __init__(self, spec: str, n_workers: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S,
                 import_timeout_s: float = IMPORT_TIMEOUT_S, start: bool = True):
        check_plugin(spec, import_timeout_s)  # fail here, at startup, not in a worker during the first rollout
        self.spec, self.timeout_s = spec, timeout_s
        self.pool = VerifierPool(n_workers=n_workers, timeout_s=timeout_s, warm_imports=(spec.partition(":")[0],),
                                 start=start)
        self.counts = collections.Counter()

    def __call__(self, responses: Sequence[str], problems: Sequence) -> list[float]:
        if len(responses) != len(problems):
            raise ValueError(f"{len(responses)} responses but {len(problems)} problems")
        outcomes = self.pool.map(_plugin_call, [(self.spec, r, p) for r, p in zip(responses, problems)])
        out, lost = [], 0
        for (status, value), p in zip(outcomes, problems):
            self.counts[status] += 1
            if status == "error":
                raise RewardPluginError(f"reward plug-in {self.spec} failed on problem {p.id!r}: {value} (a plug-in "
                                        f"must score bad responses itself; see nanoflash/rl/plugins.py)")
            lost += status != "ok"
            out.append(float(value) if status == "ok" else REWARD_WRONG)
        if lost:
            print(f"reward plug-in {self.spec}: {lost} of {len(out)} calls timed out (> {self.timeout_s:g} s) or "
                  f"crashed their worker; scored {REWARD_WRONG:g} ({self.counts['timeout']} timeouts, "
                  f"{self.counts['crash']} crashes so far)", file=sys.stderr)
        return out

    def close(self) -> None:
        self.pool.close()


def token_plugin_fn(decode: Callable[[Sequence[int]], str], plugin: Callable) -> Callable:
    """Adapt a plug-in reward `(responses, problems) -> rewards` to `(problems, token-id lists) -> rewards`."""
    def reward_fn(problems, responses_ids):
        return plugin([decode(ids) for ids in responses_ids], list(problems))
    return reward_fn
