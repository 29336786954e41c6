"""One restart policy for every wait on the rollout servers: the rollout, the eval and the weight push.

A rollout server can die (its supervisor restarts it, with its initial weights) or come back unnoticed (its
weight version is not the last verified push: `collector.StaleServerError`). Whatever the loop was doing with
the servers when that shows -- sampling a rollout, sampling the eval, pushing weights -- takes the same road,
at most `rollout.max_server_restarts` times a run:

    1. one line naming what failed and why ("eval at step 4: ServerGoneError: ...; waiting up to 900 s for
       the servers (restart 1 of 2), then re-push and redo")
    2. wait up to `rollout.health_timeout_s` for every server's /health (not the client's `retry_s`: a
       restarted SGLang loads for minutes)
    3. forget what was known of the servers (`StagePusher.reconnect(restarted=True)`: update groups, an open
       session, the change-set baseline) and push the last pushed weights again, verified
    4. redo what failed: the rollout from the same data position (same prompts, same seeds), the eval with
       the same seeds, the push itself

Past the budget, or when a server is not back in time: one line, stop (the last checkpoint stands; re-run
the same command once the servers are back). Nothing is trained on, scored or logged from a server that lost
the weights.

Collective: every rank builds a `ServerRestarts` and calls `run` / `push` at the same points of the loop. The
rollout and the eval run on rank 0 only; their outcome (ok, or the error's text) reaches every rank over the
side group, so every rank takes part in the re-push. A failed push fails on every rank together
(`StagePusher` shares its errors). The push's own quick retry (`StagePusher(max_retries=)`, re-created
groups, no waiting) comes first; this policy takes over when that is spent.

Tests: `pytest tests/test_server_restarts.py tests/test_train_e2e.py -k "restart or dies" -q`.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from nanoflash.rl.collector import StaleServerError, wait_for_servers
from nanoflash.sglang.client import ServerGoneError
from nanoflash.sglang.transports import PushFailed

# what a server that died, or came back with other weights, raises in a rollout or an eval
SERVER_ERRORS = (ServerGoneError, StaleServerError)


def why(e: BaseException) -> str:
    """The error as one line names it ("ServerGoneError: ..."; a failed push says its own story)."""
    return str(e) if isinstance(e, PushFailed) else f"{type(e).__name__}: {e}"


class ServerRestarts:
    """The policy of the module docstring over one run's servers.

        restarts.push(state, version) -> the push summary (rank 0; {} elsewhere)   collective, redone on failure
        restarts.run(where, at, fn)   -> fn() on rank 0 (None elsewhere)           collective, redone on failure

    `client`: rank 0's `SGLangClient` (None elsewhere); `pusher`: the run's `StagePusher`; `log(kind, step,
    record)`: where a restart is recorded ("server_restart")."""

    def __init__(self, rc, dims, client, pusher, log=None):
        self.budget, self.wait_s = rc.max_server_restarts, rc.health_timeout_s
        self.dims, self.client, self.pusher, self.log = dims, client, pusher, log
        self.used, self.last = 0, None   # restarts so far; (state, version) of the last push

    def push(self, state, version: int, restarted: bool = False) -> dict:
        """A full verified push of `state` as `version`; a failed one goes through the policy, then again."""
        while True:
            try:
                if restarted:
                    self.pusher.reconnect(restarted=True)
                out = self.pusher.push(state, version)
                self.last = (state, version)
                return out
            except PushFailed as e:
                self._recover(f"weight push v{version}", self._share(why(e)))
                restarted = True

    def run(self, where: str, at: int, fn):
        """fn() on rank 0 (a rollout or an eval); a server error -> the policy, a re-push, fn() again."""
        while True:
            out, err = None, ""
            if self.dims.rank == 0:
                try:
                    out = fn()
                except SERVER_ERRORS as e:
                    err = why(e)
            err = self._share(err)
            if not err:
                return out
            self._recover(where, err)
            t0 = time.time()
            info = self.push(*self.last, restarted=True)
            if self.log is not None:
                self.log("server_restart", at, {"during": where, "server_restarts": self.used,
                                                "sync_s": time.time() - t0, "sync_tensors": info.get("tensors"),
                                                "sync_bytes": info.get("bytes")})

    def recover(self, where: str, at: int, err: str) -> None:
        """A server error met outside `run` (one step off: the rollout beside step `at`, reported by the schedule's
        boundary on every rank): the policy's line and wait; the caller then pushes with `restarted=True`."""
        self._recover(where, err)
        if self.log is not None:
            self.log("server_restart", at, {"during": where, "server_restarts": self.used})

    def _recover(self, where: str, err: str) -> None:
        """One restart of the budget: one line, then wait for every server's /health (rank 0); or stop."""
        if self.used >= self.budget:
            raise SystemExit(f"{where} failed: {err} (rollout.max_server_restarts={self.budget}"
                             f"{' used up' if self.budget else ''}; re-run the same command once the servers "
                             f"are back to resume from the last checkpoint)")
        self.used += 1
        if self.dims.rank == 0:
            print(f"{where}: {err}; waiting up to {self.wait_s:g} s for the servers (restart {self.used} of "
                  f"{self.budget}), then re-push and redo", flush=True)
            wait_for_servers(self.client, self.wait_s)

    def _share(self, msg: str) -> str:
        """Rank 0's `msg` on every rank (the side group's long timeout covers a rank 0 that is still sampling)."""
        if self.dims.world_size == 1:
            return msg
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.dims.side_group)
        return box[0]
