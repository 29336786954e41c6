"""The README's commands as a new user types them: the quick start's two commands (the first is CI's own, the
second runs verbatim from a clean environment with a 1-step override), the own-data example on the CPU (run
verbatim the same way) and on a GPU (its flags through start-up with the example's files), and every
train.py command of the README writes its own run directory.

Run: `pytest tests/test_readme.py -q`.
"""
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from nanoflash.cli import parse_args
from nanoflash.config import run_preset
from nanoflash.rl.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# appended to the demo command so the suite stays short: 1 GRPO step (the demo's own 30-step warm start) and
# a 64-problem eval at steps 0 and 1
SHORT = ["--steps", "1", "--eval.n_problems", "64", "--eval.k_samples", "4", "--train.plots", "false"]
# After the copy warm start nearly every sample is a digit + <eos> (measured truncation_rate 0.008); the
# truncation bug of issue 18 counted every such 2-token answer and reported ~1.0.
MAX_TRUNCATION = 0.2


def code_lines(section: str | None = None) -> list[str]:
    """Command lines of the README's ```bash blocks (of one `## section` if given), comments stripped."""
    text = open(README).read()
    if section is not None:
        text = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        lines += [ln.split("  #")[0].strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]
    return lines


def test_quick_start_is_two_commands_and_the_first_is_ci():
    cmds = code_lines("Quick start: two commands, from the repository root, in a fresh shell")
    assert cmds == ["bash scripts/setup.sh --test", ".venv/bin/python train.py --recipe demo"]
    assert cmds[0] in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()   # CI runs exactly this line


def test_demo_command_runs_verbatim_in_a_clean_environment(tmp_path):
    """No activated venv, no PYTHONPATH, a bare PATH: what a fresh shell has."""
    if not os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")):
        pytest.skip("no .venv: this test runs after scripts/setup.sh (CI's command)")
    cmd = code_lines("Quick start: two commands, from the repository root, in a fresh shell")[1]
    out = tmp_path / "demo"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    full = cmd + " " + " ".join(shlex.quote(a) for a in SHORT + ["--out", str(out), "--train.progress", "false"])
    p = subprocess.run(["bash", "-c", full], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, f"{full}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    assert [r["step"] for r in read_jsonl(str(out / "metrics.jsonl"), "train")] == [1]
    evals = read_jsonl(str(out / "metrics.jsonl"), "eval")
    assert [r["step"] for r in evals] == [0, 1] and all(r["n_problems"] == 64 for r in evals)
    assert all(r["truncation_rate"] <= MAX_TRUNCATION for r in evals), evals
    with open(out / "config.json") as f:
        assert json.load(f)["train"]["out_dir"] == str(out)              # the run's whole config, at its start
    metas = sorted((out / "checkpoints").glob("step_*/meta.json"))
    assert [m.parent.name for m in metas] == ["step_00000000", "step_00000001"]
    cfg = parse_args(shlex.split(cmd)[2:])
    want = dataclasses.asdict(run_preset(cfg))
    for m in metas:                                                      # every checkpoint carries its model
        with open(m) as f:
            assert json.load(f)["extra"]["model_config"] == json.loads(json.dumps(want))


def test_every_train_command_writes_its_own_run_directory():
    outs = {}
    for line in dict.fromkeys(code_lines()):      # the same command twice is the same run
        words = shlex.split(line)
        if "train.py" not in words or "--dry-run" in words:
            continue
        argv = words[words.index("train.py") + 1:]
        out = parse_args(argv).train.out_dir
        assert out not in outs, f"{line!r} and {outs.get(out)!r} both write {out}"
        outs[out] = line
    assert len(outs) >= 5, outs


def own_data_commands() -> tuple[str, str]:
    """(the CPU own-data command, the GPU one) of the README's "Your own data and reward" paragraph."""
    cmds = [c for c in code_lines() if "--train.prompt_key" in c]
    cpu = [c for c in cmds if "examples/own_data/cpu.txt" in c]
    gpu = [c for c in cmds if "--parallel.device cuda" in c]
    assert len(cpu) == 1 and len(gpu) == 1 and len(cmds) == 2, cmds
    return cpu[0], gpu[0]


def test_own_data_cpu_example_runs_verbatim_in_a_clean_environment(tmp_path):
    """Bug caught (issue 40): the README's only own-data example was a GPU-sized command on files nobody has, and
    its eval file's fields were never named (--eval.prompt_key / --eval.answer_key), so even on a GPU it stopped
    at "none of its rows gives a problem". The CPU one runs as printed, 1 step, a 4-problem eval."""
    if not os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")):
        pytest.skip("no .venv: this test runs after scripts/setup.sh (CI's command)")
    cmd = own_data_commands()[0]
    out = tmp_path / "mine"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    extra = ["--steps", "1", "--eval.n_problems", "4", "--train.plots", "false", "--train.progress", "false",
             "--out", str(out)]
    full = cmd + " " + " ".join(shlex.quote(a) for a in extra)
    p = subprocess.run(["bash", "-c", full], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, f"{full}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    assert "task chat: 64 training problems (0 rows skipped), 16 eval problems" in p.stdout, p.stdout
    assert [r["step"] for r in read_jsonl(str(out / "metrics.jsonl"), "train")] == [1]
    assert [(r["step"], r["n_problems"]) for r in read_jsonl(str(out / "metrics.jsonl"), "eval")] == [(0, 4), (1, 4)]
    assert [m.parent.name for m in sorted((out / "checkpoints").glob("step_*/meta.json"))][-1] == "step_00000001"


def test_own_data_gpu_example_flags_pass_start_up(tmp_path):
    """The GPU command's flags, with the example's files in place of ~/data and its reward module, through
    start-up on this CPU (the GPU count stubbed to 1): the tokenizer fits the preset, both files give problems."""
    words = shlex.split(own_data_commands()[1])
    swap = {"~/data/train.parquet": "examples/own_data/train.jsonl", "~/data/test.jsonl": "examples/own_data/test.jsonl",
            "my_rewards:score": "examples.own_data.my_rewards:score", "runs/mine": str(tmp_path / "mine")}
    argv = [swap.get(w, w) for w in words[words.index("train.py") + 1:]]
    code = ("import sys, torch; torch.cuda.device_count = lambda: 1\n"
            "from nanoflash.cli import startup\n"
            "cfg, mcfg, task = startup(sys.argv[1:])\n"
            "print(cfg.train.preset, mcfg.vocab_size, len(task.train), len(task.heldout))")
    p = subprocess.run([sys.executable, "-c", code] + argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "small 129280 64 16", p.stdout


# ---------------------------------------------------------------------------------------------- quoted numbers
# Every number README.md and docs/demo.md quote about the demo and the suite comes from a file a command writes:
# docs/demo/controls.json (scripts/demo_controls.py), docs/results/suite.json (scripts/suite_stats.py), or the
# command itself (the dry run, the demo's model). Bug caught (issue 40): the README said 0.111 -> 0.714 and
# "462 tests", docs/demo.md's dry run 108.0 GiB, each true of an older commit, and nothing compared them.
DEMO_MD = os.path.join(ROOT, "docs", "demo.md")


def flat(path: str) -> str:
    """A text with every run of whitespace (line breaks included) as one space."""
    return " ".join(open(path).read().split())


def demo_controls():
    """scripts/demo_controls.py as a module, and docs/demo/controls.json."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("demo_controls", os.path.join(ROOT, "scripts", "demo_controls.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(mod.CONTROLS_JSON) as f:
        return mod, json.load(f)


def f3(x: float) -> str:
    return f"{x:.3f}"


def test_readme_demo_numbers_are_controls_json():
    mod, res = demo_controls()
    first, second = (mod.demo_numbers(res, s) for s in mod.seeds_of(res))
    text = flat(README)
    m = re.search(r"held-out pass@1 (\S+) -> (\S+) and (\S+) -> (\S+) \(two seeds; (\S+) and (\S+) at steps (\d+) "
                  r"and (\d+) for the first\), while the same warm start continued for (\d+) supervised steps on its "
                  r"own data stays at chance \((\S+), (\S+)\)\. One run is (\d+)-(\d+) minutes of single-core CPU "
                  r"time \((\d+) s / (\d+) s measured", text)
    assert m, "the README's demo sentence changed shape: update this test with it"
    cpu = (first["cpu_s"], second["cpu_s"])
    assert list(m.groups()) == [f3(first["warm"]), f3(first["grpo"]), f3(second["warm"]), f3(second["grpo"]),
                                *map(f3, first["mid"]), *map(str, first["mid_steps"]), str(first["steps"]),
                                f3(first["control"]), f3(second["control"]), f"{min(cpu) / 60:.0f}",
                                f"{max(cpu) / 60:.0f}", *(f"{c:.0f}" for c in cpu)]
    assert re.search(rf"runs/demo/ \(~{first['cpu_s'] / 60:.0f} CPU-min\)", text), "the quick start's demo time"
    assert re.search(rf"The demo command: held-out pass@1 {f3(first['warm'])} -> {f3(first['grpo'])} in "
                     rf"{first['cpu_s']:.0f} s of CPU", text), "the Verified numbers' demo line"


def test_demo_md_table_is_written_from_controls_json():
    mod, res = demo_controls()
    text = open(DEMO_MD).read()
    block = mod.read_block(DEMO_MD, mod.DEMO_TABLE)
    assert block.strip() == mod.demo_table(res), "run scripts/demo_controls.py --write-docs docs/demo/controls.json"
    section = text.split("### CPU demo", 1)[1].split("\n### ", 1)[0].replace(block, "")
    stray = re.findall(r"\b\d\.\d{3}\b", section)          # a result quoted outside the table would go stale
    assert not stray, f"docs/demo.md's CPU demo prose quotes {stray}: put results in the generated table"


def test_the_suite_size_is_suite_json():
    with open(os.path.join(ROOT, "docs", "results", "suite.json")) as f:
        suite = json.load(f)
    m = re.search(r"The suite \(`python -m pytest -q -x -n auto --dist loadscope`, CI's command\): ([\d,]+) tests at "
                  r"commit (\w+)", flat(README))
    assert m, "the README's suite line changed shape: update this test with it"
    assert (int(m.group(1).replace(",", "")), suite["commit"].startswith(m.group(2))) == (suite["selected"], True)
    if "wall_s" in suite:                                   # the run's outcome and time, when the file has them
        run = re.search(r"all ([\d,]+) passed in ([\d,]+) s", flat(README))
        assert run and (int(run.group(1).replace(",", "")), int(run.group(2).replace(",", ""))) == \
            (suite["passed"], round(suite["wall_s"])) and suite["failed"] == 0, (run and run.groups(), suite)


def test_demo_md_dry_run_is_the_commands_output():
    from nanoflash.cli import dry_run_text
    text = open(DEMO_MD).read()
    block = text.split("<!-- DRY_RUN:", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    assert block.rstrip("\n") == dry_run_text(parse_args(["--recipe", "flash", "--dry-run"]))


def test_demo_md_model_size_is_the_recipes_model():
    from nanoflash.model import Transformer
    m = re.search(r"The model is the `tiny` preset \((\d+)K parameters", flat(DEMO_MD))
    n = sum(p.numel() for p in Transformer(run_preset(parse_args(["--recipe", "demo"]))).parameters())
    assert m and int(m.group(1)) == round(n / 1000), (m and m.group(1), n)
