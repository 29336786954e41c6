"""Issue 20's new pieces on the CPU: the synthetic task, the probe, the live checks, the run statistics.

The whole pipeline runs end to end on the CPU in `bash experiments/h200/grpo_h200.sh dry` (minutes: the V4 vocabulary's
head is slow on two cores); these tests keep each piece honest in seconds, against naive references.
"""
import argparse
import importlib
import json
import math
import os
import random
import re
import subprocess
import tempfile
import time

import pytest
import torch

from nanoflash.rl import data, rewards
from instruments import live, runstats
from experiments.h200 import synth
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.sglang import probe as probe_lib
from nanoflash.sglang.client import Generation
from nanoflash.quant import dequantize_fp8_block, quantize_fp8_block
from nanoflash.sglang.layout import sglang_fp8
from nanoflash.sglang.buckets import convert_items

FP32_TOL = 1e-5    # the same fp32 computation done two ways (batched vs one position at a time)
T_TOL = 2e-3       # Cornish-Fisher t quantile vs the tabulated value (3 decimals in the tables)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout


def bench(name: str):
    """One of the experiment's scripts (experiments/h200/<name>.py) imported as a module."""
    return importlib.import_module(f"experiments.h200.{name}")


# ---------------------------------------------------------------------------------------------- task
def test_synth_splits_disjoint_complete_and_solutions_are_right():
    k4 = {s: synth.problems("sum4", s) for s in synth.SPLITS}
    prompts = {s: {p.prompt for p in ps} for s, ps in k4.items()}
    assert sum(len(v) for v in prompts.values()) == 9 ** 4           # every operand tuple exactly once
    assert not (prompts["train"] & prompts["heldout"]) and not (prompts["val"] & prompts["heldout"])
    assert 0.08 < len(prompts["heldout"]) / 9 ** 4 < 0.12             # HELDOUT_PERCENT = 10
    assert [p.prompt for p in synth.problems("sum4", "heldout")] == [p.prompt for p in k4["heldout"]]  # fixed order
    rng = random.Random(0)
    for p in rng.sample(k4["heldout"], 20):
        ops = synth.parse_prompt(p.prompt)
        sol = synth.solution(p.prompt)
        steps = sol.split(".</think>")[0].split(", ")
        acc = ops[0]
        for x, step in zip(ops[1:], steps):                         # naive: re-add step by step
            assert step == f"{acc}+{x}={acc + x}"
            acc += x
        assert p.answer == str(sum(ops)) == str(acc)
        assert rewards.integer_match(rewards.extract_answer(sol), p.answer)   # the math reward reads it
        assert not rewards.integer_match(rewards.extract_answer(sol.replace(f"{{{acc}}}", f"{{{acc + 1}}}")), p.answer)


def test_synth_rows_through_data_and_errors():
    probs, skipped = data.load_problems("py:experiments.h200.synth:sum3:heldout", "chat")
    assert skipped == 0 and probs[0].prompt == synth.problems("sum3", "heldout")[0].prompt
    for bad in ("sum9:train", "sum4:test", "sum4"):
        with pytest.raises(ValueError, match="sum|split|synth:"):
            synth.rows(bad)
    with pytest.raises(ValueError, match="not a synthetic sum prompt"):
        synth.solution("What is 2 + 2?")


def test_synth_sft_pairs_in_the_v4_chat_format():
    tok = data.V4Tokenizer()
    p = synth.problems("sum4", "train")[0]
    prompt, resp = synth.sft_pairs([p], tok)[0]
    assert tok.decode(prompt).endswith(data.ASSISTANT + data.THINK_START) and resp[-1] == tok.eos_id
    assert tok.decode(prompt + resp) == tok.chat_text(p) + synth.solution(p.prompt) + data.EOS


def _worked_steps(text: str, ops: tuple) -> tuple[list, list]:
    """Naive reader of a worked response: (the steps as (a, b, c), the separators between them); asserts each
    step adds the next operand to the running sum in either order and the box holds the total."""
    chain, boxed = text.split(".</think>")
    pieces = re.split(r"(\d+\+\d+=\d+)", chain)                               # "", step, sep, step, ..., ""
    seps, steps, acc = pieces[2:-1:2], [tuple(map(int, re.split("[+=]", s))) for s in pieces[1::2]], ops[0]
    assert pieces[0] == pieces[-1] == "" and len(steps) == len(ops) - 1
    for x, (a, b, c) in zip(ops[1:], steps):
        assert {a, b} == {acc, x} and c == acc + x
        acc += x
    assert boxed == f"\\boxed{{{acc}}}"
    return steps, seps


def test_synth_worked_phrasing_is_drawn_and_always_right():
    """solution(prompt, rng): every step right in either order, the separators from SEPARATORS, each choice
    near its share over many draws; without rng the canonical text."""
    probs, rng = synth.problems("sum4", "train")[:600], random.Random(0)
    swapped, seps = [], []
    for p in probs:
        ops = synth.parse_prompt(p.prompt)
        text = synth.solution(p.prompt, rng)
        steps, sp = _worked_steps(text, ops)
        assert rewards.integer_match(rewards.extract_answer(text), p.answer)
        swapped += [a == x for x, (a, b, _) in zip(ops[1:], steps) if a != b]   # x+acc (a tie tells nothing)
        seps += sp
        assert _worked_steps(synth.solution(p.prompt), ops)[1] == [synth.SEPARATORS[0]] * (len(ops) - 2)
    assert set(seps) == set(synth.SEPARATORS)
    assert 0.45 < sum(swapped) / len(swapped) < 0.55                 # 1/2 +- 4 SE (n ~ 1700)
    for sep in synth.SEPARATORS:
        assert 0.13 < seps.count(sep) / len(seps) < 0.21             # 1/6 +- 3.4-4 SE (n = 1200)


def test_synth_glance_is_an_estimate_and_the_mix_follows_worked_share():
    """An answer at a glance: `</think>` first (no reasoning), off by -2..2, exact ~1 time in 5; sft_pairs draws
    worked demonstrations with probability worked_share, each a right chain in a drawn phrasing."""
    probs, rng = synth.problems("sum4", "train")[:500], random.Random(0)
    errs = []
    for p in probs:
        g = synth.glance(p.prompt, rng)
        assert g.startswith(data.THINK_END)
        errs.append(int(rewards.extract_answer(g)) - int(p.answer))
    assert set(errs) == set(range(-synth.GLANCE_SPREAD, synth.GLANCE_SPREAD + 1))
    assert 0.14 < errs.count(0) / len(errs) < 0.26                  # 1 / (2 * GLANCE_SPREAD + 1), +-3 SE
    tok = data.V4Tokenizer()
    end = tok.encode(data.THINK_END)
    pairs = synth.sft_pairs(probs, tok, 0.3, random.Random(1))
    worked = [r[:1] != end for _, r in pairs]
    assert 0.24 < sum(worked) / len(worked) < 0.36                   # 0.3 +- 3 SE
    for (_, r), p, w in zip(pairs, probs, worked):
        text = tok.decode(r)
        assert text.endswith(data.EOS)
        if w:
            _worked_steps(text[:-len(data.EOS)], synth.parse_prompt(p.prompt))
    drawn = [tok.decode(r) != synth.solution(p.prompt) + data.EOS for (_, r), p, w in zip(pairs, probs, worked) if w]
    assert sum(drawn) > 0.9 * len(drawn)                        # canonical by chance: <= 1/8 x 1/36 of the time
    assert all(r[:1] != end for _, r in synth.sft_pairs(probs[:20], tok))   # default: all worked, no rng needed
    for bad in ((0.5, None), (1.5, random.Random(0))):
        with pytest.raises(ValueError, match="worked_share"):
            synth.sft_pairs(probs[:2], tok, *bad)


# ---------------------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def tiny_pair():
    cfg = preset("tiny", kernels="reference")
    a = Transformer(cfg).init_weights(seed=0).eval()
    b = Transformer(cfg).init_weights(seed=1).eval()
    return cfg, a, b


class FakeServer:
    """Samples from `model` at T and answers with its log-probs, as /generate does (optionally stale)."""

    def __init__(self, model, version="3"):
        self.model, self.version = model, version

    def generate(self, prompt, sp, url=None):
        g = torch.Generator().manual_seed(sp["sampling_seed"])
        ids, lps = list(prompt), []
        with torch.no_grad():
            for _ in range(sp["max_new_tokens"]):
                logp = torch.log_softmax(self.model(torch.tensor([ids]))[0, -1] / sp["temperature"], -1)
                t = int(torch.multinomial(logp.exp(), 1, generator=g))
                ids.append(t)
                lps.append(float(logp[t]))
        return [Generation(list(prompt), ids[len(prompt):], lps, "length", self.version, "fake")]


def test_probe_matches_same_weights_and_flags_others(tiny_pair):
    cfg, a, b = tiny_pair
    prompt = [1, 5, 9, 12, 3]
    same = probe_lib.probe(FakeServer(a), a, prompt, seed=4, n_tokens=6, other=b)
    assert same["mean"] < FP32_TOL and same["tokens"] == 6
    assert same["other_mean"] == pytest.approx(same["shift_mean"], rel=1e-3) and same["shift_mean"] > 0.05
    probe_lib.require_landed(same, 3)
    stale = probe_lib.probe(FakeServer(b), a, prompt, seed=4, n_tokens=6)
    assert stale["mean"] > 0.05
    with pytest.raises(SystemExit, match="weight version 3"):
        probe_lib.require_landed(same, 4)
    with pytest.raises(SystemExit, match="above"):
        probe_lib.require_landed({**same, "mean": probe_lib.PROBE_MAX_MEAN * 2}, 3)


def test_live_probe_after_a_push_expects_the_pushers_tagged_version(tiny_pair, tmp_path):
    """The live hook's probe compares the server's weight version with the one the pusher told it
    (`StagePusher.tag`: '{step}-{launch nonce}', issue 39), for the step's push and a swap push alike. Bug
    caught: comparing with the bare step number stopped every run at its first push ('the server reports weight
    version 0-6db11911'), in the CPU dry run and on the H200 alike."""
    import types
    from nanoflash.rl.hooks import HookContext
    cfg, a, _ = tiny_pair

    class Short(FakeServer):                # 4 probe tokens: the version is what is tested, not the gap
        def generate(self, prompt, sp, url=None):
            return super().generate(prompt, {**sp, "max_new_tokens": 4}, url)
    pusher = types.SimpleNamespace(tag=lambda v: f"{v}-abc123", summary={"verified": {"u": "checksums"}})
    run_cfg = types.SimpleNamespace(train=types.SimpleNamespace(out_dir=str(tmp_path), seed=0),
                                    rollout=types.SimpleNamespace(temperature=1.0))
    task = types.SimpleNamespace(heldout=[], train=["x"], encode=lambda p: [1, 5, 9, 12])
    ctx = HookContext(run_cfg, cfg, types.SimpleNamespace(model=a, device=torch.device("cpu")),
                      types.SimpleNamespace(client=Short(a, version="3-abc123")), pusher, task)
    hook = live.LiveChecks(ctx)
    out = hook.after_push(3)
    assert out["probe_mean"] < FP32_TOL and out["verify_full_checksums"] == 1
    assert hook._probe_swap(a, 3) < FP32_TOL
    hook.rollouts.client = Short(a, version="3")                     # a server that never took this launch's push
    with pytest.raises(SystemExit, match="weight version 3"):
        hook.after_push(3)


def test_token_entropy_against_naive(tiny_pair):
    cfg, a, _ = tiny_pair
    ids = torch.randint(3, cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    got = live.token_entropy(a, ids, temperature=0.7, rows=2)
    with torch.no_grad():
        for b, t in ((0, 0), (1, 4), (2, 2)):
            p = torch.softmax(a(ids[b:b + 1, :t + 1])[0, -1].double() / 0.7, -1)
            assert float(got[b, t]) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-4)


def test_fp8_roundtrip_touches_exactly_the_fp8_served_weights(tiny_pair):
    cfg, a, _ = tiny_pair
    m = Transformer(cfg).init_weights(seed=0)
    live.fp8_roundtrip_(m, cfg)
    ref = a.state_dict()
    fp8 = [n for n, t in m.state_dict().items() if t.is_floating_point() and sglang_fp8(n, cfg)
           and not n.startswith("mtp.")]   # MTP is never pushed (and not checked here)
    live.fp8_roundtrip_(m, cfg)   # idempotent: FP8 values round to themselves
    assert fp8 and any(".experts." in n for n in fp8) and not any(n.endswith("wo_a.weight") for n in fp8)
    for n, p in m.state_dict().items():
        if n.startswith("mtp."):
            continue
        changed = not torch.equal(p, ref[n])
        assert changed == (n in fp8), n
        if n in fp8:   # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4
            assert float(((p - ref[n]).abs() - ref[n].abs() / 16).max()) <= 1e-6, n


def test_fp8_then_storage_roundtrip_hold_what_the_fp8_push_sends(tiny_pair):
    """After fp8_roundtrip_ + storage_roundtrip_, every pushed tensor of the sim equals what the FP8 stream sends
    for it, read back in the model's dtype: dequant(Q, S) for an FP8 item, the cast for the rest (the fp32 norms,
    head and compressors of a trainer become bf16 values; mHC stays fp32). The storage step alone touches no
    FP8-served weight, and both are idempotent (the storage step says whether it moved anything: the live check
    skips a forward when it did not)."""
    cfg, a, _ = tiny_pair
    m = Transformer(cfg).init_weights(seed=0)
    live.fp8_roundtrip_(m, cfg)
    fp8_only = {n: t.clone() for n, t in m.state_dict().items()}
    assert live.storage_roundtrip_(m, cfg)                                      # fp32 head etc. moved
    assert not live.storage_roundtrip_(m, cfg)                                  # then nothing left to move
    live.fp8_roundtrip_(m, cfg)
    bf16 = set()
    for name, t in a.state_dict().items():
        if name.startswith("mtp.") or not t.is_floating_point():
            continue
        items = convert_items(name, t, cfg, fp8=True)
        if items[0].how == "q":
            q, s = quantize_fp8_block(t.float(), fmt="fp32")
            want = dequantize_fp8_block(q, s, dtype=torch.float32)
            assert torch.equal(m.state_dict()[name], fp8_only[name]), name      # storage step left it alone
        else:
            want = t.to(items[0].dtype).float()
            bf16 |= {name} if items[0].dtype == torch.bfloat16 else set()
        assert torch.equal(m.state_dict()[name].float(), want), name
    assert {"head.weight", "norm.weight"} <= bf16 and any("compressor.wkv" in n for n in bf16)
    assert not any(".hc_" in n or n.startswith("hc_") for n in bf16)


def test_verify_counts():
    s = {"verified": {"u1": {"exact": 60, "change_sets": 155, "first_push_unchecked": 0, "state": None},
                      "u2": "checksums"}}
    assert live.verify_counts(s) == {"verify_servers": 2, "verify_exact": 60, "verify_change_sets": 155,
                                     "verify_unchecked": 0, "verify_full_checksums": 1}
    assert live.verify_counts({})["verify_servers"] == 0


# ---------------------------------------------------------------------------------------------- statistics
def test_t_quantile_and_ols_against_hand_values():
    for df, want in ((5, 2.571), (10, 2.228), (30, 2.042), (48, 2.011)):   # tabulated t_{0.975, df}
        assert runstats.t_quantile(0.975, df) == pytest.approx(want, abs=T_TOL)
    xs, ys = [0, 1, 2, 3, 4], [1.0, 3.1, 4.9, 7.2, 8.8]
    r = runstats.ols(xs, ys)
    # by hand: b = sum((x-2)(y-5)) / 10 = 19.7 / 10, a = 5 - 2b; residual SS / 3 / 10 under the root
    b = 1.97
    res = [y - (5 - 2 * b) - b * x for x, y in zip(xs, ys)]
    se = math.sqrt(sum(e * e for e in res) / 3 / 10)
    assert r["slope"] == pytest.approx(b) and r["slope_se"] == pytest.approx(se)
    assert r["ci95"][0] == pytest.approx(b - 3.182 * se, abs=1e-2 * se)
    flat = runstats.ols(list(range(40)), [0.05 + 0.001 * ((i * 7) % 5 - 2) for i in range(40)])
    assert flat["ci95"][0] <= 0 <= flat["ci95"][1] or abs(flat["slope"]) < 1e-4
    with pytest.raises(ValueError, match=">= 3 points"):
        runstats.ols([0, 1], [0, 1])


def test_jumps_finds_a_planted_jump_only():
    g = random.Random(0)
    ys = [0.07 + 0.003 * g.gauss(0, 1) for _ in range(40)]
    assert runstats.jumps(ys)["over"] == 0
    ys[25] += 0.05
    j = runstats.jumps(ys)
    assert j["over"] >= 1 and j["at_index"] == 25 and j["max_abs_z"] > 10 and 25 in j["over_at"]


def test_summary_of_a_synthetic_run(tmp_path):
    g = random.Random(1)
    run = tmp_path / "run"
    run.mkdir()
    from nanoflash.rl.metrics import MetricsLog
    log = MetricsLog(str(run / "metrics.jsonl"))
    log.log("push", 0, {"verify_servers": 1, "probe_mean": 0.05})
    for s in range(1, 21):
        log.log("train", s, {"gap_mean": 0.06 + 0.002 * g.gauss(0, 1), "gap_p99": 0.3, "floor_mean": 0.055,
                             "floor_fp8_mean": 0.04,
                             "reward_mean": 0.2 + 0.02 * s, "verify_servers": 1, "probe_mean": 0.06,
                             "rollout_s": 1.0, "logprobs_s": 0.2, "train_s": 0.6, "sync_s": 0.3, "live_s": 0.1,
                             "gpu_mem_gib": 20.0, "gpu_peak_gib": 30.0, "gpu_used_total_gib": 80.0})
        if s % 10 == 0:
            log.log("eval", s, {"pass@1": 0.2 + 0.02 * s, "pass@2": 0.5, "pass@1_se": 0.02, "eval_s": 2.0})
            log.log("eval_warm", s, {"warm_pass@1": 0.2, "pass@1": 0.2 + 0.02 * s, "gain_pass@1": 0.02 * s,
                                     "gain_se": 0.03, "gain_z": 0.02 * s / 0.03, "warm_eval_s": 2.0})
    log.close()
    out = runstats.report(str(run), str(tmp_path / "report"), draw=False)   # figures: the dry run draws them
    bars = out["bars"]
    assert bars["every_push_verified"] and out["pushes"] == 21 and bars["reward_slope_positive"]
    assert bars["pass@1_gain_>=_0.15_and_>3se"] and bars["gap_mean_below_0.09"] and bars["gap_within_1.2x_floor"]
    assert (tmp_path / "report" / "summary.json").exists() and out["gap_drift"]["n"] == 20
    assert out["warm"][-1]["gain_pass@1"] == pytest.approx(0.4) and out["gap_jumps"]["over"] == 0
    assert out["floor_fp8_mean"] == pytest.approx(0.04)
    assert out["gap_over_floor_fp8"] == pytest.approx(out["gap_mean"] / 0.04)


def test_token_stats_against_naive_loops():
    """live.token_stats: tails, means and the high-entropy halves, against plain Python over the same values."""
    g = torch.Generator().manual_seed(3)
    gap, floor = torch.randn(101, generator=g) * 0.01, torch.rand(101, generator=g) * 0.01
    ent = torch.rand(101, generator=g)
    out = live.token_stats(gap, floor, ent)
    med = sorted(ent.tolist())[50]                                              # 101 values: the 51st
    hi = [i for i in range(101) if ent[i].item() > med]
    assert len(hi) == 50
    mean = lambda xs: sum(xs) / len(xs)                                         # noqa: E731
    assert out["gap_mean"] == pytest.approx(mean([abs(x) for x in gap.tolist()]), rel=FP32_TOL)
    assert out["gap_max"] == pytest.approx(max(abs(x) for x in gap.tolist()), rel=FP32_TOL)
    assert out["floor_mean"] == pytest.approx(mean(floor.tolist()), rel=FP32_TOL)
    assert out["gap_high_entropy_mean"] == pytest.approx(mean([abs(gap[i].item()) for i in hi]), rel=FP32_TOL)
    assert out["floor_high_entropy_mean"] == pytest.approx(mean([floor[i].item() for i in hi]), rel=FP32_TOL)
    one = live.token_stats(gap[:1], floor[:1], ent[:1])                        # one token: no upper half
    assert one["gap_high_entropy_mean"] == 0.0 and one["gap_tokens"] == 1
    pre = gap + torch.randn(101, generator=g) * 0.001                          # the server's prefill scores
    ps = live.prefill_stats(pre, gap, floor)
    assert ps["prefill_gap_mean"] == pytest.approx(mean([abs(x) for x in pre.tolist()]), rel=FP32_TOL)
    assert ps["prefill_over_floor"] == pytest.approx(sum(abs(x) for x in pre.tolist()) / sum(floor.tolist()),
                                                     rel=FP32_TOL)
    assert ps["decode_vs_prefill_mean"] == pytest.approx(mean([abs(a - b) for a, b in zip(gap.tolist(),
                                                                                         pre.tolist())]), rel=FP32_TOL)


def test_excess_by_token_against_naive_sums(tmp_path):
    """runstats.excess_by_token over two steps' per-token files (live.LiveChecks.step writes them): per token id
    and first token vs the rest, against plain Python sums; a step filter reads only those steps."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for step in (1, 2):
        n = 40
        d = {"gap": torch.randn(n, generator=g) * 0.01, "floor": torch.rand(n, generator=g) * 0.005,
             "entropy": torch.rand(n, generator=g), "token": torch.randint(0, 6, (n,), generator=g).int(),
             "pos": torch.arange(n).remainder(8).short()}
        d["gap"][d["token"] == 3] += 0.05                                        # token 3 carries the excess
        d["prefill_gap"] = d["floor"] * 1.1                                      # the prefill: near the floor
        torch.save(d, tmp_path / f"step_{step:04d}.pt")
        rows += [(step, abs(a), b, int(t), int(p)) for a, b, t, p in zip(d["gap"].tolist(), d["floor"].tolist(),
                                                                          d["token"], d["pos"])]
    out = runstats.excess_by_token(str(tmp_path), decode=lambda i: f"<{i}>")
    total = sum(a - b for _, a, b, _, _ in rows)
    assert out["steps"] == 2 and out["tokens"] == 80 and out["excess_sum"] == pytest.approx(total)
    top = out["by_token"][0]
    assert top["token"] == 3 and top["text"] == "<3>" and top["n"] == sum(1 for r in rows if r[3] == 3)
    assert top["gap_sum"] == pytest.approx(sum(a for _, a, _, t, _ in rows if t == 3))
    assert top["excess_share"] == pytest.approx(sum(a - b for _, a, b, t, _ in rows if t == 3) / total)
    firsts = [(a, b) for _, a, b, _, p in rows if p == 0]
    assert out["first_token"]["n"] == len(firsts) == 10
    assert out["first_token"]["gap_over_floor"] == pytest.approx(sum(a for a, _ in firsts) / sum(b for _, b in firsts))
    assert out["first_token"]["excess_share"] + out["rest"]["excess_share"] == pytest.approx(1.0)
    assert out["all"]["prefill_over_floor"] == pytest.approx(1.1) and top["prefill_sum"] == pytest.approx(
        1.1 * top["floor_sum"])                                                  # decode carries the excess
    assert runstats.excess_by_token(str(tmp_path), [2])["tokens"] == 40
    assert runstats.excess_by_token(str(tmp_path), [7]) == {"steps": 0}


def test_report_names_the_token_that_carries_a_jump(tmp_path):
    """A run whose step 30 jumps because one rare token has |gap| = its floor = 6 nats (run 9's step 35): the
    report's jump_tokens names that token, and the step's means without it, against plain Python sums."""
    g = torch.Generator().manual_seed(9)
    run = tmp_path / "run"
    (run / "live_tokens").mkdir(parents=True)
    from nanoflash.rl.metrics import MetricsLog
    log = MetricsLog(str(run / "metrics.jsonl"))
    for s in range(1, 41):
        n = 500
        d = {"gap": torch.randn(n, generator=g) * 0.004, "floor": torch.rand(n, generator=g) * 0.006,
             "entropy": torch.rand(n, generator=g), "token": torch.randint(0, 50, (n,), generator=g).int(),
             "pos": torch.arange(n).remainder(25).short()}
        if s == 30:
            d["gap"][7], d["floor"][7], d["token"][7], d["pos"][7] = -6.0, 6.0, 1602, 24
        torch.save(d, run / "live_tokens" / f"step_{s:04d}.pt")
        gap, floor = d["gap"].abs().tolist(), d["floor"].tolist()
        log.log("train", s, {"gap_mean": sum(gap) / n, "floor_mean": sum(floor) / n, "reward_mean": 0.2,
                             "verify_servers": 1, "probe_mean": 0.01})
        if s == 30:
            want = (sum(gap) - 6.0) / (n - 1), (sum(floor) - 6.0) / (n - 1)
    log.close()
    out = runstats.report(str(run), str(tmp_path / "report"), draw=False, decode=lambda i: f"<{i}>")
    assert out["gap_jumps"]["over_at"] == [29] and out["context"]["excess_jumps"]["over"] == 0
    (jt,) = out["jump_tokens"]
    assert jt["step"] == 30 and jt["tokens"] == 500 and jt["top"]["token"] == 1602 and jt["top"]["pos"] == 24
    assert jt["top"]["gap"] == pytest.approx(6.0) and jt["top"]["floor"] == pytest.approx(6.0)
    assert jt["top"]["text"] == "<1602>"
    assert jt["gap_mean_without"] == pytest.approx(want[0], rel=FP32_TOL)
    assert jt["floor_mean_without"] == pytest.approx(want[1], rel=FP32_TOL)
    assert runstats.jump_tokens(str(run / "live_tokens"), [99]) == []           # no file: nothing to name


def test_floor_context_separates_the_servers_excess_from_a_sharpening_policy():
    """A floor that falls with the entropy and a gap = floor + a steady excess: the gap drifts, its excess over
    the floor does not; gap / floor per third of the run rises as the floor shrinks. Naive: sums by hand."""
    g = random.Random(2)
    steps = list(range(1, 31))
    floor = [0.004 * 0.93 ** s for s in steps]
    gap = [f + 0.0005 + 1e-5 * g.gauss(0, 1) for f in floor]
    assert runstats.ols(steps, gap)["ci95"][1] < 0                              # the gap's own slope: drift
    ctx = runstats.floor_context(steps, gap, floor)
    assert ctx["excess_drift_ci_contains_0"] and abs(ctx["excess_drift"]["slope"]) < 1e-5
    want = [sum(gap[a:a + 10]) / sum(floor[a:a + 10]) for a in (0, 10, 20)]
    assert ctx["gap_over_floor_thirds"] == pytest.approx(want) and want[0] < want[1] < want[2]
    assert "gap_over_floor_high_entropy" not in ctx                             # steps that did not log it
    hi = runstats.floor_context(steps, gap, floor, [2 * x for x in gap], floor)
    assert hi["gap_over_floor_high_entropy"] == pytest.approx(2 * sum(gap) / sum(floor))
    assert not runstats.floor_context(steps, [f + 1e-5 * s for f, s in zip(floor, steps)], floor)[
        "excess_drift_ci_contains_0"]                                           # a growing excess is caught


def test_drift_power_is_the_change_at_which_the_slope_interval_touches_zero():
    """runstats.drift_power: a series with no trend plus a line that changes by exactly `resolution` over the run
    has its slope's 95% interval end at 0; the gap per nat is the slope of a gap built as a + b H; the entropy
    budget is resolution / b."""
    n = 40
    steps = list(range(1, n + 1))
    noise = [0.3 * math.sin(1.7 * i) + 0.2 * math.cos(0.9 * i * i) for i in steps]
    flat = [x - runstats.ols(steps, noise)["slope"] * (i - (n + 1) / 2) for i, x in zip(steps, noise)]  # slope 0
    ent = [0.4 - 0.005 * i + 0.01 * math.sin(i) for i in steps]
    gap = [0.002 + 0.004 * h for h in ent]
    base = [5 + x for x in flat]
    p = runstats.drift_power(steps, base)
    line = [y + p["resolution"] * (i - 1) / (n - 1) for i, y in zip(steps, base)]
    assert runstats.ols(steps, line)["ci95"][0] == pytest.approx(0.0, abs=1e-9)
    assert p["resolution_share"] == pytest.approx(p["resolution"] / (sum(base) / n), rel=1e-9)
    q = runstats.drift_power(steps, [g + 1e-4 * x for g, x in zip(gap, flat)], ent)
    assert q["gap_per_nat"] == pytest.approx(0.004, rel=0.05)
    assert q["entropy_budget_nat"] == pytest.approx(q["resolution"] / q["gap_per_nat"], rel=1e-9)
    assert q["entropy_change"] == pytest.approx(-0.005 * (n - 1), rel=0.05)


def test_floor_context_tells_a_floor_jump_from_a_server_jump():
    """A batch whose tokens lift the FP8 floor lifts the gap with it: a jump of the gap and of the floor at the
    same step, none of gap - floor. A jump of the gap alone (what a broken push does) is one of gap - floor."""
    g = random.Random(3)
    steps = list(range(1, 41))
    floor = [0.003 + 1e-4 * g.gauss(0, 1) for _ in steps]
    gap = [f + 1e-4 + 2e-5 * g.gauss(0, 1) for f in floor]
    floor[20] += 0.004
    gap[20] += 0.004                                                            # the batch moved both
    assert runstats.jumps(gap)["over_at"] == [20]
    ctx = runstats.floor_context(steps, gap, floor)
    assert ctx["floor_jumps"]["over_at"] == [20] and ctx["excess_jumps"]["over"] == 0
    gap[30] += 0.002                                                            # the server alone
    ctx = runstats.floor_context(steps, gap, floor)
    assert ctx["excess_jumps"]["over_at"] == [30] and ctx["floor_jumps"]["over_at"] == [20]


# ---------------------------------------------------------------------------------------------- warm-up
def test_p_worked_is_one_minus_the_think_end_probability(tiny_pair):
    """experiments/h200/grpo_h200.py p_worked (last position only, prompts grouped by length) against the naive full forward
    of each prompt alone: mean over prompts of 1 - softmax(logits[-1])[think_end]."""
    grpo_h200 = bench("grpo_h200")
    cfg, model, _ = tiny_pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 5, 12)]
    end = 7
    naive = [1.0 - model(torch.tensor([p]))[0, -1].softmax(-1)[end].item() for p in prompts]
    assert grpo_h200.p_worked(model, prompts, end) == pytest.approx(sum(naive) / len(naive), abs=FP32_TOL)


def test_parity_tables_by_length_and_position_against_naive_loops():
    """experiments/h200/sglang_check.py by_length (each prompt's n samples together) and by_position (bands of absolute
    position prompt length + i) against plain loops over the same per-token values."""
    sglang_check = bench("sglang_check")
    g = random.Random(4)
    samples = [([1] * L, [2] * k, [0.0] * k) for L, k in ((40, 30), (40, 50), (120, 20), (120, 30), (300, 10),
                                                          (300, 5))]
    vals = [g.random() for _, ids, _ in samples for _ in ids]
    rows = {"bf16": torch.tensor(vals, dtype=torch.float64)}
    want_len, at = [], 0
    for i in (0, 2, 4):
        k = len(samples[i][1]) + len(samples[i + 1][1])
        want_len.append(sum(vals[at:at + k]) / k)
        at += k
    got = sglang_check.by_length(samples, rows, 2)
    assert [r["prompt_len"] for r in got] == [40, 120, 300]
    assert [r["bf16"] for r in got] == pytest.approx(want_len, abs=1e-5)
    pos = [len(p) + i for p, ids, _ in samples for i in range(len(ids))]
    edges = sglang_check.POSITION_EDGES
    want_pos = {}
    for q, v in zip(pos, vals):
        lo = max(e for e in edges if e <= q)
        want_pos.setdefault(lo, []).append(v)
    got = sglang_check.by_position(samples, rows)
    assert [r["pos_lo"] for r in got] == sorted(want_pos) == [0, 64, 128, 256]
    assert [r["tokens"] for r in got] == [len(want_pos[lo]) for lo in sorted(want_pos)]
    assert [r["bf16"] for r in got] == pytest.approx([sum(v) / len(v) for _, v in sorted(want_pos.items())],
                                                     abs=1e-5)


def test_parity_synth_prompt_is_exact_length_and_ends_where_a_response_starts():
    """experiments/h200/sglang_check.py synth_prompt: exactly `length` tokens of the task's chat text, the last problem's
    prompt whole at the end (BOS ... <think>), so a sample is a response; too short a length is one error."""
    sglang_check = bench("sglang_check")
    tok = data.V4Tokenizer()
    last = tok.encode_chat(synth.problems("sum4", "heldout", seed=3)[-1])
    for length in (len(last) + 1, 64, 300):
        ids = sglang_check.synth_prompt(length, 3)
        assert len(ids) == length and ids[-len(last):] == last and ids[0] == tok.bos_id
        assert tok.decode(ids).endswith("<｜Assistant｜><think>")
    with pytest.raises(ValueError, match="the last problem alone"):
        sglang_check.synth_prompt(len(last), 3)


def test_parity_by_eos_splits_each_generation_at_its_first_eos():
    """experiments/h200/sglang_check.py by_eos: a token counts as in the response up to and including the first EOS of its
    own generation (not another sample's), past it after; means against a plain loop."""
    sglang_check = bench("sglang_check")
    eos = 9
    samples = [([1, 2], [3, eos, 4, eos, 5], None), ([1], [3, 4, 5], None), ([7], [eos, 6], None)]
    vals = [0.1, 0.2, 0.3, 0.4, 0.5, 1.0, 2.0, 3.0, 7.0, 11.0]
    past = [False, False, True, True, True, False, False, False, False, True]
    got = sglang_check.by_eos(samples, {"bf16": torch.tensor(vals)}, eos)
    want_in = [v for v, q in zip(vals, past) if not q]
    want_past = [v for v, q in zip(vals, past) if q]
    assert [(r["part"], r["tokens"]) for r in got] == [("in_response", len(want_in)), ("past_eos", len(want_past))]
    assert [r["bf16"] for r in got] == pytest.approx([sum(want_in) / len(want_in), sum(want_past) / len(want_past)],
                                                     abs=1e-5)


def test_write_parity_splits_the_table_samples_at_their_eos_apart_from_the_sweep(tmp_path):
    """write_parity with --synth: by_eos pools every sample, by_eos_table only the table's (the first
    prompts x n samples, the first `head` tokens), which the 2-4K parity question is about."""
    import argparse
    import json
    sglang_check = bench("sglang_check")
    from nanoflash.rl.data import V4Tokenizer
    eos = V4Tokenizer().eos_id
    samples = [([1] * 5, [3, eos, 4], None), ([1] * 6, [3, 4, eos], None), ([1] * 2, [eos, 6, 6], None)]
    rows = {"bf16": torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])}
    a = argparse.Namespace(out=str(tmp_path / "parity.json"), synth=1, n=1, prompts=2)
    sglang_check.write_parity(a, {}, rows, 6, samples)
    res = json.load(open(a.out))
    assert res["by_eos"] == sglang_check.by_eos(samples, rows, eos)
    assert [(r["part"], r["tokens"], r["bf16"]) for r in res["by_eos_table"]] == [
        ("in_response", 5, pytest.approx((0.1 + 0.2 + 0.4 + 0.5 + 0.6) / 5, abs=1e-5)),
        ("past_eos", 1, pytest.approx(0.3, abs=1e-5))]
    assert res["bf16"]["tokens"] == 6                                           # the table's tails: its tokens


def test_parity_variants_change_only_where_they_act_and_restore_the_model(tiny_pair):
    """experiments/h200/parity_variants.py on `tiny` (window 8, a ratio-8 layer): the window and C128 variants leave every
    position before their first effect as it was (to fp32 rounding) and change the ones after; the shared-expert
    clamp is a no-op until a pre-activation passes the limit (w1 scaled x22 here: its largest values near 10);
    after each, the model is what it was. `score`
    adds one row per variant and flags the positions over the limit, against the shared experts' inputs done by
    hand."""
    parity_variants = bench("parity_variants")
    cfg, model, _ = tiny_pair
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))

    def lp():
        with torch.no_grad():
            return model.token_logprobs(ids[:, :-1], ids[:, 1:])[0]                 # [23], position t predicts t+1
    base = lp()
    first = {"window_127": cfg.window_size - 1, "window_129": cfg.window_size, "no_c128_entries": 7}
    for name, at in first.items():
        with parity_variants.variants(model)[name]():
            got = lp()
        assert torch.allclose(got[:at], base[:at], atol=FP32_TOL), name          # same math, another sum order
        assert (got[at:] - base[at:]).abs().max() > 100 * FP32_TOL, name
        assert torch.equal(lp(), base), name                                        # restored
    with parity_variants.variants(model)["shared_expert_clamp"]():
        assert torch.equal(lp(), base)                                              # nothing passes 10
    shared = [m.shared_experts for m in model.modules() if type(m).__name__ == "MoE"]
    saved = [ex.w1.weight.detach().clone() for ex in shared]
    with torch.no_grad():
        for ex in shared:
            ex.w1.weight.mul_(22.0)
        try:
            loud = lp()
            with parity_variants.variants(model)["shared_expert_clamp"]():
                assert not torch.allclose(lp(), loud)
                with parity_variants.variants(model)["shared_expert_no_clamp"]():   # a model that clamps (h200.txt)
                    assert torch.equal(lp(), loud)                                 # back to the published one
            samples = [(ids[0, :10].tolist(), ids[0, 10:].tolist(), None),
                       (ids[0, :4].tolist(), ids[0, 4:9].tolist(), None)]
            rows = {}
            pos, over = parity_variants.score(
                model, samples, torch.zeros(19), rows, ["window_127"],
                lambda m, ss: torch.cat([m.token_logprobs(torch.tensor([p + i])[:, :-1], torch.tensor([p + i])[:, 1:])
                                         [0, len(p) - 1:] for p, i, _ in ss]))
            naive_pos, naive_over = [], []
            for p, i, _ in samples:                    # the shared experts' inputs by a plain hook, then by hand
                seen = []
                hooks = [ex.register_forward_pre_hook(lambda m, inp: seen.append((m, inp[0]))) for ex in shared]
                model(torch.tensor([p + i])[:, :-1])
                for h in hooks:
                    h.remove()
                for t in range(len(p) + len(i) - 1):
                    naive_pos.append(t)
                    naive_over.append(any(bool((ex.w1(x.reshape(-1, x.shape[-1])[t]) > cfg.swiglu_limit).any()
                                               or (ex.w3(x.reshape(-1, x.shape[-1])[t]).abs() > cfg.swiglu_limit).any())
                                          for ex, x in seen))
        finally:
            for ex, w in zip(shared, saved):
                ex.w1.weight.copy_(w)
    assert list(rows) == ["bf16_window_127"] and rows["bf16_window_127"].shape == (19,)
    assert pos.tolist() == naive_pos and over.tolist() == naive_over
    assert 0 < sum(naive_over) < len(naive_over)                   # the x22 gate passed 10 at some positions only
    assert torch.equal(lp(), base)


def test_warmup_waits_for_the_server_then_sends_rollout_shaped_requests(capsys, monkeypatch):
    """experiments/h200/grpo_h200.py warmup: retried until the HTTP server answers (it binds 0.5 s after the warm-up makes
    its client, where its clock starts: connections are refused till then, so http_up_s >= 0.5 however loaded the
    machine), then one request, then `rounds` x `prompts` requests of the first training prompts in the V4 chat
    format with n samples each."""
    import json
    import os
    import sys
    import threading
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))   # run alone, too
    from conftest import FakeSGLang, free_port
    from nanoflash.sglang import client as client_lib
    grpo_h200 = bench("grpo_h200")
    port, srv = free_port(), []

    def serve():
        srv.append(FakeSGLang(["/generate"], port=port))
    late = threading.Timer(0.5, serve)

    class LateClient(client_lib.SGLangClient):   # the timer starts with the client, just before the clock
        def __init__(self, *args, **kw):
            late.start()
            super().__init__(*args, **kw)
    monkeypatch.setattr(client_lib, "SGLangClient", LateClient)
    try:
        grpo_h200.main(["warmup", "--url", f"http://127.0.0.1:{port}", "--wait", "30", "--prompts", "3", "--n", "2",
                        "--new-tokens", "4", "--rounds", "2"])
    finally:
        late.cancel()
        if srv:
            srv[0].close()
    out, sent = json.loads(capsys.readouterr().out.strip().splitlines()[-1]), srv[0].bodies
    tok = data.V4Tokenizer()
    want = [tok.encode_chat(p) for p in synth.problems("sum4", "train")[:3]]
    assert out["requests"] == 1 + 2 * 3 * 2 and len(sent) == 1 + 2 * 3 and out["http_up_s"] >= 0.4
    assert sent[0]["sampling_params"]["n"] == 1 and all(b["sampling_params"]["n"] == 2 for b in sent[1:])
    assert sent[0]["input_ids"] == want[0] and sorted(b["input_ids"] for b in sent[1:]) == sorted(want * 2)
    assert all(b["sampling_params"]["max_new_tokens"] == 4 for b in sent)


@pytest.mark.slow
def test_sglang_check_distributed_push_dry_run(tmp_path):
    """experiments/h200/sglang_check.py push --transport distributed, the live H200 proof's code, on the CPU against
    the embedded server (NF_DEVICE=cpu NF_CHECK_PRESET=tiny): preflight, a gloo Broadcaster joined through
    /init_weights_update_group, flattened FP8 buckets, each of 3 pushes verified by checksum and behaviour and timed.
    Bug caught: a push that leaves the server on the old weights (the checksums refuse it, the script exits 1).
    ~40 s on 2 cores: `pytest -m slow experiments/h200/test_h200_pieces.py -k distributed`."""
    import json
    import os
    import subprocess
    import sys
    from nanoflash.checkpoint import load_hf_checkpoint
    from nanoflash.config import ModelConfig
    from nanoflash.server.engine import RolloutEngine
    from nanoflash.server.http import serve
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from conftest import free_port
    ck, out = str(tmp_path / "ck"), str(tmp_path / "push.json")
    script = os.path.join(ROOT, "experiments", "h200", "sglang_check.py")
    env = dict(os.environ, NF_DEVICE="cpu", NF_CHECK_PRESET="tiny", PYTHONPATH=ROOT)
    subprocess.run([sys.executable, script, "ckpt", "--dir", ck], env=env, check=True, cwd=ROOT, capture_output=True)
    model = Transformer(ModelConfig.from_hf_config(ck))
    load_hf_checkpoint(model, ck)
    httpd, url = serve(RolloutEngine(model.float(), weights="fp8"), model_path=ck)
    try:
        p = subprocess.run([sys.executable, script, "push", "--dir", ck, "--transport", "distributed", "--pushes", "3",
                            "--sync-port", str(free_port()), "--out", out], env=dict(env, NF_URL=url), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    finally:
        httpd.shutdown()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.load(open(out))
    assert res["group"]["backend"] == "gloo" and res["group"]["flattened"] and res["group"]["world"] == 2
    for i in (1, 2, 3):
        push = res[f"push{i}"]
        assert push["checksums"] == {"embedded": "checksums"} and push["version_ok"], push
        assert push["gb"] > 0 and push["send_s"] > 0 and push["behaviour"]["max"] < 0.1, push


def test_compare_of_a_sync_and_an_async_run(tmp_path):
    """Issue 41's compare.json from two scripted runs: the step time over steps 2..N, pass@1 at the last common
    eval against 2 SE of the difference, pushes verified only when every push record names its servers.
    Bugs caught: step 1 (no rollout beside it one step off) in the mean, the SEs added instead of combined in
    quadrature, a push that no server verified counted as verified; the step ratio's interval from the steps'
    SEs (its delta-method formula) with step 1 in it or an SE of the steps instead of their mean."""
    from experiments.h200 import grpo_h200

    def run(name, step_s, passes, verified=1):
        d = tmp_path / name
        d.mkdir()
        recs = [{"kind": "eval", "step": s, "pass@1": p, "pass@1_se": 0.03} for s, p in passes]
        recs += [{"kind": "train", "step": i + 1, "step_s": t, "reward_mean": 0.1, "sync_tensors": 5,
                  "sync_verified": verified, "samples_generated": 12, "samples_trained": 8,
                  "train_rollout_logprob_abs_diff": 0.01, "tis": 1.0} for i, t in enumerate(step_s)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return str(d)
    sync = run("sync", [20.0, 10.0, 10.0], [(0, 0.20), (3, 0.40)])
    fast = run("async", [30.0, 6.0, 6.0], [(3, 0.30)])
    a = argparse.Namespace(sync=sync, async_run=fast, gpu="", windows="", out=str(tmp_path / "c.json"))
    grpo_h200.cmd_compare(a)
    bars = json.load(open(tmp_path / "c.json"))["bars"]
    assert bars["async_over_sync_step_s"] == pytest.approx(0.6) and bars["step_ratio_met"]
    assert bars["pass_step"] == 3 and bars["pass_diff_se"] == pytest.approx(0.03 * 2 ** 0.5)
    assert not bars["pass_within_2se"] and bars["pushes_all_verified"]       # |-0.10| > 2 x 0.0424
    a.async_run = run("unverified", [30.0, 6.0, 6.0], [(3, 0.40)], verified=0)
    grpo_h200.cmd_compare(a)
    bars = json.load(open(tmp_path / "c.json"))["bars"]
    assert bars["pass_within_2se"] and not bars["pushes_all_verified"]
    assert bars["step_ratio_ci95"] == pytest.approx([0.6, 0.6])           # steps 2..N without scatter
    a.sync, a.async_run = run("sync2", [20.0, 10.0, 12.0], []), run("async2", [30.0, 6.0, 7.0], [])
    grpo_h200.cmd_compare(a)
    bars = json.load(open(tmp_path / "c.json"))["bars"]
    r, se = 6.5 / 11, 6.5 / 11 * ((1.0 / 11) ** 2 + (0.5 / 6.5) ** 2) ** 0.5   # SEs of the means: 1.0 and 0.5
    assert bars["step_ratio_ci95"] == pytest.approx([r - 1.96 * se, r + 1.96 * se])


def test_compare_of_an_async_run_cut_short_by_a_server_restart(tmp_path):
    """The 2026-12-03 H200 comparison: the one-step-off run lost its server at step 5 (restart logged, the rollout
    for step 6 redone) and the hold ended at step 6. Bugs caught: the restart's 97 s and the refill step in the
    mean step time, the bar judged on 6 steps against 20, an open time window (no end stamp) crashing the GPU rows."""
    from experiments.h200 import grpo_h200

    def run(name, step_s, restart_at=None):
        d = tmp_path / name
        d.mkdir()
        recs = [{"kind": "train", "step": i + 1, "step_s": t, "reward_mean": 0.1, "sync_tensors": 5,
                 "sync_verified": 1, "samples_generated": 8, "samples_trained": 8} for i, t in enumerate(step_s)]
        if restart_at:
            recs.append({"kind": "server_restart", "step": restart_at, "during": f"rollout for step {restart_at + 1}"})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return str(d)
    sync = run("sync", [9.0] + [8.0] * 19)
    cut = run("async", [9.7, 6.0, 4.0, 5.0, 97.6, 13.4], restart_at=5)
    (tmp_path / "w.txt").write_text("sync 100\nsync 300\nasync 300\n")
    (tmp_path / "gpu.csv").write_text("150, 20, 1000\n350, 90, 2000\n")
    a = argparse.Namespace(sync=sync, async_run=cut, gpu=str(tmp_path / "gpu.csv"), windows=str(tmp_path / "w.txt"),
                           out=str(tmp_path / "c.json"))
    grpo_h200.cmd_compare(a)
    res = json.load(open(tmp_path / "c.json"))
    assert res["async"]["restart_steps"] == [5, 6] and res["async"]["steps_timed"] == 3
    assert res["bars"]["async_over_sync_step_s"] == pytest.approx(5.0 / 8.0)
    assert res["bars"]["complete"] is False and res["bars"]["step_ratio_met"] is None
    assert res["async"]["gpu_mem_max_mib"] == 2000 and res["sync"]["gpu_mem_max_mib"] == 1000


def _regenerated_compare(name: str, tmp_path):
    """compare.json of docs/results/<name> regenerated from its runs' metrics by `grpo_h200.py
    compare`, after checking it equals the stored one (a stored file edited by hand, or left from older code)."""
    from experiments.h200 import grpo_h200
    d = os.path.join(ROOT, "docs", "results", name)
    a = argparse.Namespace(sync=os.path.join(d, "run_sync"), async_run=os.path.join(d, "run_async"),
                           gpu=os.path.join(d, "gpu.csv"), windows=os.path.join(d, "windows.txt"),
                           out=str(tmp_path / "c.json"))
    grpo_h200.cmd_compare(a)
    res = json.load(open(tmp_path / "c.json"))
    assert res == json.load(open(os.path.join(d, "compare.json")))
    return res


def test_rollouts_md_quotes_the_h200_comparison_as_measured(tmp_path):
    """docs/rollouts.md's figures of the 2026-12-03 H200 comparison are what `grpo_h200.py compare` makes of the
    runs' metrics today (the stored compare.json regenerated, then each quoted number found in the doc)."""
    res = _regenerated_compare("async_compare_long_h200", tmp_path)
    s, y = res["sync"], res["async"]
    doc = open(os.path.join(ROOT, "docs", "rollouts.md")).read()
    quoted = [f"**{s['step_s_mean']:.2f} s**", f"rollout {s['rollout_s']:.2f} s", f"trainer {s['train_s']:.2f} s",
              f"push {s['sync_s']:.2f} s", f"gap {s['gap_mean']:.4f}", f"**{y['step_s_mean']:.2f} s**",
              f"**{res['bars']['async_over_sync_step_s']:.2f}x**", f"rollout ({y['rollout_s']:.2f} s)",
              f"trainer's {y['train_s']:.2f} s", f"push ({y['sync_s']:.2f} s)", f"gap {y['gap_mean']:.4f}",
              f"**{y['gpu_mem_max_mib']:,.0f} of", f"pass@1 {s['evals'][0]['pass@1']:.3f} -> {s['evals'][-1]['pass@1']:.3f}"]
    missing = [q for q in quoted if q not in doc]
    assert not missing, missing
    assert y["steps_timed"] == 3 and res["bars"]["complete"] is False


def test_rollouts_md_quotes_the_h100_comparison_as_measured(tmp_path):
    """docs/rollouts.md's table of the 2026-12-07 H100 comparison (the first complete one) is what `grpo_h200.py
    compare` makes of the runs' metrics today: the stored compare.json regenerated, then each row of the table
    rebuilt from it and found in the doc, and the bars as the prose states them (ratio <= 0.7, within 2 SE)."""
    res = _regenerated_compare("async_compare_long_h100", tmp_path)
    s, y, bars = res["sync"], res["async"], res["bars"]
    doc = open(os.path.join(ROOT, "docs", "rollouts.md")).read()
    sec = lambda x: f"{x:.2f} s"                                                  # noqa: E731
    rows = [("step", f"**{sec(s['step_s_mean'])}**", f"**{sec(y['step_s_mean'])}**"),
            ("rollout (one step off: beside the training)", sec(s["rollout_s"]), sec(y["rollout_s"])),
            ("waiting for the rollout", sec(s["rollout_wait_s"]), sec(y["rollout_wait_s"])),
            ("trainer: old log-probs, forward + backward, optimizer", sec(s["train_s"]), sec(y["train_s"])),
            ("push (FP8, verified by SGLang's checksums)", sec(s["sync_s"]), sec(y["sync_s"])),
            ("waiting at the boundary", sec(s["boundary_wait_s"]), sec(y["boundary_wait_s"])),
            ("pushes verified", f"{s['pushes_verified']} of {s['pushes']}", f"{y['pushes_verified']} of {y['pushes']}"),
            ("gap, mean \\|dlogp\\| SGLang vs trainer", f"{s['gap_mean']:.4f}", f"{y['gap_mean']:.4f}"),
            ("TIS ratio, mean", f"{s['tis_mean']:.3f}", f"{y['tis_mean']:.3f}"),
            ("staleness, mean / max", f"{s['staleness_mean']:.2f} / {s['staleness_max']}",
             f"{y['staleness_mean']:.2f} / {y['staleness_max']}"),
            ("held-out pass@1 at step 20 (64 problems x 8)", f"{s['evals'][-1]['pass@1']:.3f} (SE {s['evals'][-1]['se']:.3f})",
             f"{y['evals'][-1]['pass@1']:.3f} (SE {y['evals'][-1]['se']:.3f})"),
            ("samples generated / trained", f"{s['generated_per_trained']:.2f}", f"{y['generated_per_trained']:.2f}"),
            ("GPU utilisation, mean", f"{s['gpu_util_mean']:.0f}%", f"{y['gpu_util_mean']:.0f}%"),
            ("GPU memory, max (of 81,559 MiB)", f"{s['gpu_mem_max_mib']:,.0f} MiB", f"{y['gpu_mem_max_mib']:,.0f} MiB"),
            ("the trainer's peak", f"{s['gpu_peak_gib']:.2f} GiB", f"{y['gpu_peak_gib']:.2f} GiB")]
    missing = [r for r in rows if f"| {r[0]} | {r[1]} | {r[2]} |" not in doc]
    assert not missing, missing
    assert f"**{bars['async_over_sync_step_s']:.2f}x**" in doc and f"met, by {0.7 - bars['async_over_sync_step_s']:.3f}" in doc
    lo, hi = bars["step_ratio_ci95"]
    assert f"its 95% interval from the {s['steps_timed']} timed steps of each run is {lo:.2f}-{hi:.2f}" in doc
    assert s["steps_timed"] == y["steps_timed"] and lo < bars["step_ratio_bar"] < hi       # "not beyond its scatter"
    assert f"differs by {bars['pass_diff']:.3f}" in doc and f"({bars['pass_diff_se']:.3f})" in doc
    assert bars["complete"] and bars["step_ratio_met"] and bars["pass_within_2se"] and bars["pushes_all_verified"]
    assert abs(bars["pass_diff"]) <= bars["pass_diff_se"]                        # "within 1 SE", as the prose says
    serial = max(y["rollout_s"], y["train_s"]) + y["sync_s"] + y["boundary_wait_s"]
    assert f"= {serial:.2f} s" in doc
    readme = " ".join(open(os.path.join(ROOT, "experiments", "h200", "README.md")).read().split())
    assert (f"the trainer's peak {s['gpu_peak_gib']:.2f} GiB, the GPU's {max(s['gpu_mem_max_mib'], y['gpu_mem_max_mib']):,.0f} "
            f"of 81,559 MiB") in readme


def _sh_functions(*names: str) -> str:
    """A bash line that defines grpo_h200.sh's functions `names` (each from `name() {` to its closing `}` line),
    for a test to call them alone."""
    sh = os.path.join(os.path.dirname(__file__), "grpo_h200.sh")
    return "source <(sed -n '" + ";".join(f"/^{n}()/,/^}}/p" for n in names) + "' " + sh + ")"


def test_compare_deadlines_leave_the_second_run_its_share(tmp_path):
    """grpo_h200.sh's compare_deadline: each compared run ends where the hold (H20_HOLD_S from $W/T0) has 60 s
    left, the synchronous one at 3/5 of that. Bugs caught: the first run given the whole hold (the 2026-12-05
    attempt lost its second run and collect so), the split applied to the one-step-off run, the reserve dropped."""
    funcs = _sh_functions("hold_left", "compare_deadline")
    t0 = int(time.time()) - 100
    (tmp_path / "T0").write_text(str(t0))
    out = subprocess.run(["bash", "-c", f"{funcs}; compare_deadline sync; compare_deadline async"],
                         env={**os.environ, "W": str(tmp_path), "H20_HOLD_S": "1140"}, capture_output=True, text=True)
    late = int(time.time()) + 1 - (t0 + 100)       # seconds the calls can have seen pass (a loaded CI box: several)
    sync, one_off = map(int, out.stdout.split())
    assert out.returncode == 0 and 980 - late <= one_off <= 980, (out.stdout, out.stderr, late)
    assert (980 - late) * 3 // 5 <= sync <= 980 * 3 // 5, (out.stdout, late)     # 3/5 of the same hold, earlier


def test_card_knobs_fit_the_long_task_to_an_80_gb_card_only_where_unset(tmp_path):
    """grpo_h200.sh's card_knobs: on a card under 100,000 MiB (nvidia-smi, faked here) the long task gets SGLang's
    0.25, the trainer's cap 0.60 and micro-batches of 4,096 tokens (8,192 for the comparison, which has no live
    checks); a knob set by hand is kept; an H200 (143,771 MiB) and the sums task get none. Bugs caught: the 80 GB
    knobs applied on an H200, a hand-set knob overwritten, the live-check run left at 8,192 (the second long
    hold's OOM)."""
    funcs = _sh_functions("card_knobs")
    fake = tmp_path / "nvidia-smi"
    show = 'card_knobs > /dev/null; echo "${H20_MEM:-} ${H20_TRAIN_MEM:-} ${H20_TRAIN_ARGS:-}"'

    def knobs(mib, **env):
        fake.write_text(f"#!/bin/sh\necho {mib}\n")
        fake.chmod(0o755)
        base = {k: v for k, v in os.environ.items() if not k.startswith("H20_")}
        out = subprocess.run(["bash", "-c", f"{funcs}; {show}"], capture_output=True, text=True,
                             env={**base, "PATH": f"{tmp_path}:{os.environ['PATH']}", "LONG": "1", **env})
        assert out.returncode == 0, out.stderr
        return out.stdout.split()
    assert knobs(81559) == ["0.25", "0.60", "--parallel.micro_batch_tokens", "4096"]
    assert knobs(81559, H20_COMPARE="1") == ["0.25", "0.60", "--parallel.micro_batch_tokens", "8192"]
    assert knobs(81559, H20_MEM="0.3", H20_TRAIN_ARGS="--x 1") == ["0.3", "0.60", "--x", "1"]
    assert knobs(143771) == [] and knobs(81559, LONG="0") == []


def test_oom_half_reads_only_this_runs_output_and_halves_its_micro_batch(tmp_path):
    """grpo_h200.sh's oom_half, which decides the pipeline's one retry of train.py: a CUDA OOM in the run's own
    lines of pipeline.log (from line $1) gives half the micro-batch tokens of the last override (else h200.txt's);
    no OOM, an OOM of an earlier run, or micro-batches already at 1,024 give none. Bugs caught: a retry after any
    failure (a deadline's Ctrl-C, a server gone), an earlier flag read instead of the last, no floor."""
    funcs = _sh_functions("oom_half") + "; overrides() { echo \"$OV\"; }"
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1010.00 MiB."

    def half(lines, start, ov):
        (tmp_path / "pipeline.log").write_text("\n".join(lines) + "\n")
        out = subprocess.run(["bash", "-c", f"{funcs}; oom_half {start}"], capture_output=True, text=True,
                             env={**os.environ, "W": str(tmp_path), "R": ROOT, "OV": ov})
        return out.stdout.strip() if out.returncode == 0 else None
    flags = "--parallel.micro_batch_tokens 8192 --x 1 --parallel.micro_batch_tokens 6144"
    assert half(["=== sft", "=== train", "step 1", oom], 2, flags) == "3072"
    assert half(["=== train", oom], 1, "--model.kernels auto") == "8192"          # h200.txt's 16384
    assert half(["=== train", "step 1", "Traceback", "KeyboardInterrupt"], 1, flags) is None
    assert half([oom, "=== train", "step 1"], 2, flags) is None                     # an earlier run's OOM
    assert half(["=== train", oom], 1, "--parallel.micro_batch_tokens 1024") is None


@pytest.mark.parametrize("fails,t0_ago,calls,rc,parity", [
    ("oom", 100, ["", "--parallel.micro_batch_tokens 4096"], 0, "1"),     # retried at half, which runs
    ("oom oom", 100, ["", "--parallel.micro_batch_tokens 4096"], 1, "1"),  # once only
    ("oom", 1000, [""], 1, "1"),                                           # < 300 s of GRPO left beyond the reserve
    ("oom", 1000, ["", "--parallel.micro_batch_tokens 4096"], 0, "0"),     # ... which is 80 s without the parity
    ("other", 100, [""], 1, "1")])                                         # a failure that is not an OOM: no retry
def test_grpo_once_more_retries_a_cuda_oom_once_at_half_the_micro_batch(tmp_path, fails, t0_ago, calls, rc, parity):
    """grpo_h200.sh's grpo_once_more with train.py faked (grpo_run: writes its output into pipeline.log as the
    pipeline's stdout, fails as `fails` says): one retry after a CUDA OOM, with half the micro-batch tokens, only
    while the hold (1,440 s from $W/T0) leaves 300 s beyond the deadline's reserve (260 s; 80 s with
    H20_PARITY=0); the failed run moved to run_oom."""
    funcs = (_sh_functions("grpo_once_more", "oom_half", "hold_left", "deadline_reserve")
             + "; overrides() { echo --parallel.micro_batch_tokens 8192; }; stamp() { echo \"=== $1\"; }")
    fake = ('grpo_run() { echo "call:$1" >> $W/calls; mkdir -p $W/run; touch $W/run/m$(wc -l < $W/calls)\n'
            '  set -- $FAILS; local f; f=$(eval echo \\${$(wc -l < $W/calls):-ok})\n'
            '  [ "$f" = oom ] && { echo "torch.OutOfMemoryError: CUDA out of memory."; return 1; }\n'
            '  [ "$f" = other ] && { echo "RuntimeError: server gone"; return 1; }; return 0; }')
    (tmp_path / "T0").write_text(str(int(time.time()) - t0_ago))
    (tmp_path / "pipeline.log").write_text("=== sft\n")
    out = subprocess.run(["bash", "-c", f"{funcs}\n{fake}\ngrpo_once_more >> $W/pipeline.log"], capture_output=True,
                         text=True, env={**os.environ, "W": str(tmp_path), "R": ROOT, "FAILS": fails,
                                         "H20_HOLD_S": "1440", "H20_PARITY": parity})
    assert out.returncode == rc, (out.stdout, out.stderr)
    assert (tmp_path / "calls").read_text().split("\n")[:-1] == [f"call:{c}" for c in calls]
    log = (tmp_path / "pipeline.log").read_text()
    assert ("train again: CUDA out of memory, micro-batches of 4096 tokens" in log) == (len(calls) == 2)
    if len(calls) == 2:   # the first run's files in run_oom, the second's in run
        assert os.listdir(tmp_path / "run_oom") == ["m1"] and os.listdir(tmp_path / "run") == ["m2"]


def test_rollouts_md_prose_of_the_h100_comparison_is_its_files():
    """The prose around that table: the prompt and response lengths, the all-equal groups and the mean reward, the
    aborted samples, the gap's ratio to the first run and the two warm starts' P(worked), each from its file."""
    res = os.path.join(ROOT, "docs", "results")
    doc = " ".join(open(os.path.join(ROOT, "docs", "rollouts.md")).read().split())
    para = doc.split("**The first complete comparison", 1)[1]

    def steps(run):
        with open(os.path.join(res, "async_compare_long_h100", run, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if r.get("kind") == "train"]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)                 # noqa: E731
    s, y = steps("run_sync"), steps("run_async")
    both = s + y
    assert f"prompts of ~{round(mean(both, 'prompt_len_mean'), -1):,.0f} tokens" in para
    assert f"responses of ~{mean(both, 'response_len_mean'):.0f}" in para and max(r["truncated_frac"] for r in s) == 0
    assert f"({mean(s, 'zero_std_group_frac'):.0%} and {mean(y, 'zero_std_group_frac'):.0%} of the groups seen" in para
    assert f"mean reward of {mean(both, 'reward_mean'):.2f}" in para
    assert f"{mean(s, 'samples_aborted'):.1f} samples a step were aborted" in para and mean(y, "samples_aborted") == 0
    new, old = (json.load(open(os.path.join(res, d, "compare.json")))["sync"]["gap_mean"]
                for d in ("async_compare_long_h100", "async_compare_long_h200"))
    assert f"{new / old:.1f}x the first run's {old:.4f}" in para
    worked = [json.load(open(os.path.join(res, d, "warm", "sft.json")))["final"]["p_worked"]
              for d in ("async_compare_long_h200", "async_compare_long_h100")]
    assert f"(P(worked) {worked[0]:.2f}), this one works the chain ({worked[1]:.2f})" in para


def test_agreement_summary_reads_each_kind_by_its_prefix():
    """runstats.summarize's indexer agreement: the exact-vs-FP8 sets (`agree_`), and the exact and FP8 sets
    against SGLang's own (`server_agree_`, `server_fp8_agree_`), each position-weighted over the steps, none
    mixed into another. Bug caught: a prefix matching the others' keys (`agree_` inside `server_agree_`), or
    the layer read from the wrong field of the key."""
    from instruments import runstats
    recs = []
    for step, (n, ov) in enumerate([(10, 0.9), (30, 0.5)], 1):
        rec = {"kind": "train", "step": step}
        for prefix, shift in (("agree", 0.0), ("server_agree", 0.01), ("server_fp8_agree", 0.02)):
            rec.update({f"{prefix}_3_positions": n, f"{prefix}_3_overlap_mean": ov + shift,
                        f"{prefix}_3_identical_share": ov / 2, f"{prefix}_3_swapped_mean": 1.0,
                        f"{prefix}_3_overlap_min": ov - 0.1})
        recs.append(rec)
    got = {k: runstats.agreement_summary(recs, p)
           for k, p in (("a", "agree"), ("s", "server_agree"), ("f", "server_fp8_agree"))}
    for k, shift in (("a", 0.0), ("s", 0.01), ("f", 0.02)):
        assert list(got[k]) == ["layer_3"] and got[k]["layer_3"]["positions"] == 40
        assert got[k]["layer_3"]["overlap_mean"] == pytest.approx((10 * 0.9 + 30 * 0.5) / 40 + shift)
        assert got[k]["layer_3"]["overlap_min"] == pytest.approx(0.4)


def test_server_topk_bounds_the_pool_only_when_asked_on_the_long_task():
    """grpo_h200.sh's server_topk: SGLang reports its C4 kept sets (for LiveChecksLong's server_agree_*) only with
    H20_SERVER_TOPK=1 on the long task, and then always with its KV pool bounded (SGLang 0.5.16 pins 4 KiB of host
    memory a pool token for the report; an H100's unbounded pool held 24.7M). Bug caught: the report switched on
    without the bound (~100 GB pinned), or on the sums task, or by default."""
    funcs = _sh_functions("server_topk")
    base = {k: v for k, v in os.environ.items() if not k.startswith("H20_")}

    def flags(**env):
        out = subprocess.run(["bash", "-c", f"{funcs}; server_topk"], capture_output=True, text=True,
                             env={**base, **env})
        assert out.returncode == 0, out.stderr
        return out.stdout.split()
    assert flags(LONG="1", H20_SERVER_TOPK="1") == ["--enable-return-indexer-topk", "--max-total-tokens", "262144"]
    assert flags(LONG="1", H20_SERVER_TOPK="1", H20_TOPK_TOKENS="131072")[-1] == "131072"
    assert flags(LONG="1", H20_INDEXER_REPLAY="1") == flags(LONG="1", H20_SERVER_TOPK="1")    # replay needs them
    assert flags(LONG="1") == [] and flags(LONG="0", H20_SERVER_TOPK="1") == []
    with tempfile.TemporaryDirectory() as w:   # SGLang did not boot with them once (server_up): never again
        open(os.path.join(w, "NO_TOPK"), "w").close()
        assert flags(LONG="1", H20_SERVER_TOPK="1", W=w) == []


def test_long_overrides_replay_only_when_asked_and_while_sglang_reports_its_sets(tmp_path):
    """grpo_h200.sh's long_overrides: H20_INDEXER_REPLAY=1 gives train.py `--rollout.indexer_replay true` (the dry
    run's embedded server reports the records too), but not once SGLang had to boot without the report
    ($W/NO_TOPK, server_up): train.py's preflight would refuse such a server and the hold would be lost. Bug
    caught: replay asked of a server started without the report, or never asked in the dry run."""
    funcs = _sh_functions("long_overrides")
    base = {k: v for k, v in os.environ.items() if not k.startswith("H20_")}

    def args(**env):
        out = subprocess.run(["bash", "-c", f"{funcs}; long_overrides"], capture_output=True, text=True,
                             env={**base, "LT": "py:experiments.h200.longctx", "W": str(tmp_path), **env})
        assert not out.stderr, out.stderr   # (its status is its last test's: 1 in the dry run, as in the script)
        return " ".join(out.stdout.split())
    for mode in ("dry", "gpu"):
        assert "--rollout.indexer_replay true" in args(MODE=mode, H20_INDEXER_REPLAY="1"), mode
        assert "indexer_replay" not in args(MODE=mode), mode
    (tmp_path / "NO_TOPK").touch()
    assert "indexer_replay" not in args(MODE="gpu", H20_INDEXER_REPLAY="1")
