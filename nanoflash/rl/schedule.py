"""When rollouts run relative to training, and when the weights are pushed: synchronous (Miles `train.py`) or
one step off (Miles `train_async.py`, `rollout.asynchronous`).

    synchronous    rollout k (weights k-1) -> train k -> push k -> eval / save -> rollout k+1 ...
    one step off   take rollout k -> start rollout k+1 (in a thread, on the weights the servers hold) ->
                   train k -> [boundary: wait for rollout k+1 to end] -> push k -> eval / save -> take rollout k+1

Where the push happens: at the round boundary, never during a rollout. The push of step k waits until the
rollout running beside the step (k+1's, tail aborted once it has its groups) has ended; the weights therefore
never change under a request, every sample has one weight version (the step last pushed when it was sent),
and the version check of every sample (`rounds.check_versions`) holds as in the synchronous loop. This is
Miles' `train_async.py` with `--update-weights-interval` (radixark/miles@31f1ca96: "sync generate before
update weights to prevent update weight in the middle of generation"); slime's `train_async.py` does the same.
The other design, a push into running generation (`/pause_generation` retract, push, `/continue_generation`),
would hide the push too but mixes two policies inside a sample without the server saying which token came
from which; it is not built.

How staleness is bounded: a sample trained at step k (whose update starts from the weights of step k - 1) was
sampled by the weights of step v; its staleness is (k - 1) - v. One step off, the rollout of step k+1 starts
on the weights the servers hold when step k starts, so with a push every step each sample is exactly one step
stale. `rollout.max_staleness` s > 1 skips pushes: after step k the push is due only when the next rollout
(trained at step k + 2) would otherwise be more than s steps stale, (k + 1) - served > s, or when an eval, a
checkpoint or the last step needs the servers to hold step k (every s-th step at most). Each step logs its
samples' staleness (`staleness_mean`, `_max`, and per value). The trainer recomputes the old log-probs with
the weights it holds; the TIS weight exp(old - rollout) (grpo.use_tis, required) corrects for the policy that
sampled; `tis`, `tis_clipfrac` and `train_rollout_logprob_abs_diff` report the off-policy ratio.

Checkpoints: a save happens after a push, so no rollout is running; the rollout that ended at that boundary
(the next step's batch, not yet trained) and the carried groups are saved with the checkpoint
(`state_dict`, rank 0's `rollout_state.pt`), beside the data position already past them. A resumed run trains
that batch first, so every prompt the data stream handed out is trained once or dropped by rule (dynamic
sampling, the tail), none twice and none lost, and the resumed run is the run that was killed.

Ctrl-C: `cancel()` stops the rollout running in the background (its unsent requests never sent, the running
ones aborted on the servers) so the one line of `rl/interrupt.py` comes within seconds.

Tests: `pytest tests/test_schedule.py -q` (the schedule, the kill -9 and resume of an asynchronous run).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from nanoflash.rl.restarts import SERVER_ERRORS, why
from nanoflash.rl.rounds import INTERRUPT_ABORT_S, abort_all
from nanoflash import grpo

STATE_FILE = "rollout_state.pt"   # rank 0's file in a checkpoint: the pending batch, the carried groups


def make_schedule(collector, rc, steps: int, dims, served: int):
    """The run's schedule (`rollout.asynchronous`), the servers holding the weights of step `served`."""
    cls = OneStepOff if rc.asynchronous else Synchronous
    return cls(collector, rc, steps, dims, served)


class Synchronous:
    """Rollout, then training, then the push, every step (the collector's own loop; nothing runs beside)."""

    def __init__(self, collector, rc, steps: int, dims, served: int):
        self.collector, self.rc, self.steps, self.dims = collector, rc, steps, dims
        self.waited = 0.0   # seconds the last boundary waited for a rollout
        self.pushed(served)

    def take(self, at: int) -> tuple:
        """Rank 0: the packed batch and metrics of step `at` (grpo.RolloutBatch | None, dict)."""
        t0 = time.time()
        batch, m = self.collector.next_batch(at)
        return batch, {**m, "rollout_wait_s": time.time() - t0}

    def push_due(self, step: int, needed: bool) -> bool:
        """Every rank: push the weights of `step` now? (`needed`: an eval, a checkpoint or the last step)."""
        return True

    def boundary(self) -> str:
        """Every rank: wait until no rollout runs; -> the server error it met ("" if none: no re-push needed)."""
        self.waited = 0.0
        return ""

    def pushed(self, step: int) -> None:
        """Every rank: the servers now hold the weights of `step`."""
        self.served = step
        if self.collector is not None:
            self.collector.served = step

    def state_dict(self) -> dict:
        return {"pending": None, "collector": self.collector.state_dict()}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.collector.load_state_dict(state["collector"])

    def cancel(self) -> None:
        """Rank 0, Ctrl-C: nothing runs beside the loop (the rollout's own pool handles its requests)."""

    def close(self) -> None:
        pass


class OneStepOff(Synchronous):
    """Step k+1's rollout runs in a thread while step k trains (see the module docstring)."""

    def __init__(self, collector, rc, steps: int, dims, served: int):
        super().__init__(collector, rc, steps, dims, served)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if collector else None
        self.pending: tuple[int, Future] | None = None     # (step, future of next_batch(step))

    def _start(self, at: int) -> None:
        self.pending = (at, self.pool.submit(self.collector.next_batch, at))

    def _wait(self) -> tuple:
        """The pending rollout's result, waited for (Ctrl-C while waiting cancels it)."""
        try:
            return self.pending[1].result()
        except KeyboardInterrupt:
            self.cancel()
            raise

    def take(self, at: int) -> tuple:
        t0 = time.time()
        if self.pending is not None and self.pending[0] != at:
            raise RuntimeError(f"the rollout running is step {self.pending[0]}'s, but step {at} asked for one")
        if self.pending is None:                       # the first step, or after a restart: none ran beside
            self._start(at)
        try:   # a server error raises here: the loop's restart policy (rl/restarts.py) re-pushes, then asks again
            batch, m = self._wait()
        finally:
            self.pending = None
        m = {**m, "rollout_wait_s": time.time() - t0}
        if at < self.steps:
            self._start(at + 1)
        return batch, m

    def push_due(self, step: int, needed: bool) -> bool:
        return needed or (step + 1) - self.served > self.rc.max_staleness

    def boundary(self) -> str:
        err, t0 = "", time.time()
        if self.collector is not None and self.pending is not None:
            at, fut = self.pending
            try:
                batch, m = self._wait()
            except SERVER_ERRORS as e:   # a server died under it: dropped (the data position did not move);
                self.pending, err = None, why(e)   # the loop's restart policy waits, re-pushes; take() redoes it
            else:
                done = Future()
                done.set_result((batch, m))
                self.pending = (at, done)
        self.waited = time.time() - t0
        if self.dims.world_size > 1:   # every rank re-connects together (sglang.push.StagePusher.reconnect)
            box = [err]
            dist.broadcast_object_list(box, src=0, group=self.dims.side_group)
            err = box[0]
        return err

    def state_dict(self) -> dict:
        """The pending batch (finished: a save comes after a boundary) and the collector's carried groups."""
        pending = None
        if self.pending is not None:
            at, fut = self.pending
            if not fut.done():
                raise RuntimeError(f"a checkpoint while step {at}'s rollout runs: saves come after a boundary")
            batch, m = fut.result()
            pending = {"at": at, "metrics": m,
                       "batch": None if batch is None else {k: v for k, v in vars(batch).items() if v is not None}}
        return {"pending": pending, "collector": self.collector.state_dict()}

    def load_state_dict(self, state: dict, step: int) -> None:
        super().load_state_dict(state, step)
        p = state["pending"]
        if p is None:
            return
        if p["at"] != step + 1:
            raise ValueError(f"{STATE_FILE} holds step {p['at']}'s rollout, but the checkpoint is step {step}'s")
        done = Future()
        done.set_result((None if p["batch"] is None else grpo.RolloutBatch(**p["batch"]), p["metrics"]))
        self.pending = (p["at"], done)

    def cancel(self) -> None:
        if self.collector is not None:
            self.collector.cancel.set()
            abort_all(self.collector.client, INTERRUPT_ABORT_S)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
