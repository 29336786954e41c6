"""Wall-clock timing shared by the multi-rank bench scripts: median of `iters` runs after one warm-up, with a
barrier before each run (when a process group exists) so every rank starts together, and CUDA synchronised."""
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int, cuda: bool) -> float:
    """Median seconds of fn()."""
    fn()
    out = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)
