"""The training engine: PP x EP x DP over torch.distributed, applied to a model built by `nanoflash.model`.

Reading order: dims (the grid) -> comm (collectives; colocate: ranks sharing a GPU) -> expert (EP dispatcher) -> pipeline (stages, 1F1B)
-> train_step (reduction, clipping, loss scaling) -> optim (AdamW, freeze list) -> microbatch (token budget)
-> dcp (distributed checkpoints, atomic) -> planner (memory dry run). Tests: `pytest tests/test_parallel_*.py -q`.
"""
from nanoflash.parallel.dims import ParallelDims, init_distributed
from nanoflash.parallel.expert import apply_expert_parallel
from nanoflash.parallel.pipeline import build_stage, forward_backward
from nanoflash.parallel.train_step import make_optimizer, parallelize, train_step

__all__ = ["ParallelDims", "init_distributed", "apply_expert_parallel", "build_stage", "forward_backward",
           "parallelize", "make_optimizer", "train_step"]
