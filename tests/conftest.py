"""Shared test fixtures.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` fresh processes
(spawn) joined into one gloo process group on a free localhost port, the CPU stand-in for a torchrun job.
It returns the list of the ranks' return values (passed back through files, so tensors survive the child's
exit), re-raises a child's exception with its traceback, and kills every rank after a timeout so that a
deadlocked collective fails a test instead of hanging CI. `FakeSGLang` is a canned SGLang HTTP server (the
client, warm-up tests). Other helpers may append fixtures below.

Randomness is replayable. Every test gets a seed derived from its own node id (`test_seed`), so the same
test draws the same numbers on every run, on every machine, whatever ran before it or was deselected:
* `gen` is a `torch.Generator` seeded with it; tests pass `generator=gen` to every draw they make;
* an autouse fixture seeds torch's, numpy's and `random`'s global generators with it too, so the draws
  the tests cannot route through `gen` (a module's default parameter init) are replayable as well.
A failure is replayed by running the same node id again; the seed is printed in the failure report.

The habit (tests/README.md): every test names the bug it would catch, and was seen once to fail on it,
planted in a copy of the tree.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import socket
import tempfile
import threading
import time
import traceback
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

RUN_RANKS_TIMEOUT_S = 150  # one multi-rank test on the 2-core CI box takes < 30 s; 5x headroom, then kill


# Ports a test picks itself lie below Linux's ephemeral range (32768-60999), where the OS hands out port-0 binds
# (embedded servers, gloo's pair sockets) and outgoing connections: a port the OS chose once and released can
# be re-chosen by anyone before the test binds it, and port + k (a stage's weight-update group) was never
# checked at all (test_weight_sync_train failed once with EADDRINUSE that way).
FIXED_PORTS = (20000, 32000)
_next_port = [FIXED_PORTS[0] + (os.getpid() * 97) % (FIXED_PORTS[1] - FIXED_PORTS[0])]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(n: int = 1) -> int:
    """A base port P with P .. P + n - 1 free now, outside the ephemeral range (so no port-0 bind or outgoing
    connection of this or another process takes it meanwhile); successive calls move on, wrapping around."""
    lo, hi = FIXED_PORTS
    for _ in range(hi - lo):
        p = _next_port[0]
        _next_port[0] = lo + (p + n - lo) % (hi - lo - n)
        if p + n <= hi and all(_bindable(p + k) for k in range(n)):
            return p
    raise RuntimeError(f"no {n} consecutive free ports in {FIXED_PORTS}")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny forwards (a module opts in: `pytestmark =
    pytest.mark.usefixtures("one_thread")`): they are latency-bound, and two threads on a loaded 2-core box spin
    against each other (a 2-token generate measured 2-7 s with two, 0.26 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _child(rank, world_size, port, outdir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks: threads would only fight
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=RUN_RANKS_TIMEOUT_S // 2))
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise SystemExit(1)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = RUN_RANKS_TIMEOUT_S, allow_killed: bool = False):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results.

    `fn` must be a module-level function (spawn pickles it by name). With `allow_killed=True`, ranks that
    died by a signal (e.g. a test's deliberate SIGKILL) are not an error; their result is None.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [ctx.Process(target=_child, args=(r, world_size, port, outdir, fn, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            _wait(procs, deadline, allow_killed)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            out = torch.load(path, weights_only=False) if os.path.exists(path) else None
            if out is not None and not out["ok"]:
                errors.append(f"--- rank {r} ---\n{out['error']}")
            results.append(out["result"] if out is not None and out["ok"] else None)
        if errors:
            raise RuntimeError("child rank(s) failed:\n" + "\n".join(errors))
        bad = [(r, p.exitcode) for r, p in enumerate(procs)
               if p.exitcode != 0 and not (allow_killed and p.exitcode is not None and p.exitcode < 0)]
        if bad:
            raise RuntimeError(f"rank(s) exited abnormally (rank, exitcode): {bad}")
        return results


def _wait(procs, deadline, allow_killed):
    """Wait for all ranks; stop early when one fails (its peers would block forever in a collective)."""
    while any(p.is_alive() for p in procs):
        failed = [p for p in procs if p.exitcode not in (None, 0) and not (allow_killed and p.exitcode < 0)]
        if failed:
            time.sleep(1.0)  # give the peers a moment to write their own tracebacks
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"run_ranks: ranks still running after the timeout; exit codes "
                               f"{[p.exitcode for p in procs]}")
        time.sleep(0.05)


@pytest.fixture
def ranks():
    """The `run_ranks` helper as a fixture."""
    return run_ranks


SEED_SALT = os.environ.get("NANOFLASH_TEST_SEED_SALT", "")  # set to sweep other seeds (robustness checks)


def test_seed(nodeid: str) -> int:
    """The seed of one test: a stable hash of its node id (not Python's salted `hash`), plus the optional
    salt `NANOFLASH_TEST_SEED_SALT`, so a tolerance can be checked over many seeds without editing tests."""
    return zlib.crc32((nodeid + SEED_SALT).encode())


test_seed.__test__ = False  # a helper, not a test


@pytest.fixture(autouse=True)
def _seed_global_rngs(request):
    """Seed the global RNGs per test, so module inits and any stray draw replay exactly."""
    seed = test_seed(request.node.nodeid)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU `torch.Generator` seeded with this test's seed: pass it as `generator=` to every draw."""
    return torch.Generator().manual_seed(test_seed(request.node.nodeid))


def pytest_runtest_makereport(item, call):
    """On failure, say which seed the test ran with (it is the same on every run of that node id)."""
    if call.when == "call" and call.excinfo is not None:
        salt = f" (NANOFLASH_TEST_SEED_SALT={SEED_SALT!r})" if SEED_SALT else ""
        item.add_report_section("call", "seed", f"{item.nodeid} ran with seed {test_seed(item.nodeid)}{salt}")


class FakeSGLang:
    """A canned SGLang look-alike on `port` (0: any): `routes` (None = no /openapi.json), `version`; records
    every call (method, path) in `calls` and every POST body in `bodies`."""

    def __init__(self, routes=None, version="0.5.16", port=0):
        self.routes, self.version, self.calls, self.bodies = routes, version, [], []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append(("GET", self.path))
                if self.path == "/openapi.json" and fake.routes is not None:
                    return self._reply(200, {"paths": {p: {"post": {}} for p in fake.routes}})
                if self.path == "/get_server_info":
                    return self._reply(200, {"version": fake.version})
                if self.path == "/health":
                    return self._reply(200, {})
                self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append(("POST", self.path))
                fake.bodies.append(body)
                if self.path == "/generate":
                    if body["input_ids"] == [0]:
                        return self._reply(400, {"error": {"message": "token 0 is not allowed"}})
                    n = body["sampling_params"].get("n", 1)
                    one = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                           "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]], "weight_version": "1"}}
                    return self._reply(200, [one] * n if n > 1 else one)
                self._reply(404, {"detail": "Not Found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# Metrics two identical runs may differ in: wall times, and what the tail abort catches still running (the
# groups kept do not depend on timing: rl/rounds.py). A resumed run equals the uninterrupted one elsewhere.
TIMING_KEYS = {"rollout_s", "train_s", "sync_s", "step_s", "eval_s", "time_s", "rollout_tokens_per_s",
               "train_tokens_per_s", "logprobs_s", "optim_s", "rollout_wait_s", "boundary_wait_s",
               "samples_generated", "samples_aborted", "samples_unused", "tokens_generated", "generated_per_trained"}
