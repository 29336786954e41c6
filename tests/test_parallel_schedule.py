"""The 1F1B schedule itself, not only its numerics: the order of forwards and backwards on every stage and
the number of micro-batches in flight, recorded by wrapping `_Schedule.forward` / `_Schedule.backward`
inside each rank (pipeline.py is not changed).

PipeDream-flush 1F1B on stage r of p with m micro-batches (arXiv 2104.04473, Fig. 4):

    F_0 .. F_{w-1}                       warm-up, w = min(p - r - 1, m)
    F_{w+i}, B_i        for i < m - w    steady state: one forward, one backward
    B_{m-w} .. B_{m-1}                   cool-down

so at most p - r micro-batches are alive on stage r (the bound `planner.py` sizes activations with).
The bug this catches: a schedule that runs all forwards, then all backwards (GPipe), or any order that keeps
more than p - r micro-batches alive; the parity tests pass on those, since the gradients are the same.
Run: `pytest tests/test_parallel_schedule.py -q` (one spawn of 4 gloo ranks).
"""
import torch

from conftest import run_ranks
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel import pipeline
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.train_step import token_nll_loss

PP, N_MICRO, SEQ = 4, 6, 8   # m > p, so a GPipe order would hold 6 > p - r micro-batches on every stage


def expected_order(p: int, r: int, m: int) -> list:
    """The 1F1B event list of stage r, written from the paper's definition."""
    w = min(p - r - 1, m)
    order = [("F", i) for i in range(w)]
    for i in range(m - w):
        order += [("F", w + i), ("B", i)]
    return order + [("B", i) for i in range(m - w, m)]


def _record_schedule(rank, world):
    """One forward_backward on this stage with the schedule's compute steps recorded."""
    events, alive = [], []
    fwd, bwd = pipeline._Schedule.forward, pipeline._Schedule.backward

    def forward(self, h_in, mb):
        out = fwd(self, h_in, mb)
        events.append(("F", int(mb["input_ids"][0, 0])))   # token 0 of micro-batch i is i (it travels)
        alive.append(len(self.inflight))
        return out

    def backward(self, dy):
        events.append(("B", int(self.inflight[0][2]["input_ids"][0, 0])))
        return bwd(self, dy)

    pipeline._Schedule.forward, pipeline._Schedule.backward = forward, backward
    dims = ParallelDims(pp=world)
    model = pipeline.build_stage(Transformer(preset("tiny")).init_weights(0), dims)
    g = torch.Generator().manual_seed(0)
    mbs = []
    for i in range(N_MICRO):
        ids = torch.randint(N_MICRO, 256, (1, SEQ + 1), generator=g)
        ids[:, 0] = i
        mbs.append({"input_ids": ids[:, :-1], "targets": ids[:, 1:]})
    first = dims.is_first_stage
    pipeline.forward_backward(model, dims, mbs if first else None, token_nll_loss, 1.0 if first else None)
    return events, alive


def test_1f1b_order_and_in_flight_bound_per_stage():
    results = run_ranks(_record_schedule, PP)
    for r, (events, alive) in enumerate(results):
        assert events == expected_order(PP, r, N_MICRO), f"stage {r} ran {events}"
        assert max(alive) <= PP - r, f"stage {r} held {max(alive)} micro-batches, bound p - r = {PP - r}"
        assert max(alive) == min(PP - r, N_MICRO), f"stage {r}: the warm-up must fill the pipe"


def test_expected_order_is_1f1b_not_gpipe():
    """Self-check of the reference: last stage alternates from the start; the first stage warms up p-1."""
    assert expected_order(4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert expected_order(4, 0, 6)[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert expected_order(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]   # m < p: warm-up is m
