"""The per-step numbers of the live check (`rl/live.py`, `LiveChecks.step`) against a naive recomputation on CPU.

`LiveChecks.before_update(batch, old, step)` (the live hook, instruments/live.py) logs, over the response tokens (batch.mask > 0):
    gap        |log p_train - log p_rollout|                      (old: the trainer's recomputed log-probs)
    floor      |log p_sim - log p_train|, sim = the trainer's weights as the server holds them: FP8-served
               weights rounded through FP8 128x128 blocks (fp32 scales, Miles' convention), every other float
               weight rounded to the dtype the push sends (bf16, or fp32 for mHC / sinks / ape / gate bias),
               forward with the FP8 activation simulation on (qat)
    floor_fp8  the same with the FP8 rounding only
    entropy    the trainer's token entropy at the rollout temperature
    prefill    |log p_train - log p_server_prefill| (the server's one-prefill scores)
and dumps the per-token values. No CPU test ran `step`, so a floor measured against the rollout's log-probs (or
the FP8-only sim standing in for the full one) went unnoticed.

Reference: `_naive_*` below, sharing no code with live.py or quant.py: a literal list of the weights SGLang serves
FP8 (docs/rl_notes.md §4.5: experts, shared experts, wq_a, wq_b, wkv, wo_b, indexer wq_b; wo_a stays bf16),
a block loop for the FP8 round trip, and log_softmax(model(ids) / T) gathered at the targets. The rollout side is a
fake: rollout log-probs recorded as old + a known offset per token, and a fake server answering the prefill with
recorded values. A tiny fp32 model, whose weights are off the bf16 grid, so floor and floor_fp8 differ.

Run: pytest tests/test_live_naive.py -q
"""
import base64
import contextlib
import dataclasses
import json
import re
import types

import pytest
import torch

from nanoflash.config import preset
from nanoflash.grpo import Episode, pack
from nanoflash.model import Transformer
from instruments.live import LiveChecks, full_tokens
from nanoflash.rl.hooks import HookContext

T = 0.7               # rollout temperature (not 1, so a dropped temperature shows)
BLOCK, E4M3_MAX, AMAX_EPS = 128, 448.0, 1e-10
# same fp32 math in another order (token_logprobs' chunked head vs log_softmax of the full logits): measured
# worst per-token |difference| 9.5e-7 over three seeds (salts "", s1, s2); 20x that. The numbers compared are
# of order 1e-2 .. 1, and the smallest planted difference (floor vs floor_fp8) is 2.7e-4
LOGP_ABS_TOL = 2e-5

FP8_SERVED = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.(experts\.\d+|shared_experts)\.w[123]"
                        r"|e_proj|h_proj)\.weight$")
KEPT_FP32 = re.compile(r"(hc_\w+|attn_sink|\.ape|gate\.bias)$")


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny forwards, one thread


def _naive_fp8_roundtrip(w):
    """dequant(quant(w)) by 128x128 blocks: S = max(amax, 1e-10)/448, Q = e4m3(clamp(w * (1/S), +-448))."""
    out = torch.empty_like(w, dtype=torch.float32)
    wf = w.float()
    for r in range(0, w.shape[0], BLOCK):
        for c in range(0, w.shape[1], BLOCK):
            blk = wf[r:r + BLOCK, c:c + BLOCK]
            s = torch.maximum(blk.abs().max(), torch.tensor(AMAX_EPS)) / torch.tensor(E4M3_MAX)
            q = (blk * (torch.tensor(1.0) / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[r:r + BLOCK, c:c + BLOCK] = q.float() * s
    return out.to(w.dtype)


@torch.no_grad()
def _naive_sim(trainer, storage: bool):
    """The trainer's weights as the server holds them (storage=False: the FP8 rounding only), qat forward."""
    sim = Transformer(dataclasses.replace(trainer.cfg, qat=True))
    sim.load_state_dict(trainer.state_dict())
    for name, p in sim.state_dict().items():
        if not p.is_floating_point():
            continue
        if FP8_SERVED.search(name):
            p.copy_(_naive_fp8_roundtrip(p))
        elif storage and not KEPT_FP32.search(name):
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return sim.eval()


@torch.no_grad()
def _naive_logp(model, ids, tgt):
    logp = torch.log_softmax(model(ids).float() / T, -1)                          # [B,S,V]
    return logp.gather(-1, tgt[..., None])[..., 0], -(logp.exp() * logp).sum(-1)  # [B,S], entropy [B,S]


class _FakeServer:
    """Answers the live check's prefill request with recorded log-probs (SGLang's input_token_logprobs shape)."""
    urls = ["http://fake"]

    def __init__(self, recorded, topk=None, seqs=None):
        self.recorded = recorded          # one list of L-1 log-probs per sequence
        self.topk = topk                  # one int32 [L-1, C4 layers, index_topk] per sequence: SGLang's kept sets
        self.seqs = seqs                  # the sequences, to answer a request for some of them (else: all, in order)
        self.bodies = []

    def post(self, url, path, body):
        assert path == "/generate" and body["logprob_start_len"] == 0
        self.bodies.append(body)
        which = ([self.seqs.index(list(x)) for x in body["input_ids"]] if self.seqs is not None
                 else range(len(body["input_ids"])))
        out = []
        for x, i in zip(body["input_ids"], which):
            meta = {"input_token_logprobs": [[None, x[0]]] + [[lp, t] for lp, t in zip(self.recorded[i], x[1:])]}
            if body.get("return_indexer_topk") and self.topk is not None:   # SGLang's record: base64 int32
                meta["indexer_topk"] = base64.b64encode(self.topk[i].to(torch.int32).numpy().tobytes()).decode()
            out.append({"meta_info": meta})
        return out


def _batch(cfg, gen):
    eps = []
    for i, (P, R) in enumerate([(5, 7), (3, 12), (8, 4), (6, 9)]):
        ids = torch.randint(0, cfg.vocab_size, (P + R,), generator=gen).tolist()
        eps.append(Episode(ids[:P], ids[P:], [0.0] * R, float(i % 2), i // 2))
    return pack(eps, [0.0] * len(eps))


def test_live_step_numbers_match_a_naive_recomputation(tmp_path, gen):
    """Bugs caught: the FP8 floor measured against the rollout's log-probs (or any log-probs but the trainer's
    `old`); floor and floor_fp8 swapped, or the storage rounding skipped; the sim without the FP8 rounding; a
    gap, entropy or prefill gap over the wrong mask, at T = 1, or against the wrong side; gap / floor inverted."""
    cfg = preset("tiny")
    trainer = Transformer(cfg).init_weights(0).eval()
    batch = _batch(cfg, gen)
    on = batch.mask > 0
    old, _ = _naive_logp(trainer, batch.input_ids, batch.targets)
    old = old * batch.mask
    offset = (0.05 + 0.3 * torch.rand(old.shape, generator=gen)) * torch.where(
        torch.rand(old.shape, generator=gen) < 0.5, -1.0, 1.0)                      # |offset| in [0.05, 0.35]
    batch.rollout_logprobs = (old + offset) * batch.mask
    sim8, _ = _naive_logp(_naive_sim(trainer, storage=False), batch.input_ids, batch.targets)
    sim, ent = _naive_logp(_naive_sim(trainer, storage=True), batch.input_ids, batch.targets)   # served entropy
    pre_offset = 0.02 * torch.randn(old.shape, generator=gen)
    recorded = []
    for b in range(len(batch)):
        L = int(batch.prompt_lens[b] + batch.response_lens[b])
        recorded.append((old[b, :L - 1] + pre_offset[b, :L - 1]).tolist())       # the server's prefill scores

    run_cfg = types.SimpleNamespace(train=types.SimpleNamespace(out_dir=str(tmp_path), seed=0),
                                    rollout=types.SimpleNamespace(temperature=T))
    actor = types.SimpleNamespace(model=trainer, device=torch.device("cpu"))
    task = types.SimpleNamespace(heldout=["1+1"], train=["1+1"], encode=lambda s: [1, 2, 3])
    ctx = HookContext(run_cfg, cfg, actor, types.SimpleNamespace(client=_FakeServer(recorded)), None, task)
    out = LiveChecks(ctx).before_update(batch, old, step=3)

    gap, floor, floor8 = offset[on].abs(), (sim - old)[on].abs(), (sim8 - old)[on].abs()
    prefill = pre_offset[on].abs()
    assert float(floor.mean()) > 1e-3 and abs(float(floor.mean() - floor8.mean())) > 10 * LOGP_ABS_TOL, \
        "the test needs a measurable floor, different with and without the storage rounding"
    want = {"gap_mean": gap.mean(), "gap_max": gap.max(), "floor_mean": floor.mean(), "floor_max": floor.max(),
            "floor_fp8_mean": floor8.mean(), "entropy_mean": ent[on].mean(),
            "sim_vs_rollout_mean": (sim - batch.rollout_logprobs)[on].abs().mean(),
            "prefill_gap_mean": prefill.mean(), "decode_vs_prefill_mean": (pre_offset - offset)[on].abs().mean()}
    for k, v in want.items():
        assert out[k] == pytest.approx(float(v), abs=LOGP_ABS_TOL), f"{k}: live.py {out[k]}, naive {float(v)}"
    assert out["gap_tokens"] == out["floor_tokens"] == int(on.sum())
    assert out["gap_over_floor"] == pytest.approx(float(gap.mean() / floor.mean()), rel=1e-3)
    assert out["prefill_errors"] == 0
    parts = [out[k] for k in ("sim_copy_s", "floor_s", "prefill_s")]   # the live checks' time, split
    assert min(parts) >= 0 and sum(parts) <= out["live_s"]

    dump = torch.load(tmp_path / "live_tokens" / "step_0003.pt")
    for k, v in {"gap": -offset[on], "floor": floor, "floor_fp8": floor8, "entropy": ent[on],
                 "prefill_gap": -pre_offset[on]}.items():
        torch.testing.assert_close(dump[k], v.float(), atol=LOGP_ABS_TOL, rtol=0, msg=k)
    assert torch.equal(dump["token"], batch.targets[on].int())


@pytest.mark.parametrize("default_device", [None, "meta"])
def test_live_checks_long_logs_bands_an_fp8_index_floor_and_the_topk_agreement(tmp_path, gen, default_device):
    """LiveChecksLong (issue 42): the floor's model scores its indexer in FP8 (SGLang's), the gap and floor are
    split by the band of the query scoring each token, and each step's C4 top-k agreement is the overlap of the
    entries the trainer's indexer keeps with those the same indexer keeps with FP8 scores. Bugs caught: the floor
    still built on the FP4-QAT indexer; a band formed on token instead of query positions, or from other tokens'
    floor; the agreement read at unscored positions, below the top-k band, or on the floor model's weights.
    Reference: the naive sim with indexer_quant="fp8", and the Indexer module's own keep mask on its captured
    inputs with the model's config switched to FP8 scores.
    default_device="meta" runs the hook with factories defaulting to the meta device: a tensor made on the
    default device instead of its data's meets the CPU data and fails, as it meets CUDA data on a GPU. Bug
    caught (2026-12-07, the first long hold, an H100): `indexer_agreement.overlap` built its result on the CPU
    while the kept sets were on the GPU, and step 1 died in `overlap_stats`.
    SGLang's own kept sets (`return_indexer_topk`, answered by the fake server: the exact sets with one entry
    swapped at one position) are compared on the same positions; bugs caught: the server's row t read for
    query t + 1 (or t - 1), its layers out of order, the swap listed at another row or position."""
    from instruments import bands
    from instruments.live import LiveChecksLong
    cfg = preset("tiny")                       # window 8, top-4 of (t + 1) // 4: the top-k band starts at 16
    trainer = Transformer(cfg).init_weights(0).eval()
    eps = []
    for i, (P, R) in enumerate([(14, 8), (5, 4), (12, 10)]):
        ids = torch.randint(0, cfg.vocab_size, (P + R,), generator=gen).tolist()
        eps.append(Episode(ids[:P], ids[P:], [0.0] * R, float(i % 2), i))
    batch = pack(eps, [0.0] * len(eps))
    on = batch.mask > 0
    old, _ = _naive_logp(trainer, batch.input_ids, batch.targets)
    old = old * batch.mask
    offset = 0.1 * torch.randn(old.shape, generator=gen)
    batch.rollout_logprobs = (old + offset) * batch.mask
    sim = Transformer(dataclasses.replace(cfg, qat=True, indexer_quant="fp8"))
    sim.load_state_dict(_naive_sim(trainer, storage=True).state_dict())
    sim_lp, _ = _naive_logp(sim.eval(), batch.input_ids, batch.targets)
    recorded = [old[b, :int(batch.prompt_lens[b] + batch.response_lens[b]) - 1].tolist() for b in range(len(batch))]
    run_cfg = types.SimpleNamespace(train=types.SimpleNamespace(out_dir=str(tmp_path), seed=0),
                                    rollout=types.SimpleNamespace(temperature=T))
    actor = types.SimpleNamespace(model=trainer, device=torch.device("cpu"))
    task = types.SimpleNamespace(heldout=["1+1"], train=["1+1"], encode=lambda s: [1, 2, 3])
    captured = {}
    for name, mod in trainer.named_modules():
        if name.endswith("attn.indexer"):
            mod.register_forward_pre_hook(lambda m, a, name=name: captured.setdefault(name, []).append(a[:2]))
    exact, fp8, server_ov, server_fp8_ov, kept = {}, {}, {}, {}, {}
    for b in (0, 2):                               # the two longest rows
        L = int(batch.prompt_lens[b] + batch.response_lens[b])
        captured.clear()
        with torch.no_grad():
            trainer(batch.input_ids[b:b + 1, :L - 1])
        pos = [t for t in range(L - 1) if on[b, t] and t >= 16]
        for name, ((x, qr),) in captured.items():
            mod = trainer.get_submodule(name)
            keep = mod(x, qr, 0, None)[0][0]
            cfg8 = dataclasses.replace(cfg, indexer_quant="fp8")
            saved = mod.cfg, mod.compressor.cfg
            mod.cfg = mod.compressor.cfg = cfg8
            keep8 = mod(x, qr, 0, None)[0][0]
            mod.cfg, mod.compressor.cfg = saved
            kept[b, name] = (keep, keep8, pos)
    # SGLang's kept sets as the server reports them: the exact ones, one entry swapped at one scored position
    names = sorted({n for _, n in kept}, key=lambda n: int(n.split(".")[1]))
    K, planted = cfg.index_topk, (0, kept[0, names[0]][2][-1], names[0])     # row 0, its last scored position
    server = []
    for b in range(len(batch)):
        L = int(batch.prompt_lens[b] + batch.response_lens[b])
        t_b = torch.full((L - 1, len(names), K), -1, dtype=torch.int32)
        for i, name in enumerate(names):
            if (b, name) in kept:
                for t in range(L - 1):
                    ks = kept[b, name][0][t].nonzero()[:, 0].tolist()
                    if (b, t, name) == planted:                 # one kept entry swapped for one not kept
                        ks[0] = next(u for u in range((t + 1) // 4) if u not in ks)
                    t_b[t, i, :len(ks)] = torch.tensor(ks, dtype=torch.int32)
        server.append(t_b)
    for (b, name), (keep, keep8, pos) in kept.items():
        i = names.index(name)
        for t in pos:
            a, c = set(keep[t].nonzero()[:, 0].tolist()), set(keep8[t].nonzero()[:, 0].tolist())
            sv = {u for u in server[b][t, i].tolist() if u >= 0}
            exact.setdefault(name, []).append(len(a & c) / len(a))
            fp8.setdefault(name, []).append(a == c)
            server_ov.setdefault(name, []).append(len(a & sv) / len(a))
            server_fp8_ov.setdefault(name, []).append(len(c & sv) / len(c))
    fake = _FakeServer(recorded, server, [full_tokens(batch, b) for b in range(len(batch))])
    ctx = HookContext(run_cfg, cfg, actor, types.SimpleNamespace(client=fake), None, task)
    hook = LiveChecksLong(ctx)
    assert hook.sim.cfg.indexer_quant == "fp8" and hook.sim.cfg.qat
    with torch.device(default_device) if default_device else contextlib.nullcontext():
        out = hook.before_update(batch, old, step=1)

    qpos = torch.arange(on.shape[1]).expand_as(on)[on]
    gap, floor = offset[on].abs(), (sim_lp - old)[on].abs()
    for b, lo, hi in (("window", 0, 8), ("c4_all", 8, 16), ("c4_topk", 16, 99)):
        m = (qpos >= lo) & (qpos < hi)
        assert out[f"band_{b}_tokens"] == int(m.sum()) > 0, b
        assert out[f"band_{b}_gap_mean"] == pytest.approx(float(gap[m].mean()), abs=LOGP_ABS_TOL), b
        assert out[f"band_{b}_floor_mean"] == pytest.approx(float(floor[m].mean()), abs=LOGP_ABS_TOL), b
    assert bands.BANDS == ("window", "c4_all", "c4_topk")

    for name, ov in exact.items():
        layer = name.split(".")[1]
        assert out[f"agree_{layer}_positions"] == out[f"server_agree_{layer}_positions"] == len(ov)
        assert out[f"agree_{layer}_overlap_mean"] == pytest.approx(sum(ov) / len(ov))
        assert out[f"agree_{layer}_identical_share"] == pytest.approx(sum(fp8[name]) / len(ov))
        for key, want in (("server_agree", server_ov[name]), ("server_fp8_agree", server_fp8_ov[name])):
            assert out[f"{key}_{layer}_overlap_mean"] == pytest.approx(sum(want) / len(want)), key
            assert out[f"{key}_{layer}_identical_share"] == pytest.approx(sum(w == 1 for w in want) / len(want)), key
    assert out["server_topk_errors"] == out["server_topk_unreplayable"] == 0
    asked = [b for b in fake.bodies if b.get("return_indexer_topk")]          # the agreement rows only
    assert [len(b["input_ids"]) for b in fake.bodies] == [len(batch), 2] and len(asked) == 1, fake.bodies
    with open(tmp_path / "live_tokens" / "agree_0001.json") as f:                  # kept before the update
        saved = json.load(f)
    assert saved.pop("server_swaps") == [[0, planted[1], int(planted[2].split(".")[1]), 1]]   # the planted swap
    assert saved == {k: v for k, v in out.items() if k.startswith(("agree_", "server_agree_", "server_fp8_agree_"))}


def test_a_server_record_replay_would_refuse_is_counted_and_a_short_one_is_not_read():
    """The hold reads whether indexer replay could train on SGLang's records: a record with an entry its query
    cannot see is still compared but counted in `server_topk_unreplayable`; one with fewer rows than the
    sequence's L - 1 is not read (`server_topk_errors`). Bug caught: a record of another sequence compared as
    if it were this one's, or a hold that cannot tell whether replay would run."""
    from instruments.live import LiveChecksLong
    from nanoflash.server.engine import encode_record
    hook = LiveChecksLong.__new__(LiveChecksLong)
    hook.mcfg, hook.server_topk_errors, hook.server_topk_unreplayable = preset("tiny"), 0, 0
    K, L = hook.mcfg.index_topk, 24
    good = torch.full((L - 1, 2, K), -1, dtype=torch.int32)
    good[:, :, 0] = (torch.arange(L - 1) + 1).div(4, rounding_mode="floor")[:, None] - 1   # the last visible
    bad = good.clone()
    bad[10, 1, 1] = 3                                      # query 10 sees entries 0..1 only
    good_m, bad_m, short_m = ({"indexer_topk": encode_record(r)} for r in (good, bad, good[:L - 3]))
    assert torch.equal(hook._server_topk(good_m, 2, L), good.long())
    assert hook.server_topk_errors == hook.server_topk_unreplayable == 0
    assert torch.equal(hook._server_topk(bad_m, 2, L), bad.long()) and hook.server_topk_unreplayable == 1
    assert hook._server_topk(short_m, 2, L) is None and hook.server_topk_errors == 1


class _RefusingServer(_FakeServer):
    """A server that rejects a request carrying `return_indexer_topk` (one started without the option may)."""

    def post(self, url, path, body):
        if body.get("return_indexer_topk"):
            raise RuntimeError("400: return_indexer_topk is not enabled")
        return super().post(url, path, body)


def test_a_server_refusing_the_topk_field_costs_one_request_not_the_prefill_check(gen):
    """LiveChecksLong asks SGLang's kept sets in a prefill of the agreement rows alone; a server that refuses the
    field is named once and not asked again, and the step's prefill check (all rows, no extra field) is
    untouched. Bug caught: a refusal counted as a prefill failure every step (the prefill gap lost for the
    whole run), or the field asked on every row's prefill (a record is ~4 KiB a token and layer pair)."""
    from instruments.live import LiveChecksLong
    batch = _batch(preset("tiny"), gen)
    recorded = [[-0.5] * (int(batch.prompt_lens[b] + batch.response_lens[b]) - 1) for b in range(len(batch))]
    hook = LiveChecksLong.__new__(LiveChecksLong)
    hook.cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(temperature=T))
    server = _RefusingServer(recorded, seqs=[full_tokens(batch, b) for b in range(len(batch))])
    hook.rollouts = types.SimpleNamespace(client=server)
    hook.prefill_errors, hook.ask_topk, hook.server_topk_errors = 0, True, 0
    pre = hook._prefill(batch)
    on = batch.mask > 0
    assert pre is not None and torch.allclose(pre[on], torch.full((int(on.sum()),), -0.5))
    assert hook._server_records(batch, [1, 3]) == {} and hook.server_topk_errors == 1 and not hook.ask_topk
    assert hook._server_records(batch, [1, 3]) == {} and len(server.bodies) == 1   # not asked again
    assert hook.prefill_errors == 0 and not server.bodies[0].get("return_indexer_topk")
