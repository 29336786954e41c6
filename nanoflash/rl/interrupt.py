"""Ctrl-C: the first press stops the run within seconds with one line; a second press exits at once.

    interrupt = Interrupt(ckpt_dir, rank0)   # train.py, right after start-up
    interrupt.at = step + 1                  # the step the loop is working on

The first SIGINT raises KeyboardInterrupt in the main thread, as Python's own handler does, so whatever the
loop waits on unwinds: the rollout's request pool cancels its queued /generate requests (never sent) and
aborts the running ones on every server (`rounds.request_pool`: `/abort_request {"abort_all"}`, a few
seconds at most), so SGLang does not go on generating for a run that is gone. A rollout running beside the
step in a thread (one step off, `rl/schedule.py`) is cancelled the same way by the loop (`schedule.cancel()`).
When the KeyboardInterrupt reaches the top, `sys.excepthook` prints ONE line on stderr (rank 0) instead of a
traceback:

    interrupted at step 7; last checkpoint step 5 (runs/demo/checkpoints/step_00000005); re-run the same command to resume
    interrupted at step 3; no checkpoint yet; re-run the same command to start again

and ends the process with exit code 130 (128 + SIGINT, the shell's convention) by `os._exit`, so no thread a
request still holds (and no reward worker) is waited for; the metrics file is written line by line, fsynced,
so nothing logged is lost. A second SIGINT while the first is handled exits at once, also 130.

Checkpoints are atomic (`parallel.dcp`), so a press during a save leaves the previous checkpoint as the last.

A full disk (an OSError ENOSPC / EDQUOT reaching the top: a checkpoint, the metrics file, a disk push) is one
line too, naming the file and the checkpoint to resume from, exit code 1: the failed save's `step_N.tmp` is
removed at the next start (`dcp.tidy`), and the run directory may move to a bigger disk (its path is no part of
the run's identity, `cli.RESUMABLE`).

Tests: `pytest tests/test_interrupt.py -q`.
"""
from __future__ import annotations

import errno
import os
import signal
import sys

from nanoflash.parallel.dcp import latest_checkpoint

EXIT_CODE = 130   # 128 + SIGINT


class Interrupt:
    """Installs the SIGINT handler and the excepthook of a run; `at` names the step in progress."""

    def __init__(self, ckpt_dir: str, rank0: bool = True):
        self.ckpt_dir, self.rank0, self.at, self.pressed = ckpt_dir, rank0, "start-up", False
        self._excepthook = sys.excepthook
        signal.signal(signal.SIGINT, self._on_sigint)
        sys.excepthook = self._on_exception

    def line(self, what: str = "interrupted") -> str:
        """The one line of an interrupted (or stopped) run: where it stopped, where it resumes from."""
        where = f"step {self.at}" if isinstance(self.at, int) else self.at
        latest = latest_checkpoint(self.ckpt_dir)
        if latest is None:
            return f"{what} at {where}; no checkpoint yet; re-run the same command to start again"
        step = int(os.path.basename(latest)[len("step_"):])
        return f"{what} at {where}; last checkpoint step {step} ({latest}); re-run the same command to resume"

    def _on_sigint(self, signum, frame):
        if self.pressed:   # the second press: do not wait for the servers' aborts or anything else
            os.write(2, b"\ninterrupted again: exiting now\n")
            os._exit(EXIT_CODE)
        self.pressed = True
        raise KeyboardInterrupt

    def _on_exception(self, tp, value, tb):
        if issubclass(tp, OSError) and value.errno in (errno.ENOSPC, errno.EDQUOT):
            sys.stdout.flush()
            if self.rank0:
                print(self.line(f"disk full ({value.filename or 'a write'}: {value.strerror})") +
                      " once there is space (or with the run directory moved to a bigger disk)", file=sys.stderr,
                      flush=True)
            return os._exit(1)
        if not issubclass(tp, KeyboardInterrupt):
            return self._excepthook(tp, value, tb)
        sys.stdout.flush()
        if self.rank0:
            print(self.line(), file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)
