"""The process grid: world = PP x DP x EP (tensor parallelism is 1), with explicit process groups.

Every rank has three coordinates. Ranks are laid out as `grid = arange(world).view(pp, dp, ep)`, so EP is the
innermost (fastest-varying) axis: the ranks of one EP group are neighbours, i.e. on the same node, which is
where the all-to-all traffic must stay. PP is the outermost axis.

    pp_group    same (dp, ep), all stages          -> P2P of activations [B,S,M,D] and input ids
    ep_group    same (pp, dp), all expert shards   -> all_to_all_single of routed tokens
    dp_group    same (pp, ep), all replicas        -> all-reduce of *expert* gradients
    data_group  same pp, all (dp, ep)              -> all-reduce of *dense* gradients (dense weights are
                                                      replicated on every EP and DP rank of a stage)

EP "borrows" its ranks from data parallelism: each EP rank reads its own slice of the batch, so one stage
consumes `dp * ep` batch shards, numbered `data_rank = dp_rank * ep + ep_rank`.

Waiting for rank 0: rank 0 alone drives the rollout servers (and evaluates and pushes), which can take
minutes; the other ranks wait for its data on `side_group`, a gloo group of the whole world created with a
long timeout (`wait_timeout_s`), instead of sitting inside an NCCL collective whose watchdog would kill the
job. Both timeouts are `ParallelConfig` fields; the training timeout (`timeout_s`) is every subgroup's too
(PP, EP, DP, data: torch's `new_group` would otherwise give them its 10-minute default, which a push -- EP
peers waiting while their stage's source loads a bucket into a cold server -- can outlast).

`ParallelDims` is passed around explicitly; there are no module-level singletons (unlike Megatron's
`parallel_state` or picotron's process-group manager). With world size 1 every group is `None` and every
collective in `nanoflash.parallel` short-circuits, so the single-process code path is the same code.

Backend: `nccl` when CUDA is available, else `gloo` (CPU tests). With `colocate=True`
(`--parallel.colocate_ranks`) every rank binds cuda:0 and the backend is gloo, whose P2P goes through host
buffers (`parallel.colocate`, `ParallelDims.staging`): several ranks of the engine on one GPU.

Eager NCCL initialisation (`init_process_group(device_id=...)`) is not used: a default group bound to a device
makes torch build every later NCCL group of the process by `ncclCommSplit` of the world communicator
(`distributed_c10d._new_process_group_helper`: `split_from` whenever the default group has a
`bound_device_id`), and that includes the weight-update groups, which SGLang's recipe builds with an empty
rank list (`sglang.transports.join_group`): split from the trainer's world they could never hold the servers'
ranks, so `join_group` refuses such a default group. What eager init would give -- every rank taking part in the
first operation of the WORLD group -- is checked instead on the recorded calls of a run
(`tests/nccl_rules.py`, rule `first_batch`).

Tests: `pytest tests/test_parallel_comm.py -q`.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from nanoflash.parallel.colocate import HostStaging

INIT_TIMEOUT_S = 1800  # training collectives (NCCL / gloo) that wait longer than this raise (torch: 600 s)
WAIT_TIMEOUT_S = 7200  # ranks waiting for rank 0 (rollouts, evaluation, pushes take minutes) on the side group


def default_backend() -> str:
    """`nccl` on GPU machines, `gloo` on CPU-only machines."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class ParallelDims:
    """This rank's place in the PP x DP x EP grid and the process groups it belongs to.

    Equation: rank = (pp_rank * dp + dp_rank) * ep + ep_rank.
    Shapes: grid [pp, dp, ep] of global ranks.
    """

    def __init__(self, pp: int = 1, ep: int = 1, dp: int | None = None, wait_timeout_s: float = WAIT_TIMEOUT_S,
                 timeout_s: float = INIT_TIMEOUT_S, colocate: bool = False):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if dp is None:
            assert world % (pp * ep) == 0, f"world size {world} is not divisible by PP {pp} x EP {ep}"
            dp = world // (pp * ep)
        assert pp * dp * ep == world, f"world size ({world}) != PP ({pp}) * DP ({dp}) * EP ({ep})"
        self.pp, self.dp, self.ep, self.world_size, self.rank = pp, dp, ep, world, rank
        self.colocate = colocate   # every rank on one device, gloo: P2P through host buffers (parallel.colocate)
        self.staging = HostStaging() if colocate and world > 1 else None
        self.timeout = datetime.timedelta(seconds=timeout_s)   # every subgroup's (torch's new_group default: 10 min)
        self.grid = torch.arange(world).view(pp, dp, ep)  # [pp, dp, ep]
        coords = (self.grid == rank).nonzero()[0].tolist()
        self.pp_rank, self.dp_rank, self.ep_rank = coords
        # Every rank must create every group, in the same order (a torch.distributed rule).
        self.pp_group = self._make_groups(self.grid.permute(1, 2, 0).reshape(-1, pp))   # rows: one pipeline
        self.dp_group = self._make_groups(self.grid.permute(0, 2, 1).reshape(-1, dp))   # rows: one DP ring
        self.ep_group = self._make_groups(self.grid.reshape(-1, ep))                     # rows: one EP group
        self.data_group = self._make_groups(self.grid.reshape(pp, dp * ep))              # rows: one stage
        self.pp_ranks = self.grid[:, self.dp_rank, self.ep_rank].tolist()  # global ranks of my pipeline
        self.side_group = None if world == 1 else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=wait_timeout_s))  # whole world, CPU, long wait

    def _make_groups(self, rows: torch.Tensor):
        """Create one group per row of global ranks; return the one holding this rank (None if trivial)."""
        if self.world_size == 1 or rows.shape[1] == 1:
            return None
        mine = None
        for row in rows.tolist():
            group = dist.new_group(row, timeout=self.timeout)
            if self.rank in row:
                mine = group
        return mine

    # ------------------------------------------------------------------ coordinates
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def data_rank(self) -> int:
        """Which of the `data_world` batch shards this rank's pipeline consumes."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def data_world(self) -> int:
        return self.dp * self.ep

    @property
    def device(self) -> torch.device:
        """Where this rank's collectives' tensors live: CUDA under nccl (or alone on a GPU box, or colocated on
        one GPU over gloo), else CPU."""
        gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        if torch.cuda.is_available() and (self.colocate or not gloo):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def object_device(self) -> torch.device:
        """Where pickled objects travel in `broadcast_object_list`: the CPU under gloo (colocated ranks too)."""
        gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        return torch.device("cpu") if gloo else self.device

    def __repr__(self) -> str:
        return (f"ParallelDims(rank={self.rank}/{self.world_size}, pp={self.pp_rank}/{self.pp}, "
                f"dp={self.dp_rank}/{self.dp}, ep={self.ep_rank}/{self.ep})")


def init_distributed(pp: int = 1, ep: int = 1, dp: int | None = None, timeout_s: float = INIT_TIMEOUT_S,
                     wait_timeout_s: float = WAIT_TIMEOUT_S, colocate: bool = False) -> ParallelDims:
    """Initialise torch.distributed from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) and build the grid. Under torchrun a process group is created even for a world
    of one (so a one-GPU run exercises NCCL's init and device binding); a plain `python` run is world size 1
    with no process group. Each rank binds `cuda:LOCAL_RANK` under nccl; `colocate`: every rank binds cuda:0
    (when there is a GPU) and the group is gloo (module docstring)."""
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = "gloo" if colocate else default_backend()
        if backend == "nccl" or (colocate and torch.cuda.is_available()):
            torch.cuda.set_device(0 if colocate else int(os.environ.get("LOCAL_RANK", "0")))
        # no device_id= (eager NCCL init): torch would then split the SGLang update groups from this world
        # communicator, which holds none of the servers' ranks (module docstring; sglang.transports.join_group)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelDims(pp=pp, ep=ep, dp=dp, wait_timeout_s=wait_timeout_s, timeout_s=timeout_s, colocate=colocate)


def shutdown_distributed(dims: ParallelDims) -> None:
    """End a finished run's process groups together. Every rank waits at a barrier on the CPU side group, then
    destroys its groups: a rank that simply exits while another still tears down its gloo or NCCL group can take
    that rank down with `terminate called without an active exception` (SIGABRT, seen in CI on a 4-rank gloo
    run) -- a run that finished every step would then exit non-zero."""
    if not dist.is_initialized():
        return
    if dims.side_group is not None:
        dist.barrier(group=dims.side_group)
    dist.destroy_process_group()


def all_gather_values(dims: ParallelDims, value) -> list:
    """Every rank's `value` (a small picklable object) in rank order, on every rank, over the CPU side group."""
    if dims.world_size == 1:
        return [value]
    out = [None] * dims.world_size
    dist.all_gather_object(out, value, group=dims.side_group)
    return out


def print0(*args, dims: ParallelDims | None = None, **kwargs) -> None:
    """print on global rank 0 only."""
    rank = dims.rank if dims is not None else (dist.get_rank() if dist.is_initialized() else 0)
    if rank == 0:
        print(*args, **kwargs, flush=True)
