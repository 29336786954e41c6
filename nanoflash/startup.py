"""What `train.py` does first with its command line: --help, overrides, checks, task data, the run directory.

    cfg, mcfg, task = startup(sys.argv[1:])

`startup` prints `--help` (`cli.help_text`) or the `--dry-run` plan and exits 0; otherwise it parses the
overrides (`cli.parse_args`), runs the checks that need no model (`check_config`: data and checkpoint paths,
server URLs, knob combinations; the config dataclasses refuse bad values and the knobs nothing reads), resolves
the model config (`model_config`: a checkpoint's own, or the preset, plus `--model.*`), loads the task's data
and reward plug-in (`rollouts.make_task`: the tokenizer/vocabulary check, field names, `train.reward`), and
prepares the run directory. A user error anywhere in there is ONE line on stderr (`train.py: error: ...`)
and exit code 2, before any model is built (`NANOFLASH_TRACEBACK=1` shows the traceback instead).

Run directories (`train.out_dir`): a run writes `config.json` (the whole tree, `cli.to_dict`) there at start.
A directory that already holds checkpoints is resumed only by the same run: a config that differs in anything
but the fields of `RESUMABLE` (steps, logging, layout, server addresses) is refused naming the differences, as
is `--no-resume` (its checkpoints would mix with the new run's); a run that already reached `train.steps`
says so and exits 0.

Differs from Miles: Miles validates its argparse namespace in `miles/utils/arguments.py` and raises
AssertionErrors (tracebacks); here every refusal is a sentence naming the flag.

Tests: `pytest tests/test_startup.py -q`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

from nanoflash import config as config_mod
from nanoflash.cli import GPU_RECIPES, dry_run_text, help_text, parse_args, recipe_name, to_dict
from nanoflash.config import ModelConfig, RunConfig, preset, run_preset

# Fields a resumed run may change (everything else must match the run directory's config.json).
RESUMABLE = {"train": {"steps", "resume", "progress", "plots", "tensorboard", "wandb", "threads", "save_every",
                       "keep", "dry_run", "max_skipped_steps", "reward_timeout_s", "reward_workers"},
             "parallel": "*", "eval": {"every"},
             "rollout": {"urls", "max_workers", "transport", "sync_addr", "verify", "bucket_bytes", "health_timeout_s",
                         "api_key", "max_server_restarts", "retry_s"}}
DATA_HELP = ("the defaults point at the project's shared data folder, ../shared/data/ seen from the directory "
             "you run in (README: Data)")


def usage_error(e: BaseException, prog: str = "train.py"):
    """One line on stderr and exit code 2 (NANOFLASH_TRACEBACK=1 re-raises instead)."""
    if os.environ.get("NANOFLASH_TRACEBACK"):
        raise e
    msg = " ".join(str(e).split()) if not isinstance(e, KeyError) else str(e.args[0])
    print(f"{prog}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def startup(argv: list[str], prog: str = "train.py"):
    """--help, overrides, checks, task data, run directory -> (cfg, model config, task). See the module docstring."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        raise SystemExit(0)
    try:
        cfg = parse_args(argv)
        if cfg.train.dry_run:
            print(dry_run_text(cfg))
            raise SystemExit(0)
        check_gpu(cfg, recipe_name(argv))
        check_config(cfg)
        mcfg = model_config(cfg)
        from nanoflash.rl import rollouts
        task = rollouts.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
        prepare_out_dir(cfg, rank0=int(os.environ.get("RANK", "0")) == 0)
    except (ValueError, OSError, ImportError, KeyError) as e:
        usage_error(e, prog)
    return cfg, mcfg, task


def _check_file(path: str, field: str) -> None:
    p = os.path.expanduser(path)
    if os.path.isfile(p) or not (os.sep in path or path.endswith((".jsonl", ".json", ".parquet"))):
        return  # a file, or a hub dataset name (data.py loads it through `datasets`, with its own error)
    default = getattr(config_mod, "TrainConfig" if field.startswith("train") else "EvalConfig")().data
    why = f"; {DATA_HELP}" if path == default else ""
    raise ValueError(f"{field}={path!r}: no such file (relative to {os.getcwd()}){why}; pass --{field} PATH")


def torch_build() -> str:
    """'torch 2.13.0+cpu (no CUDA/ROCm build)', 'torch 2.9.1+rocm6.4 (ROCm 6.4 build)', ... for error lines."""
    import torch
    if torch.version.hip:
        kind = f"ROCm {torch.version.hip} build"
    elif torch.version.cuda:
        kind = f"CUDA {torch.version.cuda} build"
    else:
        kind = "no CUDA/ROCm build"
    return f"torch {torch.__version__} ({kind})"


def check_gpu(cfg: RunConfig, recipe: str | None, gpu_count=None) -> None:
    """A run that expects GPUs (a recipe of cli.GPU_RECIPES, or --parallel.device cuda) on a machine where torch
    sees none stops here, naming the torch it found, instead of falling back to the CPU (`ParallelDims.device`
    and the gloo backend would). `gpu_count`: a stand-in for torch.cuda.device_count (tests)."""
    wants = [f"recipe {recipe!r}"] if recipe in GPU_RECIPES else []
    if cfg.parallel.device == "cuda" and not wants:
        wants = ["--parallel.device cuda"]
    if not wants:
        return
    import torch
    if (gpu_count or torch.cuda.device_count)() == 0:   # 0 on a CPU build, or with no GPU visible
        masks = [f"{v}={os.environ[v]!r}" for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES") if v in os.environ]
        raise ValueError(f"{wants[0]} needs GPUs but {torch_build()} sees none{''.join(', ' + m for m in masks)}")


def check_config(cfg: RunConfig) -> None:
    """What can be refused from the config alone: data and checkpoint paths, server URLs, knob combinations."""
    tc, ec = cfg.train, cfg.eval
    if tc.task != "arith":
        _check_file(tc.data, "train.data")
        if ec.every:
            _check_file(ec.data, "eval.data")
    elif tc.prompt_key or tc.answer_key:
        raise ValueError("train.prompt_key / train.answer_key name fields of a data file; task=arith has none")
    if tc.warmup_steps and tc.task != "arith":
        raise ValueError(f"train.warmup_steps={tc.warmup_steps}: the supervised warm-up is for task=arith only")
    bad = [u for u in cfg.rollout.urls if not re.match(r"^https?://[^/:]+(:\d+)?/?$", u)]
    if bad:
        raise ValueError(f"rollout.urls: {bad} are not http(s)://host[:port] addresses")
    if tc.checkpoint and not os.path.isdir(os.path.expanduser(tc.checkpoint)):
        raise ValueError(f"train.checkpoint={tc.checkpoint!r}: no such directory")


def model_config(cfg: RunConfig) -> ModelConfig:
    """The model to build: a checkpoint's own config (HF config.json, or a training checkpoint's meta.json)
    or the preset, with the --model.* overrides on top."""
    ckpt = os.path.expanduser(cfg.train.checkpoint)
    if not ckpt:
        return run_preset(cfg)
    if os.path.exists(os.path.join(ckpt, "meta.json")):  # a nanoflash training checkpoint (DCP)
        with open(os.path.join(ckpt, "meta.json")) as f:
            stored = json.load(f).get("extra", {}).get("model_config")
        base = ModelConfig.from_dict(stored) if stored else preset(cfg.train.preset)
    elif os.path.exists(os.path.join(ckpt, "config.json")):
        base = ModelConfig.from_hf_config(ckpt)
    else:
        raise ValueError(f"train.checkpoint={cfg.train.checkpoint!r} holds neither meta.json (a training "
                         f"checkpoint) nor config.json (HF layout)")
    return dataclasses.replace(base, **cfg.model)


def config_diff(old: dict, new: dict) -> list[str]:
    """`section.field: old -> new` for every field outside RESUMABLE that differs (fields `old` lacks: skipped)."""
    out = []
    for sec in sorted(set(old) & set(new)):
        allowed, a, b = RESUMABLE.get(sec, set()), old[sec], new[sec]
        if allowed == "*":
            continue
        for k in sorted(set(a) | set(b) if sec == "model" else set(a) & set(b)):
            if k not in allowed and a.get(k) != b.get(k):
                out.append(f"{sec}.{k} {a.get(k)!r} there, {b.get(k)!r} here")
    return out


def prepare_out_dir(cfg: RunConfig, rank0: bool = True) -> None:
    """Refuse another run's directory; stop (exit 0) if this run is finished; write out_dir/config.json."""
    from nanoflash.parallel.dcp import latest_checkpoint
    tc, out = cfg.train, cfg.train.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"train.out_dir={out!r} is a file, not a directory")
    latest, cfg_path = latest_checkpoint(os.path.join(out, "checkpoints")), os.path.join(out, "config.json")
    if latest:
        done = int(os.path.basename(latest)[len("step_"):])
        if not tc.resume:
            raise ValueError(f"--out {out} holds checkpoints of an earlier run (up to step {done}) that --no-resume "
                             f"would mix with this run's: pass a new --out, or delete {out}")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                diff = config_diff(json.load(f), to_dict(cfg))
            if diff:
                raise ValueError(f"--out {out} holds another run ({'; '.join(diff[:4])}"
                                 f"{'; ...' if len(diff) > 4 else ''}): pass a new --out, or delete {out}")
        if done > tc.steps:
            raise ValueError(f"--out {out}: that run is at step {done}, past train.steps={tc.steps}; pass --steps "
                             f"above {done} to continue it, or a new --out")
        if done == tc.steps:
            print(f"{out}: this run already finished ({done} of {tc.steps} steps); nothing to do. --steps N > "
                  f"{done} continues it; a new --out starts another run.")
            raise SystemExit(0)
    if rank0:
        os.makedirs(out, exist_ok=True)
        with open(cfg_path + ".tmp", "w") as f:
            json.dump(to_dict(cfg), f, indent=1)
        os.replace(cfg_path + ".tmp", cfg_path)


