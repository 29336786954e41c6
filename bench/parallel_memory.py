"""Engine checks on one GPU: a CUDA train step, the planner against measured peak memory, the flash
activation fit, and the AdamW step with and without host offload.

1. smoke: the tiny model's train_step on CUDA (bf16 weights, recompute on and off) runs and its loss matches
   the CPU fp32 loss to bf16 precision.
2. planner check: the `small` preset (real head geometry, dim 2048, 8 layers) at PP1: peak activation memory
   of one forward+backward of T tokens (max_memory_allocated minus what was allocated before) vs the
   planner's prediction from its measured per-layer fit, with and without recompute.
3. flash fit: `measure_layer_bytes(flash)` on the GPU at S = 4096 / 8192 (the planner's MEASURED_FLASH).
4. AdamW: step time for 0.5B bf16 parameters with state on the GPU vs offloaded to (pinned) host memory.

Run on a GPU: PYTHONPATH=. python bench/parallel_memory.py
"""
import time

import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.optim import AdamW, trainable_parameters
from nanoflash.parallel.planner import layer_act_bytes, measure_layer_bytes
from nanoflash.parallel.train_step import token_nll_loss, train_step

GIB = 2 ** 30


def smoke():
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    out = {}
    for dev, dtype, rec in (("cpu", torch.float32, False), ("cuda", torch.float32, False),
                            ("cuda", torch.bfloat16, False), ("cuda", torch.bfloat16, True)):
        with torch.device(dev):
            model = Transformer(cfg)
        model.init_weights(0).cast_(dtype)
        model.recompute = rec
        opt = AdamW(trainable_parameters(model), lr=1e-3)
        r = train_step(model, ParallelDims(), [batch], opt, 1 / 64, token_nll_loss)
        out[f"{dev}/{dtype}/recompute={rec}"] = round(r["loss"], 5)
    print("smoke losses:", out, flush=True)


def planner_check(T=4096):
    cfg = preset("small")
    fit = measure_layer_bytes(cfg, (T // 2, T), device="cuda")
    print("small fit (a, b) per ratio:", {k: (round(a), round(b, 1)) for k, (a, b) in fit.items()}, flush=True)
    with torch.device("cuda"):
        model = Transformer(cfg)
    model.init_weights(0).cast_(torch.bfloat16)
    trainable_parameters(model)
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1), device="cuda")
    for rec in (False, True):
        model.recompute = rec
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        h = model.run_layers(model.embed_streams(ids[:, :-1]), ids[:, :-1])
        after_fwd = torch.cuda.memory_allocated() - base
        loss = token_nll_loss(model, h, {"targets": ids[:, 1:]})
        loss.backward()
        peak = torch.cuda.max_memory_allocated() - base
        per = [layer_act_bytes(cfg, cfg.compress_ratios[i], T, fit) for i in range(cfg.n_layers)]
        pred = (cfg.n_layers * T * cfg.hc_mult * cfg.dim * 2 + max(per)) if rec else sum(per)
        print(f"small T={T} recompute={rec}: kept after forward {after_fwd / GIB:.2f} GiB, peak over fwd+bwd "
              f"{peak / GIB:.2f} GiB (incl. grads {sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / GIB:.2f}); "
              f"planner activations {pred / GIB:.2f} GiB", flush=True)
        del h, loss


def flash_fit():
    t = time.time()
    fit = measure_layer_bytes(preset("flash"), (4096, 8192), device="cuda")
    print("MEASURED_FLASH =", {k: (round(a), round(b, 2)) for k, (a, b) in fit.items()},
          f"({time.time() - t:.0f} s)", flush=True)


def adamw(n_params=2 ** 29, chunk=2 ** 26):
    torch.set_num_threads(16)
    params = [torch.nn.Parameter(torch.randn(chunk // 4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(n_params // chunk)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    named = [(str(i), p) for i, p in enumerate(params)]
    for offload in (False, True):
        opt = AdamW(named, lr=1e-6, offload=offload)
        opt.step()  # warm-up (first-touch of host pages)
        torch.cuda.synchronize()
        t = time.time()
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        dt = (time.time() - t) / 3
        print(f"AdamW step, {n_params / 1e9:.2f}B bf16 params, offload={offload}: {dt * 1e3:.0f} ms "
              f"({dt / (n_params / 1e9):.2f} s per 1B params)", flush=True)
        del opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    smoke()
    planner_check()
    flash_fit()
    adamw()
