"""Continuous batching in the embedded engine (server/engine.py): which forwards a step runs, which rows they
carry, and that batching changes neither the samples nor the log-probs beyond the last bits.

The scheduler is driven deterministically: requests are sent while the engine is paused (they all join the next
step), and a request joins mid-way from the `_next_logits` hook, which pauses the engine until it is queued.
Every model forward is logged as (rows, tokens per row, per-row positions or one start). Run:
`pytest tests/test_rollout_batching.py -q` (the GPU test: `-m gpu`).
"""
from __future__ import annotations

import base64
import threading
import time

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.server.engine import RolloutEngine, parse_sampling

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny forwards: latency-bound, one thread
WAIT_S = 60.0
# Batched scoring vs a batch of one (fp32, CPU): the same math on other GEMM shapes; measured <= 1e-6 on log-probs
# of order 1-10 (tiny model). A padding leak or a shifted slice moves them by O(0.1-1).
BATCHED_SCORE_TOL = 1e-5
# GPU, fp32 engine on the `small` geometry: batched vs serial changes cuBLAS's GEMM shapes (split-K, tiles) on
# every layer; 1e-3 on log-probs leaves room for that while a row decoded on another row's cache or position
# moves them by > 0.1. At least 90% of the samples must be the very same: a draw flips only when its uniform
# lands within ~1e-5 of a boundary of the cumulative distribution, and then the rest of that sample differs.
GPU_DLOGP_TOL, GPU_SAME_SAMPLES = 1e-3, 0.9
# Decode seam vs reference on the GPU (fp32): fused mHC's FMA dots over M*D and the dense experts' sums over all 16
# experts reorder fp32 sums (9.4e-7 on the CPU, small: docs/results/launches_small_cpu.json); 8 layers and cuBLAS's
# other GEMM shapes leave room to 1e-4 of the logits' max, while a wrong comb, weight or row moves them by > 1e-2.
GPU_DECODE_REL = 1e-4
# Device ops (kernels, copies) of a decode step, seam / reference: 0.093 of the aten ops + Triton launches on the
# CPU profile with the one-token step path (`Block.decode_step`: 452 / 4883, docs/results/launches_small_cpu.json),
# 0.34 with only the fused mHC and dense experts (1,643, docs/benchmarks.md); 0.25 leaves the step's extra device
# copies (einsum's permutes, index_put, pad) 2.5x while a step that left the step path fails.
GPU_DECODE_KERNELS = 0.25


def tiny(seed=0):
    return Transformer(preset("tiny")).init_weights(seed)


def sp_(n, max_new, seed, temperature=1.0):
    return parse_sampling({"n": n, "temperature": temperature, "max_new_tokens": max_new, "stop_token_ids": [],
                           "sampling_seed": seed}, 256)


def log_forwards(engine) -> list:
    """Every model forward from now on: (rows, tokens per row, "rows" for per-row positions else the start)."""
    log, real = [], engine.model.forward

    def forward(ids, start_pos=0, cache=None):
        log.append((ids.shape[0], ids.shape[1], "rows" if torch.is_tensor(start_pos) else start_pos))
        return real(ids, start_pos, cache)
    engine.model.forward = forward
    return log


def start(engine, jobs: dict, out: dict) -> list:
    """One thread per job {name: (prompt, sp)}, results into out[name] (an exception is the result)."""
    def run(name, prompt, sp):
        try:
            out[name] = engine.generate(prompt, sp, rid=name)
        except Exception as e:  # the point of some tests: what each request gets
            out[name] = e
    threads = [threading.Thread(target=run, args=(k, *v), daemon=True) for k, v in jobs.items()]
    for t in threads:
        t.start()
    return threads


def wait_until(cond, what: str):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < WAIT_S, f"timed out waiting for {what}"
        time.sleep(0.002)


def run_paused(engine, jobs: dict) -> dict:
    """Send every job while the engine is paused, so they all join its next step; -> results by name."""
    out = {}
    engine.pause("in_place")
    threads = start(engine, jobs, out)
    wait_until(lambda: len(engine.waiting) == len(jobs), "the requests to queue")
    engine.unpause()
    for t in threads:
        t.join(timeout=WAIT_S)
    assert not any(t.is_alive() for t in threads), "a request never returned"
    return out


def serial_results(jobs: dict) -> dict:
    engine = RolloutEngine(tiny(), weights="fp32", batching="serial")
    return {k: engine.generate(p, sp, rid=k) for k, (p, sp) in jobs.items()}


def ids_and_logprobs(results: list) -> list:
    return [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]) for r in results]


def test_one_forward_per_step_over_every_request_and_the_serial_samples():
    """Requests of prompt lengths 3, 5, 8 join together, a fourth joins at step 4, the first three leave after
    step 6: step 1 prefills each length once, every later step runs ONE decode forward over every row in flight
    at its own position (plus the joiner's prefill at step 4), and each request's tokens and log-probs equal the
    serial engine's (same seeds). Bugs caught: a forward per request, rows of a finished request kept (or the
    wrong rows dropped), the joiner's cache not appended, one request's logits drawn for another."""
    engine = RolloutEngine(tiny(), weights="fp32")
    jobs = {"a": ([3, 17, 42], sp_(2, 6, 1)), "b": ([5, 9, 2, 100, 7], sp_(3, 6, 2)),
            "c": ([11, 12, 13, 14, 15, 16, 17, 18], sp_(1, 6, 3))}
    late = {"d": ([40, 41, 42, 43], sp_(2, 6, 4))}
    log, calls, out = log_forwards(engine), [0], {}
    real = engine._next_logits

    def next_logits(reqs, state):
        calls[0] += 1
        logits = real(reqs, state)
        if calls[0] == 3:   # d is queued during step 3 and joins at step 4
            engine.pause("in_place")
            threads.extend(start(engine, late, out))
        return logits
    threads: list = []
    engine._next_logits = next_logits
    engine.pause("in_place")
    threads += start(engine, jobs, out)
    wait_until(lambda: len(engine.waiting) == 3, "a, b, c to queue")
    engine.unpause()
    wait_until(lambda: calls[0] >= 3 and engine.paused and len(engine.waiting) == 1, "d to queue")
    engine.unpause()
    for t in threads:
        t.join(timeout=WAIT_S)
    abc, d = 2 + 3 + 1, 2
    assert log == ([(2, 3, 0), (3, 5, 0), (1, 8, 0)] + [(abc, 1, "rows")] * 2 + [(abc, 1, "rows"), (d, 4, 0)]
                   + [(abc + d, 1, "rows")] * 2 + [(d, 1, "rows")] * 3), log
    want = serial_results({**jobs, **late})
    for k in want:
        assert ids_and_logprobs(out[k]) == ids_and_logprobs(want[k]), k


def test_serial_mode_runs_one_request_at_a_time():
    """The bench's baseline (`batching="serial"`, the engine before continuous batching): a request's n rows are
    every forward's rows, the next request starts when it ends. Bug caught: serial mode batching anyway (the
    'before' of bench/bench_rollout.py --part batching would measure the new engine)."""
    engine = RolloutEngine(tiny(), weights="fp32", batching="serial")
    log = log_forwards(engine)
    run_paused(engine, {"a": ([3, 17, 42], sp_(2, 3, 1)), "b": ([5, 9], sp_(3, 3, 2))})
    first = log[0][0]
    rest = 3 if first == 2 else 2
    assert log == [(first, 3 if first == 2 else 2, 0)] + [(first, 1, "rows")] * 2 + \
        [(rest, 3 if rest == 2 else 2, 0)] + [(rest, 1, "rows")] * 2, log


def test_batched_scoring_is_one_padded_forward_within_tolerance_of_the_trainer():
    """score="batched": the samples that finish in one step are scored by one right-padded `token_logprobs` per
    temperature; their log-probs are the trainer's batch-of-one values to BATCHED_SCORE_TOL and their R3 records
    the trainer's routing. Bugs caught: left padding or an off-by-one slice (O(1) errors), the routes of
    another sample or of the padding, a scoring forward per sample."""
    trainer, engine = tiny(), RolloutEngine(tiny(), weights="fp32", score="batched")
    calls, real = [], engine.model.token_logprobs

    def token_logprobs(ids, targets, temperature=1.0, chunk=1024):
        calls.append((ids.shape[0], temperature))
        return real(ids, targets, temperature, chunk)
    engine.model.token_logprobs = token_logprobs
    jobs = {"a": ([3, 17, 42], sp_(2, 5, 1)), "b": ([5, 9, 2, 100, 7, 8, 9, 10, 11], sp_(2, 5, 2)),
            "c": ([1], sp_(1, 5, 3, temperature=0.7))}
    out, threads = {}, []
    engine.pause("in_place")
    for k, (p, sp) in jobs.items():   # with R3 records
        threads.append(threading.Thread(target=lambda k=k, p=p, sp=sp: out.__setitem__(
            k, engine.generate(p, sp, rid=k, records=("routed_experts",))), daemon=True))
        threads[-1].start()
    wait_until(lambda: len(engine.waiting) == 3, "the requests to queue")
    engine.unpause()
    for t in threads:
        t.join(timeout=WAIT_S)
    assert sorted(calls) == [(1, 0.7), (4, 1.0)], calls   # c alone is scored alone; a and b together
    cfg, err = trainer.cfg, 0.0
    for k, (p, _) in jobs.items():
        for r in out[k]:
            full = torch.tensor(p + r["output_ids"])
            T = 0.7 if k == "c" else 1.0
            with torch.no_grad():
                want = trainer.token_logprobs(full[None, :-1], full[None, 1:], temperature=T)[0, len(p) - 1:]
            got = torch.tensor([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
            err = max(err, (got - want).abs().max().item())
            routes = torch.stack([trainer.layers[i].ffn.last_indices for i in sorted(trainer.layers, key=int)], 1)
            rx = torch.frombuffer(bytearray(base64.b64decode(r["meta_info"]["routed_experts"])), dtype=torch.int32)
            assert torch.equal(rx.view(len(full) - 1, cfg.n_layers, -1).long(), routes), k
    assert err <= BATCHED_SCORE_TOL, f"batched log-probs {err:.2e} from the trainer's"


def test_a_failed_step_reaches_every_request_in_it():
    """Non-finite logits in a step: every request of the batch gets the error (FloatingPointError, HTTP 500),
    the engine serves again once the weights are fixed. Bug caught: only the driving thread's request fails and
    the others wait forever for a result."""
    engine = RolloutEngine(tiny(), weights="fp32")
    emb, calls, real = engine.model.embed.weight, [0], engine._next_logits
    keep = emb.data.clone()

    def next_logits(reqs, state):
        calls[0] += 1
        if calls[0] == 2:
            emb.data.fill_(float("nan"))
        return real(reqs, state)
    engine._next_logits = next_logits
    out = run_paused(engine, {"a": ([3, 17, 42], sp_(2, 4, 1)), "b": ([5, 9], sp_(1, 4, 2))})
    assert all(isinstance(out[k], FloatingPointError) for k in "ab"), out
    emb.data.copy_(keep)
    assert len(engine.generate([3, 4], sp_(1, 2, 5))[0]["output_ids"]) == 2
    assert not engine.batch and not engine.finished and not engine.waiting


def test_a_weight_update_between_steps_re_prefills_every_row():
    """SGLang's retract: after `post_process` (a new epoch) the next step rebuilds every row's cache by a prefill
    of its whole sequence, then decodes on; the results equal the serial engine's (the same weights re-derived).
    Bug caught: decoding on across an update with the stale cache."""
    engine = RolloutEngine(tiny(), weights="fp32")
    log, calls, real = log_forwards(engine), [0], engine._next_logits

    def next_logits(reqs, state):
        calls[0] += 1
        if calls[0] == 3:
            engine.post_process()
        return real(reqs, state)
    engine._next_logits = next_logits
    jobs = {"a": ([3, 17, 42], sp_(2, 5, 1)), "b": ([5, 9, 2, 100, 7], sp_(1, 5, 2))}
    out = run_paused(engine, jobs)
    assert log == [(2, 3, 0), (1, 5, 0), (3, 1, "rows"), (2, 5, 0), (1, 7, 0), (3, 1, "rows"), (3, 1, "rows")], log
    want = serial_results(jobs)
    assert all(ids_and_logprobs(out[k]) == ids_and_logprobs(want[k]) for k in jobs)


@pytest.mark.gpu
def test_batched_engine_agrees_with_serial_on_the_gpu():
    """The `gpu` recipe's geometry (small, 18-id vocabulary, FP8 engine) on CUDA, 4 requests x 8 samples x 16
    tokens: continuous batching with batched scoring vs the serial engine with exact scoring, same seeds. At
    least GPU_SAME_SAMPLES of the samples identical, their log-probs within GPU_DLOGP_TOL."""
    cfg = preset("small", vocab_size=18, max_seq_len=64)
    with torch.device("cuda"):
        model = Transformer(cfg).init_weights(0, generator=torch.Generator("cuda").manual_seed(0))
    engine = RolloutEngine(model, weights="fp8")
    assert engine.use_cache and engine.score_mode == "batched"
    sp = {"n": 8, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16, "stop_token_ids": [2]}
    jobs = {f"r{i}": ([1, 5 + i, 6, 9, 7, 13, 4, 16], parse_sampling({**sp, "sampling_seed": 100 + i}, 18))
            for i in range(4)}
    batched = run_paused(engine, jobs)
    engine.batching, engine.score_mode = "serial", "exact"
    serial = run_paused(engine, jobs)
    pairs = [(a, b) for k in jobs for a, b in zip(ids_and_logprobs(batched[k]), ids_and_logprobs(serial[k]))]
    same = [(a, b) for a, b in pairs if a[0] == b[0]]
    dlogp = max(abs(x - y) for a, b in same for x, y in zip(a[1], b[1]))
    print(f"\nGPU batched vs serial: {len(same)}/{len(pairs)} samples identical, max |dlogp| {dlogp:.2e}")
    assert len(same) >= GPU_SAME_SAMPLES * len(pairs) and dlogp <= GPU_DLOGP_TOL


@pytest.mark.gpu
def test_decode_kernels_agree_with_the_reference_on_the_gpu():
    """The decode seam on CUDA (`model.decode_kernels`, kernels "auto": fused mHC, dense experts, the one-token
    step's `Block.decode_step`) against kernels="reference" on the `gpu` recipe's geometry (small, fp32 as the FP8
    engine runs it): 64 rows at four lengths prefilled, joined, 4 per-row steps; logits within GPU_DECODE_REL, and
    a step runs at most GPU_DECODE_KERNELS of the reference's device ops (kernels, copies). Bugs caught: the seam
    or its step path not taken on the GPU (the count), a fused or dense path that is wrong only at real width or
    on CUDA (the logits)."""
    from torch.profiler import ProfilerActivity, profile
    cfg = preset("small", vocab_size=18, max_seq_len=64)
    with torch.device("cuda"):
        model = Transformer(cfg).init_weights(0, generator=torch.Generator("cuda").manual_seed(0)).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 18, (16, L), generator=g).cuda() for L in (8, 9, 10, 11)]
    steps = torch.randint(0, 18, (4, 64, 1), generator=g).cuda()
    out, kernels = {}, {}
    for mode in ("reference", "auto"):
        model.cfg.kernels = mode           # every module holds this one config
        with torch.no_grad():
            caches = [model.new_cache() for _ in prompts]
            logits = [torch.cat([model(p, 0, c)[:, -1] for p, c in zip(prompts, caches)])]
            cache, pos = model.cat_caches(caches), torch.tensor([8, 9, 10, 11]).repeat_interleave(16)
            for i, ids in enumerate(steps):
                if i == len(steps) - 1:        # the last step profiled: its device ops
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        logits.append(model(ids, pos + i, cache)[:, -1])
                        torch.cuda.synchronize()
                    kernels[mode] = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
                else:
                    logits.append(model(ids, pos + i, cache)[:, -1])
        out[mode] = torch.stack(logits)
    model.cfg.kernels = "auto"
    err = float((out["auto"] - out["reference"]).abs().max() / out["reference"].abs().max())
    print(f"\nGPU decode seam vs reference: logits rel {err:.2e}, device ops per step {kernels}")
    assert err <= GPU_DECODE_REL and kernels["auto"] <= GPU_DECODE_KERNELS * kernels["reference"], (err, kernels)
