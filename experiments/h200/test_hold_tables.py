"""A long hold's bars table (`scripts/hold_tables.py`): every `HOLD_TABLE` block of experiments/h200/README.md is
what the script renders from that hold's files, and each row's verdict flips exactly at issue 42's bar.

Bugs caught: a table edited by hand or left from an older run; a bar's comparison inverted or off at its edge
(40 steps, share 0.5, 1.2x, the drift's CI at 0, 3 SE, +0.15); a jump seen only in a band dropped; SGLang's
agreement claimed for a run that did not read it.

Run: `pytest experiments/h200/test_hold_tables.py -q`.
"""
import copy
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD3 = os.path.join(ROOT, "docs", "results", "long_hold3_h100")


def script():
    from scripts import hold_tables   # the repository root is on the path (conftest.py)
    return hold_tables


def test_every_hold_table_in_the_readme_is_rendered_from_its_files():
    mod = script()
    names = re.findall(r"<!-- HOLD_TABLE:(\S+) ", open(mod.DOC).read())
    assert "long_hold3_h100" in names
    for name in names:
        block = mod.read_block(mod.DOC, mod.markers(name))
        want = mod.table(mod.load(os.path.join(ROOT, "docs", "results", name)))
        assert block.strip() == want, f"run scripts/hold_tables.py docs/results/{name} --write-docs"


def _verdicts(mod, monkeypatch, edit) -> dict:
    """bar -> met, for hold 3's summary edited by `edit(summary)`."""
    from instruments import runstats
    recs = mod.load(HOLD3)
    base = runstats.summarize(recs)
    s = copy.deepcopy(base)
    edit(s)
    monkeypatch.setattr(runstats, "summarize", lambda _: s)
    return {bar.split(":")[0].split(" >=")[0]: ok for bar, _, ok in mod.bar_rows(recs)}


def test_each_verdict_flips_at_its_bar(monkeypatch):
    mod = script()
    v = _verdicts(mod, monkeypatch, lambda s: None)
    assert [v[k] for k in ("GRPO steps", "scored tokens at", "mean \\|dlogp\\| / FP8 floor <= 1.2x, overall",
                           "every push verified")] == [False, True, True, True]

    def at(**kw):
        def edit(s):
            for path, value in kw.items():
                *keys, last = path.split("__")
                d = s
                for k in keys:
                    d = d[int(k)] if isinstance(d, list) else d[k]
                d[last] = value
        return _verdicts(mod, monkeypatch, edit)
    assert at(steps=40)["GRPO steps"] and not at(steps=39)["GRPO steps"]
    assert at(bands__share_c4_topk=0.5)["scored tokens at"] and not at(bands__share_c4_topk=0.499)["scored tokens at"]
    overall = "mean \\|dlogp\\| / FP8 floor <= 1.2x, overall"
    assert at(gap_over_floor=1.2)[overall] and not at(gap_over_floor=1.2001)[overall]
    assert not at(bands__c4_topk__gap_over_floor=1.25)["... at positions"]     # the >= 2048 band's row
    drift = "no increasing drift of the excess (gap - floor)"
    assert at(context__excess_drift__ci95=[0.0, 1.0])[drift]
    assert not at(context__excess_drift__ci95=[1e-6, 1.0])[drift]
    assert not at(bands__window__excess_increasing=True)[drift]
    jump = "no jump of the excess beyond 3 SE (overall or in a band)"
    clean = {"context__excess_jumps__over_at": [],
             **{f"bands__{k}__excess_jumps__over_steps": [] for k in ("window", "c4_all", "c4_topk")}}
    assert at(**clean)[jump]
    assert not at(**{**clean, "bands__c4_all__excess_jumps__over_steps": [9]})[jump]   # a jump in one band alone
    assert not at(**{**clean, "context__excess_jumps__over_at": [3]})[jump]
    gain = "held-out pass@1 gain on the warm start re-evaluated"
    assert at(**{"warm__1__gain_pass@1": 0.15, "warm__1__gain_z": 3.01})[gain]
    assert not at(**{"warm__1__gain_pass@1": 0.15, "warm__1__gain_z": 3.0})[gain]
    assert not at(**{"warm__1__gain_pass@1": 0.149, "warm__1__gain_z": 9.0})[gain]
    slope = "reward slope positive (its 95% CI above 0)"
    assert at(reward_slope__ci95=[1e-4, 0.01])[slope] and not at(reward_slope__ci95=[0.0, 0.01])[slope]
    assert not at(pushes_verified=19)["every push verified"]
    empty = at(bands__window={"tokens": 0, "share": 0.0, "steps": 0})   # no scored token in a band: no verdict
    assert empty["... at positions < 128"] is None and empty[drift] is not None


def test_sglangs_own_agreement_is_shown_only_where_the_run_read_it(monkeypatch):
    mod = script()
    rows = {bar: measured for bar, measured, _ in mod.bar_rows(mod.load(HOLD3))}
    assert rows["C4 top-k overlap with the server's own kept sets"] == "not read in this run"
    agree = {"layer_1": {"overlap_mean": 0.981, "positions": 843}, "layer_3": {"overlap_mean": 0.977, "positions": 843}}

    def edit(s):
        s["indexer_agreement_server"] = agree
    from instruments import runstats
    real = runstats.summarize
    monkeypatch.setattr(runstats, "summarize", lambda recs: (lambda s: (edit(s), s)[1])(real(recs)))
    rows = {bar: measured for bar, measured, _ in mod.bar_rows(mod.load(HOLD3))}
    key = "C4 top-k overlap, nanoflash's exact kept sets vs the server's own (layers 1 / 3)"
    assert rows[key] == "0.981 / 0.977 on 843 positions"
    assert "C4 top-k overlap with the server's own kept sets" not in rows


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
