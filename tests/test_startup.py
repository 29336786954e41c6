"""train.py's startup (nanoflash/startup.py): --help, one-line user errors with exit code 2 before any model is
built, knobs nothing reads refused, run directories that refuse another run.

Run: `pytest tests/test_startup.py -q`.
"""
import json
import os
import subprocess
import sys

import pytest

from nanoflash import cli
from nanoflash import cli as startup
from nanoflash.config import GRPOConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fail_line(capsys, argv) -> str:
    """Run startup(argv), expect exit code 2 and exactly one stderr line; return it."""
    with pytest.raises(SystemExit) as exc:
        startup.startup(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: "), err
    return err[0]


def test_help_lists_sections_fields_defaults_comments_and_recipes(capsys):
    with pytest.raises(SystemExit) as exc:
        startup.startup(["--recipe", "demo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for section in ("--train.*", "--grpo.*", "--optim.*", "--parallel.*", "--rollout.*", "--eval.*", "--model.*"):
        assert section in out, section
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("--grpo.clip_high "))
    assert "FLOAT = 0.28" in line and "clip-higher" in line          # type, default, the config.py comment
    assert "INT|NONE = None" in out                                 # an optional field's type
    for recipe in cli.recipe_names():
        assert f"  {recipe} " in out
    assert "--train.reward STR = ''" in out and "--model.vocab_size INT" in out


def source_comments(cls) -> dict:
    """field -> its whole `#` comment in config.py, read with `tokenize` (not the help's regex): the comment on
    the field's line plus the comment-only lines indented under it."""
    import inspect
    import io
    import textwrap
    import tokenize
    out, last, last_row = {}, None, None
    src = textwrap.dedent(inspect.getsource(cls))
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    for i, t in enumerate(toks):
        if t.type != tokenize.COMMENT:
            continue
        first = next(x for x in toks if x.start[0] == t.start[0])
        if first is not t and first.type == tokenize.NAME and first.start[1] == 4 and toks[toks.index(first) + 1].string == ":":
            last, last_row = first.string, t.start[0]
            out[last] = t.string[1:].strip()
        elif first is t and last and t.start[0] == last_row + 1 and t.start[1] > 4:
            out[last] += " " + t.string[1:].strip()
            last_row = t.start[0]
        else:
            last = None
    return out


def help_entry(text: str, flag: str) -> str:
    """A field's comment in --help, its wrapped lines joined."""
    lines = text.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith(f"  {flag} "))
    padded = lines[i][cli.HELP_COLUMN - 2:cli.HELP_COLUMN] == "  "        # else a long default, the comment below
    body = [lines[i][cli.HELP_COLUMN:] if padded else ""]
    for ln in lines[i + 1:]:
        if not ln.startswith(" " * cli.HELP_COLUMN):
            break
        body.append(ln)
    return " ".join(b.strip() for b in body).strip()


def test_help_keeps_every_comment_whole_and_lists_the_presets():
    """Bug caught (issue 40): --help printed only the first line of a comment that goes on below its field, so
    `--optim.round_to_served` ended "(norms, head," and `--rollout.max_server_restarts` "(its"; and it never
    listed the model presets that --preset takes."""
    from nanoflash import config
    text = cli.help_text()
    for section in ("train", "grpo", "optim", "parallel", "rollout", "eval"):
        cls = type(getattr(config.RunConfig(), section))
        for name, comment in source_comments(cls).items():
            assert help_entry(text, f"--{section}.{name}") == comment, (section, name)
    assert help_entry(text, "--optim.round_to_served").endswith("their fp32 master the updates (rl/trainer.py)")
    assert help_entry(text, "--rollout.max_server_restarts").endswith("this many times a run; 0 = stop")
    presets = text.split("model presets", 1)[1].split("\n\n", 1)[0]
    assert [ln.split()[0] for ln in presets.splitlines()[1:]] == list(config.PRESETS), presets
    wrapped = [ln for ln in text.splitlines() if ln.startswith("  --") and ln[cli.HELP_COLUMN - 2:cli.HELP_COLUMN] == "  "
               or ln.startswith(" " * cli.HELP_COLUMN)]                 # comments (a long default aside)
    assert max(len(ln) for ln in wrapped) <= cli.HELP_WIDTH


def test_help_into_a_closed_pipe_is_quiet():
    """`train.py --help | head -3`: the reader leaves early; no BrokenPipeError traceback."""
    p = subprocess.run(f"{sys.executable} train.py --help | head -3", shell=True, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert len(p.stdout.splitlines()) == 3 and "Traceback" not in p.stderr, p.stderr


def test_help_from_train_py_exits_0_without_a_traceback():
    p = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--rollout.health_timeout_s" in p.stdout and not p.stderr.strip(), p.stderr


@pytest.mark.parametrize("argv, culprit", [
    (["--grpo.clip_hgh", "0.3"], "did you mean --grpo.clip_high"),
    (["--steps", "abc"], "'abc'"),
    (["--recipe", "nonexistent"], "'nonexistent'"),
    (["--grpo.kl_coef", "0.1"], "grpo.kl_coef=0.1"),             # declared, read by nobody: refused
    (["--grpo.kl_type", "k3"], "kl_type='k3'"),
    (["--grpo.entropy_coef", "0.01"], "grpo.entropy_coef=0.01"),
    (["--train.task", "dapo"], "vocab_size is 256"),               # tiny model vs the V4 tokenizer
    (["--train.task", "dapo", "--preset", "small", "--train.data", "nope/missing.parquet"], "train.data="),
    (["--train.task", "chat", "--preset", "small", "--eval.data", "nope/x.jsonl"], "eval.data="),
    (["--recipe", "demo", "--train.reward", "no_such_module_xyz:score"], "no_such_module_xyz"),
    (["--recipe", "demo", "--train.reward", "score_only"], "module:function"),
    (["--train.checkpoint", "/nonexistent/ckpt"], "train.checkpoint="),
    (["--rollout.urls", "node0:30000"], "node0:30000"),
    (["--recipe", "demo", "--model.vocab_size", "12"], "--model.vocab_size 18"),
    (["--help-me"], "--help-me"),
])
def test_user_mistakes_are_one_line_and_exit_2(capsys, tmp_path, argv, culprit):
    rows = tmp_path / "rows.jsonl"                                 # a data file for the non-arith tasks
    rows.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    files = ["--train.data", str(rows), "--eval.data", str(rows)]
    line = fail_line(capsys, files + argv + ["--out", str(tmp_path / "run")])
    assert culprit in line, line
    assert not os.path.exists(tmp_path / "run")                   # refused before anything was written


@pytest.mark.parametrize("which", ["train", "eval"])
def test_no_row_gives_a_problem_names_the_flags_that_fix_it(capsys, tmp_path, which):
    """Bug caught (issue 40): "none of its rows gives a problem" named the fields a row has but not the flags
    that name them, nor which of the two files (train or eval) it was."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"question": "1+1?", "meta": {"gold": "2"}}) + "\n")
    keys = {w: ["--" + w + ".prompt_key", "question", "--" + w + ".answer_key", "meta.gold"] for w in ("train", "eval")}
    other = "eval" if which == "train" else "train"
    line = fail_line(capsys, ["--train.task", "chat", "--model.vocab_size", "129280", "--train.data", str(mine),
                              "--eval.data", str(mine), "--out", str(tmp_path / "run")] + keys[other])
    assert "none of its 1 rows gives a problem" in line and "['meta', 'question']" in line, line
    assert f"--{which}.prompt_key / --{which}.answer_key" in line and f"--{other}." not in line, line


def test_default_data_path_missing_explains_the_shared_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                                    # ../shared/data does not exist from here
    line = fail_line(capsys, ["--train.task", "dapo", "--preset", "small"])
    assert "shared data folder" in line and "../shared/data/dapo_math_17k.parquet" in line


def test_grpo_config_refuses_unread_knobs_directly():
    GRPOConfig()  # the defaults are fine
    with pytest.raises(ValueError, match="reference policy"):
        GRPOConfig(kl_coef=0.05)


def test_train_py_mistake_is_one_line_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "train.py", "--grpo.clip_hgh", "0.3", "--out", str(tmp_path / "r")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == ["train.py: error: --grpo.clip_hgh: GRPOConfig has no field 'clip_hgh' "
                                             "(did you mean --grpo.clip_high?)"]


@pytest.mark.parametrize("world, layout, says", [
    (3, ["--parallel.pp", "2"], "--parallel.pp 2 x --parallel.ep 1 needs a multiple of 2 processes but torchrun "
                                "started 3 processes (WORLD_SIZE)"),
    (4, ["--parallel.pp", "2", "--parallel.dp", "1"], "needs exactly 2 processes but torchrun started 4"),
    (None, ["--parallel.ep", "2"], "needs a multiple of 2 processes but plain python is 1 process"),
])
def test_world_size_mismatch_is_one_line_before_any_process_group(capsys, tmp_path, monkeypatch, world, layout,
                                                                  says):
    """Bug caught (issue 40): a torchrun world that does not fill PP x DP x EP stopped every rank on the grid's
    assertion, inside init_distributed, each with its own traceback (3 ranks: 30 lines, torchrun's report on top)."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    line = fail_line(capsys, ["--recipe", "smoke", "--out", str(tmp_path / "run")] + layout)
    assert says in line, line
    monkeypatch.setenv("RANK", "1")                                # the other ranks: the same exit, no line
    with pytest.raises(SystemExit) as exc:
        startup.startup(["--recipe", "smoke", "--out", str(tmp_path / "run")] + layout)
    assert exc.value.code == 2 and capsys.readouterr().err == ""


def test_torchrun_world_mismatch_prints_one_line_of_ours():
    """End to end under torchrun (3 CPU processes, PP 2): the ranks print one line in all; what remains is
    torchrun's own failure report (its log lines and the ChildFailedError summary)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("no torchrun next to this python")
    p = subprocess.run([torchrun, "--nproc-per-node", "3", "train.py", "--recipe", "smoke", "--parallel.pp", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = (p.stdout + p.stderr).splitlines()
    ours = [ln for ln in out if "train.py: error:" in ln]
    assert ours == ["train.py: error: --parallel.pp 2 x --parallel.ep 1 needs a multiple of 2 processes but torchrun "
                    "started 3 processes (WORLD_SIZE); start a multiple of 2 (torchrun --nproc-per-node N "
                    "[--nnodes M]) or change the layout"], out
    assert not any(ln.startswith("[rank") for ln in out), out      # no rank's traceback
    assert p.returncode != 0


# ---------------------------------------------------------------------------------------------- run directories
def fake_checkpoint(out: str, step: int) -> None:
    d = os.path.join(out, "checkpoints", f"step_{step:08d}")
    os.makedirs(d)
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"step": step, "extra": {}}, f)


def test_out_dir_gets_config_json(tmp_path):
    out = str(tmp_path / "run")
    cfg, mcfg, task = startup.startup(["--recipe", "smoke", "--out", out])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == cli.to_dict(cfg)
    assert mcfg.vocab_size == 18 and len(task.heldout) == cfg.eval.n_problems


def test_another_runs_directory_is_refused_naming_the_difference(capsys, tmp_path):
    out = str(tmp_path / "run")
    startup.startup(["--recipe", "smoke", "--out", out])
    fake_checkpoint(out, 3)
    line = fail_line(capsys, ["--recipe", "smoke", "--out", out, "--rollout.weights", "fp32", "--steps", "10"])
    assert "rollout.weights 'fp8' there, 'fp32' here" in line and "new --out" in line
    line = fail_line(capsys, ["--recipe", "smoke", "--out", out, "--no-resume"])
    assert "up to step 3" in line
    line = fail_line(capsys, ["--recipe", "smoke", "--out", out, "--steps", "2"])
    assert "past train.steps=2" in line


@pytest.mark.parametrize("left", ["config.json", "metrics.jsonl", "both", "metrics.jsonl+checkpoint"])
def test_another_runs_files_without_checkpoints_are_refused_not_overwritten(capsys, tmp_path, left):
    """Bug caught (issue 40): a directory holding another run's config.json or metrics.jsonl but no checkpoint
    (a run stopped before its first save, or one with --train.save_every -1) was silently overwritten: its
    config.json replaced, its metrics.jsonl emptied by the next start. The same run's re-start is accepted."""
    out = str(tmp_path / "run")
    theirs = cli.to_dict(cli.parse_args(["--recipe", "smoke", "--out", out, "--seed", "7"]))
    os.makedirs(out)
    if left in ("config.json", "both"):
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(theirs, f)
    if left != "config.json":
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"kind": "info", "step": 0, "config": theirs}) + "\n")
            f.write(json.dumps({"kind": "train", "step": 1, "reward_mean": 0.5}) + "\n")
    if left.endswith("checkpoint"):
        fake_checkpoint(out, 1)
    before = {n: open(os.path.join(out, n)).read() for n in os.listdir(out) if n.endswith(("json", "jsonl"))}
    line = fail_line(capsys, ["--recipe", "smoke", "--out", out])
    assert "holds another run" in line and "train.seed 7 there, 1234 here" in line and "new --out" in line, line
    assert {n: open(os.path.join(out, n)).read() for n in before} == before      # nothing overwritten
    cfg, _, _ = startup.startup(["--recipe", "smoke", "--out", out, "--seed", "7", "--steps", "5"])
    assert cfg.train.seed == 7                                     # the same run (resumable fields aside) may


def test_metrics_of_an_unknown_run_are_refused_and_an_empty_one_is_not(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 3}) + "\n")
    line = fail_line(capsys, ["--recipe", "smoke", "--out", str(out)])
    assert "holds another run (metrics.jsonl: its config is not recorded)" in line, line
    (out / "metrics.jsonl").write_text("")                          # a start that died before its first record
    startup.startup(["--recipe", "smoke", "--out", str(out)])


def test_finished_run_says_so_and_exits_0_while_more_steps_continue(capsys, tmp_path):
    out = str(tmp_path / "run")
    startup.startup(["--recipe", "smoke", "--out", out])
    fake_checkpoint(out, 3)
    with pytest.raises(SystemExit) as exc:
        startup.startup(["--recipe", "smoke", "--out", out])
    assert exc.value.code == 0 and "already finished (3 of 3 steps)" in capsys.readouterr().out
    cfg, _, _ = startup.startup(["--recipe", "smoke", "--out", out, "--steps", "5", "--train.progress", "false"])
    assert cfg.train.steps == 5                                      # resumable fields may change


def _take(*argv: str):
    """What startup does with a run directory (`prepare_out_dir`), without loading the task. -> the config"""
    cfg = cli.parse_args(["--recipe", "smoke", *argv])
    startup.prepare_out_dir(cfg)
    return cfg


def test_the_advised_recovery_and_a_moved_run_resume(tmp_path):
    """Issue 39 case 7. Bugs caught: after "diverged ... lower --optim.lr" the re-run with a lower lr was refused
    as another run; a run directory moved (or copied) to a bigger disk could not be resumed because its path
    was part of its identity (`train.out_dir ... there`)."""
    out, moved = str(tmp_path / "run"), str(tmp_path / "bigger_disk" / "run")
    _take("--out", out, "--steps", "5")
    fake_checkpoint(out, 2)
    cfg = _take("--out", out, "--steps", "5", "--optim.lr", "1e-4", "--optim.grad_clip", "0.5",
                "--train.lr_warmup_steps", "3")
    assert (cfg.optim.lr, cfg.train.lr_warmup_steps) == (1e-4, 3)
    with pytest.raises(ValueError, match="optim.weight_decay 0.1 there, 0.2 here"):   # the rest is identity
        _take("--out", out, "--steps", "5", "--optim.weight_decay", "0.2")
    import shutil
    shutil.copytree(out, moved)
    assert _take("--out", moved, "--steps", "5").train.out_dir == moved
    with open(os.path.join(moved, "config.json")) as f:
        assert json.load(f)["train"]["out_dir"] == moved              # the record follows the run


@pytest.mark.parametrize("lost", ["config.json", "config.json+metrics.jsonl"])
def test_a_lost_config_json_keeps_the_identity_check(tmp_path, lost):
    """Issue 39 (low). Bug caught: with config.json deleted (and metrics.jsonl too), a run directory with
    checkpoints took any config silently. Each checkpoint's meta.json records the run's config (`run_config`),
    the last place the check reads; checkpoints that record none are refused, not adopted."""
    out = str(tmp_path / "run")
    theirs = cli.to_dict(cli.parse_args(["--recipe", "smoke", "--out", out, "--seed", "7"]))
    d = os.path.join(out, "checkpoints", "step_00000002")
    os.makedirs(d)
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"step": 2, "extra": {"run_config": theirs}}, f)
    if lost == "config.json":
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"kind": "train", "step": 1}) + "\n")   # its info record lost too
    with pytest.raises(ValueError, match="checkpoints/step_00000002/meta.json: train.seed 7 there, 1234 here"):
        _take("--out", out)
    _take("--out", out, "--seed", "7")                                   # the same run resumes
    os.remove(os.path.join(out, "config.json"))
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"step": 2, "extra": {}}, f)                           # a checkpoint that records none
    with pytest.raises(ValueError, match="its config is not recorded"):
        _take("--out", out, "--seed", "7")


def test_a_literal_api_key_is_never_written(tmp_path, monkeypatch):
    """Issue 39 case 9. Bug caught: a literal --rollout.api_key landed in clear in config.json (and, through the
    same dict, the `info` record of metrics.jsonl, W&B's config and the checkpoints' meta.json). `env:VAR`
    names the variable, not the key, and stays."""
    out = str(tmp_path / "run")
    cfg = _take("--out", out, "--rollout.api_key", "s3cret-Key")
    assert cfg.rollout.key() == "s3cret-Key"                                   # the run itself still has it
    with open(os.path.join(out, "config.json")) as f:
        text = f.read()
    assert "s3cret-Key" not in text and json.loads(text)["rollout"]["api_key"] == cli.REDACTED
    _take("--out", out, "--rollout.api_key", "an0ther")                        # resumable, and redacted too
    monkeypatch.setenv("NF_TEST_KEY", "from-env")
    assert cli.to_dict(cli.parse_args(["--rollout.api_key", "env:NF_TEST_KEY"]))["rollout"]["api_key"] == \
        "env:NF_TEST_KEY"
    from nanoflash.rl.metrics import MetricsLog                                  # train.py's info record
    log = MetricsLog(str(tmp_path / "m.jsonl"), config=cli.to_dict(cfg))
    log.log("info", 0, {"config": cli.to_dict(cfg)})
    assert "s3cret-Key" not in (tmp_path / "m.jsonl").read_text()


def test_metrics_faults_are_one_line_and_a_finished_run_redraws_its_plots(tmp_path):
    """Issue 39 (low). Bugs caught: a corrupt middle line of metrics.jsonl, or a metrics.jsonl that is a
    directory, gave a traceback after the model was built (now: one line at start-up); a run killed after its
    final save never drew its plots, and every re-run said "already finished" without drawing them."""
    out = str(tmp_path / "run")
    _take("--out", out)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"kind": "train", "step": 1, "reward_mean": 0.5}\n{"kind": "tr\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        _take("--out", out)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps({"kind": "train", "step": s, "reward_mean": 0.1 * s}) + "\n" for s in (1, 2, 3)))
    fake_checkpoint(out, 3)
    with pytest.raises(SystemExit) as exc:
        _take("--out", out, "--train.plots", "true")
    assert exc.value.code == 0 and os.path.exists(os.path.join(out, "plots", "reward.png"))
    other = str(tmp_path / "other")
    os.makedirs(os.path.join(other, "metrics.jsonl"))
    with pytest.raises(ValueError, match=r"metrics.jsonl is a directory"):
        _take("--out", other)


def test_config_diff_ignores_resumable_and_unknown_fields():
    a = cli.to_dict(cli.parse_args(["--recipe", "smoke"]))
    b = cli.to_dict(cli.parse_args(["--recipe", "smoke", "--steps", "9", "--parallel.pp", "2", "--seed", "7"]))
    assert startup.config_diff(a, b) == ["train.seed 1234 there, 7 here"]
    del a["train"]["reward"]                                         # a config.json written before the field existed
    assert startup.config_diff(a, cli.to_dict(cli.parse_args(["--recipe", "smoke"]))) == []


# ---------------------------------------------------------------------------------------------- external servers
def test_external_server_started_late_is_waited_for_and_a_dead_one_is_one_line():
    """A cold SGLang start: the server comes up 1 s after the trainer asks; one that never does stops the run
    with one line naming it once `rollout.health_timeout_s` is over."""
    import threading
    import time

    from conftest import free_port
    from nanoflash.rl import collector
    from nanoflash.config import preset
    from nanoflash.model import Transformer
    from nanoflash.sglang.client import SGLangClient
    from nanoflash.server.engine import RolloutEngine
    from nanoflash.server.http import serve

    port = free_port()
    late = threading.Timer(1.0, lambda: serve(RolloutEngine(Transformer(preset("tiny")), weights="fp32"), port=port))
    late.start()
    t0 = time.monotonic()
    collector.wait_for_servers(SGLangClient([f"http://127.0.0.1:{port}"]), timeout_s=60)
    assert 0.9 < time.monotonic() - t0 < 60
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exc:
        collector.wait_for_servers(SGLangClient([dead]), timeout_s=0.5)
    assert dead in str(exc.value) and "health_timeout_s=0.5" in str(exc.value) and "\n" not in str(exc.value)


def test_dry_run_prints_the_plan_and_touches_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(startup, "dry_run_text", lambda cfg: f"PLAN {cfg.train.preset} PP{cfg.parallel.pp}")
    with pytest.raises(SystemExit) as exc:   # no data files needed: the flash recipe's DAPO paths are not read
        startup.startup(["--recipe", "flash", "--dry-run", "--train.data", "/nonexistent.parquet",
                         "--out", str(tmp_path / "run")])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == "PLAN flash PP4"
    assert not os.path.exists(tmp_path / "run")


# ---------------------------------------------------------------------------------------------- GPU recipes
@pytest.mark.parametrize("argv,culprit", [
    (["--recipe", "flash"], "recipe 'flash' needs GPUs"),
    (["--recipe", "gpu"], "recipe 'gpu' needs GPUs"),
    (["--recipe", os.path.join(ROOT, "experiments", "h200", "h200.txt")], "recipe 'h200' needs GPUs"),
    (["--recipe", "demo", "--parallel.device", "cuda"], "--parallel.device cuda needs GPUs"),
])
def test_gpu_recipe_without_a_gpu_stops_naming_the_torch_found(capsys, tmp_path, monkeypatch, argv, culprit):
    """Bug caught (issue 38): a GPU recipe on a machine whose torch sees no GPU (a CPU wheel on a ROCm node)
    silently running on the CPU (ParallelDims.device -> cpu, gloo). Stubbed to 0 GPUs so it runs anywhere."""
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    line = fail_line(capsys, argv + ["--out", str(tmp_path / "run")])
    assert culprit in line and f"torch {torch.__version__}" in line and "sees none" in line, line
    assert not os.path.exists(tmp_path / "run")


def test_gpu_check_passes_with_a_gpu_and_ignores_cpu_recipes():
    """The check's other side: a seen GPU passes, and a CPU recipe never asks (the demo must run on CPU CI)."""
    startup.check_gpu(cli.parse_args(["--recipe", "flash"]), "flash", gpu_count=lambda: 1)
    startup.check_gpu(cli.parse_args(["--recipe", "demo"]), "demo", gpu_count=lambda: 0)
    with pytest.raises(ValueError, match="needs GPUs"):
        startup.check_gpu(cli.parse_args(["--recipe", "demo", "--parallel.device", "cuda"]), "demo",
                          gpu_count=lambda: 0)


def test_train_py_gpu_recipe_on_this_cpu_is_one_line():
    """End to end on the CPU CI (torch 2.13.0+cpu): one error line, exit 2, no traceback, no model built."""
    import torch
    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, "train.py", "--recipe", "flash"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: recipe 'flash' needs GPUs but "
                                                   f"{startup.torch_build()} sees none"), lines


def test_quiet_ranks_under_torchrun_leave_rank_0_time_to_print(monkeypatch, capsys):
    """Bug caught: under a loaded machine torchrun's first failing process was a quiet rank, torchrun then
    stopped rank 0 before its line (the world-mismatch test above failed so in the suite). The other ranks wait
    USAGE_EXIT_DELAY_S under torchrun before their exit; outside torchrun, and on rank 0, nothing waits."""
    waits = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    for rank, run_id, waited in (("1", "x", [cli.USAGE_EXIT_DELAY_S]), ("0", "x", []), ("1", None, [])):
        waits.clear()
        monkeypatch.setenv("RANK", rank)
        if run_id:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        else:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        with pytest.raises(SystemExit) as exc:
            cli.usage_error(ValueError("bad"))
        assert exc.value.code == 2 and waits == waited
        assert ("train.py: error: bad" in capsys.readouterr().err) == (rank == "0")
