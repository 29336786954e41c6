"""Find the first block where SGLang and nanoflash disagree, from SGLang's own per-module tensor dump.

SGLang started with `--debug-tensor-dump-output-folder DIR` saves, for every forward pass, the output of every
module (`model.layers.3.self_attn`, `model.layers.3.mlp`, ...) in `DIR/TP0_PP0_Rank0_pid*/PassNNNNN.pt`. This
script sends one prefill of fixed tokens, loads the dump of that pass, runs nanoflash on the same tokens with a
forward hook on every module, maps module names (official -> SGLang HF-style: attn -> self_attn, ffn -> mlp,
attn_norm -> input_layernorm, ...) and prints, in forward order, the relative error of every pair whose element
counts agree. The first row above the threshold is where the engines part.

    python experiments/h200/sglang_dump_compare.py --dir /tmp/nf_small --dump /tmp/dump --out $OUT/dump_compare.json
"""
import argparse
import glob
import json
import os

import torch

from sglang_check import DEVICE, URL, load_model   # sibling script in bench/

TOP = {"embed": "model.embed_tokens", "head": "lm_head", "norm": "model.norm"}
SUB = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn": "self_attn", "ffn": "mlp"}
REL_TOL = 0.02   # bf16 engines with FP8 GEMMs agree to ~1e-2 relative per block; above that they differ


def sglang_name(ours: str) -> str:
    """Official module name -> SGLang's (`layers.3.attn.indexer` -> `model.layers.3.self_attn.indexer`)."""
    parts = ours.split(".")
    if parts[0] in TOP:
        return ".".join([TOP[parts[0]]] + parts[1:])
    if parts[0] == "layers" and len(parts) > 2:
        return ".".join(["model.layers", parts[1], SUB.get(parts[2], parts[2])] + parts[3:])
    return "model." + ours


def capture(model, ids):
    out = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, name=name: out.__setitem__(name, o))
             for name, m in model.named_modules() if name]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def compare(theirs: dict, ours: dict) -> list:
    rows = []
    by_sg = {sglang_name(k): k for k in ours}
    for key, t in theirs.items():
        if not isinstance(t, torch.Tensor) or key not in by_sg:
            continue
        a, b = ours[by_sg[key]].float().cpu().flatten(), t.float().flatten()
        if a.numel() != b.numel():
            rows.append({"sglang": key, "ours": by_sg[key], "skip": f"numel {a.numel()} vs {b.numel()}"})
            continue
        rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        rows.append({"sglang": key, "ours": by_sg[key], "rel_l2": rel, "max_abs": (a - b).abs().max().item()})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/nf_small")
    ap.add_argument("--dump", default="/tmp/dump")
    ap.add_argument("--out", default="/tmp/dump_compare.json")
    ap.add_argument("--len", type=int, default=256)
    a = ap.parse_args()
    from nanoflash.sglang.client import SGLangClient
    ids = torch.randint(3, 100000, (a.len,), generator=torch.Generator().manual_seed(3)).tolist()
    client = SGLangClient([URL], timeout=600)
    client.wait_healthy(timeout=420)
    before = set(glob.glob(os.path.join(a.dump, "*", "Pass*.pt")))
    client.generate(ids, {"temperature": 0, "max_new_tokens": 2})
    client.generate(ids[:8], {"temperature": 0, "max_new_tokens": 1})   # a pass is written when the next begins
    new = sorted(set(glob.glob(os.path.join(a.dump, "*", "Pass*.pt"))) - before)
    new = new or sorted(glob.glob(os.path.join(a.dump, "*", "Pass*.pt")))
    new = [f for f in new if any(v.shape[0] == a.len for v in torch.load(f, map_location="cpu", weights_only=False)
                                 .values() if isinstance(v, torch.Tensor) and v.dim() > 0)] or new
    theirs = torch.load(new[0], map_location="cpu", weights_only=False)
    print(f"{len(new)} new pass files; first has {len(theirs)} tensors: {list(theirs)[:12]} ...")
    ours = capture(load_model(argparse.Namespace(dir=a.dir)), torch.tensor([ids], device=DEVICE))
    rows = compare(theirs, ours)
    first = next((r for r in rows if r.get("rel_l2", 0) > REL_TOL), None)
    res = {"sglang_keys": list(theirs)[:400], "rows": rows, "first_above_tol": first, "rel_tol": REL_TOL}
    for r in rows[:80]:
        print(r)
    print("FIRST ABOVE TOL:", first)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
