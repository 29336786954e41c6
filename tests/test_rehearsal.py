"""The reference deployment rehearsed on one CPU box (issue 37 item 3): docs/demo.md's four-node commands, run.

The commands are read from docs/demo.md's "Reference deployment: four nodes" block and run as written, with
only these substitutions (each must match once, so a changed doc fails here rather than running something
else): host names -> 127.0.0.1 and free ports; the official checkpoint -> a tiny one written as the release
is (FP8 linears, FP4 experts); `python3 -m sglang.launch_server` -> `python -m nanoflash.server`, which takes
SGLang's launch flags; sizes (8 GPUs a node -> 2 ranks, --tp 8 -> 1). The training command gets the run's
sizes appended: the CPU (the recipe asks for GPUs), PP2 x EP2 (2 "nodes" x 2 ranks), 2 steps, the arithmetic task (DAPO needs V4's 129K-token
vocabulary), a checkpoint every step. Skipped: step 1's `scripts/setup.sh` (this environment is set up).

What runs: the export of the serving checkpoint (`--from-release ... --experts fp8`); two "rollout nodes"
(embedded servers, SGLang's command line, FP8, R3 on, each its own process and port); two "training nodes"
(`torchrun --nnodes 2 --node-rank {0,1}` on localhost, GLOO_SOCKET_IFNAME=lo) through start-up (preflight of
both servers, per-stage update groups -- sources on both nodes --, the first push), GRPO steps with verified
pushes, an asynchronous checkpoint (the flash recipe's), a SIGKILL of training node 1 once checkpoint 1 is
committed (node 0 then stops by itself), and a relaunch of both nodes with the same commands, which resumes
from the newest committed checkpoint and finishes, its last push verified on both servers.

Run: pytest tests/test_rehearsal.py -m slow -q   (about 3 minutes on 2 cores)
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import free_port
from nanoflash.checkpoint import save_hf_checkpoint
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.rl.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ["--parallel.device", "cpu", "--parallel.pp", "2", "--parallel.ep", "2", "--train.steps", "2", "--train.save_every", "1",
         "--train.task", "arith", "--train.data", "arith:mod10", "--train.difficulty", "4", "--train.threads", "1",
         "--grpo.n_prompts", "2", "--grpo.group_size", "4", "--grpo.over_sampling_batch_size", "2",
         "--grpo.dynamic_sampling", "false", "--rollout.max_new_tokens", "2", "--rollout.max_workers", "2",
         "--parallel.micro_batch_tokens", "64", "--eval.every", "0", "--train.progress", "false",
         "--train.plots", "false"]
NODE_STOP_S = 120   # node 0 stops by itself once node 1 is gone (gloo: "connection closed by peer")


def doc_commands() -> list[str]:
    """The four-node block of docs/demo.md: one string per command (continuations joined, comments dropped)."""
    text = open(os.path.join(ROOT, "docs", "demo.md")).read()
    block = text.split("### Reference deployment: four nodes", 1)[1].split("The commands as they must be run:", 1)[1]
    lines = []
    for line in block.split("\n")[1:]:
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    cmds, cur = [], ""
    for line in lines:
        line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
        cur += line.rstrip("\\").strip() + " " if line.strip() else ""
        if cur and not line.rstrip().endswith("\\"):
            cmds.append(cur.strip())
            cur = ""
    return cmds


def substitute(cmd: str, subs: dict) -> str:
    for old, new in subs.items():
        if old in cmd:
            assert cmd.count(old) == 1, (old, cmd)
            cmd = cmd.replace(old, new)
    return cmd


def descendants(pid: int) -> list[int]:
    """pid and every process below it (read from /proc)."""
    kids = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
        except OSError:
            pass
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        todo += kids.get(q, [])
    return out


def kill_tree(proc) -> None:
    for pid in reversed(descendants(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.loads(r.read())


def wait_healthy(urls, procs, timeout=180) -> None:
    deadline = time.time() + timeout
    for url, p in zip(urls, procs):
        while True:
            assert p.poll() is None, f"server {url} exited: {p.stderr.read()[-2000:]}"
            try:
                get(url, "/health")
                break
            except OSError:
                assert time.time() < deadline, f"server {url} never answered /health"
                time.sleep(0.5)


@pytest.mark.slow
def test_the_four_node_commands_rehearsed_on_one_box(tmp_path):
    cmds = doc_commands()
    export = next(c for c in cmds if "nanoflash.export --from-release" in c)
    exports = [c for c in cmds if c.startswith("export ")]
    server = next(c for c in cmds if "sglang.launch_server" in c)
    train = next(c for c in cmds if "torchrun" in c)
    assert any("setup.sh" in c for c in cmds) and len(exports) == 3, cmds

    release, served, out = str(tmp_path / "release"), str(tmp_path / "release-fp8e"), str(tmp_path / "run")
    mcfg = preset("tiny", **parse_args(["--recipe", "smoke"]).model)   # 18-id vocabulary of the arithmetic task
    save_hf_checkpoint(Transformer(mcfg).init_weights(3), release, weights="fp8", experts="fp4")
    ports = [free_port(), free_port(), free_port(), free_port(8)]   # 2 servers, torchrun's store, update groups
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    bin_dir = os.path.dirname(sys.executable)
    subs = {".venv/bin/python": sys.executable, ".venv/bin/torchrun": os.path.join(bin_dir, "torchrun"),
            "python3 -m sglang.launch_server": f"{sys.executable} -m nanoflash.server",
            "/ckpt/DeepSeek-V4-Flash-fp8e": served, "/ckpt/DeepSeek-V4-Flash": release, "--tp 8": "--tp 1",
            "http://ROLL0:30000": urls[0], "http://ROLL1:30000": urls[1], "--nproc-per-node 8": "--nproc-per-node 2",
            "--master-addr TRAIN0": "--master-addr 127.0.0.1", "--master-port 29500": f"--master-port {ports[2]}",
            "TRAIN0:29600": f"127.0.0.1:{ports[3]}", "<NIC the nodes reach each other on>": "lo",
            "<same NIC>": "lo", "<this node's address on that NIC>": "127.0.0.1"}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for e in exports:
        for kv in shlex.split(substitute(e, subs))[1:]:
            k, _, v = kv.partition("=")
            env[k] = v
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["SGLANG_DSV4_FP4_EXPERTS"] == "0", env
    p = subprocess.run(shlex.split(substitute(export, subs)), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]

    servers, nodes = [], []
    try:
        for port in ports[:2]:
            cmd = shlex.split(substitute(server.replace("--port 30000", f"--port {port}"), subs))
            servers.append(subprocess.Popen(cmd + ["--threads", "1"], cwd=ROOT, env=env, text=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        wait_healthy(urls, servers)

        def launch(node: int):
            cmd = shlex.split(substitute(train.replace("$NODE_RANK", str(node)), subs)) + SIZES + ["--out", out]
            log = open(os.path.join(str(tmp_path), f"node{node}-{len(nodes)}.log"), "w")
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

        nodes += [launch(0), launch(1)]
        committed = os.path.join(out, "checkpoints", "step_00000001", "meta.json")
        deadline = time.time() + 400
        while not os.path.exists(committed) and all(n.poll() is None for n in nodes) and time.time() < deadline:
            time.sleep(0.1)
        assert os.path.exists(committed), _logs(tmp_path)
        kill_tree(nodes[1])                                  # training node 1 goes down
        try:
            nodes[0].wait(NODE_STOP_S)                       # node 0 stops by itself, it does not hang
        except subprocess.TimeoutExpired:
            kill_tree(nodes[0])
            pytest.fail(f"training node 0 still running {NODE_STOP_S} s after node 1 died\n{_logs(tmp_path)}")
        assert nodes[0].returncode != 0

        relaunched = [launch(0), launch(1)]                  # the same commands: resume
        nodes += relaunched
        for n in relaunched:
            n.wait(400)
        assert [n.returncode for n in relaunched] == [0, 0], _logs(tmp_path)
        log0 = open(os.path.join(str(tmp_path), "node0-2.log")).read()
        assert re.search(r"resumed from \S+step_0000000[12]: step [12]", log0), log0[-3000:]
        train_recs = read_jsonl(os.path.join(out, "metrics.jsonl"), "train")
        assert [r["step"] for r in train_recs] == [1, 2], train_recs
        assert all(r["sync_tensors"] > 0 for r in train_recs)          # a verified push after each step
        ckpts = sorted(os.listdir(os.path.join(out, "checkpoints")))
        assert ckpts[-1] == "step_00000002" and not [c for c in ckpts if c.endswith(".tmp")], ckpts
        versions = {get(u, "/get_weight_version")["weight_version"] for u in urls}
        assert len(versions) == 1 and versions.pop().startswith("2-"), versions   # both hold step 2's push
    finally:
        for proc in nodes + servers:
            if proc.poll() is None:
                kill_tree(proc)


def _logs(tmp_path) -> str:
    return "\n".join(f"--- {f} ---\n" + open(os.path.join(str(tmp_path), f)).read()[-2500:]
                     for f in sorted(os.listdir(str(tmp_path))) if f.endswith(".log"))
