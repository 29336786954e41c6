"""Instruments attached to the loop: one interface, named on the command line, never called by name.

    python train.py --recipe experiments/h200/h200.txt --train.hooks instruments.live:LiveChecks

The loop (`train.py`) knows only `Hooks`; what a run measures beyond its own metrics (the FP8 floor on every
step's tokens, a probe after every push, the warm start re-evaluated, ...) lives outside the package
(`instruments/`, an experiment's folder) in a class that subclasses `Hook` and overrides what it needs. Each
method returns a dict of metrics, which the loop merges into the record it is writing:

    after_push(version)            -> the step's `train` record (at start-up: a `push` record)
    before_update(batch, old, step) -> the step's `train` record; rank 0's packed global batch and the trainer's
                                      old log-probs [B,S] of the weights that generated it, before the update
    after_eval(at, acc, gen_for)   -> an `eval_<name>` record; acc [P] per-problem accuracy of the eval just
                                      run, gen_for(at) the eval's generate function at step `at`
    close()                        -> at the end of the run

Hooks run on rank 0 only, built after the first push from `HookContext` (the run's config, model config,
trainer, collector, pusher and task). A hook that raises stops the run (an instrument that sees a broken push
must say so); one that must not stop it catches its own errors and counts them.

Differs from Miles: Miles' `--custom-*-function-path` flags name one function per extension point; here one
class per instrument holds its state (the warm start's copy, the simulated FP8 model) across the points.

Tests: `pytest tests/test_hooks.py -q`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass
class HookContext:
    """What a hook may read (rank 0): the run's objects as train.py built them."""

    cfg: object        # config.RunConfig
    mcfg: object       # config.ModelConfig
    trainer: object    # rl.trainer.Trainer
    collector: object  # rl.collector.Collector
    pusher: object     # sglang.push.StagePusher
    task: object       # rl.collector.Task


class Hook:
    """An instrument; override any of the methods (see the module docstring). `name` names its eval record."""

    name = "hook"

    def __init__(self, ctx: HookContext):
        self.ctx = ctx

    def after_push(self, version: int) -> dict:
        return {}

    def before_update(self, batch, old, step: int) -> dict:
        return {}

    def after_eval(self, at: int, acc, gen_for) -> dict:
        return {}

    def close(self) -> None:
        pass


def load_hook(spec: str):
    """`module:Class` -> the class, checked to be a `Hook`; an error names the spec."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--train.hooks {spec!r}: name a hook as module:Class (e.g. instruments.live:LiveChecks)")
    cls = getattr(importlib.import_module(module), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Hook)):
        raise ValueError(f"--train.hooks {spec!r}: {module}.{attr} is not a nanoflash.rl.hooks.Hook subclass")
    return cls


class Hooks:
    """The hooks of `--train.hooks`, in order; each call merges their metrics (a later hook wins a key)."""

    def __init__(self, specs, ctx: HookContext | None):
        self.hooks = [load_hook(s)(ctx) for s in specs] if ctx is not None else []

    def after_push(self, version: int) -> dict:
        return {k: v for h in self.hooks for k, v in h.after_push(version).items()}

    def before_update(self, batch, old, step: int) -> dict:
        return {k: v for h in self.hooks for k, v in h.before_update(batch, old, step).items()}

    def after_eval(self, at: int, acc, gen_for) -> dict:
        """-> {record name: metrics} (`eval_<hook name>`), for the hooks that returned something."""
        out = {f"eval_{h.name}": h.after_eval(at, acc, gen_for) for h in self.hooks}
        return {k: v for k, v in out.items() if v}

    def close(self) -> None:
        for h in self.hooks:
            h.close()
