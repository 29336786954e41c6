"""Command line of `train.py`: one dataclass tree (`config.RunConfig`), named run recipes, dotted overrides.

    python train.py --recipe demo --grpo.clip_high 0.28 --rollout.weights fp32 --model.max_seq_len 64
    python train.py --preset flash --parallel.pp 4 --parallel.ep 4 --dry-run

Resolution order (later wins): dataclass defaults -> `--recipe NAME|FILE` (a file of overrides, one a line:
`nanoflash/recipes/NAME.txt`, or any path, e.g. an experiment's own) ->
the command line. An override is `--section.field value` (or `--section.field=value`); the value is parsed
by the field's declared type: int, float, bool (`true/false/1/0/yes/no`), str, `None`/`none` for optional
fields, and comma lists for tuples (`--rollout.urls http://a:30000,http://b:30000`). `--model.<field>`
overrides a `ModelConfig` field of the preset. Short forms: `--preset` = `--train.preset`, `--dry-run` =
`--train.dry_run true`, `--steps` = `--train.steps`, `--out` = `--train.out_dir`, `--rollout.async` =
`--rollout.asynchronous` (`async` is a Python keyword, so no field can have the name). An unknown section or field,
or a value that does not parse, is one error naming it.

`--help` (`help_text`) lists every section and field with its type, default and comment, read from
`config.py`, and the recipes.

## Start-up

Start-up (`startup`), what `train.py` does first with its command line: --help, overrides, checks, task data, the run directory.

    cfg, mcfg, task = startup(sys.argv[1:])

`startup` prints `--help` (`cli.help_text`) or the `--dry-run` plan and exits 0; otherwise it parses the
overrides (`cli.parse_args`), runs the checks that need no model (`check_config`: data and checkpoint paths,
server URLs, knob combinations; the config dataclasses refuse bad values and the knobs nothing reads), resolves
the model config (`model_config`: a checkpoint's own, or the preset, plus `--model.*`), loads the task's data
and reward plug-in (`collector.make_task`: the tokenizer/vocabulary check, field names, `train.reward`), and
prepares the run directory. A user error anywhere in there is ONE line on stderr (`train.py: error: ...`)
and exit code 2, before any model is built (`NANOFLASH_TRACEBACK=1` shows the traceback instead).

Run directories (`train.out_dir`): a run writes `config.json` (the whole tree, `cli.to_dict`: secrets redacted)
there at start.
A directory that another run wrote into -- its `config.json`, or without one the config that starts its
`metrics.jsonl`, or its newest checkpoint's `meta.json` (`recorded_config`), with or without checkpoints -- is
taken only by the same run: a config that differs in anything but the fields of `RESUMABLE` (steps, logging,
the step size, the directory's own path, layout, server addresses) is refused
naming the differences (never overwritten), as is `--no-resume` over checkpoints (they would mix with the new
run's); a run that already reached `train.steps` says so and exits 0.

Differs from Miles: Miles validates its argparse namespace in `miles/utils/arguments.py` and raises
AssertionErrors (tracebacks); here every refusal is a sentence naming the flag. Miles has ~400 flat argparse flags; we keep the config as the dataclasses of
`config.py` and address their fields by path.

Tests: `pytest tests/test_train_cli.py tests/test_startup.py -q`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import inspect
import json
import os
import re
import sys
import textwrap
import time
import typing

from nanoflash import config
from nanoflash.config import ModelConfig, RunConfig, preset, run_preset
from nanoflash.parallel import planner
from nanoflash.parallel.dcp import latest_checkpoint
from nanoflash.rl.collector import make_task
from nanoflash.rl.hooks import load_hook
from nanoflash.rl.metrics import read_jsonl
from nanoflash.rl.plots import write_plots

SHORT = {"--preset": "train.preset", "--steps": "train.steps", "--out": "train.out_dir",
         "--checkpoint": "train.checkpoint", "--seed": "train.seed", "--rollout.async": "rollout.asynchronous"}
FLAGS = {"--dry-run": ("train.dry_run", "true"), "--no-resume": ("train.resume", "false")}

# Recipes that only make sense on GPUs: on a machine where torch sees none, start-up stops naming what it found
# (`check_gpu`) instead of running a 284B model or an H200 recipe on the CPU (issue 38).
GPU_RECIPES = ("flash", "gpu", "h200")
RECIPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")


def recipe_names() -> list[str]:
    """The named recipes: nanoflash/recipes/<name>.txt."""
    return sorted(f[:-4] for f in os.listdir(RECIPE_DIR) if f.endswith(".txt"))


def recipe_path(name_or_path: str) -> str:
    """`--recipe demo` -> nanoflash/recipes/demo.txt; a path to a recipe file is taken as it is."""
    if os.path.isfile(name_or_path):
        return name_or_path
    path = os.path.join(RECIPE_DIR, f"{name_or_path}.txt")
    if not os.path.isfile(path):
        raise ValueError(f"--recipe {name_or_path!r}: no such file, and not a named recipe; recipes are "
                         f"{recipe_names()}")
    return path


def read_recipe(name_or_path: str, seen: tuple = ()) -> list[str]:
    """A recipe file -> its overrides in order. One `section.field=value` a line; `#` starts a comment (the
    why lives there); `include NAME` splices another recipe's lines in at that point."""
    path = recipe_path(name_or_path)
    if path in seen:
        raise ValueError(f"--recipe {name_or_path!r}: includes itself ({' -> '.join(seen + (path,))})")
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if line.startswith("include "):
                out += read_recipe(line.split(None, 1)[1], seen + (path,))
            elif line:
                if "=" not in line:
                    raise ValueError(f"{path}:{n}: {line!r} is not section.field=value")
                out.append(line)
    return out


def recipe_summary(name: str) -> str:
    """The first comment line of a recipe file (for --help)."""
    with open(recipe_path(name)) as f:
        first = f.readline().strip()
    return first.lstrip("# ") if first.startswith("#") else ""


def _parse_value(raw: str, tp, where: str):
    """Parse `raw` as the declared type `tp` (a typing object or a string annotation already resolved)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if raw.lower() == "none" and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _parse_value(raw, inner[0], where)
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: {raw!r} is not a bool (true/false)")
    if tp is tuple or origin is tuple:
        return tuple(x for x in raw.split(",") if x) if raw else ()
    if tp is dict:
        return json.loads(raw)
    try:
        return tp(raw) if tp in (int, float, str) else raw
    except ValueError as e:
        raise ValueError(f"{where}: cannot parse {raw!r} as {tp.__name__}") from e


def _model_field_type(name: str):
    hints = typing.get_type_hints(ModelConfig)
    if name not in hints:
        near = difflib.get_close_matches(name, list(hints), n=1)
        raise ValueError(f"--model.{name}: ModelConfig has no field {name!r}" +
                         (f" (did you mean --model.{near[0]}?)" if near else ""))
    return hints[name]


def apply_override(cfg: RunConfig, path: str, raw: str) -> None:
    """Set `cfg.<section>.<field>` from the string `raw`, in place."""
    section, _, name = path.partition(".")
    if not name:
        raise ValueError(f"--{path}: not an option; overrides look like --<section>.<field> VALUE (--help lists them)")
    if section == "model":
        tp = _model_field_type(name)
        cfg.model[name] = tuple(int(x) for x in raw.split(",")) if name == "compress_ratios" else \
            _parse_value(raw, tp, f"--{path}")
        return
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    if section not in sections:
        raise ValueError(f"--{path}: unknown section {section!r}; sections are {sorted(sections)}")
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if name not in hints:
        near = difflib.get_close_matches(name, list(hints), n=1)
        hint = f" (did you mean --{section}.{near[0]}?)" if near else f"; fields are {sorted(hints)}"
        raise ValueError(f"--{path}: {type(obj).__name__} has no field {name!r}{hint}")
    setattr(obj, name, _parse_value(raw, hints[name], f"--{path}"))


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    """argv -> [(dotted path, raw value)], expanding short forms and flags."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in FLAGS:
            out.append(FLAGS[arg])
            i += 1
            continue
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --section.field value")
        key, eq, val = arg.partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"{arg} needs a value (--help lists the options)")
            val, i = argv[i + 1], i + 1
        i += 1
        out.append((SHORT.get(key, key[2:]), val))
    return out


def recipe_name(argv: list[str]) -> str | None:
    """The --recipe of a command line (the last one), or None."""
    names = [val for path, val in _pairs(list(argv)) if path == "recipe"]
    return names[-1] if names else None


def recipe_name(argv: list[str]) -> str | None:
    """The --recipe of a command line (the last one, as a name: a file's base name without .txt), or None."""
    names = [val for path, val in _pairs(list(argv)) if path == "recipe"]
    return os.path.basename(names[-1]).removesuffix(".txt") if names else None


def parse_args(argv: list[str]) -> RunConfig:
    """Defaults, then `--recipe`, then every other override, re-validated by each dataclass' checks."""
    cfg = RunConfig()
    pairs = _pairs(list(argv))
    for path, val in pairs:
        if path == "recipe":
            for item in read_recipe(val):
                apply_override(cfg, *item.split("=", 1))
    for path, val in pairs:
        if path != "recipe":
            apply_override(cfg, path, val)
    for f in dataclasses.fields(cfg):  # re-run __post_init__ validation on the final values
        sec = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sec):
            setattr(cfg, f.name, dataclasses.replace(sec))
    return cfg


REDACTED = "<redacted>"


def to_dict(cfg: RunConfig) -> dict:
    """JSON-able view of the whole tree, every secret (`config.SECRET_FIELDS`) redacted: what config.json, the
    `info` record of metrics.jsonl, W&B's config and each checkpoint's meta.json record. A literal value becomes
    REDACTED; `env:VAR` (the variable's name, not the secret) stays as it is."""
    d = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    for path in config.SECRET_FIELDS:
        section, name = path.split(".")
        v = d[section][name]
        if v and not str(v).startswith("env:"):
            d[section][name] = REDACTED
    return d


# ---------------------------------------------------------------------------------------------- --help
def _field_comments(cls) -> dict:
    """field -> the `# comment` that ends its line in config.py (the one place fields are documented), with the
    comment-only lines indented under it that continue it."""
    out, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"^    (\w+): [^\n]*?  # (.*)$", line)
        more = re.match(r"^ {5,}# (.*)$", line)
        if field:
            last = field.group(1)
            out[last] = field.group(2).strip()
        elif more and last:
            out[last] += " " + more.group(1).strip()
        else:
            last = None
    return out


HELP_COLUMN, HELP_WIDTH = 53, 120   # where a field's comment starts in --help, and where its lines wrap


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and len(args) < len(typing.get_args(tp)):  # Optional[X]
        return _type_name(args[0]) + "|none"
    return "list" if tp is tuple or typing.get_origin(tp) is tuple else getattr(tp, "__name__", str(tp))


def _section_help(name: str, cls, default_obj, note: str = "") -> list[str]:
    doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())   # the first paragraph, whole
    hints, comments = typing.get_type_hints(cls), _field_comments(cls)
    lines = [f"--{name}.* ({cls.__name__}): {doc}{note}"]
    for f in dataclasses.fields(cls):
        default = getattr(default_obj, f.name)
        left = f"  --{name}.{f.name} {_type_name(hints[f.name]).upper()} = {default!r}"
        text = textwrap.wrap(comments.get(f.name, ""), HELP_WIDTH - HELP_COLUMN) or [""]
        if len(left) >= HELP_COLUMN - 1:   # a long default: the comment starts on the next line, in its column
            text = [""] + text
        lines.append(f"{left:<{HELP_COLUMN - 1}} {text[0]}".rstrip())
        lines += [" " * HELP_COLUMN + t for t in text[1:]]
    return lines


def preset_summary(name: str) -> str:
    """One line of --help per model preset: what it is for, and its size."""
    c = preset(name)
    doc = " ".join((config.PRESETS[name].__doc__ or "").split())
    return (f"{doc}; dim {c.dim}, {c.n_layers} layers, {c.n_routed_experts} experts top-{c.n_activated_experts}, "
            f"vocab {c.vocab_size:,}")


def help_text() -> str:
    """Every section and field (type, default, comment) and the recipes: what `train.py --help` prints."""
    short = ", ".join(f"{k} = --{v}" for k, v in SHORT.items())
    flags = ", ".join(f"{k} = --{p} {v}" for k, (p, v) in FLAGS.items())
    out = ["usage: python train.py [--recipe NAME] [--<section>.<field> VALUE | --<section>.<field>=VALUE ...]", "",
           "GRPO for DeepSeek-V4. Later wins: defaults -> --recipe -> the command line. Values parse by the field's",
           "type: int, float, bool (true/false), str, none (for |none fields), comma-separated lists.",
           *textwrap.wrap(f"Short forms: {short}; {flags}.", HELP_WIDTH), "",
           "recipes (--recipe NAME, or the path of a recipe file):"]
    out += [f"  {k:<12} {recipe_summary(k)}" for k in recipe_names()]
    out += ["", "model presets (--preset NAME; --model.<field> overrides any field):"]
    out += [f"  {k:<12} {preset_summary(k)}" for k in config.PRESETS]
    cfg = RunConfig()
    for f in dataclasses.fields(RunConfig):
        if f.name != "model":
            out += [""] + _section_help(f.name, type(getattr(cfg, f.name)), getattr(cfg, f.name))
    out += [""] + _section_help("model", ModelConfig, ModelConfig(),
                                " -- overrides of the preset's value; the defaults shown are flash's")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- dry run
def dry_run_text(cfg: RunConfig, gpus_per_node: int = 8, rollout_nodes: int = 2) -> str:
    """Per-GPU memory plan of the configured trainer layout (parallel.planner) plus the rollout side."""
    tc, par = cfg.train, cfg.parallel
    mcfg = run_preset(cfg)
    layout = dataclasses.replace(par, dp=par.dp or 1)   # external SGLang servers, NCCL push; rank 0's rollout data
    setup = planner.Setup(gpus_per_host=gpus_per_node, rollout=planner.rollout_shape(cfg, mcfg))
    with contextlib.redirect_stdout(io.StringIO()):
        plan = planner.report(mcfg, tc.preset, layout, setup)
    n_train = par.pp * par.ep * (par.dp or 1)
    w, w_push = planner.rollout_weight_bytes(mcfg), planner.rollout_weight_bytes(mcfg, push=True)
    w_served = planner.rollout_weight_bytes(dataclasses.replace(mcfg, expert_dtype="fp8"))  # --from-release re-pack
    lines = [f"dry run: {tc.preset} | trainer {n_train} GPUs = PP{par.pp} x EP{par.ep} x DP{par.dp or 1} (TP1) on "
             f"{-(-n_train // gpus_per_node)} node(s) | rollout: {rollout_nodes} node(s) x {gpus_per_node} GPUs "
             f"serving SGLang", "", "trainer, per GPU (parallel.planner):", plan, "",
             f"rollout, per engine: the release re-packed with FP8 experts (python -m nanoflash.export "
             f"--from-release; release weights {w / 2**30:.1f} GiB with FP4 experts) {w_served / 2**30:.1f} GiB -> "
             f"{w_served / gpus_per_node / 2**30:.1f} GiB per GPU at TP/EP {gpus_per_node}; the rest is KV cache "
             f"(SGLang --mem-fraction-static)",
             f"weight sync per step: {w_push / 2**30:.1f} GiB (FP8 blocks, experts re-packed FP8, no MTP) "
             f"to each of {rollout_nodes} engines in {cfg.rollout.bucket_bytes / 2**30:.2f} GiB buckets"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- start-up
# A run's identity is its config minus these fields, the ones a resumed run may change (everything else must
# match what the run directory recorded). The one list: how long and how it runs and logs; where it lives
# (out_dir: a run moved to a bigger disk resumes); the step size (lr, its warm-up, the clip: the recovery a
# divergence advises); the layout; the servers and how weights reach them; instruments; the eval's cadence.
RESUMABLE = {"train": {"steps", "resume", "progress", "plots", "tensorboard", "wandb", "threads", "save_every",
                       "keep", "async_save", "dry_run", "max_skipped_steps", "max_abs_weight",
                       "reward_timeout_s", "reward_workers", "out_dir", "lr_warmup_steps", "hooks"},
             "optim": {"lr", "grad_clip"},
             "parallel": "*", "eval": {"every", "path", "before_train"},
             "rollout": {"urls", "max_workers", "transport", "sync_addr", "verify", "bucket_bytes", "health_timeout_s",
                         "api_key", "max_server_restarts", "retry_s", "update_timeout_s"}}
DATA_HELP = ("the defaults point at the project's shared data folder, ../shared/data/ seen from the directory "
             "you run in (README: Data)")


USAGE_EXIT_DELAY_S = 10.0   # seconds: torchrun ends the waiting ranks once rank 0 exits, so only a rank 0 slower
                            # than this (a loaded machine) could still lose its line


def usage_error(e: BaseException, prog: str = "train.py"):
    """One line on stderr (rank 0's: under torchrun every rank meets the same error) and exit code 2
    (NANOFLASH_TRACEBACK=1 re-raises instead). The other ranks exit USAGE_EXIT_DELAY_S later: torchrun stops
    every process once the first one fails, and a quiet rank that exited first took rank 0's line with it."""
    if os.environ.get("NANOFLASH_TRACEBACK"):
        raise e
    msg = " ".join(str(e).split()) if not isinstance(e, KeyError) else str(e.args[0])
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    elif os.environ.get("TORCHELASTIC_RUN_ID"):        # under torchrun (a test calling startup directly: no wait)
        time.sleep(USAGE_EXIT_DELAY_S)
    raise SystemExit(2)


def startup(argv: list[str], prog: str = "train.py"):
    """--help, overrides, checks, task data, run directory -> (cfg, model config, task). See the module docstring."""
    if any(a in ("-h", "--help") for a in argv):
        try:
            print(help_text(), flush=True)
        except BrokenPipeError:   # `train.py --help | head`: the reader left; no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    try:
        cfg = parse_args(argv)
        if cfg.train.dry_run:
            print(dry_run_text(cfg))
            raise SystemExit(0)
        check_gpu(cfg, recipe_name(argv))
        check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        check_config(cfg)
        mcfg = model_config(cfg)
        task = make_task(cfg.train, cfg.eval, mcfg.vocab_size, rewards_here=int(os.environ.get("RANK", "0")) == 0)
        prepare_out_dir(cfg, rank0=int(os.environ.get("RANK", "0")) == 0)
    except (ValueError, OSError, ImportError, KeyError) as e:
        usage_error(e, prog)
    return cfg, mcfg, task


def _check_file(path: str, field: str) -> None:
    p = os.path.expanduser(path)
    if os.path.isfile(p) or not (os.sep in path or path.endswith((".jsonl", ".json", ".parquet"))):
        return  # a file, or a hub dataset name (data.py loads it through `datasets`, with its own error)
    default = getattr(config, "TrainConfig" if field.startswith("train") else "EvalConfig")().data
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
    if cfg.parallel.device == "cpu":   # asked for the CPU in so many words (a dry run of a GPU recipe)
        return
    wants = [f"recipe {recipe!r}"] if recipe in GPU_RECIPES else []
    if cfg.parallel.device == "cuda" and not wants:
        wants = ["--parallel.device cuda"]
    if not wants:
        return
    import torch
    if (gpu_count or torch.cuda.device_count)() == 0:   # 0 on a CPU build, or with no GPU visible
        masks = [f"{v}={os.environ[v]!r}" for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES") if v in os.environ]
        raise ValueError(f"{wants[0]} needs GPUs but {torch_build()} sees none{''.join(', ' + m for m in masks)}")


def check_world(cfg: RunConfig, world: int) -> None:
    """The process count (torchrun's WORLD_SIZE; 1 for plain python) must fill the PP x DP x EP grid, checked
    before any process group exists (else every rank stopped on the grid's assertion with its own traceback,
    and torchrun's report on top)."""
    par = cfg.parallel
    grid = par.pp * par.ep * (par.dp or 1)
    if (world % grid if par.dp is None else world - grid) == 0:
        return
    need = f"a multiple of {grid}" if par.dp is None else f"exactly {grid}"
    layout = f"--parallel.pp {par.pp} x --parallel.ep {par.ep}" + (f" x --parallel.dp {par.dp}" if par.dp else "")
    started = f"torchrun started {world} processes (WORLD_SIZE)" if "WORLD_SIZE" in os.environ else \
        "plain python is 1 process"
    raise ValueError(f"{layout} needs {need} processes but {started}; start {need} (torchrun --nproc-per-node N "
                     f"[--nnodes M]) or change the layout")


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
    for spec in tc.hooks:   # an instrument that cannot be imported: one line before anything is built
        load_hook(spec)
    rc = cfg.rollout
    if (rc.asynchronous or rc.partial) and not cfg.grpo.use_tis:   # Miles' train_async asks for a correction too
        flag = "rollout.asynchronous" if rc.asynchronous else "rollout.partial"
        raise ValueError(f"{flag}=true trains on tokens sampled by older weights: set --grpo.use_tis true (the "
                         f"TIS weight exp(old - rollout) corrects them; rl/schedule.py)")


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


def recorded_config(out: str) -> tuple[dict | None, str | None]:
    """The config a run left in `out` and the file it came from: config.json, else the `info` record that starts
    its metrics.jsonl, else its newest checkpoint's meta.json (`run_config`: every save records it), so a lost
    config.json never switches the identity check off. (None, None): none of them, or an empty metrics.jsonl
    and no checkpoint; (None, where): records or checkpoints without a config (not a run of this trainer's)."""
    cfg_path, metrics = os.path.join(out, "config.json"), os.path.join(out, "metrics.jsonl")
    if os.path.exists(cfg_path):
        return _read_json(cfg_path, out), "config.json"
    recs = read_jsonl(metrics)
    info = next((r["config"] for r in recs if r.get("kind") == "info" and isinstance(r.get("config"), dict)), None)
    if info is not None:
        return info, "metrics.jsonl"
    latest = latest_checkpoint(os.path.join(out, "checkpoints"))
    if latest:
        meta = _read_json(os.path.join(latest, "meta.json"), out)
        extra = meta.get("extra") if isinstance(meta, dict) else None
        run = extra.get("run_config") if isinstance(extra, dict) else None
        return (run if isinstance(run, dict) else None), os.path.relpath(os.path.join(latest, "meta.json"), out)
    return None, "metrics.jsonl" if recs else None


def _read_json(path: str, out: str):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--out {out}: its {os.path.relpath(path, out)} is not JSON ({e}): pass a new --out, or "
                         f"delete {out}") from None


def prepare_out_dir(cfg: RunConfig, rank0: bool = True) -> None:
    """Refuse another run's directory; stop (exit 0) if this run is finished; write out_dir/config.json."""
    tc, out = cfg.train, cfg.train.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"train.out_dir={out!r} is a file, not a directory")
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.isdir(metrics):
        raise ValueError(f"--out {out}: {metrics} is a directory; the run writes its records there: move it away, "
                         f"or pass a new --out")
    read_jsonl(metrics)   # a corrupt line (not a torn last one): this one line now, not after the model is built
    latest, cfg_path = latest_checkpoint(os.path.join(out, "checkpoints")), os.path.join(out, "config.json")
    recorded, where = recorded_config(out)   # with or without checkpoints: another run's files are never overwritten
    if where is not None:
        diff = ["its config is not recorded"] if recorded is None else config_diff(recorded, to_dict(cfg))
        if diff:
            raise ValueError(f"--out {out} holds another run ({where}: {'; '.join(diff[:4])}"
                             f"{'; ...' if len(diff) > 4 else ''}): pass a new --out, or delete {out}")
    if latest:
        done = int(os.path.basename(latest)[len("step_"):])
        if not tc.resume:
            raise ValueError(f"--out {out} holds checkpoints of an earlier run (up to step {done}) that --no-resume "
                             f"would mix with this run's: pass a new --out, or delete {out}")
        if done > tc.steps:
            raise ValueError(f"--out {out}: that run is at step {done}, past train.steps={tc.steps}; pass --steps "
                             f"above {done} to continue it, or a new --out")
        if done == tc.steps:
            print(f"{out}: this run already finished ({done} of {tc.steps} steps); nothing to do. --steps N > "
                  f"{done} continues it; a new --out starts another run.")
            if tc.plots and rank0 and os.path.exists(metrics):   # a run killed after its final save never drew them
                for path in write_plots(out):
                    print(f"wrote {path}")
            raise SystemExit(0)
    if rank0:
        os.makedirs(out, exist_ok=True)
        with open(cfg_path + ".tmp", "w") as f:
            json.dump(to_dict(cfg), f, indent=1)
        os.replace(cfg_path + ".tmp", cfg_path)


