"""Record every torch.distributed call of a run, per rank, for the NCCL-contract checker (tests/nccl_rules.py).

    torchrun --nproc-per-node 4 tests/dist_trace.py OUTDIR train.py --recipe smoke --parallel.pp 2 ...

patches torch.distributed's collective and point-to-point entry points (`TRACED` below, plus `new_group` and
`P2POp`), then runs `train.py` with `runpy` as `__main__` (argv and sys.path[0] as `python train.py` would
have them). Each rank appends one JSON line per call to `OUTDIR/rank{r}.jsonl`, written and flushed BEFORE the
call runs (new_group's after it: the record names the group it made), so a run that hangs or crashes still
leaves the call it stopped in:

    {"seq", "op", "group", "ranks", "backend", "explicit", "tensors": {arg: {"shape", "dtype", "device"}},
     "root" | "peer" (global ranks), "reduce", "splits", "n_objects", "tag", "async", "site", "at"}

`group` names the communicator: "WORLD", or "g{i}" for the i-th `new_group` call, a number every rank
agrees on because every rank must create every group in the same order (a torch rule, checked from the
`new_group` records). `explicit` is the backend `new_group` was asked for (the gloo side group says
"gloo"); None means the default backend: NCCL on a GPU run, gloo in this CPU run. `batch_isend_irecv`
writes one record whose `p2p` lists its P2POps in order ({"op": "send"|"recv", "peer", "shape", "dtype",
"tag"}). `site` is the code that called the torch.distributed function (file:line function, torch's own
files included: DCP calls `dist.gather_object` etc. by module attribute, so patching the module catches it),
`at` the innermost frame in this repository (nanoflash/ or train.py). The last line is {"op": "exit", "code"}.

Only the outermost call is recorded: torch's object collectives call the tensor collectives through
distributed_c10d's own globals, which are not patched, and a re-entrant call is passed through.

`P2POp` is replaced by a subclass that maps the patched `isend`/`irecv` back to torch's own, because
`P2POp` and `batch_isend_irecv` compare `op` with torch's functions by identity.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import runpy
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
# every public entry point that moves data or synchronises (the ones nanoflash and DCP call, and their kin)
TRACED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
          "reduce_scatter", "reduce", "gather", "scatter", "all_to_all_single", "all_to_all", "barrier",
          "monitored_barrier", "broadcast_object_list", "gather_object", "all_gather_object",
          "scatter_object_list", "send_object_list", "recv_object_list", "send", "recv", "isend", "irecv",
          "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced")
PASS_THROUGH_FILES = ("distributed_c10d.py", "c10d_logger.py")   # torch's decorators around the entry points


def _desc(t) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "device": t.device.type}


class Tracer:
    """The per-rank recorder: one open JSONL file, group ids by creation order."""

    def __init__(self, outdir: str, rank: int):
        os.makedirs(outdir, exist_ok=True)
        self.rank, self.seq, self.n_groups = rank, 0, 0
        self.groups: dict[int, tuple] = {}   # id(ProcessGroup) -> (gid, explicit backend, the group: kept alive)
        self.lock, self.local = threading.Lock(), threading.local()
        self.file = open(os.path.join(outdir, f"rank{rank}.jsonl"), "w")
        self.orig: dict = {}

    def write(self, rec: dict) -> None:
        with self.lock:
            rec = {"seq": self.seq, **rec}
            self.seq += 1
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    # ------------------------------------------------------------------ what a call is
    def group_info(self, group) -> dict:
        default = c10d._get_default_group()
        if group is None or group is default:
            return {"group": "WORLD", "ranks": list(range(dist.get_world_size())), "backend": dist.get_backend(),
                    "explicit": None}
        gid, explicit, _ = self.groups.get(id(group), (f"unregistered:{getattr(group, 'group_name', id(group))}",
                                                       None, None))
        return {"group": gid, "ranks": dist.get_process_group_ranks(group), "backend": dist.get_backend(group),
                "explicit": explicit}

    @staticmethod
    def _global(group, rank):
        if rank is None:
            return None
        return rank if group is None or group is c10d._get_default_group() else dist.get_global_rank(group, rank)

    def describe(self, name: str, args: dict) -> dict:
        if name == "batch_isend_irecv":
            ops = list(args["p2p_op_list"])
            rec = {"op": name, **self.group_info(ops[0].group if ops else None), "async": True,
                   "p2p": [{"op": "send" if o.op is c10d.isend else "recv", "peer": o.peer, "tag": o.tag,
                            **_desc(o.tensor)} for o in ops]}
            return rec
        group = args.get("group")
        rec = {"op": name, **self.group_info(group)}
        tensors = {}
        for k, v in args.items():
            if torch.is_tensor(v):
                tensors[k] = _desc(v)
            elif isinstance(v, (list, tuple)) and v and all(torch.is_tensor(x) for x in v):
                tensors[k] = [_desc(x) for x in v]
        rec["tensors"] = tensors
        root = args.get("src", args.get("dst"))
        if root is None:
            root = self._global(group, args.get("group_src", args.get("group_dst")))
        if name in ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"):
            rec["peer"] = root                      # None: recv from any source
            rec["tag"] = args.get("tag", 0)
        elif root is not None:
            rec["root"] = root
        if "op" in args and name != "batch_isend_irecv":
            rec["reduce"] = str(args["op"])
        if "output_split_sizes" in args or "input_split_sizes" in args:
            rec["splits"] = {"out": _ints(args.get("output_split_sizes")), "in": _ints(args.get("input_split_sizes"))}
        for k in ("object_list", "scatter_object_input_list", "object_gather_list"):
            if isinstance(args.get(k), list):
                rec.setdefault("n_objects", {})[k] = len(args[k])
        rec["async"] = bool(args.get("async_op", False)) or name in ("isend", "irecv")
        return rec

    def sites(self) -> dict:
        """`site`: the frame that called torch.distributed; `at`: the innermost frame of this repository."""
        site = at = None
        f = sys._getframe(2)
        while f is not None and (site is None or at is None):
            fn = os.path.abspath(f.f_code.co_filename)
            if fn != os.path.abspath(__file__) and not fn.endswith(PASS_THROUGH_FILES):
                where = f"{_rel(fn)}:{f.f_lineno} {f.f_code.co_name}"
                site = site or where
                if at is None and fn.startswith(ROOT + os.sep) and "site-packages" not in fn:   # a .venv inside
                    at = where
            f = f.f_back
        return {"site": site, "at": at}

    # ------------------------------------------------------------------ patches
    def wrap(self, name: str, orig):
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def traced(*a, **k):
            if getattr(self.local, "inside", False):
                return orig(*a, **k)
            try:
                rec = self.describe(name, dict(sig.bind(*a, **k).arguments))
            except Exception as e:  # never let the recorder change the run; the checker reports the gap
                rec = {"op": name, "describe_error": f"{type(e).__name__}: {e}"}
            self.write({**rec, **self.sites()})
            self.local.inside = True
            try:
                return orig(*a, **k)
            finally:
                self.local.inside = False
        return traced

    def wrap_new_group(self, orig):
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def new_group(*a, **k):
            args = sig.bind(*a, **k).arguments
            g = orig(*a, **k)
            gid = f"g{self.n_groups}"
            self.n_groups += 1
            backend = args.get("backend")
            explicit = str(backend).lower() if backend is not None else None
            ranks = sorted(args["ranks"]) if args.get("ranks") is not None else list(range(dist.get_world_size()))
            member = isinstance(g, dist.ProcessGroup)
            if member:
                self.groups[id(g)] = (gid, explicit, g)
            self.write({"op": "new_group", "group": gid, "ranks": ranks, "explicit": explicit, "member": member,
                        **self.sites()})
            return g
        return new_group

    def install(self) -> None:
        for name in TRACED:
            if hasattr(dist, name):
                self.orig[name] = getattr(dist, name)
                setattr(dist, name, self.wrap(name, self.orig[name]))
        self.orig["new_group"] = dist.new_group
        dist.new_group = self.wrap_new_group(dist.new_group)
        real = {dist.isend: c10d.isend, dist.irecv: c10d.irecv}

        class TracedP2POp(c10d.P2POp):
            """P2POp taking the patched isend / irecv (torch checks `op` by identity)."""

            def __new__(cls, op, *a, **k):
                return super().__new__(cls, real.get(op, op), *a, **k)

            def __init__(self, op, *a, **k):
                super().__init__(real.get(op, op), *a, **k)
        dist.P2POp = TracedP2POp


def _ints(x):
    return None if x is None else [int(v) for v in x]


def _rel(path: str) -> str:
    for base in (ROOT, TORCH_PARENT):
        if path.startswith(base + os.sep):
            return os.path.relpath(path, base)
    return path


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: torchrun ... tests/dist_trace.py OUTDIR script.py [ARGS...]")
    outdir, script, rest = argv[0], os.path.abspath(argv[1]), argv[2:]
    tracer = Tracer(outdir, int(os.environ.get("RANK", "0")))
    tracer.install()
    tracer.write({"op": "start", "world_size": int(os.environ.get("WORLD_SIZE", "1")), "argv": [argv[1], *rest]})
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
        raise
    finally:
        tracer.write({"op": "exit", "code": code})


if __name__ == "__main__":
    main(sys.argv[1:])
