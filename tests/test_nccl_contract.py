"""NCCL's contract as a CI test: `train.py --recipe smoke` under torchrun (gloo on the CPU) with every
torch.distributed call recorded per rank (`tests/dist_trace.py`), the traces checked by `tests/nccl_rules.py`:
per communicator the same collectives in the same order on every member, no collective of a subset, P2P
messages matched per ordered pair, a group's first batch_isend_irecv joined by all its members, and the whole
run replayed with rendezvous semantics across communicators (the gloo side group apart from the NCCL ones).

The runs take every communication path of a step: the supervised warm-up (whose pipeline exchange then opens
the default group; without it, the step-0 checkpoint's finiteness all-reduce does), old log-probs (forward_only), the 1F1B GRPO step with several micro-batches
per shard, activation recompute (the backward re-issues the forward's all-to-alls), routing replay (R3
records travel with the micro-batches), the gradient all-reduces, the per-stage push (EP gather of the
experts; the smoke recipe pushes every step), rank 0's eval while the others wait, and a DCP checkpoint save
(save_every 1; DCP's own collectives on the gloo side group).

Runs: PP2 x EP2 (4 ranks) with the warm-up in the default suite (its time budget); PP2 x EP2 cold and the 8-rank
PP2 x EP2 x DP2 and PP4 x EP2 runs, each with and without the warm-up, under `-m slow` (all pass, 2026-12-03).
The checker's rules are also seen to fire on small synthetic traces (below), and on a planted bug in a copy
of the tree (pipeline sends posted before receives: tests/README.md).

Run: `pytest tests/test_nccl_contract.py -q` (`-m slow` for the other five runs).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import nccl_rules
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "tests", "dist_trace.py")
RUN_TIMEOUT_S = 420   # one 8-rank run takes ~1-2 min on the 2-core box; a hang is killed well before CI's limit
# One GRPO step that trains whatever the reward (dynamic sampling off: the smoke's untrained policy often
# scores 0 everywhere, and dropped groups would skip the step's collectives), 16-token micro-batches (several
# per shard: 1F1B's steady state), a short eval, and a training timeout that turns a hang into an error.
FLAGS = ["--recipe", "smoke", "--parallel.recompute", "true", "--rollout.routing_replay", "true",
         "--grpo.dynamic_sampling", "false", "--steps", "1", "--eval.every", "1", "--eval.n_problems", "2",
         "--parallel.micro_batch_tokens", "16", "--train.warmup_batch", "8", "--parallel.timeout_s", "120",
         "--train.progress", "false", "--train.plots", "false"]
LAYOUTS = {"pp2xep2": (2, 1, 2), "pp2xep2xdp2": (2, 2, 2), "pp4xep2": (4, 1, 2)}   # (pp, dp, ep)


def traced_run(out: str, world: int, flags: list, root: str = ROOT, timeout: float = RUN_TIMEOUT_S):
    """torchrun tests/dist_trace.py OUT/trace train.py ... -> (returncode, output tail, wall seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), TRACE, os.path.join(out, "trace"), os.path.join(root, "train.py"),
           "--out", os.path.join(out, "run"), *flags]
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        text = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)      # torchrun and every rank
        text = p.communicate()[0] + f"\n[killed after {timeout} s]"
    return p.returncode, text[-4000:], time.time() - t0


def roles(pp: int, dp: int, ep: int) -> list:
    """The roles of the groups `ParallelDims` creates, in its creation order (trivial groups are not created)."""
    out = []
    for name, size, rows in (("pp", pp, dp * ep), ("dp", dp, pp * ep), ("ep", ep, pp * dp), ("data", dp * ep, pp)):
        out += [name] * rows if size > 1 else []
    return out + ["side"]


def check_layout(tmp_path, layout: str, warmup: int):
    pp, dp, ep = LAYOUTS[layout]
    world = pp * dp * ep
    out = str(tmp_path / f"{layout}_w{warmup}")
    rc, text, wall = traced_run(out, world, ["--parallel.pp", str(pp), "--parallel.ep", str(ep), *FLAGS,
                                             "--train.warmup_steps", str(warmup)])
    traces = nccl_rules.load(os.path.join(out, "trace"))
    report = nccl_rules.check(traces)
    labels = {f"g{i}": r for i, r in enumerate(roles(pp, dp, ep))} | {"WORLD": "world"}
    summary = report.summary(labels)
    print(f"\n{layout} warmup={warmup}: {world} ranks, {wall:.1f} s; " + json.dumps(summary, sort_keys=True))
    for c in report.comms.values():
        print(f"  first op of {labels.get(c.gid, c.gid)} {c.label()}: {sorted(set(c.first_ops.values()))}")
    assert not report.violations, "NCCL contract broken:\n" + "\n".join(map(str, report.violations[:20]))
    assert rc == 0, f"torchrun failed ({rc}):\n{text}"
    return traces, report, labels, summary


def assert_every_path_was_taken(traces, report, labels, summary, warmup: int):
    """A trace that missed a path would pass the rules vacuously (a step skipped, a push or save gone)."""
    comms = report.comms
    # the groups are the ones ParallelDims documents, in its order, the side group alone gloo
    assert [labels[g] for g in comms if g != "WORLD"] == list(labels.values())[:-1]
    assert {c.kind for c in comms.values() if labels[c.gid] == "side"} == {"gloo"}
    assert {c.kind for c in comms.values() if labels[c.gid] != "side"} == {"nccl"}
    w, side = summary["world"], summary["side"]
    assert w["p2p_messages"] > 0 and summary["ep"]["all_to_all_single"] > 0     # pipeline and expert traffic
    assert summary["ep"]["gather"] > 0                                          # the push's expert gather
    assert summary["data"]["all_reduce"] > 0 and summary["pp"]["broadcast_object_list"] > 0
    assert w.get("gather_object", 0) == 0 and w.get("barrier", 0) == 0     # nothing of the save on WORLD (NCCL):
    assert side["gather_object"] > 0 and side["barrier"] > 0                # DCP and dcp.py's barriers, side group
    assert side["p2p_messages"] > 0 and side["all_gather_object"] > 0           # scatter_shards, the push's turns
    recs = [x for t in traces.values() for x in t]
    dcp = {x["group"] for x in recs if "torch/distributed/checkpoint/" in (x.get("site") or "")}
    side_gid = [g for g in comms if g != "WORLD" and labels[g] == "side"]
    assert dcp == set(side_gid), dcp                   # DCP's own collectives, seen through the module patch
    sent = {(len(o["shape"]), o["dtype"]) for x in recs if x["op"] == "batch_isend_irecv" for o in x["p2p"]}
    assert (4, "uint8") in sent, sent                  # routing replay: R3 records [B,S,L,K] cross the stages
    first_world = set(comms["WORLD"].first_ops.values())
    # warm-up: the SFT step's pipeline exchange opens WORLD; cold: the step-0 checkpoint's finiteness check
    want = "batch_isend_irecv" if warmup else "all_reduce"
    assert {f.split(" @ ")[0] for f in first_world} == {want}, first_world


# (layout, warm-up steps): 15-23 s a 4-rank run, 27-40 s an 8-rank one on the 2-core box (tests/README.md);
# the default suite keeps PP2 x EP2 with warm-up (suite time); the 8-rank layouts and the cold start: -m slow
RUNS = [pytest.param("pp2xep2", 1, id="pp2xep2-warmup"),
        pytest.param("pp2xep2", 0, id="pp2xep2-cold", marks=pytest.mark.slow),
        pytest.param("pp2xep2xdp2", 0, id="pp2xep2xdp2-cold", marks=pytest.mark.slow),
        pytest.param("pp4xep2", 1, id="pp4xep2-warmup", marks=pytest.mark.slow),
        pytest.param("pp2xep2xdp2", 1, id="pp2xep2xdp2-warmup", marks=pytest.mark.slow),
        pytest.param("pp4xep2", 0, id="pp4xep2-cold", marks=pytest.mark.slow)]


@pytest.mark.parametrize("layout,warmup", RUNS)
def test_run_keeps_the_nccl_contract(tmp_path, layout, warmup):
    """Bugs caught: a rank issuing a collective the others skip or reorder (a hang or garbage on NCCL,
    sometimes silent on gloo), pipeline neighbours that both post their sends before their receives (a
    deadlock, planted: tests/README.md), a first batched P2P on a group that not every member joins (NCCL's
    communicator creation hangs; gloo never notices), a P2P shape disagreement between neighbours, a
    collective of one communicator waiting on another's in a cycle. 8 ranks add DP's expert all-reduce and a
    DP replica that does not push (pp2xep2xdp2), middle pipeline stages that receive and send (pp4xep2)."""
    traces, report, labels, summary = check_layout(tmp_path, layout, warmup)
    assert_every_path_was_taken(traces, report, labels, summary, warmup)
    if "dp" in labels.values():
        assert summary["dp"]["all_reduce"] > 0


# ---------------------------------------------------------------------------------------------- the tracer
ENTRY_POINTS = """
import os, tempfile, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
g = dist.new_group([0, 1])
side = dist.new_group(backend="gloo")
x = torch.ones(3)
dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)
dist.broadcast(x, src=1)
dist.all_gather([torch.empty(3) for _ in range(w)], x)
dist.all_gather_into_tensor(torch.empty(3 * w), x)
dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * w))
dist.all_to_all_single(torch.empty([3, 7][r]), torch.ones(5), [[1, 2], [4, 3]][r], [[1, 4], [2, 3]][r], group=g)
dist.barrier(group=side)
dist.monitored_barrier(group=side)
box = [r]
dist.broadcast_object_list(box, src=0, group=side)
dist.gather_object(r, [None] * w if r == 0 else None, dst=0)
dist.all_gather_object([None] * w, r)
out = [None]
dist.scatter_object_list(out, [10, 11] if r == 0 else None, src=0)
dist.gather(x, [torch.empty(3) for _ in range(w)] if r == 1 else None, dst=1)
y = torch.empty(2, dtype=torch.int64)
if r == 0:
    dist.send(torch.zeros(2, dtype=torch.int64), dst=1)
    dist.isend(torch.zeros(4), dst=1).wait()
    dist.send_object_list([{"a": 1}], dst=1, group=side)
else:
    dist.recv(y, src=0)
    dist.irecv(torch.empty(4), src=0).wait()
    dist.recv_object_list([None], src=0, group=side)
peer = 1 - r
ops = [dist.P2POp(dist.isend, torch.full((2, 3), r, dtype=torch.float16), peer), dist.P2POp(dist.irecv, torch.empty(2, 3, dtype=torch.float16), peer)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
dcp.save({"w": torch.arange(4.0) + r}, checkpoint_id=os.environ["CKPT"])
dist.destroy_process_group()
"""


def test_tracer_records_every_entry_point(tmp_path):
    """Each patched entry point, called once on 2 gloo ranks, is recorded with its communicator, root / peer
    (global ranks), shapes and dtypes, and a DCP save's collectives are caught through the module attributes
    (DCP calls `dist.gather_object` etc.). Bugs caught: an entry point left unpatched, or called through a
    name bound at import (`from torch.distributed import ...`), so its calls never reach the checker; the
    P2POp patch breaking torch's identity check on isend / irecv; wrong global ranks for a subgroup."""
    script = tmp_path / "entry_points.py"
    script.write_text(ENTRY_POINTS)
    env = dict(os.environ, CKPT=str(tmp_path / "ckpt"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           TRACE, str(tmp_path / "trace"), str(script)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    traces = nccl_rules.load(str(tmp_path / "trace"))
    report = nccl_rules.check(traces)
    assert not report.violations, "\n".join(map(str, report.violations))
    ops = [x["op"] for x in traces[1]]
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "barrier", "monitored_barrier", "broadcast_object_list", "gather_object",
                 "all_gather_object", "scatter_object_list", "gather", "recv", "irecv", "recv_object_list",
                 "batch_isend_irecv", "new_group"):
        assert name in ops, (name, ops)
    by_op = {x["op"]: x for x in traces[1] if x["op"] not in ("new_group",)}
    assert by_op["all_reduce"]["group"] == "g0" and by_op["all_reduce"]["reduce"] == "RedOpType.MAX"
    assert by_op["broadcast"]["root"] == 1 and by_op["broadcast"]["group"] == "WORLD"
    assert by_op["barrier"]["explicit"] == "gloo" and by_op["barrier"]["group"] == "g1"
    assert by_op["recv"]["peer"] == 0 and by_op["recv"]["tensors"]["tensor"] == {"shape": [2], "dtype": "int64",
                                                                                  "device": "cpu"}
    assert by_op["batch_isend_irecv"]["p2p"] == [
        {"op": "send", "peer": 0, "tag": 0, "shape": [2, 3], "dtype": "float16", "device": "cpu"},
        {"op": "recv", "peer": 0, "tag": 0, "shape": [2, 3], "dtype": "float16", "device": "cpu"}]
    assert by_op["all_to_all_single"]["splits"] == {"out": [4, 3], "in": [2, 3]}
    dcp_sites = {x["site"].split(":")[0] for x in traces[1] if "checkpoint/" in (x.get("site") or "")}
    assert any(s.endswith("torch/distributed/checkpoint/utils.py") for s in dcp_sites), dcp_sites   # .venv anywhere
    assert traces[0][-1] == {"seq": len(traces[0]) - 1, "op": "exit", "code": 0}


# ---------------------------------------------------------------------------------------------- the rules
class Synth:
    """Hand-written traces in dist_trace's format: `world` ranks, groups {gid: (ranks, explicit backend)}."""

    def __init__(self, world: int, groups: dict | None = None):
        self.groups = {"WORLD": (list(range(world)), None), **(groups or {})}
        self.recs = {r: [{"op": "start", "world_size": world}] for r in range(world)}
        for gid, (ranks, explicit) in (groups or {}).items():
            for r in range(world):
                self.recs[r].append({"op": "new_group", "group": gid, "ranks": ranks, "explicit": explicit})

    def _rec(self, gid, **kw):
        ranks, explicit = self.groups[gid]
        return {"group": gid, "ranks": ranks, "backend": "gloo", "explicit": explicit, "site": "x.py:1 f", **kw}

    def coll(self, ranks, gid="WORLD", op="all_reduce", shape=(4,), dtype="float32", **kw):
        for r in ranks:
            self.recs[r].append(self._rec(gid, op=op, tensors={"tensor": {"shape": list(shape), "dtype": dtype,
                                                                           "device": "cpu"}}, **kw))
        return self

    def a2a(self, rank, gid, in_splits, out_splits, width=8):
        t = {"input": {"shape": [sum(in_splits), width], "dtype": "bfloat16", "device": "cpu"},
             "output": {"shape": [sum(out_splits), width], "dtype": "bfloat16", "device": "cpu"}}
        self.recs[rank].append(self._rec(gid, op="all_to_all_single", tensors=t,
                                         splits={"out": out_splits, "in": in_splits}))
        return self

    def batch(self, rank, *items, gid="WORLD"):
        """items: ("send" | "recv", peer, shape)."""
        self.recs[rank].append(self._rec(gid, op="batch_isend_irecv", p2p=[
            {"op": d, "peer": peer, "tag": 0, "shape": list(shape), "dtype": "bfloat16", "device": "cpu"}
            for d, peer, shape in items]))
        return self

    def traces(self, exit_code=0) -> dict:
        out = {}
        for r, recs in self.recs.items():
            recs = recs + [{"op": "exit", "code": exit_code}]
            out[r] = [{"seq": i, **x} for i, x in enumerate(recs)]
        return out


H, G = (2, 4, 8), (2, 4)   # an activation and its ids, as one pipeline stage sends them


def _pipeline(split_sends: bool = False, fields_swapped: bool = False) -> Synth:
    """Two stages (ranks 0 -> 1), one micro-batch in flight each way, as 1F1B's steady state posts it: stage 0
    sends forward i+1 while receiving backward i, stage 1 sends backward i while receiving forward i+1.
    `split_sends`: both stages send first and receive afterwards (two batches each)."""
    s = Synth(2).coll([0, 1])                                 # an all_reduce opens WORLD
    s.batch(0, ("send", 1, H), ("send", 1, G)).batch(1, ("recv", 0, H), ("recv", 0, G[::-1] if fields_swapped else G))
    if split_sends:
        s.batch(0, ("send", 1, H), ("send", 1, G)).batch(0, ("recv", 1, H))
        s.batch(1, ("send", 0, H)).batch(1, ("recv", 0, H), ("recv", 0, G))
    else:
        s.batch(0, ("send", 1, H), ("send", 1, G), ("recv", 1, H))
        s.batch(1, ("send", 0, H), ("recv", 0, H), ("recv", 0, G))
    s.batch(0, ("recv", 1, H)).batch(1, ("send", 0, H))
    return s.coll([0, 1], shape=())


def _cases():
    two = {"A": ([0, 1], None), "B": ([0, 1], None)}
    swapped = Synth(2).coll([0, 1], shape=(4,)).coll([0, 1], shape=(8,))
    swapped.recs[1][-2:] = swapped.recs[1][-2:][::-1]         # rank 1 issues the two all_reduces the other way
    same_shape = Synth(2).coll([0, 1], site="a.py:1 f").coll([0, 1], site="b.py:2 g")
    same_shape.recs[1][-2:] = same_shape.recs[1][-2:][::-1]   # same shapes: only the call sites tell
    cross = Synth(2, two).coll([0], "A").coll([0], "B").coll([1], "B").coll([1], "A")
    first = Synth(3).batch(0, ("send", 1, H)).batch(1, ("recv", 0, H)).coll([2], shape=()) \
        .coll([0, 1], shape=()).batch(2, ("send", 0, H)).batch(0, ("recv", 2, H))
    absent = Synth(3).batch(0, ("send", 1, H)).batch(1, ("recv", 0, H))     # rank 2 never uses WORLD
    first_gloo = Synth(3, {"S": ([0, 1, 2], "gloo")}).batch(0, ("send", 1, H), gid="S") \
        .batch(1, ("recv", 0, H), gid="S").coll([0, 1, 2], "S", shape=())
    splits = Synth(2).a2a(0, "WORLD", [1, 4], [1, 2]).a2a(1, "WORLD", [3, 3], [4, 3])
    splits_ok = Synth(2).a2a(0, "WORLD", [1, 4], [1, 2]).a2a(1, "WORLD", [2, 3], [4, 3])
    groups = Synth(2, two)
    groups.recs[1][1:3] = [{**groups.recs[1][1], "ranks": [1]}, groups.recs[1][2]]
    return {
        "a correct 1F1B exchange": (_pipeline(), set()),
        "all_to_all_single with matching splits": (splits_ok, set()),
        "gloo group opened by a subset's P2P": (first_gloo, set()),
        "two collectives swapped on one rank": (swapped, {"order"}),
        "two same-shape collectives swapped on one rank": (same_shape, {"order"}),
        "reduce op differs": (Synth(2).coll([0], reduce="RedOpType.SUM").coll([1], reduce="RedOpType.MAX"),
                              {"order"}),
        "a collective of a subset": (Synth(2).coll([0, 1]).coll([0], shape=(2,)), {"subset", "deadlock"}),
        "a P2P shape mismatch": (_pipeline(fields_swapped=True), {"p2p"}),
        "a send without its receive": (Synth(2).coll([0, 1]).batch(0, ("send", 1, H)), {"p2p", "deadlock"}),
        "both neighbours send before receiving": (_pipeline(split_sends=True), {"deadlock"}),
        "two communicators in opposite orders": (cross, {"deadlock"}),
        "a first batch_isend_irecv a member opens with a collective": (first, {"first_batch"}),
        "a first batch_isend_irecv a member never joins": (absent, {"first_batch", "deadlock"}),
        "all_to_all_single splits disagree": (splits, {"splits"}),
        "groups created differently": (groups, {"groups"}),
    }


CASES = _cases()


@pytest.mark.parametrize("case", list(CASES))
def test_rules_on_synthetic_traces(case):
    """Each rule fires on the smallest trace that breaks it, and only the rules that should (a correct 1F1B
    exchange, matching splits and a gloo group opened by a subset pass). Bugs caught in the checker: a rule
    that cannot fire (e.g. the deadlock replay treating sends as buffered, which hides the send-before-receive
    deadlock: gloo's sends wait for the receive too, measured), or one that fires on correct schedules."""
    s, want = CASES[case]
    report = nccl_rules.check(s.traces())
    assert {v.rule for v in report.violations} == want, "\n".join(map(str, report.violations))


def test_trace_rule_wants_every_rank_to_exit_cleanly():
    """A run that crashed or hung leaves traces without a clean exit; a rank without a trace is named."""
    report = nccl_rules.check(_pipeline().traces(exit_code=1))
    assert {v.rule for v in report.violations} == {"trace"} and len(report.violations) == 2
    traces = _pipeline().traces()
    del traces[1]
    assert "rank 1" in {v.comm for v in nccl_rules.check(traces).by_rule("trace")}
