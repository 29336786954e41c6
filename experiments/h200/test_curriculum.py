"""The SFT curriculum (experiments/h200/curriculum.py, `grpo_h200.py sft --curriculum`) with a fake clock and a
stub trainer: the spec's parsing, each way a phase ends, and the record sft.json keeps. No model runs here; the
long dry run (`H20_TASK=long bash experiments/h200/grpo_h200.sh dry`) runs it with one.
"""
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from experiments.h200 import curriculum, glance, grpo_h200, longctx

STEP_S = 1.5             # the fake clock's seconds per training step (the first hold: ~1.75 s a step)
CHECK_S = 0.5            # and per accuracy check
COMPILE_S = 40.0         # and the first step on a family, with `Stub(compile_s=COMPILE_S)` (its compiles)


class Stub:
    """A fake clock, a trainer that only counts (family, step within phase) and a check that reads its accuracy
    from `accs[family]` and its lookup share from `looks[family]` (lists, one value per check; the last
    repeats; no lookups given: each check's lookup share is 0)."""

    def __init__(self, accs=None, compile_s=0.0, looks=None):
        self.t, self.trained, self.accs, self.checked = 0.0, [], accs or {}, []
        self.compile_s, self.looks = compile_s, looks or {}

    def clock(self):
        return self.t

    def train_step(self, ph, k):
        self.t += STEP_S + (self.compile_s if k == 1 else 0.0)
        self.trained.append((ph.family, k))

    def accuracy(self, ph):
        self.t += CHECK_S
        self.checked.append(ph.family)
        n = sum(f == ph.family for f in self.checked) - 1
        acc, look = self.accs.get(ph.family, [0.0]), self.looks.get(ph.family, [0.0])
        return {"acc": acc[min(n, len(acc) - 1)], "look": look[min(n, len(look) - 1)]}

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
    assert curriculum.parse("factsnear:look=0.9:s=5,factssft", longctx.FAMILIES)[0] == \
        curriculum.Phase("factsnear", None, 5.0, None, 0.9)
    assert isinstance(got[1].steps, int)
    assert curriculum.parse(" factscpu ", longctx.FAMILIES) == [curriculum.Phase("factscpu")]
    bad = {"": "empty spec", "factsnear:s=5,,factssft": "phase 2 is empty", ":acc=0.5": "phase 1 is empty",
           "factsnear:s=5,factsfar:acc=1": "unknown family 'factsfar'",
           "factsnear:secs=5,factssft": "unknown key 'secs=5'", "factsnear:acc,factssft": "unknown key 'acc'",
           "factsnear:acc=high:s=5,factssft": "bad number acc='high'", "factsnear:acc=1.5:s=5,factssft": "acc='1.5'",
           "factsnear:look=2:s=5,factssft": "look='2' \\(must be in \\[0, 1\\]\\)",
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
    assert [(r["family"], r["steps"], r["ended"]) for r in recs] == [("factscpu", 6, "target"), ("factscpumid", 9, "target")]
    assert [c["step"] for c in recs[0]["checks"]] == [3, 6] and [c["acc"] for c in recs[1]["checks"]] == [0.1, 0.3, 0.5]
    assert s.trained == [("factscpu", k) for k in range(1, 7)] + [("factscpumid", k) for k in range(1, 10)]
    assert recs[0]["seconds"] == pytest.approx(6 * STEP_S + 2 * CHECK_S, abs=0.1)
    s = Stub({"factscpumid": [0.1, 0.5]})                       # a phase before it ends off the check grid
    recs = s.run("factscpu:acc=0.6:steps=4,factscpumid:acc=0.5", check_every=3)
    assert [(r["steps"], r["ended"], [c["step"] for c in r["checks"]]) for r in recs] == \
        [(4, "steps", [3]), (6, "target", [3, 6])]


def test_a_lookup_target_ends_a_phase_alone_or_together_with_acc():
    """Bugs caught (the `look=` key, issue 42: the near phase hands over once the lookup is learned, not the whole
    chain, which the CPU learned ~300 steps later): the lookup share compared with the acc target or not at all,
    a phase with both targets ending on the first one reached, the checks not recording both shares."""
    s = Stub({"factscpu": [0.0, 0.1, 0.2]}, looks={"factscpu": [0.5, 0.9, 0.95]})
    recs = s.run("factscpu:look=0.9:steps=50,factscpumid:steps=1", check_every=2)
    assert (recs[0]["steps"], recs[0]["ended"], recs[0]["look_target"]) == (4, "target", 0.9)
    assert recs[0]["checks"][1] == {"step": 4, "acc": 0.1, "look": 0.9, "time_s": recs[0]["checks"][1]["time_s"]}
    assert recs[0]["why"] == "look 0.9 >= 0.9 at step 4"
    s = Stub({"factscpu": [0.0, 0.1, 0.2, 0.3]}, looks={"factscpu": [0.5, 0.9, 0.95]})
    recs = s.run("factscpu:acc=0.3:look=0.9:steps=50,factscpumid:steps=1", check_every=2)
    assert (recs[0]["steps"], recs[0]["ended"]) == (8, "target") and "acc 0.3 >= 0.3 and look" in recs[0]["why"]
    s = Stub({"factscpu": [0.9]}, looks={"factscpu": [0.1]})
    recs = s.run("factscpu:look=0.5:steps=6,factscpumid:steps=1", check_every=2)
    assert (recs[0]["steps"], recs[0]["ended"]) == (6, "steps")                  # acc alone is not the target


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
        first = probs[0].id.startswith("factscpu-")
        return {"all": 0.75 if first else 0.0, "lookup": 0.8 if first else 0.1}
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
        [("factscpu", 2, "target", [0.75]), ("factscpumid", 3, "steps", [0.0])]
    assert [c["look"] for r in rec for c in r["checks"]] == [0.8, 0.1]
    assert [(c["step"], c["phase"], c["val_pass@1"]) for c in curve] == \
        [(2, "curriculum:factscpu", 0.75), (4, "curriculum:factscpumid", 0.0)]


# ---------------------------------------------------------------------------------------------- the pipeline's spec
SH = os.path.join(os.path.dirname(__file__), "grpo_h200.sh")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout


def readme() -> str:
    """experiments/h200/README.md, whose quoted numbers the tests below check against their files."""
    with open(os.path.join(ROOT, "experiments", "h200", "README.md")) as f:
        return f.read()


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
    text = readme()
    rows = re.findall(r"^\| ([\d.e-]+) \| (\d+) \| ([\d,]+) \| (\d+) \| (\d+) of (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      text.split("**The probe, run", 1)[1].split("\n\n", 2)[1], re.M)
    assert len(rows) == 3, rows
    for lr, steps, demos, secs, pos, n, best, last, loss in rows:
        with open(os.path.join(ROOT, "docs", "results", "sft_probe_h100", f"sft_probe_lr{lr}.json")) as f:
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
    text = readme()
    with open(os.path.join(ROOT, "experiments", "h200", "calibrate_long.json")) as f:
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


def test_readme_gpu_near_phase_is_its_sft_json():
    """README.md's paragraph on the near phase's first GPU run quotes the comparison hold's warm/sft.json (steps,
    seconds, checks, the mid phase, the final check) and the CPU run it is read against (calibrate_long.json):
    a number edited by hand, or left from another run, fails here."""
    text = readme()
    para = text.split("**The near phase on a GPU (2026-12-07", 1)[1].split("\n\n", 1)[0]
    with open(os.path.join(ROOT, "docs", "results", "async_compare_long_h100", "warm", "sft.json")) as f:
        d = json.load(f)
    near, mid, sft = d["curriculum"]
    acc = [c["acc"] for c in near["checks"]]
    fin = d["final"]["val_forced_by_class"]
    quoted = [f"{near['steps']}\nsteps in {near['seconds']} s**", f"(the first {near['first_step_s']} s",
              f"at {sum(a > 0 for a in acc)} of {len(acc)} checks", f"**{max(acc):.2f} at best** and {acc[-1]:.2f} at the last",
              f"got the {mid['seconds']} s left", f"{mid['steps']}\nsteps (its first {mid['first_step_s']} s), check "
              f"{mid['checks'][-1]['acc']:.2f}", f"0.03\n(far {fin['far']:.2f}, mid {fin['mid']:.2f}, near {fin['near']:.2f}), "
              f"P(worked) {d['final']['p_worked']:.2f}", f"lr {d['lr']:.0e}, batch {d['batch']}".replace("e-04", "e-4")]
    flat = " ".join(para.split())
    missing = [q for q in quoted if " ".join(q.split()) not in flat]
    assert not missing, missing
    assert f"{fin['all']:.2f}" == "0.03" and sft["ended"] == "not_reached" and d["curriculum_spec"] in flat
    with open(os.path.join(ROOT, "experiments", "h200", "calibrate_long.json")) as f:
        cpu = {c["step"]: c for c in json.load(f)["runs"]["oneback_near_dim128_lr1e-3_b64"]["arms"]["curriculum"]["curve"]}
    cpu_quoted = (f"{cpu[300]['near']:.2f} at step 300 and {cpu[350]['near']:.2f} at 350, while its lookup share was "
                  f"already {cpu[300]['near_lookup']:.2f} and {cpu[350]['near_lookup']:.2f}; its whole chain reached "
                  f"{cpu[600]['near']:.2f} only at step 600")
    assert cpu_quoted in flat, cpu_quoted
    with open(os.path.join(ROOT, "docs", "results", "async_compare_long_h100", "run_sync", "metrics.jsonl")) as f:
        ev0 = next(r for r in map(json.loads, f) if r.get("kind") == "eval" and r["step"] == 0)
    assert f"pass@1 at step 0 was {ev0['pass@1']:.3f}" in flat


def test_readme_long_hold_h100_is_its_files():
    """README.md's section on the first long hold (2026-12-07, H100) quotes docs/results/long_hold_h100/: the SFT's
    phases (sft.json), the step-0 eval (run/metrics.jsonl), step 1's per-token live values by band
    (run/live_tokens/step_0001.pt, banded here from qpos as instruments.bands does) and the parity rows
    (parity.json). A number edited by hand, or left from another run, fails here."""
    import torch
    res = os.path.join(ROOT, "docs", "results", "long_hold_h100")
    text = readme()
    flat = " ".join(text.split("### The long hold, first run (2026-12-07", 1)[1].split("\n### ", 1)[0].split())
    with open(os.path.join(res, "sft.json")) as f:
        d = json.load(f)
    near, mid, sft = d["curriculum"]
    nl, ml = [c["look"] for c in near["checks"]], [c["look"] for c in mid["checks"]]
    fin = d["final"]["val_forced_by_class"]
    with open(os.path.join(res, "run", "metrics.jsonl")) as f:
        ev0 = next(r for r in map(json.loads, f) if r.get("kind") == "eval" and r["step"] == 0)
    t = torch.load(os.path.join(res, "run", "live_tokens", "step_0001.pt"), weights_only=False)
    g, fl, q = t["gap"].abs().double(), t["floor_fp8"].double(), t["qpos"]
    lo, hi = (q < 128), (q >= 2048)
    assert not ((q >= 128) & (q < 2048)).any()                      # "none between"
    with open(os.path.join(res, "parity.json")) as f:
        p = json.load(f)
    inr, past = p["by_eos_table"]
    over = [b["over_share"] for b in p["shared_expert_over_limit"]]
    quoted = [f"`factsnear` ran {near['steps']} steps in {near['seconds']} s (its first {near['first_step_s']} s",
              f"lookup share {max(nl):.2f} at best over {len(nl)} checks and {nl[-1]:.2f} at the last",
              f"`factsmid` ran {mid['steps']} steps in {mid['seconds']} s, lookup {max(ml):.2f} at best",
              f"near {fin['near']:.2f} (lookup {fin['near_lookup']:.2f}), mid and far {fin['mid']:.2f}, "
              f"P(worked) {d['final']['p_worked']:.2f}",
              f"pass@1 at step 0: {ev0['pass@1']:.3f} (SE {ev0['pass@1_se']:.3f})",
              f"live values ({len(g)} scored tokens)", f"floor (SGLang's FP8 index scores) {fl.mean():.5f} a token",
              f"the gap {g.mean():.4f}: **{g.mean() / fl.mean():.1f}x the floor**",
              f"positions < 128, {int(lo.sum())} tokens (share {lo.double().mean():.2f}",
              f"{g[lo].mean() / fl[lo].mean():.1f}x; >= 2048, {int(hi.sum())} tokens (share {hi.double().mean():.2f}), "
              f"{g[hi].mean() / fl[hi].mean():.1f}x",
              f"({p['samples']} samples of {p['seq_len_min']:,}-{p['seq_len_max']:,} tokens",
              f"the {inr['tokens']} response tokens before the first EOS nanoflash bf16 is {inr['bf16']:.4f} from SGLang "
              f"against a floor of {inr['floor_qat8_vs_bf16']:.5f}, **{inr['bf16'] / inr['floor_qat8_vs_bf16']:.1f}x**",
              f"past the EOS ({past['tokens']:,} tokens) {past['bf16'] / past['floor_qat8_vs_bf16']:.1f}x",
              f"own prefill: {inr['server_decode_vs_prefill']:.5f}",
              f"FP8 index scores: {inr['bf16_fp8_index_scores']:.4f}", f"planted mHC bug {inr['bf16_planted_comb_bug']:.3f}",
              f"at {100 * over[0]:.1f}% of positions < 64 and {100 * min(over[1:]):.1f}-{100 * max(over[1:]):.2f}%"]
    missing = [s for s in quoted if " ".join(s.split()) not in flat]
    assert not missing, missing
    assert d["sft_s"] > 0 and sft["ended"] == "not_reached" and near["why"].startswith("seconds budget")


def _hold_section(results: str, nth: str):
    """A long hold's files and README section: (docs/results/<results>, the section's text on one line, sft.json)."""
    res = os.path.join(ROOT, "docs", "results", results)
    flat = " ".join(readme().split(f"### The long hold, {nth} run (2026-12-07", 1)[1].split("\n### ", 1)[0].split())
    with open(os.path.join(res, "sft.json")) as f:
        return res, flat, json.load(f)


def _sft_parts(d: dict):
    """sft.json's curriculum phases, the last phase's chain accuracies, the glance steps' P(worked), the final check."""
    sft = d["curriculum"][-1]
    return (d["curriculum"], [c["acc"] for c in sft["checks"]],
            [c["p_worked"] for c in d["curve"] if c.get("phase") == "glance"], d["final"]["val_forced_by_class"])


def test_readme_long_hold2_h100_is_its_files():
    """README.md's section on the second long hold (2026-12-07, H100) quotes docs/results/long_hold2_h100/: the
    SFT's phases and glance steps (sft.json), the step-0 eval (run/metrics.jsonl) and step 1's per-token live
    values by band (run/live_tokens/step_0001.pt, banded from qpos as instruments.bands does)."""
    import torch
    res, flat, d = _hold_section("long_hold2_h100", "second")
    (near, mid, sft), acc, glance, fin = _sft_parts(d)
    with open(os.path.join(res, "run", "metrics.jsonl")) as f:
        ev0 = next(r for r in map(json.loads, f) if r.get("kind") == "eval" and r["step"] == 0)
    t = torch.load(os.path.join(res, "run", "live_tokens", "step_0001.pt"), weights_only=False)
    g, fl, q = t["gap"].abs().double(), t["floor_fp8"].double(), t["qpos"]
    bands = [(q < 128), (q >= 128) & (q < 2048), (q >= 2048)]
    quoted = [f"handover at step {near['steps']} (lookup {near['checks'][-1]['look']:.2f}, {near['seconds']} s)",
              f"(lookup {mid['checks'][0]['look']:.2f} at step {mid['checks'][0]['step']})",
              f"`factssft` ran {sft['steps']} steps to the SFT's 300 s, lookup "
              f"{min(c['look'] for c in sft['checks']):.2f} at every check, the whole chain {min(acc):.2f}-{max(acc):.2f}",
              f"in its {len(glance)} steps P(worked) went {glance[0]:.2f}, {glance[-3]:.2f}, {glance[-2]:.2f}, then "
              f"{glance[-1]:.2f}",
              f"lookup {fin['lookup']:.2f} (far {fin['far_lookup']:.2f}), whole chain {fin['all']:.2f}",
              f"pass@1 at step 0: {ev0['pass@1']:.3f} (SE {ev0['pass@1_se']:.3f})",
              f"({len(g)} scored tokens", f"the gap {g.mean():.4f} against the FP8 floor {fl.mean():.4f}, "
              f"**{g.mean() / fl.mean():.2f}x**"]
    for m, name in zip(bands, ("< 128", "128-2047", ">= 2048")):
        quoted.append(f"{name}, {int(m.sum())} tokens (share {m.double().mean():.2f}), ")
        quoted.append(f"{g[m].mean() / fl[m].mean():.2f}x")
    far = []                                     # per hold: (far sequences, sequences) of step 1's trained batch
    for r in ("long_hold2_h100", "long_hold_h100"):
        u = torch.load(os.path.join(ROOT, "docs", "results", r, "run", "live_tokens", "step_0001.pt"), weights_only=False)
        first = u["qpos"][u["pos"] == 0]                # a sequence's first scored token
        far.append((int((first >= 2048).sum()), len(first)))
    quoted.append(f"step 1 trained {far[0][0]} of its {far[0][1]} sequences in the far class (positions >= 2048) "
                  f"in this hold and {far[1][0]} of {far[1][1]} in the first")
    r1 = re.search(r"rollout 1/\d+ round 1: (\d+) prompts sent.*\((\d+) all 0\)", open(os.path.join(res, "pipeline.log")).read())
    quoted.append(f"(this step's first round: {r1.group(2)} of {r1.group(1)} groups, all 0)")
    missing = [s for s in quoted if " ".join(s.split()) not in flat]
    assert not missing, missing
    assert near["ended"] == mid["ended"] == "target" and sft["ended"] == "max_seconds" and d["lr"] == 1e-4


def test_readme_width_lr_table_is_calibrate_long_json():
    """README.md's "Width and learning rate" table: every lookup share, the first step at >= 0.5, the sft_mid
    shares, the loss and seconds from calibrate_long.json's oneback_near_dim256_lr*_b16 runs."""
    text = readme()
    with open(os.path.join(ROOT, "experiments", "h200", "calibrate_long.json")) as f:
        runs = json.load(f)["runs"]
    block = text.split("**Width and learning rate (2026-12-07", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| (1e-\d|3e-\d) \| ([\d. ]+) \| (\d+) \| ([\d.]+) / ([\d.]+) \| ([\d.]+) \| (\d+) \|$", block, re.M)
    assert [r[0] for r in rows] == ["1e-4", "3e-4", "1e-3"], rows
    for lr, shares, first, mid400, mid800, loss, secs in rows:
        run = runs[f"oneback_near_dim256_lr{lr}_b16"]
        assert run["lr"] == float(lr) and run["batch"] == 16 and run["model"]["dim"] == 256
        curve = {c["step"]: c for c in run["arms"]["curriculum"]["curve"]}
        assert shares.split() == [f"{curve[s]['near_lookup']:.2f}" for s in range(100, 900, 100)]
        assert int(first) == min(s for s, c in curve.items() if c["near_lookup"] >= 0.5)
        assert (mid400, mid800) == (f"{curve[400]['mid_lookup']:.2f}", f"{curve[800]['mid_lookup']:.2f}")
        assert loss == f"{curve[800]['nll']:.3f}" and int(secs) == round(run["arms"]["curriculum"]["train_s"])


def _time_column(text: str, header: str, results: str):
    """README's time table column `header` ({phase: cell}), and from docs/results/<results>/: the seconds between
    two pipeline.log stamps (gap), sft.json, and run/metrics.jsonl's records by kind."""
    import datetime
    res = os.path.join(ROOT, "docs", "results", results)
    head = text.index("| phase | run 9 (measured) |")
    rows = [[c.strip() for c in r.strip("|").split(" | ")] for r in text[head:text.index("\n\n", head)].split("\n")]
    j = rows[0].index(header)
    col = {r[0]: r[j] for r in rows[2:]}
    stamps = {}
    for line in open(os.path.join(res, "pipeline.log")):
        m = re.match(r"=== (\d\d:\d\d:\d\d) (knobs|server up|sft|train|report|parity|done)\b", line)
        if m:
            stamps.setdefault(m.group(2), datetime.datetime.strptime(m.group(1), "%H:%M:%S"))
    with open(os.path.join(res, "sft.json")) as f:
        d = json.load(f)
    with open(os.path.join(res, "run", "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return col, lambda a, b: round((stamps[b] - stamps[a]).total_seconds()), d, recs


def _first(recs: list, kind: str) -> dict:
    return next(r for r in recs if r["kind"] == kind)


HOLD_COLUMNS = [  # (header, docs/results folder, its "report, parity" cell's parity: from the stamps or not run)
    ("the first long hold (2026-12-07, H100, measured)", "long_hold_h100", True),
    ("the second long hold (2026-12-07, H100, measured; compile caches carried)", "long_hold2_h100", False),
    ("the third long hold (2026-12-07, H100, measured; compile caches carried)", "long_hold3_h100", True)]


@pytest.mark.parametrize("header,results,parity", HOLD_COLUMNS)
def test_readme_time_table_hold_columns_are_their_files(header, results, parity):
    """The time table's columns for the long holds: the phases from pipeline.log's stamps (knobs -> server up,
    sft -> train, report -> parity -> done), the SFT and save from sft.json, start-up and the step-0 eval from
    metrics.jsonl."""
    col, gap, d, recs = _time_column(readme(), header, results)
    assert col["SGLang's HTTP up before the SFT starts (`server_up`; the first hold: SGLang died of the SFT's memory)"] \
        == f"{gap('knobs', 'server up')} s (the same stamps)"
    assert col["SFT + save"] == (f"{gap('sft', 'train')} s (the `sft` stamp to `train`; sft.json: SFT {d['sft_s']} s, "
                                 f"save {d['save_s']} s)")
    assert col["GRPO start-up"] == f"{_first(recs, 'startup')['total_s']:.1f} s"
    assert col["eval points"] == ", ".join(f"step {r['step']}: {r['eval_s']:.1f} s" for r in recs if r["kind"] == "eval")
    steps = [r["step_s"] for r in recs if r["kind"] == "train"]
    if steps:                                    # the holds whose GRPO made steps
        mean = sum(steps) / len(steps)
        assert col["GRPO steps"].startswith(f"{len(steps)} x {mean:.1f} s = {len(steps) * mean:.0f} s")
    done = f"{gap('parity', 'done')} s (the stamps)" if parity else "- (not collected)"
    assert col["report, parity"] == f"{gap('report', 'parity')} s, {done}"


def test_readme_deadline_reserve_and_carried_caches_are_the_scripts_and_files():
    """The deadline's reserve in grpo_h200.sh is the one the README gives; the prose on the carried compile caches
    quotes the two holds' step-0 evals and start-ups."""
    flat = " ".join(readme().split())
    sh = open(os.path.join(ROOT, "experiments", "h200", "grpo_h200.sh")).read()
    assert '[ "$MODE" = gpu ] && dl=$(hold_left $(deadline_reserve))' in sh                    # grpo_run's
    reserve, bare = re.search(r'\[ "\$\{H20_PARITY:-1\}" = 1 \] && echo (\d+) \|\| echo (\d+)', sh).groups()
    assert f"has only {reserve} s left, for the report" in flat and f"keeps {reserve} s for the report" in flat
    assert f"the deadline then keeps {bare} s (`deadline_reserve`)" in flat
    *_, third = _time_column(readme(), *HOLD_COLUMNS[2][:2])
    train = [r for r in third if r["kind"] == "train"]
    warm = next(r for r in third if r["kind"] == "eval_warm" and r["step"] > 0)
    assert (f"took **{sum(r['step_s'] for r in train) / len(train):.1f} s a step**, the live checks "
            f"{sum(r['live_s'] for r in train) / len(train):.1f} s of it") in flat
    assert f"({warm['warm_eval_s']:.1f} s at step {warm['step']})" in flat
    first, second = ({k: _first(recs, k) for k in ("eval", "startup")}
                     for _, _, _, recs in (_time_column(readme(), h, r) for h, r, _ in HOLD_COLUMNS[:2]))
    assert (f"its step-0 eval took {second['eval']['eval_s']:.1f} s ({first['eval']['eval_s']:.1f} s without them) "
            f"and GRPO started in {second['startup']['total_s']:.1f} s ({first['startup']['total_s']:.1f} s)") in flat


def _logit_steps(moves: list, z0: float, lr: float):
    """A fake glance step: P(worked)'s logit falls by moves[k] x rate / lr at step k (the last move repeats),
    starting at z0; returns P(worked) rounded as cmd_sft's check rounds it."""
    state = {"z": z0, "k": 0}

    def step(rate):
        state["z"] -= moves[min(state["k"], len(moves) - 1)] * rate / lr
        state["k"] += 1
        return round(1.0 / (1.0 + math.exp(-state["z"])), 4)
    return step


def test_glance_lands_in_the_band_on_the_second_holds_trajectory():
    """glance.run on the second long hold's glance phase (docs/results/long_hold2_h100/sft.json, lr 3e-5): a fake
    whose logit moves reproduce that trajectory at the fixed rate (checked: the same six rounded values, down to
    0.0634) lands at P(worked) 0.2-0.6 with the rates cut. Bug caught: the fixed rate's overshoot (0.70 -> 0.06)."""
    with open(os.path.join(ROOT, "docs", "results", "long_hold2_h100", "sft.json")) as f:
        d = json.load(f)
    seen = [c["p_worked"] for c in d["curve"] if c.get("phase") == "glance"]
    z = [glance.logit(p) for p in seen[2:]]                           # the first two round to 1.0: no logit
    moves = [4.5] * 3 + [z[i] - z[i + 1] for i in range(len(z) - 1)]   # 4.5: keeps steps 1-2 at 1.0 when rounded
    lr, z0 = d["glance_lr"], z[0] + 3 * 4.5
    fixed = _logit_steps(moves, z0, lr)
    assert [fixed(lr) for _ in seen] == seen
    got = []
    step = _logit_steps(moves, z0, lr)
    ending, k, rates = glance.run(lambda r: got.append(step(r)) or got[-1], lr, 0.6, 0.25, 60)
    assert ending == "worked_max" and 0.2 <= got[-1] <= 0.6 and k == len(seen), (got, rates)
    assert rates[:-1] == [lr] * (k - 1) and rates[-1] < lr / 2                  # only the step across the mark slows
    assert (f"the last step runs at ~{rates[-1] / lr:.1f} of the rate and lands at {got[-1]:.2f}"
            in " ".join(readme().split()))


def test_glance_rate_rule_and_endings():
    """next_rate: the full rate without progress or when the last move predicts a short way; GAIN of the distance
    left otherwise; run's endings (seconds by a fake clock, steps) and its refusal of a target above the mark."""
    lr = 1e-4
    assert glance.next_rate(lr, lr, 1.0, 1.0, 0.25) == lr                 # clipped: no move seen
    assert glance.next_rate(lr, lr, 0.9, 0.95, 0.25) == lr                # moved the wrong way
    zt = glance.logit(0.25)
    got = glance.next_rate(lr, lr / 2, 0.9, 0.7, 0.25)
    want = lr / 2 * glance.GAIN * (glance.logit(0.7) - zt) / (glance.logit(0.9) - glance.logit(0.7))
    assert got == pytest.approx(min(lr, want))
    ticks = iter(range(0, 1000, 10))
    assert glance.run(lambda r: 0.99, lr, 0.6, 0.25, 60, max_seconds=25, clock=lambda: next(ticks))[:2] == ("seconds", 3)
    assert glance.run(lambda r: 0.99, lr, 0.6, 0.25, 4)[:2] == ("steps", 4)
    with pytest.raises(ValueError, match="target P\\(worked\\) 0.7"):
        glance.run(lambda r: 0.5, lr, 0.6, 0.7, 4)


def test_readme_long_hold3_h100_is_its_files():
    """README.md's section on the third long hold (2026-12-07, H100) quotes docs/results/long_hold3_h100/: the
    SFT's phases and glance steps (sft.json), the run's steps, time, evals and bars (run/metrics.jsonl through
    runstats.summarize, as the report computes them), the jump steps' tokens (run/live_tokens/step_NNNN.pt) and
    the parity rows (parity.json; run 9's and the first hold's for the past-EOS comparison)."""
    import torch
    from instruments import runstats
    res, flat, d = _hold_section("long_hold3_h100", "third")
    (near, mid, sft), acc, glance, fin = _sft_parts(d)
    with open(os.path.join(res, "run", "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    train = [r for r in recs if r["kind"] == "train"]
    ev = {r["step"]: r for r in recs if r["kind"] == "eval"}
    warm = next(r for r in recs if r["kind"] == "eval_warm" and r["step"] > 0)
    s = runstats.summarize(recs)
    mean = lambda k: sum(r[k] for r in train) / len(train)  # noqa: E731
    b = s["bands"]
    quoted = [f"`factsnear` handed over at step {near['steps']} (lookup {near['checks'][-1]['look']:.2f}, "
              f"{near['seconds']} s), `factsmid` at step {mid['steps']} (lookup {mid['checks'][-1]['look']:.2f})",
              f"`factssft` ran {sft['steps']} steps to the SFT's 300 s, lookup "
              f"{min(c['look'] for c in sft['checks']):.2f} or more at every check, the whole chain "
              f"{min(acc):.2f}-{max(acc):.2f}",
              f"{len(glance)} steps, P(worked) {glance[0]:.2f} ... {glance[-3]:.2f}, {glance[-2]:.2f}, then "
              f"{glance[-1]:.2f}, the last step at {d['glance_rates'][-1] / d['glance_lr']:.2f} of the glance rate",
              f"lookup {fin['lookup']:.2f} (far {fin['far_lookup']:.2f}), whole chain {fin['all']:.2f}",
              f"pass@1 at step 0: {ev[0]['pass@1']:.3f} (SE {ev[0]['pass@1_se']:.3f})",
              f"GRPO made {len(train)} steps", f"{s['pushes_verified']} of {s['pushes']} pushes verified",
              f"the trainer's peak {max(r['gpu_peak_gib'] for r in train):.1f} GiB",
              f"the GPU {max(r['gpu_used_total_gib'] for r in train):.1f} GiB in use at most",
              f"A step took {mean('step_s'):.1f} s: waiting for the rollout {mean('rollout_wait_s'):.1f} s, the "
              f"trainer's part {mean('train_s'):.1f} s, of which the live checks {mean('live_s'):.1f} s and the old "
              f"log-probs {mean('logprobs_s'):.1f} s, the push {mean('sync_s'):.1f} s, the probe {mean('probe_s'):.1f} s",
              f"mean |dlogp| {s['gap_mean']:.4f} against the FP8 floor {s['floor_mean']:.4f} on the same tokens, "
              f"**{s['gap_over_floor']:.2f}x**",
              f"(step 1: {train[0]['band_c4_topk_share']:.2f})",
              f"at step 12, the warm start re-evaluated there {warm['warm_pass@1']:.3f}, a gain of "
              f"{warm['gain_pass@1']:.3f} (SE {warm['gain_se']:.3f})",
              f"held-out pass@1 {ev[12]['pass@1']:.3f} (SE {ev[12]['pass@1_se']:.3f})",
              f"rewards {min(r['reward_mean'] for r in train):.2f}-{max(r['reward_mean'] for r in train):.2f} a step"]
    for name, key in (("< 128", "window"), ("128-2047", "c4_all"), (">= 2048", "c4_topk")):
        star = "**" if key == "c4_topk" else ""
        quoted.append(f"{name}, {b[key]['tokens']:,} tokens (share {star}{b[key]['share']:.2f}{star}), "
                      f"{b[key]['gap_over_floor']:.2f}x")
        assert b[key]["excess_drift"]["ci95"][0] <= 0 <= b[key]["excess_drift"]["ci95"][1]      # "containing 0"
    assert b["share_c4_topk"] >= 0.5
    jumps = [train[i]["step"] for i in s["context"]["excess_jumps"]["over_at"]]
    assert jumps == [7, 16]
    j7, j16 = (next(r for r in train if r["step"] == k) for k in jumps)
    quoted += [f"step 7, downwards (one token's floor at {j7['floor_max']:.2f} nats, the gap / floor "
               f"{j7['gap_over_floor']:.2f}x that step)", f"gap {j16['gap_mean']:.4f} against floor {j16['floor_mean']:.4f}"]
    t = torch.load(os.path.join(res, "run", "live_tokens", "step_0016.pt"), weights_only=False)
    g, fl = t["gap"].abs().double(), t["floor"].double()
    big = g > 1.0
    assert set(t["pos"][big].tolist()) == {1} and set(t["token"][big].tolist()) == {19} and (t["gap"][big] < 0).all()
    assert len(set(t["qpos"][big].tolist())) == 1
    quoted += [f"{['One', 'Two', 'Three', 'Four', 'Five'][int(big.sum()) - 1]} tokens carry it",
               f"scored by the query at position {int(t['qpos'][big][0]):,}, where nanoflash's log-probability is "
               f"{g[big].mean():.2f} nats below SGLang's decode and {t['prefill_gap'][big].abs().mean():.2f} below "
               f"SGLang's prefill, with an FP8 floor of {fl[big].mean():.3f}",
               f"Without them the step is {g[~big].mean() / fl[~big].mean():.2f}x its floor"]
    t = torch.load(os.path.join(res, "run", "live_tokens", "step_0017.pt"), weights_only=False)
    off = ((t["gap"].abs() > 1.0) & (t["floor"] < 0.1)).nonzero()[:, 0]     # far from SGLang, not from FP8
    assert len(off) == 1, off
    k = int(off[0])
    quoted.append(f"(position {int(t['pos'][k])}, query {int(t['qpos'][k]):,}: {abs(float(t['gap'][k])):.2f} nats, "
                  f"floor {float(t['floor'][k]):.3f})")
    assert int(t["gap"].abs().argmax()) != k       # the step's largest |gap| is a token its floor explains
    a1, a3 = s["indexer_agreement"]["layer_1"], s["indexer_agreement"]["layer_3"]
    quoted += [f"{a1['positions']} positions in each C4 layer: overlap {a1['overlap_mean']:.3f} / "
               f"{a3['overlap_mean']:.3f} (layers 1 / 3), identical sets at {100 * a1['identical_share']:.1f}% / "
               f"{100 * a3['identical_share']:.1f}% of positions, {a1['swapped_mean']:.1f} / {a3['swapped_mean']:.1f} of 512"]
    assert a1["positions"] == a3["positions"]
    with open(os.path.join(res, "parity.json")) as f:
        p = json.load(f)
    past = p["by_eos_table"][1]
    far = next(r for r in p["by_band"] if r["band"] == "c4_topk")
    with open(os.path.join(ROOT, "experiments", "h200", "run9", "parity.json")) as f:
        r9 = next(r for r in json.load(f)["by_eos"] if r["part"] == "past_eos")
    with open(os.path.join(ROOT, "docs", "results", "long_hold_h100", "parity.json")) as f:
        h1 = json.load(f)["by_eos_table"][1]
    quoted += [f"({p['samples']} samples of {p['seq_len_min']:,}-{p['seq_len_max']:,} tokens)",
               f"nanoflash bf16 is {p['bf16']['mean']:.4f} from SGLang against the FP8 floor "
               f"{p['floor_qat8_vs_bf16']['mean']:.4f} (FP8 index scores; {p['floor_qat_vs_bf16']['mean']:.4f} with FP4), "
               f"**{p['bf16']['mean'] / p['floor_qat8_vs_bf16']['mean']:.2f}x**",
               f"every prompt length's row at "
               f"{max(r['bf16'] / r['floor_qat8_vs_bf16'] for r in p['by_length']):.2f}x its floor or less",
               f"Past the EOS {past['bf16']:.4f} against {past['floor_qat8_vs_bf16']:.4f} "
               f"({past['bf16'] / past['floor_qat8_vs_bf16']:.2f}x)",
               f"run 9 ({r9['bf16'] / r9['floor_qat_vs_bf16']:.1f}x) and of the first run "
               f"({h1['bf16'] / h1['floor_qat8_vs_bf16']:.1f}x)",
               f"passed at {100 * max(o['over_share'] for o in p['shared_expert_over_limit']):.2f}% of positions at most",
               f"the clamp row equals bf16 ({p['bf16_shared_expert_no_clamp']['mean']:.4f})",
               f"moved the past-EOS gap from {r9['bf16']:.4f} to {r9['bf16_shared_expert_clamp']:.4f}",
               f"FP8 index scores {p['bf16_fp8_index_scores']['mean']:.4f}",
               f"at >= 2048, {far['bf16_no_c128_entries'] / far['floor_qat8_vs_bf16']:.2f}x the floor",
               f"the planted mHC bug {far['bf16_planted_comb_bug'] / far['floor_qat8_vs_bf16']:.1f}x"]
    assert abs(p["bf16_shared_expert_no_clamp"]["mean"] - p["bf16"]["mean"]) < 1e-4
    missing = [q for q in quoted if " ".join(q.split()) not in flat]
    assert not missing, missing
    assert near["ended"] == mid["ended"] == "target" and sft["ended"] == "max_seconds" and len(train) == 17
