"""A loop hook that turns train.py's embedded rollout server into a slow one (tests/test_interrupt.py).

Every decode step of every embedded engine sleeps SLOW_S seconds under the engine's lock (one busy GPU), and
<train.out_dir>/slow_server.jsonl gets a line per request that starts decoding and per abort the server takes.
"""
import json
import os
import time

from nanoflash.rl.hooks import Hook

SLOW_S = 1.0


class SlowServer(Hook):
    name = "slow_server"

    def __init__(self, ctx):
        super().__init__(ctx)
        path = os.path.join(ctx.cfg.train.out_dir, "slow_server.jsonl")

        def record(**rec):
            with open(path, "a") as f:
                f.write(json.dumps({"t": time.time(), **rec}) + "\n")

        for engine in ctx.collector.engines:
            next_logits, abort = engine._next_logits, engine.abort

            def slow_next_logits(seqs, state, next_logits=next_logits):
                if "slow_server" not in state:     # a request's first decode step
                    state["slow_server"] = True
                    record(event="start")
                time.sleep(SLOW_S)
                return next_logits(seqs, state)

            def recorded_abort(rid=None, abort_all=False, abort=abort):
                record(event="abort", rid=rid, abort_all=abort_all)
                return abort(rid=rid, abort_all=abort_all)

            engine._next_logits, engine.abort = slow_next_logits, recorded_abort
