"""NCCL's contract, checked on the per-rank traces of `tests/dist_trace.py` (gloo on the CPU runs the same
calls; gloo forgives some of what NCCL does not, and neither reports a collective that matched by accident).

A communicator is one process group: "WORLD" or the i-th `new_group` ("g{i}"), with its global ranks and its
kind: "gloo" for a group created with backend="gloo" (the side group that waits out rank 0's rollouts),
"nccl" for the default backend (NCCL on GPUs; gloo in the CPU trace). Rules, each a `Violation.rule`:

    trace        every rank of the world left a trace that ends in {"op": "exit", "code": 0}; no call the
                 recorder could not describe
    groups       every rank created the same groups, in the same order, with the same ranks and backend
                 (torch: new_group is collective over the world)
    subset       a collective issued by some members of a communicator and not by the others (they end, or
                 move on to another communicator: a hang under NCCL until the watchdog kills the job)
    order        the k-th collective of a communicator differs between members: op, root, reduce op, object
                 count, call site, dtypes or shapes (with all_to_all*: dtypes and trailing dims; split sizes
                 below). NCCL matches collectives by position only, so a swap is silent garbage or a hang
    splits       all_to_all_single: what rank i sends to j (its in_splits[j]) != what j receives from i
                 (its out_splits[i]); all_to_all: the list shapes likewise; gather / scatter: the root's list
                 entry for member j != j's tensor
    p2p          between each ordered pair (src -> dst) on a communicator, the i-th send and the i-th receive
                 differ in shape or dtype, or their counts differ (NCCL / gloo match them by order only)
    any_source   a receive without a source on an nccl communicator (ProcessGroupNCCL has none)
    first_batch  on an nccl communicator whose first operation on some member is a batch_isend_irecv, every
                 member's first operation on it is one too (torch: "if this API is the first collective call
                 in the group passed to dist.P2POp, all ranks of the group must participate", because the
                 batch creates the whole group's communicator)
    deadlock     the traces, replayed with rendezvous semantics -- a collective completes when every member
                 stands at the same collective of that communicator, a batch of P2P ops when every op's
                 partner op is posted, a group's first batch when every member stands at its first operation
                 on that group, new_group when every rank stands at it -- do not all reach their end. This is
                 NCCL's ordering across communicators (and gloo's: its sends wait for the receive, measured),
                 which no per-communicator rule sees: e.g. both pipeline neighbours sending before receiving

`check(traces)` returns a `Report`: its `violations` and, per communicator, the op counts and each member's
first operation (`first_ops`). Async collectives are replayed as blocking: stricter than NCCL, and nanoflash
issues none (its batch_isend_irecv is waited at once).
"""
from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

P2P_OPS = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
NOT_COMM = ("start", "exit", "new_group")
OBJECT_OPS = ("broadcast_object_list", "gather_object", "all_gather_object", "scatter_object_list")
ROOT_LIST = {"gather": ("gather_list", "tensor"), "scatter": ("scatter_list", "tensor")}  # only the root has it


@dataclass
class Violation:
    rule: str
    comm: str
    message: str

    def __str__(self):
        return f"[{self.rule}] {self.comm}: {self.message}"


@dataclass
class Comm:
    gid: str
    ranks: tuple
    kind: str                                            # "nccl" (default backend) | "gloo" (explicitly gloo)
    ops: Counter = field(default_factory=Counter)        # collective op -> calls (as its lowest member issued them)
    p2p: Counter = field(default_factory=Counter)        # "messages": sends (in batches and single calls)
    first_ops: dict = field(default_factory=dict)        # member -> "op @ site" of its first call here

    def label(self) -> str:
        return f"{self.gid} ({self.kind}, ranks {self.ranks})"


@dataclass
class Report:
    violations: list
    comms: dict            # gid -> Comm
    world_size: int

    def by_rule(self, rule: str) -> list:
        return [v for v in self.violations if v.rule == rule]

    def summary(self, labels: dict | None = None) -> dict:
        """{role: {op: calls, summed over the communicators of that role}} (a collective counts once per
        communicator, a P2P message once); `labels` maps a gid to a role name (default: its kind)."""
        out: dict = defaultdict(Counter)
        for c in self.comms.values():
            role = (labels or {}).get(c.gid, c.kind)
            out[role].update({k: v for k, v in c.ops.items() if v})
            out[role].update({f"p2p_{k}": v for k, v in c.p2p.items() if v})
        return {k: dict(v) for k, v in out.items()}


def load(outdir: str) -> dict:
    """{rank: [records]} from OUTDIR/rank{r}.jsonl (a line cut off by a kill is dropped)."""
    traces = {}
    for path in glob.glob(os.path.join(outdir, "rank*.jsonl")):
        rank = int(re.fullmatch(r"rank(\d+)\.jsonl", os.path.basename(path)).group(1))
        recs = []
        with open(path) as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        traces[rank] = recs
    return traces


# ---------------------------------------------------------------------------------------------- helpers
def _kind(rec) -> str:
    return "gloo" if rec.get("explicit") == "gloo" else ("nccl" if rec.get("explicit") is None else rec["explicit"])


def _where(rec) -> str:
    at, site = rec.get("at"), rec.get("site")
    return f"{rec['op']} @ {site}" + (f" (in {at})" if at and at != site else "")


def _shape(d):
    return [(x["shape"], x["dtype"]) for x in d] if isinstance(d, list) else (d["shape"], d["dtype"])


def _signature(rec) -> dict:
    """What every member of a communicator must agree on for one collective (see `order`)."""
    sig = {"op": rec["op"], "root": rec.get("root"), "reduce": rec.get("reduce"), "site": rec.get("site"),
           "n_objects": rec.get("n_objects") if rec["op"] == "broadcast_object_list" else None}
    tensors = rec.get("tensors", {})
    if rec["op"] == "all_to_all_single":
        sig["tensors"] = {k: (v["shape"][1:], v["dtype"]) for k, v in tensors.items()}
    elif rec["op"] == "all_to_all":
        sig["tensors"] = {k: [(x["shape"][1:], x["dtype"]) for x in v] for k, v in tensors.items()}
    elif rec["op"] in ROOT_LIST:
        sig["tensors"] = {k: _shape(v) for k, v in tensors.items() if k != ROOT_LIST[rec["op"]][0]}
    elif rec["op"] in OBJECT_OPS:
        sig["tensors"] = None       # pickled payloads differ by rank
    else:
        sig["tensors"] = {k: _shape(v) for k, v in tensors.items()}
    return sig


def _diff(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k])


def _p2p_items(rec, rank):
    """(direction, src, dst, shape, dtype, tag) of every P2P op of a record, in posting order."""
    if rec["op"] == "batch_isend_irecv":
        for o in rec["p2p"]:
            s, d = (rank, o["peer"]) if o["op"] == "send" else (o["peer"], rank)
            yield o["op"], s, d, o["shape"], o["dtype"], o["tag"]
        return
    send = rec["op"] in ("send", "isend", "send_object_list")
    t = next(iter(rec.get("tensors", {}).values()), None)
    if rec["op"].endswith("object_list"):
        shape, dtype = "object", "object"
    else:
        shape, dtype = (t["shape"], t["dtype"]) if isinstance(t, dict) else (None, None)
    s, d = (rank, rec.get("peer")) if send else (rec.get("peer"), rank)
    yield ("send" if send else "recv"), s, d, shape, dtype, rec.get("tag", 0)


# ---------------------------------------------------------------------------------------------- the check
def check(traces: dict) -> Report:
    violations: list = []
    bad = violations.append
    world = max((r[0].get("world_size", 0) for r in traces.values() if r and r[0]["op"] == "start"), default=0)
    world = max(world, max(traces, default=-1) + 1)

    # trace: every rank present, ended cleanly, every call described
    for r in range(world):
        recs = traces.get(r)
        if not recs:
            bad(Violation("trace", f"rank {r}", "no trace"))
        elif recs[-1]["op"] != "exit" or recs[-1].get("code") != 0:
            bad(Violation("trace", f"rank {r}", f"did not exit cleanly; last record: {recs[-1]}"))
        for rec in recs or []:
            if "describe_error" in rec:
                bad(Violation("trace", f"rank {r}", f"an undescribed {rec['op']}: {rec['describe_error']}"))

    # groups: same new_group sequence everywhere; the communicators
    comms: dict = {"WORLD": Comm("WORLD", tuple(range(world)), "nccl")}
    created = {r: [(x["group"], tuple(x["ranks"]), x.get("explicit")) for x in recs if x["op"] == "new_group"]
               for r, recs in traces.items()}
    ref_rank = min(traces, default=None)
    for r, seq in created.items():
        if seq != created[ref_rank]:
            k = next((i for i, (a, b) in enumerate(zip(seq, created[ref_rank])) if a != b), min(len(seq), len(created[ref_rank])))
            bad(Violation("groups", f"rank {r}", f"new_group call #{k}: {seq[k] if k < len(seq) else 'none'} vs "
                                                 f"rank {ref_rank}'s {created[ref_rank][k] if k < len(created[ref_rank]) else 'none'}"))
    for r, recs in traces.items():
        for x in recs:
            if x["op"] == "new_group" and x["group"] not in comms:
                comms[x["group"]] = Comm(x["group"], tuple(x["ranks"]), _kind(x))
            elif x["op"] not in NOT_COMM and x.get("group") not in comms:
                comms[x["group"]] = Comm(x["group"], tuple(x["ranks"]), _kind(x))

    # per communicator and member: collectives in order, P2P items, first op
    colls: dict = defaultdict(lambda: defaultdict(list))      # gid -> rank -> [record]
    sends: dict = defaultdict(list)                           # (gid, src, dst) -> [(shape, dtype, where)]
    recvs: dict = defaultdict(list)
    for r, recs in traces.items():
        for rec in recs:
            if rec["op"] in NOT_COMM or "describe_error" in rec:
                continue
            c = comms[rec["group"]]
            c.first_ops.setdefault(r, _where(rec))
            if rec["op"] == "batch_isend_irecv" or rec["op"] in P2P_OPS:
                for d, s, t, shape, dtype, tag in _p2p_items(rec, r):
                    c.p2p["messages"] += d == "send"
                    if s is None and c.kind == "nccl":
                        bad(Violation("any_source", c.label(), f"rank {r}: {_where(rec)} receives from any source"))
                    (sends if d == "send" else recvs)[(c.gid, s, t)].append((shape, dtype, tag, _where(rec)))
            else:
                c.ops[rec["op"]] += r == c.ranks[0]
                colls[c.gid][r].append(rec)

    # subset, order, splits
    for gid, by_rank in colls.items():
        c = comms[gid]
        seqs = {m: by_rank.get(m, []) for m in c.ranks}
        n = max(len(s) for s in seqs.values())
        for k in range(n):
            here = {m: s[k] for m, s in seqs.items() if k < len(s)}
            if len(here) < len(c.ranks):
                some = next(iter(here.values()))
                missing = sorted(set(c.ranks) - set(here))
                bad(Violation("subset", c.label(), f"collective #{k} {_where(some)} issued by ranks "
                                                   f"{sorted(here)} only; ranks {missing} issue no collective #{k}"))
                break
            sigs = {m: _signature(x) for m, x in here.items()}
            m0 = c.ranks[0]
            odd = [m for m in c.ranks if sigs[m] != sigs[m0]]
            if odd:
                bad(Violation("order", c.label(), f"collective #{k}: rank {m0} {_where(here[m0])} vs rank {odd[0]} "
                                                  f"{_where(here[odd[0]])} ({_diff(sigs[m0], sigs[odd[0]])})"))
                break
            msg = _split_mismatch(c, here)
            if msg:
                bad(Violation("splits", c.label(), f"collective #{k} {_where(here[m0])}: {msg}"))

    # p2p: per ordered pair, i-th send == i-th recv
    for key in sorted(set(sends) | set(recvs), key=str):
        gid, s, t = key
        a, b = sends.get(key, []), recvs.get(key, [])
        for i, (x, y) in enumerate(zip(a, b)):
            if x[:3] != y[:3]:
                bad(Violation("p2p", comms[gid].label(), f"{s} -> {t} message #{i}: sent {x[0]} {x[1]} tag {x[2]} by "
                                                         f"{x[3]}, received into {y[0]} {y[1]} tag {y[2]} by {y[3]}"))
                break
        if len(a) != len(b) and s is not None:
            bad(Violation("p2p", comms[gid].label(), f"{s} -> {t}: {len(a)} sends, {len(b)} receives"))

    # first_batch
    for c in comms.values():
        if c.kind != "nccl" or not c.first_ops:
            continue
        batch = {m for m, w in c.first_ops.items() if w.startswith("batch_isend_irecv ")}
        if batch and batch != set(c.ranks):
            others = {m: c.first_ops.get(m, "nothing") for m in c.ranks if m not in batch}
            bad(Violation("first_batch", c.label(), f"ranks {sorted(batch)} open it with a batch_isend_irecv; "
                                                    f"the others' first operation: {others}"))

    # deadlock
    stuck = _replay(traces, comms)
    if stuck:
        bad(Violation("deadlock", "all", "replayed with rendezvous semantics, ranks stop at: " +
                      "; ".join(f"rank {r}: {w}" for r, w in sorted(stuck.items()))))
    return Report(violations, comms, world)


def _split_mismatch(c: Comm, here: dict) -> str:
    op = next(iter(here.values()))["op"]
    n = len(c.ranks)
    idx = {m: i for i, m in enumerate(c.ranks)}
    if op == "all_to_all_single":
        def split(m, key, which):
            sp = (here[m].get("splits") or {}).get(which)
            rows = here[m]["tensors"][key]["shape"][0] if here[m]["tensors"][key]["shape"] else 1
            return sp if sp is not None else [rows // n] * n
        for i in c.ranks:
            for j in c.ranks:
                sent, got = split(i, "input", "in")[idx[j]], split(j, "output", "out")[idx[i]]
                if sent != got:
                    return f"rank {i} sends {sent} rows to rank {j}, which expects {got}"
    elif op == "all_to_all":
        for i in c.ranks:
            for j in c.ranks:
                sent = here[i]["tensors"]["input_tensor_list"][idx[j]]["shape"]
                got = here[j]["tensors"]["output_tensor_list"][idx[i]]["shape"]
                if sent != got:
                    return f"rank {i} sends {sent} to rank {j}, which expects {got}"
    elif op in ROOT_LIST:
        lst, mine = ROOT_LIST[op]
        root = here[c.ranks[0]].get("root")
        entries = here.get(root, {}).get("tensors", {}).get(lst)
        if entries is not None:
            for j in c.ranks:
                if _shape(entries[idx[j]]) != _shape(here[j]["tensors"][mine]):
                    return f"root {root}'s {lst}[{idx[j]}] is {_shape(entries[idx[j]])}, rank {j} has {_shape(here[j]['tensors'][mine])}"
    return ""


# ---------------------------------------------------------------------------------------------- the replay
def _replay(traces: dict, comms: dict) -> dict:
    """Rendezvous replay of every rank's calls (see `deadlock`). -> {rank: where it stopped} ({} if all end)."""
    steps: dict = {}
    for r, recs in traces.items():
        seq, count, sent, got, first = [], Counter(), Counter(), Counter(), set()
        for rec in recs:
            op = rec["op"]
            if op == "new_group":
                count["new_group"] += 1
                seq.append(("coll", "new_group", count["new_group"], rec))
            elif op in NOT_COMM or "describe_error" in rec:
                continue
            elif op == "batch_isend_irecv" or op in P2P_OPS:
                items = []
                for d, s, t, *_ in _p2p_items(rec, r):
                    key = (rec["group"], s, t)
                    n = (sent if d == "send" else got)
                    n[key] += 1
                    items.append((d, key, n[key]))
                opens = op == "batch_isend_irecv" and rec["group"] not in first and comms[rec["group"]].kind == "nccl"
                first.add(rec["group"])
                seq.append(("p2p", rec["group"] if opens else None, items, rec))
            else:
                first.add(rec["group"])
                count[rec["group"]] += 1
                seq.append(("coll", rec["group"], count[rec["group"]], rec))
        steps[r] = seq
    members = {g: c.ranks for g, c in comms.items()}
    members["new_group"] = tuple(sorted(traces))
    first_at = {r: {} for r in steps}            # rank -> gid -> index of its first op there
    for r, seq in steps.items():
        for i, st in enumerate(seq):
            if st[0] == "coll" and st[1] != "new_group":
                first_at[r].setdefault(st[1], i)
            elif st[0] == "p2p":
                first_at[r].setdefault(st[3]["group"], i)
    pos = {r: 0 for r in steps}
    posted: set = set()
    arrived = {r: -1 for r in steps}

    def arrive(r):
        if arrived[r] != pos[r] and pos[r] < len(steps[r]):
            arrived[r] = pos[r]
            st = steps[r][pos[r]]
            if st[0] == "p2p":
                posted.update((d, key, n) for d, key, n in st[2])

    progress = True
    while progress:
        progress = False
        for r in steps:
            while pos[r] < len(steps[r]):
                arrive(r)
                st = steps[r][pos[r]]
                if st[0] == "coll":
                    _, gid, k, _ = st
                    group = members.get(gid, ())
                    ready = all(m in steps and pos[m] < len(steps[m]) and steps[m][pos[m]][0] == "coll"
                                and steps[m][pos[m]][1] == gid and steps[m][pos[m]][2] == k for m in group)
                    if not ready:
                        break
                    for m in group:
                        pos[m] += 1
                else:
                    _, opens, items, _ = st
                    partner = {"send": "recv", "recv": "send"}
                    if not all((partner[d], key, n) in posted for d, key, n in items):
                        break
                    if opens and not all(m in steps and first_at[m].get(opens) is not None
                                         and pos[m] >= first_at[m][opens] for m in members[opens]):
                        break
                    pos[r] += 1
                progress = True
    stuck = {}
    for r in steps:
        if pos[r] < len(steps[r]):
            st = steps[r][pos[r]]
            stuck[r] = _where(st[3])
            if st[0] == "p2p":   # which messages have no partner posted
                partner = {"send": "recv", "recv": "send"}
                waits = [f"{d} #{n - 1} {key[1]}->{key[2]}" for d, key, n in st[2] if (partner[d], key, n) not in posted]
                stuck[r] += f" waiting on {', '.join(waits[:4])}{' ...' if len(waits) > 4 else ''}"
            else:
                group = members.get(st[1], ())
                absent = [m for m in group if not (m in steps and pos[m] < len(steps[m]) and steps[m][pos[m]][1:3] == st[1:3])]
                stuck[r] += f" (collective #{st[2] - 1} of {st[1]}) waiting for ranks {absent}"
    return stuck
