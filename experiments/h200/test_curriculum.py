"""The SFT curriculum (experiments/h200/curriculum.py, `grpo_h200.py sft --curriculum`) with a fake clock and a
stub trainer: the spec's parsing, each way a phase ends, and the record sft.json keeps. No model runs here; the
long dry run (`H20_TASK=long bash experiments/h200/grpo_h200.sh dry`) runs it with one.
"""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from experiments.h200 import curriculum, grpo_h200, longctx

STEP_S = 1.5             # the fake clock's seconds per training step (the first hold: ~1.75 s a step)
CHECK_S = 0.5            # and per accuracy check
COMPILE_S = 40.0         # and the first step on a family, with `Stub(compile_s=COMPILE_S)` (its compiles)


class Stub:
    """A fake clock, a trainer that only counts (family, step within phase) and a check that reads its accuracy
    from `accs[family]` (a list, one value per check; the last repeats)."""

    def __init__(self, accs=None, compile_s=0.0):
        self.t, self.trained, self.accs, self.checked = 0.0, [], accs or {}, []
        self.compile_s = compile_s

    def clock(self):
        return self.t

    def train_step(self, ph, k):
        self.t += STEP_S + (self.compile_s if k == 1 else 0.0)
        self.trained.append((ph.family, k))

    def accuracy(self, ph):
        self.t += CHECK_S
        seq = self.accs.get(ph.family, [0.0])
        self.checked.append(ph.family)
        return seq[min(sum(f == ph.family for f in self.checked) - 1, len(seq) - 1)]

    def run(self, spec, max_seconds=1e9, max_steps=10_000, check_every=2):
        phases = curriculum.parse(spec, longctx.FAMILIES)
        return curriculum.run(phases, self.train_step, self.accuracy, max_seconds, max_steps, check_every,
                              clock=self.clock)


# ---------------------------------------------------------------------------------------------- parsing
def test_parse_reads_each_key_and_names_the_culprit_of_a_bad_spec():
    """Bugs caught: a key read into the wrong field (s= as steps), steps= read as a float, the last phase's lack
    of a budget refused, or a bad spec passing / failing without naming its phase and culprit."""
    got = curriculum.parse("factsnear:acc=0.6:s=100,factsmid:acc=0.5:steps=70,factssft:acc=0.5", longctx.FAMILIES)
    assert got == [curriculum.Phase("factsnear", 0.6, 100.0, None), curriculum.Phase("factsmid", 0.5, None, 70),
                   curriculum.Phase("factssft", 0.5, None, None)]
    assert isinstance(got[1].steps, int)
    assert curriculum.parse(" factscpu ", longctx.FAMILIES) == [curriculum.Phase("factscpu")]
    bad = {"": "empty spec", "factsnear:s=5,,factssft": "phase 2 is empty", ":acc=0.5": "phase 1 is empty",
           "factsnear:s=5,factsfar:acc=1": "unknown family 'factsfar'",
           "factsnear:secs=5,factssft": "unknown key 'secs=5'", "factsnear:acc,factssft": "unknown key 'acc'",
           "factsnear:acc=high:s=5,factssft": "bad number acc='high'", "factsnear:acc=1.5:s=5,factssft": "acc='1.5'",
           "factsnear:steps=2.5,factssft": "bad number steps='2.5'", "factsnear:s=-1,factssft": "bad number s='-1'",
           "factsnear:s=1:s=2,factssft": "s= given twice",
           "factsnear:acc=0.6,factssft": "phase 1 \\(factsnear\\): only the last phase may run without"}
    for spec, msg in bad.items():
        with pytest.raises(ValueError, match=msg):
            curriculum.parse(spec, longctx.FAMILIES)


# ---------------------------------------------------------------------------------------------- transitions
def test_a_phase_ends_when_its_check_reaches_acc_and_the_next_one_starts():
    """Bugs caught: the accuracy compared with the wrong phase's target, `>` for `>=`, the next phase trained on
    the previous family, the check counted over the whole SFT instead of the phase."""
    s = Stub({"factscpu": [0.2, 0.6], "factscpumid": [0.1, 0.3, 0.5]})
    recs = s.run("factscpu:acc=0.6:steps=50,factscpumid:acc=0.5", check_every=3)
    assert [(r["family"], r["steps"], r["ended"]) for r in recs] == [("factscpu", 6, "acc"), ("factscpumid", 9, "acc")]
    assert [c["step"] for c in recs[0]["checks"]] == [3, 6] and [c["acc"] for c in recs[1]["checks"]] == [0.1, 0.3, 0.5]
    assert s.trained == [("factscpu", k) for k in range(1, 7)] + [("factscpumid", k) for k in range(1, 10)]
    assert recs[0]["seconds"] == pytest.approx(6 * STEP_S + 2 * CHECK_S, abs=0.1)
    s = Stub({"factscpumid": [0.1, 0.5]})                       # a phase before it ends off the check grid
    recs = s.run("factscpu:acc=0.6:steps=4,factscpumid:acc=0.5", check_every=3)
    assert [(r["steps"], r["ended"], [c["step"] for c in r["checks"]]) for r in recs] == \
        [(4, "steps", [3]), (6, "acc", [3, 6])]


def test_a_phase_ends_when_its_steps_or_seconds_are_spent_to_the_step():
    """Bugs caught: a steps budget off by one either way; a seconds budget read as the whole SFT's time instead of
    the phase's (the second phase would end at once); `>` for `>=` on the seconds; the first step's compiles
    charged to the phase's seconds (a 40 s compile would end a 6 s phase after one step)."""
    s = Stub(compile_s=COMPILE_S)
    recs = s.run("factscpu:acc=1:steps=3,factsnear:acc=1:s=6,factscpumid:acc=1:steps=2", check_every=100)
    assert [(r["family"], r["steps"], r["ended"]) for r in recs] == \
        [("factscpu", 3, "steps"), ("factsnear", 5, "s"), ("factscpumid", 2, "steps")]  # then 4 x 1.5 s = 6 s
    assert recs[1]["seconds"] == pytest.approx(COMPILE_S + 5 * STEP_S) and recs[0]["checks"] == []
    assert [r["first_step_s"] for r in recs] == [COMPILE_S + STEP_S] * 3
    s = Stub()
    recs = s.run("factscpu:s=10:steps=3,factsnear:steps=2", check_every=100)                 # the first of the two
    assert [r["steps"] for r in recs] == [3, 2]


def test_the_last_phase_runs_to_max_seconds_and_phases_not_reached_are_recorded():
    """Bugs caught: the last phase ending early (on the previous phase's budget, or at its first check below its
    target), the overall limit not ending a budgeted phase, later phases run after the overall limit."""
    s = Stub()
    recs = s.run("factscpu:acc=0.9:steps=2,factscpumid:acc=0.9", max_seconds=30.0, check_every=2)
    assert [(r["family"], r["ended"]) for r in recs] == [("factscpu", "steps"), ("factscpumid", "max_seconds")]
    n = len(s.trained)
    assert s.t >= 30.0 and s.t - STEP_S - CHECK_S < 30.0, (s.t, n)             # ended at the first step past it
    assert recs[1]["steps"] == n - 2 and len(recs[1]["checks"]) == recs[1]["steps"] // 2
    s = Stub()
    recs = s.run("factscpu:s=100,factsnear:s=5,factscpumid", max_seconds=7.0, check_every=100)
    assert [(r["family"], r["ended"], r["steps"]) for r in recs] == \
        [("factscpu", "max_seconds", 5), ("factsnear", "not_reached", 0), ("factscpumid", "not_reached", 0)]
    s = Stub()
    recs = s.run("factscpu:steps=2,factscpumid", max_steps=5, check_every=100)
    assert [(r["ended"], r["steps"]) for r in recs] == [("steps", 2), ("max_steps", 3)]


def test_no_phase_starts_once_the_overall_limit_is_spent():
    """Bug caught: a phase that ends on its own budget at the moment the overall limit is spent hands over to a
    next phase that trains a step anyway (and, on the GPU, pays that family's compiles past --max-seconds)."""
    s = Stub()
    recs = s.run("factscpu:s=6,factsnear:s=5,factscpumid", max_seconds=7.5, check_every=100)  # both at 7.5 s
    assert [(r["family"], r["ended"], r["steps"]) for r in recs] == \
        [("factscpu", "s", 5), ("factsnear", "not_reached", 0), ("factscpumid", "not_reached", 0)]
    assert s.t == pytest.approx(5 * STEP_S)
    s = Stub()
    recs = s.run("factscpu:steps=2,factscpumid", max_steps=2, check_every=100)
    assert [(r["ended"], r["steps"]) for r in recs] == [("steps", 2), ("not_reached", 0)] and len(s.trained) == 2


# ---------------------------------------------------------------------------------------------- sft.json
def test_run_curriculum_trains_each_phases_family_and_records_it_for_sft_json(monkeypatch):
    """Bugs caught (grpo_h200.run_curriculum, what cmd_sft writes to sft.json): a phase trained on another
    family's problems or checked on another family's val split, the batch index restarting at the SFT's step
    instead of the phase's, the learning-rate warm-up reading the phase's step, a record that is not JSON, the
    curve's rows not naming the phase, phase 2 handed the wrong family, the last loss lost (sft.json's rows after the curriculum read
    NaN)."""
    seen, checked = [], []

    def step(share, lr, probs, k, at):
        seen.append((probs[0].id.split("-")[0], k, at))
        return 1.0 / at

    def forced(model, tok, module, probs):
        checked.append({p.id.split("-")[0] for p in probs} | {len(probs)})
        return {"all": 0.75 if probs[0].id.startswith("factscpu-") else 0.0}
    monkeypatch.setattr(grpo_h200, "forced_accuracy", forced)
    a = SimpleNamespace(curriculum="factscpu:acc=0.7:steps=10,factscpumid:acc=0.9:steps=3", val_problems=4,
                        max_seconds=1e9, max_steps=400, check_every=2, lr=1e-3)
    curve = []
    recs, train, nll = grpo_h200.run_curriculum(a, longctx, SimpleNamespace(model=None), None, step, curve, 0.0, 0)
    assert nll == pytest.approx(1 / 5)                     # the last step's loss (sft.json's final row reads it)
    assert seen == [("factscpu", 1, 1), ("factscpu", 2, 2), ("factscpumid", 1, 3), ("factscpumid", 2, 4),
                    ("factscpumid", 3, 5)]
    assert checked == [{"factscpu", 4}, {"factscpumid", 4}]
    assert train == longctx.problems("factscpumid", "train")
    rec = json.loads(json.dumps(recs))
    assert [(r["family"], r["steps"], r["ended"], [c["acc"] for c in r["checks"]]) for r in rec] == \
        [("factscpu", 2, "acc", [0.75]), ("factscpumid", 3, "steps", [0.0])]
    assert [(c["step"], c["phase"], c["val_pass@1"]) for c in curve] == \
        [(2, "curriculum:factscpu", 0.75), (4, "curriculum:factscpumid", 0.0)]


# ---------------------------------------------------------------------------------------------- the pipeline's spec
SH = os.path.join(os.path.dirname(__file__), "grpo_h200.sh")


def test_the_pipelines_default_spec_parses_and_a_bad_one_stops_the_run_before_anything_starts(tmp_path):
    """Bugs caught: a default H20_CURRICULUM the parser rejects (found 4-5 minutes into a GPU hold), a last phase
    with an accuracy target (its val problems are mostly near and mid: it could end the SFT with no far answer
    learned), a bad spec that the dry run / `go` does not refuse before it starts the server and the SFT."""
    spec = re.search(r"H20_CURRICULUM:-([^}]*)}", open(SH).read()).group(1)
    phases = curriculum.parse(spec, longctx.FAMILIES)
    assert [p.family for p in phases] == ["factsnear", "factsmid", "factssft"]
    assert all(p.seconds for p in phases[:-1]) and phases[-1] == curriculum.Phase("factssft")
    env = {**os.environ, "H20_WORK": str(tmp_path), "H20_TASK": "long", "PY": sys.executable,
           "H20_CURRICULUM": "factsnear:s=5,factsfar:acc=0.5", "H20_PORT": "30977"}
    r = subprocess.run(["bash", SH, "dry", "5"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown family 'factsfar'" in r.stderr, (r.returncode, r.stderr[-800:])
    assert "FAILED: H20_CURRICULUM" in r.stderr and not os.path.exists(tmp_path / "server.pid"), r.stdout[-800:]


def test_readme_probe_table_is_the_probes_files():
    """README.md's table of the GPU probes (`sft_probe` at three learning rates): every number from
    docs/results/sft_probe_h100/; a row edited by hand or left from an older run fails here."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "experiments", "h200", "README.md")).read()
    rows = re.findall(r"^\| ([\d.e-]+) \| (\d+) \| ([\d,]+) \| (\d+) \| (\d+) of (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      text.split("**The probe, run", 1)[1].split("\n\n", 2)[1], re.M)
    assert len(rows) == 3, rows
    for lr, steps, demos, secs, pos, n, best, last, loss in rows:
        with open(os.path.join(root, "docs", "results", "sft_probe_h100", f"sft_probe_lr{lr}.json")) as f:
            d = json.load(f)
        phase, acc = d["curriculum"][0], [c["acc"] for c in d["curriculum"][0]["checks"]]
        assert float(lr) == d["lr"] and int(steps) == phase["steps"] == d["steps"]
        assert int(demos.replace(",", "")) == phase["steps"] * d["batch"] and int(secs) == round(phase["seconds"])
        assert (int(pos), int(n)) == (sum(a > 0 for a in acc), len(acc))
        assert f"{max(acc):.2f}" == best and f"{sum(acc[-10:]) / 10:.2f}" == last
        assert f"{d['final']['nll']:.3f}" == loss


def test_readme_task_form_table_is_calibrate_long_json():
    """README.md's table of the near lookup by task form (`a=5` vs `#a5`): every "value (step)" it quotes is
    that run's check in calibrate_long.json; "(a-b)": every check from a to b."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "experiments", "h200", "README.md")).read()
    with open(os.path.join(root, "experiments", "h200", "calibrate_long.json")) as f:
        runs = json.load(f)["runs"]
    names = {("`a=5`", "16", "1234"): "near_dim128_lr1e-3_b16_2500",
             ("`a=5` (rerun)", "16", "1234"): "transfer_dim128_lr1e-3_b16",
             ("`#a5`", "16", "1234"): "oneback_transfer_dim128_lr1e-3_b16",
             ("`#a5`", "16", "1"): "oneback_near_dim128_lr1e-3_b16_seed1",
             ("`#a5`", "64", "1234"): "oneback_near_dim128_lr1e-3_b64"}
    rows = re.findall(r"^\| (`[^|]+) \| (\d+) \| (\d+) \| ([^|]+) \| [^|]+ \|$", text, re.M)
    assert {r[:3] for r in rows} == set(names), rows
    for form, batch, seed, quoted in rows:
        run = runs[names[form, batch, seed]]
        assert run["batch"] == int(batch) and run.get("seed", 1234) == int(seed)
        at = {c["step"]: c["near_lookup"] for c in run["arms"]["curriculum"]["curve"]}
        for value, a, b in re.findall(r"([\d.]+) \(([\d,]+)(?:-([\d,]+))?\)", quoted):
            lo, hi = int(a.replace(",", "")), int((b or a).replace(",", ""))
            got = [v for s, v in at.items() if lo <= s <= hi]
            assert got and all(f"{v:.2f}" == value for v in got), (form, batch, seed, value, lo, hi, got)
