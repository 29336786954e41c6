"""docs/benchmarks.md's tables of issue 43's H200 measurements, rendered from their JSON results.

    .venv/bin/python scripts/bench_tables.py --write-docs      # after copying new results into docs/results/

Each table sits between `<!-- H200_TABLE:<name> -->` and `<!-- /H200_TABLE:<name> -->`; `tests/test_bench_tables.py`
checks that the doc holds exactly what `render` makes of the files, so a number quoted there cannot drift from
its measurement. The results come from (one H200, one command each):
    attention_bwd    bench/bench_attention.py --bwd --out docs/results/attention_bwd_h200.json
    stack_recompute  bench/bench_stack.py --jobs none,selective,full,planner \
                         --out docs/results/stack_recompute_h200.json          (the fused attention backward)
    stack_recompute_wgmma  bench/bench_stack.py --jobs none,selective,full --deadline 90 \
                         --out docs/results/stack_recompute_wgmma_h200.json    (the wgmma backward, Hopper's default)
    batching         bench/bench_rollout.py --part batching --out docs/results/batching_h200.json
    grpo_step        bench/bench_grpo_step.py --out docs/results/grpo_step_h200.json
    launches         bench/bench_rollout.py --part launches --device cpu --out docs/results/launches_small_cpu.json
                     (a CPU profile: the op counts are a property of the code path, the same on any device)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scripts.doc_blocks import read_block, write_block  # noqa: E402,F401 (tests read the tables)
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = {name: os.path.join(ROOT, "docs", "results", f"{name}_h200.json")
           for name in ("attention_bwd", "stack_recompute", "stack_recompute_wgmma", "batching", "grpo_step")}
RESULTS["launches"] = os.path.join(ROOT, "docs", "results", "launches_small_cpu.json")
HOPPER_DEFAULT = "m128-rows"   # attention.HOPPER_BWD_CONFIG's candidate name in the bench
B11_TOKENS_PER_S = 56          # issue 43's "today": the gpu recipe's rollout on 2026-12-03 (B11)


def attention_bwd(d: dict) -> str:
    rows = {}
    for r in d["bwd_rows"]:
        rows.setdefault((r["S"], r["kind"]), {})[r["config"]] = r
    out = [f"ceiling {d['ceiling_tflops']:.0f} TFLOP/s (bf16 matmul, same run); fwd+bwd TFLOP/s "
           "(ratio to the ceiling)", "",
           "| S | layer | fused (before) | m128-rows (default on Hopper) | best candidate | best / fused |",
           "|---|---|---|---|---|---|"]
    for (S, kind), c in sorted(rows.items()):
        f = c["fused"]
        new = c.get(HOPPER_DEFAULT) or c["m128-keys"]   # no entries: -rows is the -keys passes
        best = max((r for n, r in c.items() if n != "fused"), key=lambda r: r["fwdbwd_tflops"])
        cell = lambda r: f"{r['fwdbwd_tflops']:.1f} ({r['fwdbwd_of_ceiling']:.3f})"   # noqa: E731
        out.append(f"| {S} | {kind} | {cell(f)} | {cell(new)} | {best['config']} {cell(best)} | "
                   f"{best['fwdbwd_tflops'] / f['fwdbwd_tflops']:.2f} |")
    return "\n".join(out)


def stack_recompute(d: dict) -> str:
    lay = d["layers"]
    lay = f"{len(lay)} layers (compress ratios {', '.join(map(str, lay))})" if isinstance(lay, list) \
        else f"{lay} layers"
    out = [f"{lay}, S = {d['seq']}, kernels {d['kernels']}, ceiling {d['matmul_ceiling_tflops']:.0f} TFLOP/s", "",
           "| recompute | step s | MFU | HFU | peak GiB | activations kept after the forward, GiB |",
           "|---|---|---|---|---|---|"]
    for k in ("none", "selective", "full"):
        r = d[k]
        out.append(f"| {k} | {r['step_s']:.3f} | {r['mfu']:.3f} | {r['hfu']:.3f} | {r['peak_gib']:.1f} | "
                   f"{r['acts_after_fwd_gib']:.1f} |")
    return "\n".join(out)


def batching(d) -> str:
    d = d[0] if isinstance(d, list) else d
    out = [f"{d['workload']}, `{d['preset']}`, FP8 engine; decode cache in use: {d['cache_decode']}", "",
           f"| engine | tokens/s | x serial | x {B11_TOKENS_PER_S} (B11) | decode forwards / round | rows / forward | "
           "samples as serial | max abs dlogp vs serial |", "|---|---|---|---|---|---|---|---|"]
    for k, r in d["modes"].items():
        out.append(f"| {k} | {r['tokens_per_s']:.0f} | {d['speedup_vs_serial'][k]:.2f} | "
                   f"{r['tokens_per_s'] / B11_TOKENS_PER_S:.1f} | {r['decode_forwards_per_round']:.0f} | "
                   f"{r['rows_per_forward']:.0f} | {r['same_samples_as_serial']} | "
                   f"{r['max_abs_dlogp_vs_serial']:.1e} |")
    return "\n".join(out)


def grpo_step(d: dict) -> str:
    t, m, p = d["time_s"], d["mfu"], d["profile"]
    out = [f"{d['recipe']} ({d['preset']} geometry, {d['params'] / 1e9:.2f}B, kernels {d['kernels']}), "
           f"{d['prompts']} x {d['samples']} sequences, {d['tokens']} tokens ({d['scored_tokens']:.0f} scored), "
           f"{d['micro_batches']} micro-batches, ceiling {d['matmul_ceiling_tflops']:.0f} TFLOP/s", "",
           "| part | s | MFU |", "|---|---|---|",
           f"| old log-probs (recompute) | {t['old_logprobs_s']:.3f} | {m['old_logprobs']:.3f} |",
           f"| forward + backward | {t['fwd_bwd_s']:.3f} | {m['fwd_bwd']:.3f} |",
           f"| optimizer | {t['optimizer_s']:.3f} | |",
           f"| step | {t['step_s']:.3f} | {m['step']:.3f} |", "",
           f"Profile of one step: GPU busy {p['gpu_busy_ms']:.0f} of {p['wall_ms']:.0f} ms, outside kernels "
           f"{p['outside_kernels_frac']:.1%}, {p['launches']} launches; peak {d['peak_gib']:.1f} GiB."]
    return "\n".join(out)


def launches(d) -> str:
    d = d[0] if isinstance(d, list) else d
    cols = ("decode_forward_reference", "decode_forward", "scoring_forward")
    ref, new = d[cols[0]], d[cols[1]]
    scopes = sorted({k for c in cols for k in d[c]["kernel_ops_by_scope"]},
                    key=lambda k: (-ref["kernel_ops_by_scope"].get(k, 0), -new["kernel_ops_by_scope"].get(k, 0), k))
    out = [f"`{d['preset']}` engine model (the `gpu` recipe's), one forward of {d['rows']} rows; kernel ops (aten ops "
           "that are not views,", f"plus Triton launches) by the scope that issued them; the decode seam profiled as "
           f"kernels=\"{d['decode_kernels']}\" on {d['device']}", "",
           "| scope | decode, reference | decode, seam | scoring (no cache) |", "|---|---|---|---|"]
    for k in scopes:
        out.append(f"| {k} | " + " | ".join(str(d[c]["kernel_ops_by_scope"].get(k, "")) for c in cols) + " |")
    out.append("| **kernel ops** | " + " | ".join(f"**{d[c]['kernel_ops']}**" for c in cols) + " |")
    out.append("| view ops | " + " | ".join(str(d[c]["view_ops"]) for c in cols) + " |")
    out += ["", f"Decode seam / reference: {d['decode_ops_ratio']:.2f} of the kernel ops; logits "
                f"{d['decode_max_rel_diff']:.1e} from the reference (relative to their max)."]
    return "\n".join(out)


RENDER = {"attention_bwd": attention_bwd, "stack_recompute": stack_recompute,
          "stack_recompute_wgmma": stack_recompute, "batching": batching,
          "grpo_step": grpo_step, "launches": launches}


def render(name: str) -> str:
    with open(RESULTS[name]) as f:
        return RENDER[name](json.load(f))


def markers(name: str) -> tuple[str, str]:
    return f"<!-- H200_TABLE:{name} -->", f"<!-- /H200_TABLE:{name} -->"


def write_docs() -> None:
    for name in RENDER:
        write_block(DOC, markers(name), render(name))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args()
    if a.write_docs:
        write_docs()
    else:
        for n in RENDER:
            print(f"## {n}\n{render(n)}\n")
