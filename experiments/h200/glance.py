"""The SFT's phase 2 (issues 20 and 42): train towards answering at a glance until P(worked) lands under a mark,
each step's learning rate set from the last step's move so that one step cannot cross the band.

Phase 2 of `grpo_h200.cmd_sft` trains on a mix that is mostly answers at a glance and checks P(worked) (the
probability that a response starts the worked chain, `grpo_h200.p_worked`) after every step; it stops once
P(worked) <= `worked_max`. P(worked) is a sigmoid of a logit that the steps move along, faster and faster as the
optimizer's moments build up, so near the mark one step can cross the whole band a warm start should sit in:

    run 4 (lr 1e-4):               P(worked) 0.99 -> 0.47 -> 0.085
    the second long hold (3e-5):   P(worked) 0.99 -> 0.70 -> 0.06   (the logit -3.5 in the last step; the band
                                   0.6 .. 0.2 is 1.8 wide)

So each step's rate is the phase's `lr` scaled down, when needed, to move the logit about GAIN of the way left
to `target`, as the last step's move at its rate predicts (an AdamW step is its rate times m / sqrt(v), so at
the same moments it scales with the rate):

    z = logit P(worked)                       (P clipped to [P_CLIP, 1 - P_CLIP]: checks round it to 1.0)
    moved = z_before - z_after                of the last step, at rate r
    r_next = min(lr, r * GAIN * (z_after - logit target) / moved)      when moved > 0, else lr

With the second long hold's trajectory that gives a last step at ~0.3 of the rate, landing near P 0.4 instead
of 0.06 (a prediction; the logit's steps grew ~2x a step there, which GAIN leaves room for).

    ending, steps, lrs = glance.run(train_step, lr=3e-5, worked_max=0.6, target=0.25, max_steps=60,
                                    max_seconds=50)

`train_step(rate)` trains one step at `rate` and returns P(worked) after it; `run` takes a `clock` so the tests
drive it with a fake one. `ending` is one of ENDINGS, `lrs` each step's rate. Tests: `pytest
experiments/h200/test_curriculum.py -q`.
"""
from __future__ import annotations

import math
import time

GAIN = 0.6        # a step aims at this share of the logit distance left to the target (< 1: the moves grow)
P_CLIP = 1e-4     # P(worked) as checked is rounded to 4 decimals: 1.0 and 0.0 have no logit
ENDINGS = ("worked_max", "seconds", "steps")


def logit(p: float) -> float:
    p = min(max(p, P_CLIP), 1.0 - P_CLIP)
    return math.log(p / (1.0 - p))


def next_rate(lr: float, rate: float, p_before: float, p_after: float, target: float) -> float:
    """The next step's rate: `lr`, or less where the last step (at `rate`, P(worked) p_before -> p_after) moved
    the logit so fast that GAIN of the distance left to `target` takes a smaller one."""
    moved, left = logit(p_before) - logit(p_after), logit(p_after) - logit(target)
    if moved <= 0 or left <= 0:
        return lr
    return min(lr, rate * GAIN * left / moved)


def run(train_step, lr: float, worked_max: float, target: float, max_steps: int, max_seconds: float = 0.0,
        p_start: float = 1.0, clock=time.time) -> tuple:
    """Phase 2's loop -> (ending, steps run, each step's rate). p_start: P(worked) before the first step (the
    worked phase leaves it at ~1)."""
    if not 0.0 < target < worked_max:
        raise ValueError(f"glance: the target P(worked) {target} must lie in (0, worked_max={worked_max})")
    t0, rate, p, lrs = clock(), lr, p_start, []
    for k in range(1, max_steps + 1):
        lrs.append(rate)
        p_after = train_step(rate)
        if p_after <= worked_max:
            return "worked_max", k, lrs
        if max_seconds and clock() - t0 >= max_seconds:
            return "seconds", k, lrs
        rate, p = next_rate(lr, rate, p, p_after, target), p_after
    return "steps", max_steps, lrs
