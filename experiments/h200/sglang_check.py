"""nanoflash against a live SGLang 0.5.16 on one H200: checkpoint -> serve -> log-prob parity -> weight pushes.

Phases (run in order on the GPU machine; `experiments/h200/sglang_h200.sh` gives the exact commands):

    python experiments/h200/sglang_check.py ckpt   --dir /tmp/nf_small      # small preset, seed 0, FP8 128x128 + FP8 experts
    python experiments/h200/sglang_check.py parity --dir /tmp/nf_small --out $OUT/parity.json
    python experiments/h200/sglang_check.py push   --dir /tmp/nf_small --out $OUT/push.json
    python experiments/h200/sglang_check.py push   --dir /tmp/nf_small --transport distributed --pushes 3 --out ...

`parity` samples completions from SGLang (temperature 1, return_logprob) and scores exactly those tokens with
nanoflash's own forward on the same GPU, in BF16 and in QAT-simulation mode (FP8 activation quantization before
FP8 GEMMs, FP8 kv nope dims, Hadamard + FP4 indexer), and once more with a planted bug (mHC comb applied
untransposed) to show the threshold discriminates. It reports mean / p99 / max |dlogp| per token, and, when both
modes ran, the FP8 floor on the same tokens (`floor_qat_vs_bf16`: QAT against BF16 nanoflash, no server involved):
a BF16 row near that floor says the server adds little beyond FP8 rounding. The server also scores the same
tokens again in one prefill per sample (`server_decode_vs_prefill`, `bf16_vs_server_prefill`): the rows split
what its decode path (KV cache, compressor state carried token by token) adds from what its prefill shares.
`--modes ...,ref` scores nanoflash's reference attention too (bf16; `bf16` runs the GPU kernels), `--variants`
nanoflash with one semantic changed (`experiments/h200/parity_variants.py`: SGLang's shared-expert clamp, no C128 entries,
the window off by one), one `bf16_<variant>` row each. `--sweep 128,256,...` adds one prompt per length (for
`by_length` and `by_position` only: every row's mean per prompt, and per band of absolute positions), so a gap
that grows with depth shows where it starts: below the 128-token window, past it, past `index_topk` x 4 tokens
(where the C4 indexer starts to drop entries), or with the C128 entries. With `--synth`, `by_eos` splits every
scored token at its generation's first EOS: what a rollout scores, and the `ignore_eos` text after it.

`push` perturbs the trainer's weights, pushes them through nanoflash's weight stream (`iter_sglang_buckets`, FP8
with Miles' fp32 `weight_scale_inv`) with SGLang's own FlattenedTensorBucket payload (colocated CUDA IPC), in the
protocol the client detects, twice in a row, and verifies each push by behaviour (SGLang's log-probs on fixed
tokens vs nanoflash's for the new weights) and by `/weights_checker` through the library
(`transports.verify_real_server` on `layout.sglang_partials`): every tensor SGLang's GPU hash can be reproduced
for is compared exactly -- FP8 dequantized to bf16, the fused experts `mlp.experts.w13_weight` / `w2_weight`
stacked from their per-expert slabs -- and the rest (a raw tensor SGLang stores in another dtype) must change
on the second push exactly when what was sent changed. It also shows that the client refuses a bucket that
splits an atomic pair, before anything is sent.

`push --transport distributed` is the trainer's distributed path into live SGLang (issue 36, item 8): after the
start-up checks the trainer runs (`sglang.preflight.check_servers`: FP8 experts, torch pinned equal), a
`transports.Broadcaster` with backend `--backend` (gloo) joins SGLang's own group through
`/init_weights_update_group` (rank 0 here, SGLang's TP ranks after it) and every bucket travels as one flat uint8
broadcast with load_format="flattened_bucket" (gloo refuses float8, so FP8 reaches SGLang only that way); each of
`--pushes` pushes of changed weights (halves of the layers in turn) is verified by `/weights_checker` as above and
by behaviour, and timed (`prepare_s`: quantize into buckets; `send_s`, `gb`, `gb_per_s`: pause .. continue).
CPU dry run against the embedded server (NF_DEVICE=cpu NF_CHECK_PRESET=tiny):

    python experiments/h200/sglang_check.py ckpt --dir /tmp/nf_tiny
    python -m nanoflash.server --checkpoint /tmp/nf_tiny --weights fp8 --port 30000 &
    python experiments/h200/sglang_check.py push --dir /tmp/nf_tiny --transport distributed --pushes 3 --out x.json

Experts: FP8 (`SGLANG_DSV4_FP4_EXPERTS=0`), `wo_a` BF16 (`SGLANG_OPT_FP8_WO_A_GEMM=0`), as Miles runs it.
"""
import argparse
import json
import os
import time

import torch

from nanoflash.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from nanoflash.config import ModelConfig, preset
from nanoflash.model import Transformer
from nanoflash.sglang.probe import prefill_logprobs

URL = os.environ.get("NF_URL", "http://127.0.0.1:30000")
DEVICE = os.environ.get("NF_DEVICE", "cuda")
PRESET = os.environ.get("NF_CHECK_PRESET", "small")   # "tiny" + NF_DEVICE=cpu: a local dry run on the embedded server
VOCAB_HI = 100000 if PRESET != "tiny" else 250
PARITY_GOAL = 0.05   # issue 6: mean |dlogp| below this


# The experiment's model (h200.txt): `small` cut to 4 layers (sliding, C4, C128, C4), 1 hash layer, no MTP, and
# the shared expert clamped as SGLang 0.5.16 serves it (the trainer too, since 2026-12-07)
H200_MODEL = {"n_layers": 4, "n_hash_layers": 1, "n_mtp_layers": 0, "compress_ratios": (0, 4, 128, 4),
              "shared_expert_clamp": True}


def small_cfg(**kw) -> ModelConfig:
    """The `small` preset (or NF_CHECK_PRESET: tiny, or h200 = small cut to the experiment's 4 layers) without
    MTP (SGLang's main model ignores mtp.*), hash routing on."""
    if PRESET == "h200":
        return preset("small", **{**H200_MODEL, **kw})
    base = preset(PRESET)
    if os.environ.get("NF_VOCAB"):   # e.g. tiny with the V4 tokenizer's 129280 ids (experiments/h200/grpo_h200.sh dry)
        kw.setdefault("vocab_size", int(os.environ["NF_VOCAB"]))
    return preset(PRESET, n_mtp_layers=0, compress_ratios=base.compress_ratios[:base.n_layers], **kw)


def cmd_ckpt(a):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        m = Transformer(small_cfg()).init_weights(seed=0)
    with torch.no_grad():   # trained-looking: random router bias, hash table, mHC bases (asymmetric comb), sinks
        g = torch.Generator(device="cpu").manual_seed(1)
        for n, b in m.named_buffers():
            if n.endswith("tid2eid"):   # distinct experts per token, as a real table has
                rows = torch.rand(b.shape[0], m.cfg.n_routed_experts, generator=g).argsort(-1)[:, :b.shape[1]]
                b.copy_(rows)
        for n, p in m.named_parameters():
            if n.endswith(("_base", "attn_sink", "gate.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    t = time.time()
    info = save_hf_checkpoint(m, a.dir, weights="fp8", experts="fp8")
    print(json.dumps({"ckpt_dir": a.dir, "save_s": round(time.time() - t, 1), **{k: v for k, v in info.items()
                                                                              if isinstance(v, (int, str))}}))


def load_model(a, dtype=torch.bfloat16, **kw) -> Transformer:
    cfg = small_cfg(**kw)
    with torch.device("meta"):
        m = Transformer(cfg)
    load_hf_checkpoint(m, a.dir, cfg=cfg, device=DEVICE)
    return m.cast_(dtype).eval()


def synth_prompt(length: int, seed: int) -> list:
    """In-distribution text of the warm-started model (issue 20): held-out running-sum problems with their
    reference responses in the V4 chat format, back to back and cut to `length` minus the last problem's prompt,
    then that prompt (BOS ... `<think>`): exactly `length` tokens, so a sample starts as a response -- what the
    model was trained to write and a rollout scores (run 8 cut mid-problem: the samples continued prompt text)."""
    from experiments.h200 import synth
    from nanoflash.rl.data import V4Tokenizer
    tok, probs = V4Tokenizer(), synth.problems("sum4", "heldout", seed=seed)
    last = tok.encode_chat(probs[-1])
    if length <= len(last):
        raise ValueError(f"a synth prompt of {length} tokens: the last problem alone takes {len(last)}")
    ids, i = [], 0
    while len(ids) < length - len(last):
        p = probs[i % (len(probs) - 1)]
        ids += tok.encode_chat(p) + tok.encode(synth.solution(p.prompt)) + [tok.eos_id]
        i += 1
    return ids[:length - len(last)] + last


def long_prompt(length: int, seed: int) -> list:
    """A prompt of the long-context task (experiments/h200/longctx.py, issue 42) of about `length` tokens
    (longctx.PROMPT_BASE + 4 n): the run's far-class prompts, scored as the rollouts score them."""
    from experiments.h200 import longctx
    from nanoflash.rl.data import V4Tokenizer
    return V4Tokenizer().encode_chat(longctx.prompt_of_length(length, seed))


def sample(client, n_prompts, n, prompt_len, new_tokens, seed=0, prompt_len_max=0, synth=""):
    """`synth`: "" random token prompts, "sums" `synth_prompt`, "long" `long_prompt`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_prompts):
        L = prompt_len + (i * (prompt_len_max - prompt_len)) // max(n_prompts - 1, 1) if prompt_len_max else prompt_len
        prompt = (synth_prompt(L, seed + i) if synth == "sums" else long_prompt(L, seed + i) if synth == "long"
                  else torch.randint(3, VOCAB_HI, (L,), generator=g).tolist())
        gens = client.generate(prompt, {"n": n, "temperature": 1.0, "max_new_tokens": new_tokens,
                                        "ignore_eos": True})
        out += [(prompt, gen.output_ids, gen.logprobs) for gen in gens]
    return out


@torch.no_grad()
def our_logprobs(model, samples) -> torch.Tensor:
    """nanoflash's log-probs of every sampled token, concatenated in sample order: [tokens] fp32 on the CPU."""
    out = []
    for prompt, ids, _ in samples:
        full = torch.tensor(prompt + ids, device=DEVICE)
        out.append(model.token_logprobs(full[None, :-1], full[None, 1:])[0, len(prompt) - 1:].float().cpu())
    return torch.cat(out)


def tails(d: torch.Tensor) -> dict:
    return {"tokens": d.numel(), "mean": d.mean().item(), "p99": d.quantile(0.99).item(), "max": d.max().item()}


def score(ours: torch.Tensor, samples) -> dict:
    """|log p_nanoflash - log p_server| per sampled token -> tails (`ours`: `our_logprobs` of the samples)."""
    return tails((ours - torch.tensor([lp for _, _, lps in samples for lp in lps])).abs())


def server_prefill(client, samples):
    """The same tokens scored again by the server in one prefill per sample (`probe.prefill_logprobs`), in
    sample order as `our_logprobs`: [tokens] fp32, or the error as a string (a diagnostic, not raised)."""
    try:
        return torch.cat([torch.tensor(prefill_logprobs(client, [p + ids])[0][len(p) - 1:]) for p, ids, _ in samples])
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"


def by_length(samples, rows: dict, n: int) -> list:
    """Mean |dlogp| of each row per prompt (its `n` samples together), with the prompt's length: how the gap grows
    with depth (window 128; C4 entries past `index_topk` x 4 tokens; one C128 entry per 128). `rows`: name ->
    per-token |dlogp| in sample order."""
    out, at = [], 0
    for i in range(0, len(samples), n):
        k = sum(len(ids) for _, ids, _ in samples[i:i + n])
        out.append({"prompt_len": len(samples[i][0]), "tokens": k,
                    **{name: round(float(v[at:at + k].mean()), 5) for name, v in rows.items()}})
        at += k
    return out


POSITION_EDGES = (0, 64, 128, 256, 512, 1024, 2048, 4096, 1 << 30)   # window 128; C128's first entry at 128


def bands(pos: torch.Tensor, rows: dict, count: str = "tokens") -> list:
    """Each row's mean over the entries whose position `pos` falls in [lo, hi) of POSITION_EDGES (empty bands
    left out). `rows`: name -> values aligned with `pos`."""
    out = []
    for lo, hi in zip(POSITION_EDGES, POSITION_EDGES[1:]):
        m = (pos >= lo) & (pos < hi)
        if m.any():
            out.append({"pos_lo": lo, "pos_hi": hi, count: int(m.sum()),
                        **{name: round(float(v[m].double().mean()), 5) for name, v in rows.items()}})
    return out


def by_position(samples, rows: dict) -> list:
    """Mean |dlogp| of each row over the scored tokens by band of absolute position (prompt length + index in the
    response): a gap that starts at 128 is the window's edge or C128's first entry, one already below 128 is
    neither. `rows`: name -> per-token |dlogp| in sample order."""
    return bands(torch.cat([torch.arange(len(p), len(p) + len(ids)) for p, ids, _ in samples]), rows)


def by_band(samples, rows: dict, cfg) -> list:
    """Each row's mean over the scored tokens by position band of the query that scores them (instruments.bands:
    the window, the C4 layers keeping every entry, the indexer's top-k selecting; query = token position - 1),
    with the band's share of the tokens. `rows`: name -> per-token |dlogp| in sample order."""
    from instruments import bands
    qpos = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(ids)) for p, ids, _ in samples])
    b, out = bands.band_index(qpos, cfg), []
    for i, name in enumerate(bands.BANDS):
        m = b == i
        if m.any():
            out.append({"band": name, "tokens": int(m.sum()), "share": float(m.double().mean()),
                        **{k: round(float(v[m].double().mean()), 5) for k, v in rows.items()}})
    return out


def by_eos(samples, rows: dict, eos_id: int) -> list:
    """Each row's mean over the scored tokens up to and including the first `eos_id` of their generation
    ("in_response": what a rollout scores) and over those after it ("past_eos": `ignore_eos` text the model was
    never trained to continue). `rows`: name -> per-token |dlogp| in sample order."""
    ends = [ids.index(eos_id) + 1 if eos_id in ids else len(ids) for _, ids, _ in samples]  # first EOS, included
    part = torch.cat([torch.arange(len(ids)) >= e for (_, ids, _), e in zip(samples, ends)])  # [tokens] past it
    return [{"part": name, "tokens": int(m.sum()),
             **{k: round(float(v[m].double().mean()), 5) for k, v in rows.items()}}
            for name, m in (("in_response", ~part), ("past_eos", part)) if m.any()]


def restore(client, a):
    """--dir into the server: SGLang reads the checkpoint itself (exact: the same FP8 bytes); the embedded server
    reads no F8_E8M0 file, so it gets a push (verified) of the model loaded from it instead."""
    from nanoflash.sglang.client import RequestRejected
    from nanoflash.sglang.transports import iter_sglang_buckets, push_weights
    t = time.time()
    try:
        client.update_weights_from_disk(URL, os.path.abspath(a.dir), None)
        how = "update_weights_from_disk"
    except RequestRejected as e:
        if not client.is_embedded(URL):
            raise
        print(f"restore from disk refused ({e}); pushing the checkpoint instead", flush=True)
        push_weights(client, iter_sglang_buckets(load_model(a), fp8=True, bucket_bytes=a.bucket_mb << 20))
        how = "push"
    print(f"restored {a.dir} into {URL} by {how} in {time.time() - t:.1f} s", flush=True)


def cmd_parity(a):
    from nanoflash.sglang.client import SGLangClient
    import nanoflash.model as M
    client = SGLangClient([URL], timeout=600)
    client.wait_healthy(timeout=a.wait)
    if a.restore:   # the server holds other weights: load --dir into it first
        restore(client, a)
    t = time.time()
    samples = sample(client, a.prompts, a.n, a.prompt_len, a.new_tokens, prompt_len_max=a.prompt_len_max,
                     synth=a.synth)
    head = sum(len(ids) for _, ids, _ in samples)   # the table's tokens; the sweep's follow
    for L in [int(x) for x in a.sweep.split(",") if x]:
        samples += sample(client, 1, a.n, L, a.new_tokens, seed=L, synth=a.synth)
    lens = [len(p) + len(ids) for p, ids, _ in samples[:a.prompts * a.n]]
    res = {"protocol": client.protocol(URL), "generate_s": round(time.time() - t, 2), "samples": len(samples),
           "seq_len_min": min(lens), "seq_len_max": max(lens), "synth_prompts": a.synth or False, "dir": a.dir}
    modes = {"bf16": {}, "qat": {"qat": True}, "fp32": {"dtype": torch.float32},
             "fp32_qat": {"dtype": torch.float32, "qat": True}, "ref": {"kernels": "reference"},
             "qat8": {"qat": True, "indexer_quant": "fp8"}}   # the floor with SGLang's FP8 index scores
    server = torch.tensor([lp for _, _, lps in samples for lp in lps])   # [tokens] the server's decode
    ours = {mode: our_logprobs(load_model(a, **modes[mode]), samples) for mode in a.modes.split(",")}
    rows = {mode: (lp - server).abs() for mode, lp in ours.items()}      # name -> per-token |dlogp|
    if "bf16" in ours and "qat" in ours:   # the FP8 floor on the same tokens: what FP8 alone moves nanoflash by
        rows["floor_qat_vs_bf16"] = (ours["qat"] - ours["bf16"]).abs()
    if "bf16" in ours and "qat8" in ours:  # ... with the indexer scored in FP8 as SGLang does (issue 42)
        rows["floor_qat8_vs_bf16"] = (ours["qat8"] - ours["bf16"]).abs()
    pre = server_prefill(client, samples)
    if isinstance(pre, str):
        res["server_prefill_error"] = pre
    else:   # the server's decode against its own prefill, and nanoflash against that prefill
        rows["server_decode_vs_prefill"] = (pre - server).abs()
        if "bf16" in ours:
            rows["bf16_vs_server_prefill"] = (ours["bf16"] - pre).abs()
    if a.planted:
        orig = M.hc_post
        M.hc_post = lambda x, res_, post, comb: orig(x, res_, post, comb.transpose(-1, -2))
        rows["bf16_planted_comb_bug"] = (our_logprobs(load_model(a), samples) - server).abs()
        M.hc_post = orig
    write_parity(a, res, rows, head, samples)   # the table first: a hold that ends in the variants keeps it
    if a.variants:   # nanoflash with one semantic changed (experiments/h200/parity_variants.py): which row meets the floor
        import parity_variants
        pos, over = parity_variants.score(load_model(a), samples, server, rows, a.variants.split(","), our_logprobs)
        res["shared_expert_over_limit"] = bands(pos, {"over_share": over}, count="positions")
        write_parity(a, res, rows, head, samples)
    print(json.dumps(res, indent=1))


def write_parity(a, res, rows, head, samples):
    """res += every row's tails over the table's tokens, by_length and by_position (with --synth by_eos, over all
    samples and over the table's) -> a.out (rewritten whole)."""
    res.update({k: tails(v[:head]) for k, v in rows.items()})
    res["by_length"], res["by_position"] = by_length(samples, rows, a.n), by_position(samples, rows)
    res["by_band"] = by_band(samples, rows, small_cfg())
    if a.synth:   # the warm start's responses end at the EOS; the sampled text runs on past it (ignore_eos)
        from nanoflash.rl.data import V4Tokenizer
        eos, k = V4Tokenizer().eos_id, a.prompts * a.n   # by_eos_table: the 2-4K samples alone (no sweep)
        res["by_eos"] = by_eos(samples, rows, eos)
        res["by_eos_table"] = by_eos(samples[:k], {name: v[:head] for name, v in rows.items()}, eos)
    res["goal_mean_below"] = PARITY_GOAL
    with open(a.out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(a.out + ".tmp", a.out)


# ---------------------------------------------------------------------------------------------- pushes
def fake_quant_(model):
    """Make the trainer hold exactly what SGLang will hold: dequant(quant(w)) for every FP8-served weight."""
    from nanoflash.names import official_parameters
    from nanoflash.quant import dequantize_fp8_block, quantize_fp8_block
    from nanoflash.sglang.layout import sglang_fp8
    with torch.no_grad():
        for name, p in official_parameters(model):   # stacked experts as per-expert views (official names)
            if sglang_fp8(name, model.cfg):
                q, s = quantize_fp8_block(p.float(), fmt="fp32")
                p.copy_(dequantize_fp8_block(q, s, dtype=torch.float32).to(p.dtype))


def perturb_(model, which: str, seed: int):
    """Perturb one half of the layers (+ the head, + layer 0's hash table) by 5% relative noise."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    keep = (lambda n: n.startswith(("layers.0.", "layers.2.", "layers.4.", "layers.6.", "head."))) \
        if which == "even" else (lambda n: n.startswith(("layers.1.", "layers.3.", "layers.5.", "layers.7.")))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if keep(n) and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g, device=DEVICE).to(p.dtype) * 0.05 * p.float().std())
        if which == "even":
            t = model.layers["0"].ffn.gate.tid2eid
            t.copy_(torch.roll(t, 1, dims=0))


def sglang_expected(buckets, n_experts: int) -> dict:
    """SGLang's /weights_checker values for what was sent, from the library (`layout.sglang_partials` per bucket:
    FP8 dequantized to bf16, the fused experts stacked per layer from their slabs) -> {name: (hex|None, fp, fp8)}."""
    from nanoflash.sglang.layout import LoaderState, sglang_checksums, sglang_partials
    partials = {}
    for b in buckets:
        st = LoaderState()
        st.load(b)
        partials.update(sglang_partials(st.params, n_experts))
    return sglang_checksums(partials)


def payload(bucket, transport):
    """SGLang's pickled CUDA-IPC FlattenedTensorBucket, or the embedded server's safetensors payload."""
    from nanoflash.sglang.transports import SAFE_FORMAT, encode_tensors, sglang_flattened_payload
    if transport == "sglang":
        return sglang_flattened_payload(bucket)
    return {"serialized_named_tensors": [encode_tensors(bucket)], "load_format": SAFE_FORMAT}


def push_once(client, model, version: str, bucket_bytes: int, transport: str) -> dict:
    from nanoflash.sglang.layout import LoaderState
    from nanoflash.sglang.transports import iter_sglang_buckets
    t0 = time.time()
    buckets = list(iter_sglang_buckets(model, fp8=True, bucket_bytes=bucket_bytes))
    for b in buckets:                       # derive the loader layout first: a split pair raises before sending
        LoaderState().load(b)
    t1 = time.time()
    client.pause_generation()
    client.flush_cache()
    client.begin_update(URL)
    for b in buckets:
        body = {**payload(b, transport), "flush_cache": False, "weight_version": version}
        client.post(URL, "/update_weights_from_tensor", body)
    client.end_update(URL)
    client.continue_generation()
    t2 = time.time()
    nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    return {"buckets": len(buckets), "tensors": sum(len(b) for b in buckets), "bytes": nbytes,
            "prepare_s": round(t1 - t0, 3), "send_s": round(t2 - t1, 3), "buckets_sent": buckets}


def push_distributed(client, model, version: str, bucket_bytes: int, bc) -> dict:
    """One push through the Broadcaster `bc`, the loop's protocol: FP8 flat buckets (`buckets.stream_buckets`),
    pause -> flush -> [begin] -> one flattened broadcast per bucket -> [end] -> continue."""
    from nanoflash.sglang.buckets import stream_buckets
    from nanoflash.sglang.layout import LoaderState
    t0 = time.time()
    fbs = list(stream_buckets(model.state_dict().items(), model.cfg, fp8=True, bucket_bytes=bucket_bytes))
    buckets = [fb.tensors() for fb in fbs]
    for b in buckets:                       # derive the loader layout first: a split pair raises before sending
        LoaderState().load(b)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t1 = time.time()
    client.pause_generation()
    client.flush_cache()
    client.begin_update(URL)
    for fb in fbs:
        bc.send(fb, version)                # load_format="flattened_bucket": one uint8 broadcast per bucket
    client.end_update(URL)
    client.continue_generation()
    t2 = time.time()
    nbytes = sum(fb.nbytes for fb in fbs)
    return {"buckets": len(fbs), "tensors": sum(len(b) for b in buckets), "bytes": nbytes,
            "gb": round(nbytes / 1e9, 4), "prepare_s": round(t1 - t0, 3), "send_s": round(t2 - t1, 3),
            "gb_per_s": round(nbytes / 1e9 / max(t2 - t1, 1e-9), 3), "buckets_sent": buckets}


def open_broadcaster(client, a, res):
    """The trainer's start-up checks, then rank 0 of an update group with the server (SGLang joins it itself)."""
    from nanoflash.sglang.preflight import check_servers
    from nanoflash.sglang.transports import Broadcaster
    res["preflight_notes"] = check_servers(client, "fp8", distributed=True)
    t = time.time()
    bc = Broadcaster(client, "127.0.0.1", a.sync_port, backend=a.backend, group_name="nanoflash-check",
                     timeout_s=a.join_timeout)
    res["group"] = {"backend": a.backend, "world": bc.world, "flattened": bc.flat_ok,
                    "join_s": round(time.time() - t, 2)}
    if not bc.flat_ok:
        raise SystemExit(f"{URL} does not take flattened buckets; gloo cannot broadcast FP8 one tensor at a time")
    return bc


def behaviour(client, model, prompt, new_tokens=32):
    """Greedy-generate on the server; score the same tokens with the trainer's model: |dlogp| mean/max."""
    g = client.generate(prompt, {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}, url=URL)[0]
    samples = [(prompt, g.output_ids, g.logprobs)]
    r = score(our_logprobs(model, samples), samples)
    return {"mean": r["mean"], "max": r["max"], "tokens": g.output_ids[:8], "version": g.weight_version}


def verify_checksums(client, buckets, n_experts: int, prev, transport):
    """The library's check of a real server (`transports.verify_real_server`: SGLang's own hash where it can be
    reproduced at TP 1, fused experts included; change sets for the rest); the embedded server: raw sha256."""
    from nanoflash.sglang.layout import compare_checksums, expected_checksums
    from nanoflash.sglang.transports import verify_real_server
    if client.is_embedded(URL):
        compare_checksums(expected_checksums(buckets), client.weights_checksums(URL), URL)
        return {"embedded": "checksums"}, None
    out = verify_real_server(client, URL, sglang_expected(buckets, n_experts), prev)
    return out, out.pop("state")


def cmd_push(a):
    from nanoflash.sglang.client import SGLangClient
    from nanoflash.sglang.layout import LoaderState
    from nanoflash.sglang.transports import iter_sglang_buckets
    client = SGLangClient([URL], timeout=1200)
    client.wait_healthy(timeout=a.wait)   # a cold SGLang start: ~275 s on the H200
    model = load_model(a)
    prompt = torch.randint(3, VOCAB_HI, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    res = {"protocol": client.protocol(URL), "transport": a.transport, "before": behaviour(client, model, prompt)}
    bc = open_broadcaster(client, a, res) if a.transport == "distributed" else None
    prev = None                           # the first push is checked exactly where the hash is reproducible
    try:
        for i in range(a.pushes):
            perturb_(model, ("even", "odd")[i % 2], seed=10 + i)
            fake_quant_(model)
            p = push_distributed(client, model, str(i + 1), a.bucket_mb << 20, bc) if bc is not None else \
                push_once(client, model, str(i + 1), a.bucket_mb << 20, a.transport)
            buckets = p.pop("buckets_sent")
            t = time.time()
            p["behaviour"] = behaviour(client, model, prompt)
            p["checksums"], prev = verify_checksums(client, buckets, model.cfg.n_routed_experts, prev, a.transport)
            p["verify_s"] = round(time.time() - t, 3)
            p["version_ok"] = p["behaviour"]["version"] == str(i + 1)   # the server generates with this push
            res[f"push{i + 1}"] = p
            print(json.dumps({f"push{i + 1}": p}, indent=1), flush=True)
            with open(a.out, "w") as f:   # kept after every push: a run cut short keeps what it measured
                json.dump(res, f, indent=1)
    finally:
        if bc is not None:
            bc.close()
    bad = [[(n, t) for n, t in b if not n.endswith("self_attn.wkv.weight")] for b in
           iter_sglang_buckets(model, fp8=True, bucket_bytes=a.bucket_mb << 20)]
    try:
        st = LoaderState()
        for b in bad:
            st.load(b)
        res["atomic_split_refused"] = False
    except ValueError as e:
        res["atomic_split_refused"] = str(e)[:200]
    flash_fp8_bytes = 284.3e9 * 1.01           # FP8 payload (+ fp32 scales per 128x128 block) of V4-Flash
    last = res[f"push{a.pushes}"]         # a later push: no first-load compile in it
    per_byte = last["send_s"] / last["bytes"]
    res["extrapolated_flash_push_s"] = round(flash_fp8_bytes * per_byte, 1)
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["ckpt", "parity", "push"])
    ap.add_argument("--dir", default="/tmp/nf_small")
    ap.add_argument("--out", default="/tmp/sglang_check.json")
    ap.add_argument("--wait", type=float, default=420)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--modes", default="bf16,qat,fp32")
    ap.add_argument("--planted", type=int, default=1)
    ap.add_argument("--transport", default="sglang", choices=["sglang", "embedded", "distributed"],
                    help="push: SGLang's CUDA-IPC payload | the embedded server's safetensors | a Broadcaster group")
    ap.add_argument("--pushes", type=int, default=2, help="push: how many pushes of changed weights")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="push --transport distributed")
    ap.add_argument("--sync-port", type=int, default=29611, help="push --transport distributed: the group's port")
    ap.add_argument("--join-timeout", type=float, default=600, help="push --transport distributed: group join, s")
    ap.add_argument("--prompt-len-max", type=int, default=0, help="prompt lengths spread over prompt-len..this")
    ap.add_argument("--synth", default="0", choices=["0", "1", "long"],
                    help="prompts of a trained model's task: 1 = synth.py's sums, long = longctx.py's facts")
    ap.add_argument("--restore", type=int, default=0, help="/update_weights_from_disk --dir before sampling")
    ap.add_argument("--variants", default="",
                    help="experiments/h200/parity_variants.py names, e.g. shared_expert_no_clamp,window_127")
    ap.add_argument("--sweep", default="",
                    help="more prompt lengths, one prompt each, for `by_length` / `by_position` only")
    a = ap.parse_args()
    a.synth = {"0": "", "1": "sums", "long": "long"}[a.synth]
    {"ckpt": cmd_ckpt, "parity": cmd_parity, "push": cmd_push}[a.phase](a)


if __name__ == "__main__":
    main()
