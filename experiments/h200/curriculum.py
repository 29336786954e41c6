"""The SFT warm start's curriculum (issue 42): parse a phase schedule and run it.

    factsnear:look=0.9:s=180,factsmid:look=0.6:s=90,factssft

is three phases. Each trains on its family (longctx.FAMILIES) until the accuracy its check measures (the
teacher-forced accuracy of the worked chain on that family's validation problems, `grpo_h200.forced_accuracy`)
reaches `acc` -- or its lookup share (both looked-up values right, the same check) reaches `look`; with both
given, both must -- or its budget is spent -- `s=` seconds, or `steps=` steps, the first of the two when both are
given -- and then the next phase starts. A phase's seconds count from the end of its first step: the first step
on a family pays the compiles of its shapes (~1 minute on the H200 in the first hold), which would otherwise eat
the first phase's budget; that step's time is recorded (`first_step_s`). The last phase needs no budget: it runs
until its accuracy is reached or the whole SFT's `--max-seconds` (or `--max-steps`) is spent. Those overall
limits, counted from the start of the first phase, end any phase; a phase that would start after them is not
run, and is recorded as not reached.

Why: three minutes of SFT on `factssft` alone left that accuracy at 0.0 in every class (experiments/h200/
README.md, "The first hold on the long task"); the lookup is learned first where the facts sit inside the
attention window (`factsnear`), then moved behind the window (`factsmid`), then into the far class.

    phases = curriculum.parse(spec, longctx.FAMILIES)      # -> [Phase]; one ValueError naming the culprit
    records = curriculum.run(phases, train_step, accuracy, max_seconds=240, max_steps=400, check_every=10)

`train_step(phase, k)` runs step k (1-based, within the phase) on the phase's family; `accuracy(phase)` checks
it, every `check_every` steps of the phase, and returns {"acc": share right, "look": share looked up}. `run`
takes a `clock` so the tests drive it with a fake one. Each record (sft.json's "curriculum") holds the family,
its steps and seconds, both shares at each check, and why it ended (`ended`: one of ENDINGS, `why`: in words).

Tests: `pytest experiments/h200/test_curriculum.py -q`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

KEYS = ("acc", "look", "s", "steps")  # a phase's settings: target accuracy, target lookup share, seconds, steps
TARGETS = ("acc", "look")             # the keys that end a phase by its check (every one given must be reached)
ENDINGS = ("target", "steps", "s", "max_seconds", "max_steps", "not_reached")


@dataclass(frozen=True)
class Phase:
    family: str
    acc: float | None = None          # ends when a check reaches this (None: never on accuracy)
    seconds: float | None = None      # its budget in seconds (None: none)
    steps: int | None = None          # its budget in steps (None: none)
    look: float | None = None         # ends when a check's lookup share reaches this (with acc: both)


def _number(text: str, key: str, where: str) -> float | int:
    """The value of `key=text`: a float in [0, 1] for acc and look, a positive float for s, a positive int for
    steps."""
    try:
        v = int(text) if key == "steps" else float(text)
    except ValueError:
        raise ValueError(f"{where}: bad number {key}={text!r}") from None
    if (key in TARGETS and not 0.0 <= v <= 1.0) or (key not in TARGETS and not v > 0):
        want = "in [0, 1]" if key in TARGETS else "> 0"
        raise ValueError(f"{where}: bad number {key}={text!r} (must be {want})")
    return v


def _phase(part: str, n: int, families) -> Phase:
    """One `family:key=value:...` phase of the spec (n: its 1-based place, for the error)."""
    where = f"curriculum phase {n} ({part!r})"
    fields = part.strip().split(":")
    if not fields[0]:
        raise ValueError(f"curriculum phase {n} is empty or has no family: {part!r}")
    if fields[0] not in families:
        raise ValueError(f"{where}: unknown family {fields[0]!r}, expected one of {sorted(families)}")
    got = {}
    for kv in fields[1:]:
        key, eq, text = kv.partition("=")
        if key not in KEYS or not eq:
            raise ValueError(f"{where}: unknown key {kv!r}, expected acc=, look=, s= or steps=")
        if key in got:
            raise ValueError(f"{where}: {key}= given twice")
        got[key] = _number(text, key, where)
    return Phase(fields[0], got.get("acc"), got.get("s"), got.get("steps"), got.get("look"))


def parse(spec: str, families) -> list[Phase]:
    """`family:acc=A:s=S,family2:...` -> [Phase]; every phase but the last needs a budget (s= or steps=), or it
    could never hand over to the next one but by its accuracy."""
    if not spec.strip():
        raise ValueError("curriculum: empty spec (expected family:acc=A:s=S,...)")
    phases = [_phase(part, n, families) for n, part in enumerate(spec.split(","), 1)]
    for n, ph in enumerate(phases[:-1], 1):
        if ph.seconds is None and ph.steps is None:
            raise ValueError(f"curriculum phase {n} ({ph.family}): only the last phase may run without s= or steps=")
    return phases


def _ending(ph: Phase, k: int, phase_s: float, all_s: float, total: int, limits: tuple) -> tuple | None:
    """(ended, why) once phase `ph` is over after its step k, budgets first, then the overall limits; else None."""
    max_seconds, max_steps = limits
    if ph.steps is not None and k >= ph.steps:
        return "steps", f"steps budget {ph.steps} spent"
    if ph.seconds is not None and phase_s >= ph.seconds:
        return "s", f"seconds budget {ph.seconds:g} spent at step {k}"
    if all_s >= max_seconds:
        return "max_seconds", f"the SFT's --max-seconds {max_seconds:g} spent at step {k}"
    if total >= max_steps:
        return "max_steps", f"the SFT's --max-steps {max_steps} spent at step {k}"
    return None


def _reached(ph: Phase, got: dict, k: int) -> tuple | None:
    """("target", why) when the check `got` reaches every target the phase gives (acc=, look=); else None."""
    want = {key: getattr(ph, key) for key in TARGETS if getattr(ph, key) is not None}
    if not want or any(got[key] < v for key, v in want.items()):
        return None
    return "target", " and ".join(f"{key} {got[key]:g} >= {v:g}" for key, v in want.items()) + f" at step {k}"


def _record(ph: Phase) -> dict:
    """A phase's record before it runs (also the record of a phase never reached)."""
    return {"family": ph.family, "acc_target": ph.acc, "look_target": ph.look, "s_budget": ph.seconds,
            "steps_budget": ph.steps, "steps": 0, "seconds": 0.0, "first_step_s": None, "checks": [], "ended": None,
            "why": None}


def _run_phase(ph: Phase, train_step, accuracy, clock, t0: float, total: int, limits: tuple, check_every: int
               ) -> dict:
    """Train one phase until it ends (module docstring); -> its record."""
    rec = _record(ph)
    start, k, end = clock(), 0, None
    budget_from = start                          # the end of the first step (its compiles are not the phase's)
    while end is None:
        k += 1
        train_step(ph, k)
        if k == 1:
            budget_from = clock()
            rec["first_step_s"] = round(budget_from - start, 1)
        if k % check_every == 0:
            got = accuracy(ph)
            rec["checks"].append({"step": k, "acc": got["acc"], "look": got["look"],
                                  "time_s": round(clock() - start, 1)})
            end = _reached(ph, got, k)
        end = end or _ending(ph, k, clock() - budget_from, clock() - t0, total + k, limits)
    rec.update(steps=k, seconds=round(clock() - start, 1), ended=end[0], why=end[1])
    return rec


def run(phases: list[Phase], train_step, accuracy, max_seconds: float, max_steps: int, check_every: int,
        clock=time.monotonic, log=None) -> list[dict]:
    """Run the phases in order (module docstring); -> one record per phase, those never reached included.
    `log(record)` is called as each phase ends."""
    t0, total, out = clock(), 0, []
    for ph in phases:
        if clock() - t0 >= max_seconds or total >= max_steps:
            out.append({**_record(ph), "ended": "not_reached", "why": "the SFT's overall limit came first"})
            continue
        out.append(_run_phase(ph, train_step, accuracy, clock, t0, total, (max_seconds, max_steps), check_every))
        total += out[-1]["steps"]
        if log:
            log(out[-1])
    return out
