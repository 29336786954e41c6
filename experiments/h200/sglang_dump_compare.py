"""Find the module where SGLang and nanoflash part, from SGLang's own per-module tensor dump, measured against
nanoflash's FP8 floor on the same positions (issue 42: the past-EOS difference at 2-4K tokens).

SGLang started with `--debug-tensor-dump-output-folder DIR` saves, for every forward pass, the output of every
leaf module (`model.layers.3.self_attn.wo_b`, `...indexer.wq_b`, `...mlp.shared_experts.down_proj`, ...) in
`DIR/TP0_PP0_Rank0_pid*/PassNNNNN.pt`. With `--enable-return-indexer-topk` it also reports, per position, the
C4 entries each indexer kept (`nanoflash.sglang.client.decode_indexer_topk`). This script:

1. samples a continuation of a long-task prompt (experiments/h200/longctx.py) from the server past its EOS
   (`ignore_eos`, the parity table's setting), so the sequence has prompt, response and past-EOS positions in
   every position band (instruments/bands.py);
2. flushes the server's cache and sends that whole sequence as one prefill, asking for the C4 top-k; the
   pass whose tensors have one row per position is the one compared;
3. runs nanoflash on the same ids twice, with a forward hook on every module: bf16 (the trainer) and its FP8
   model of the served weights with SGLang's FP8 index scores (`qat`, `indexer_quant="fp8"`: the floor);
4. pairs the modules (`sglang_name`: official -> SGLang names; `FUSED`: SGLang's fused `wqkv_a` and
   `gate_up_proj` against the concatenation of nanoflash's parts) and, for every pair and every part of the
   positions (`position_parts`: the three bands, the response, past the first EOS), the relative error
   rel(SGLang, bf16) = |S - N| / |N| beside the floor rel(FP8 model, bf16) on the same rows, and their ratio;
5. names the first module in nanoflash's forward order whose ratio passes RATIO_BAR in a part beyond the
   window while it stays under it in the window band (`first_divergence`): there the two engines part for a
   reason FP8 rounding does not explain -- per layer kind (sliding / C4 / C128), so attention core, indexer
   inputs or experts of that layer. With the top-k report it also gives, per C4 layer, the overlap of the
   entries SGLang kept with those nanoflash keeps and with those its FP8-score reproduction keeps, where the
   top-k selects.

    PYTHONPATH=. python experiments/h200/sglang_dump_compare.py --dir $W/warm --dump $W/dump --out diagnose.json
    bash experiments/h200/grpo_h200.sh diagnose        # the server started for it, on the run's warm start

Tests: `pytest experiments/h200/test_long.py -q` (the pairing, the parts, the verdict on planted dumps).
"""
import argparse
import glob
import json
import os
import time

import torch

TOP = {"embed": "model.embed_tokens", "head": "lm_head", "norm": "model.norm"}
SUB = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn": "self_attn", "ffn": "mlp"}
FUSED = {   # SGLang leaf suffix -> the nanoflash leaves whose outputs it concatenates (last dim), in order
    "self_attn.wqkv_a": ("attn.wq_a", "attn.wkv"),
    "mlp.shared_experts.gate_up_proj": ("ffn.shared_experts.w1", "ffn.shared_experts.w3"),
    "mlp.shared_experts.down_proj": ("ffn.shared_experts.w2",),
}
RATIO_BAR = 3.0    # issue 42's sensitivity bar: a difference 3x the FP8 floor on the same rows is not FP8 rounding
PARTS = ("window", "c4_all", "c4_topk", "response", "past_eos")


def sglang_name(ours: str) -> str:
    """Official module name -> SGLang's (`layers.3.attn.indexer` -> `model.layers.3.self_attn.indexer`)."""
    parts = ours.split(".")
    if parts[0] in TOP:
        return ".".join([TOP[parts[0]]] + parts[1:])
    if parts[0] == "layers" and len(parts) > 2:
        return ".".join(["model.layers", parts[1], SUB.get(parts[2], parts[2])] + parts[3:])
    return "model." + ours


def capture(model, ids):
    """Every module's tensor output of one forward on `ids` [1,L], flattened to [L, ...] fp32 on the CPU, in the
    order the modules ran. Shapes other than [1,L,...] (the routed experts' token slots) are kept as they are."""
    out = {}

    def keep(mod, inp, o, name):
        if isinstance(o, torch.Tensor) and name not in out:
            o = o.detach().float().cpu()
            out[name] = o[0] if o.dim() >= 2 and o.shape[:2] == ids.shape else o
    hooks = [m.register_forward_hook(lambda mod, i, o, name=name: keep(mod, i, o, name))
             for name, m in model.named_modules() if name]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return out


def pairs(theirs: dict, ours: dict) -> list:
    """(label, SGLang name, our name(s)) for every SGLang tensor nanoflash has a counterpart of, in our forward
    order: the same module under `sglang_name`, or a FUSED one against the concatenation of our parts."""
    out, by_sg = [], {sglang_name(k): k for k in ours}
    for key in theirs:
        if key in by_sg:
            out.append((by_sg[key], key, (by_sg[key],)))
            continue
        for suffix, parts in FUSED.items():
            if key.endswith(suffix) and key.startswith("model.layers."):
                layer = key.split(".")[2]
                names = tuple(f"layers.{layer}.{p}" for p in parts)
                if all(n in ours for n in names):
                    out.append((names[0], key, names))
    order = {k: i for i, k in enumerate(ours)}
    return sorted(out, key=lambda r: order[r[0]])


def joined(ours: dict, names: tuple) -> torch.Tensor:
    return torch.cat([ours[n] for n in names], -1) if len(names) > 1 else ours[names[0]]


def position_parts(L: int, prompt_len: int, eos_at, cfg) -> dict:
    """Row masks [L] over query positions 0..L-1: the three bands (instruments.bands), the response (queries
    P-1 .. first EOS) and past the first EOS (`eos_at`: its index in the sequence, or None)."""
    from instruments import bands
    t = torch.arange(L)
    b = bands.band_index(t, cfg)
    end = L if eos_at is None else eos_at
    out = {name: b == i for i, name in enumerate(bands.BANDS)}
    out["response"] = (t >= prompt_len - 1) & (t < end)
    out["past_eos"] = t >= end
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius), 0 for an empty pair."""
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def compare(theirs: dict, ours: dict, floor: dict, masks: dict) -> list:
    """Per paired module and part: rel(SGLang, ours), rel(floor model, ours) on the same rows, their ratio.
    Tensors whose leading dim is not the sequence's are compared whole (part "all")."""
    rows, L = [], len(next(iter(masks.values())))
    for label, key, names in pairs(theirs, ours):
        t, o = theirs[key].float(), joined(ours, names)
        f = joined(floor, names) if all(n in floor for n in names) else None
        if t.shape != o.shape:
            rows.append({"module": label, "sglang": key, "skip": f"shape {tuple(o.shape)} vs {tuple(t.shape)}"})
            continue
        row = {"module": label, "sglang": key, "parts": {}}
        parts = masks.items() if t.shape[0] == L else [("all", None)]
        for part, m in parts:
            if m is not None and not m.any():
                continue
            ts, os_ = (t, o) if m is None else (t[m], o[m])
            r = {"rel": rel(ts, os_), "rows": int(m.sum()) if m is not None else t.shape[0]}
            if f is not None:
                r["floor"] = rel(f if m is None else f[m], os_)
                r["ratio"] = r["rel"] / max(r["floor"], 1e-12)
            row["parts"][part] = r
        rows.append(row)
    return rows


def first_divergence(rows: list, bar: float = RATIO_BAR) -> dict | None:
    """The first row (forward order) whose rel / floor passes `bar` in a part beyond the window (c4_all, c4_topk,
    past_eos) while it stays at most `bar` in the window band (where the run-9 table had no excess):
    {"module", "part", "ratio", "window_ratio"}, or None."""
    for r in rows:
        ps = r.get("parts", {})
        w = ps.get("window", {}).get("ratio")
        if w is None or w > bar:
            continue
        for part in ("c4_all", "c4_topk", "past_eos"):
            ratio = ps.get(part, {}).get("ratio")
            if ratio is not None and ratio > bar:
                return {"module": r["module"], "sglang": r["sglang"], "part": part, "ratio": ratio, "window_ratio": w}
    return None


def dump_pass(dump_dir: str, before: set, L: int) -> dict:
    """The new pass file whose tensors have L rows (the prefill of the whole sequence)."""
    new = sorted(set(glob.glob(os.path.join(dump_dir, "*", "Pass*.pt"))) - before)
    for f in reversed(new):
        d = torch.load(f, map_location="cpu", weights_only=False)
        if any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == L for v in d.values()):
            return d
    raise RuntimeError(f"no new pass file in {dump_dir} has {L} rows ({len(new)} new files)")


def topk_agreement(model, ids, server_topk, cfg, n_pos: int) -> dict:
    """Per C4 layer where the top-k selects: SGLang's kept entries against nanoflash's (exact scores) and against
    its FP8-score reproduction, on n_pos evenly spread positions >= 4 x index_topk."""
    from instruments import bands, indexer_agreement as ia
    L = ids.shape[1]
    lo = bands.edges(cfg)[1]
    if L <= lo:
        return {}
    pos = torch.linspace(lo, L - 1, min(n_pos, L - lo)).long().to(ids.device)
    exact = ia.agreement_with_server(model, ids, server_topk, pos)
    sets = ia.agreement_sets(model, ids, pos, "fp8")
    names = sorted(sets, key=lambda n: int(n.split(".")[1]))
    fp8 = {n: ia.overlap_stats(sets[n][1], server_topk[pos.cpu(), i]) for i, n in enumerate(names)}
    return {n: {"sglang_vs_exact": exact[n], "sglang_vs_fp8_scores": fp8[n],
                "exact_vs_fp8_scores": ia.overlap_stats(*sets[n])} for n in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="the checkpoint the server was started on")
    ap.add_argument("--dump", required=True, help="the server's --debug-tensor-dump-output-folder")
    ap.add_argument("--out", default="/tmp/diagnose.json")
    ap.add_argument("--len", type=int, default=2600, help="prompt tokens (>= 2048: every band has positions)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--topk-positions", type=int, default=128)
    ap.add_argument("--wait", type=float, default=600)
    a = ap.parse_args()
    from experiments.h200 import sglang_check as sc
    from instruments import indexer_agreement as ia
    from nanoflash.rl.data import V4Tokenizer
    from nanoflash.sglang.client import SGLangClient, decode_indexer_topk
    client, t0 = SGLangClient([sc.URL], timeout=900), time.time()
    client.wait_healthy(timeout=a.wait)
    prompt = sc.long_prompt(a.len, 42)
    gen = client.generate(prompt, {"n": 1, "temperature": 1.0, "max_new_tokens": a.new_tokens, "ignore_eos": True})
    seq = prompt + gen[0].output_ids
    eos = V4Tokenizer().eos_id
    eos_at = next((len(prompt) + i for i, t in enumerate(gen[0].output_ids) if t == eos), None)
    client.flush_cache()                                   # the prefill below must compute every position
    before = set(glob.glob(os.path.join(a.dump, "*", "Pass*.pt")))
    body = {"input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_indexer_topk": True}
    meta = client.post(sc.URL, "/generate", body)
    meta = (meta[0] if isinstance(meta, list) else meta).get("meta_info", {})
    client.generate(seq[:8], {"temperature": 0, "max_new_tokens": 1})   # a pass is written when the next begins
    L = len(seq)
    theirs = dump_pass(a.dump, before, L)
    ids = torch.tensor([seq], device=sc.DEVICE)
    model = sc.load_model(argparse.Namespace(dir=a.dir))
    ours = capture(model, ids)
    floor = capture(sc.load_model(argparse.Namespace(dir=a.dir), qat=True, indexer_quant="fp8"), ids)
    masks = position_parts(L, len(prompt), eos_at, model.cfg)
    rows = compare(theirs, ours, floor, masks)
    res = {"prompt_len": len(prompt), "seq_len": L, "eos_at": eos_at, "rows": rows, "ratio_bar": RATIO_BAR,
           "first_divergence": first_divergence(rows), "sglang_keys": list(theirs)[:400],
           "unpaired_ours": sorted(set(ours) - {n for _, _, ns in pairs(theirs, ours) for n in ns})[:200]}
    if "indexer_topk" in meta:
        n_c4 = sum(1 for r in model.cfg.compress_ratios[:model.cfg.n_layers] if r == 4)
        server_topk = decode_indexer_topk(meta, n_c4, model.cfg.index_topk)
        res["topk"] = topk_agreement(model, ids, server_topk, model.cfg, a.topk_positions)
    else:
        res["topk"] = "the server reported no indexer_topk (started without --enable-return-indexer-topk?)"
    res["seconds"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in rows:
        print(r["module"], {p: {k: round(v, 4) for k, v in d.items() if k != "rows"} for p, d in r.get("parts", {}).items()}
              or r.get("skip"))
    print("FIRST DIVERGENCE:", res["first_divergence"])
    print("TOP-K:", json.dumps(res["topk"], indent=1)[:3000])


if __name__ == "__main__":
    main()
