"""Several processes, one model: torchrun detection and the few collectives the training loop needs.

`torchrun --nproc_per_node N -m transformer train --config ...` starts N processes with RANK, WORLD_SIZE and
LOCAL_RANK in their environment; `init_distributed` joins them into one process group (nccl when training on
CUDA, gloo on the CPU). A plain `transformer train` gets a `Distributed` of world size 1 whose collectives do nothing.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..device import DeviceError

logger = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = timedelta(minutes=60)
"""How long a collective may wait for the slowest process before the job fails. Ranks other than 0 wait in one
while rank 0 alone prepares the data of a new run (trains the tokenizer, encodes the validation set) and at each
validation; torch's default for nccl (10 minutes) is too short for a large corpus's first start (`transformer
prepare` beforehand makes that wait short)."""


@dataclass(frozen=True)
class Distributed:
    """This process's place among the training processes.

    Attributes:
        rank: 0 .. world_size - 1; rank 0 writes checkpoints, logs, metrics and the progress bar.
        world_size: number of processes.
        local_rank: index on this machine (selects the GPU).
        joined: this process is in a torch.distributed process group (every torchrun process, also a single
            one, so that `--nproc_per_node 1` runs the same DDP and collectives path as N processes).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.joined or self.world_size > 1

    def all_reduce_sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum over all processes (identity for one process)."""
        if not self.is_distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every process if it is True on any (e.g. a stop request that reached one process)."""
        return self.all_reduce_sum([float(flag)], device)[0] > 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_distributed(device: torch.device) -> Distributed:
    """Join the torchrun process group if this process was started by torchrun (TORCHELASTIC_RUN_ID set, or
    WORLD_SIZE > 1).

    Args:
        device: the training device (`training.device` resolved). On CUDA each process takes GPU LOCAL_RANK and the
            backend is nccl; on any other device the backend is gloo (so the whole path runs on a CPU, also on a
            machine that has GPUs).

    Raises:
        DeviceError: training on CUDA with more processes on this machine than GPUs visible (LOCAL_RANK >= the
            number of GPUs).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return Distributed()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            if local_rank >= torch.cuda.device_count():
                raise DeviceError(
                    f"torchrun process LOCAL_RANK={local_rank} trains on CUDA, but this machine shows "
                    f"{torch.cuda.device_count()} GPU(s): start at most that many processes per "
                    "machine (--nproc_per_node), or train on the CPU (--set training.device=cpu)"
                )
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, timeout=PROCESS_GROUP_TIMEOUT)
    logger.info("process group: rank %d of %d, backend %s", rank, world_size, dist.get_backend())
    return Distributed(rank, world_size, local_rank, joined=True)


def shutdown_distributed(finished: bool = False) -> None:
    """Leave the process group (no-op without one).

    Args:
        finished: every process got here by finishing training normally; they first wait for one another
            (a barrier), so that no process tears its connections down while a peer is still in a collective.
            False after an error, where a peer may never arrive.
    """
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


def data_parallel(module: nn.Module, device: torch.device) -> DistributedDataParallel:
    """`module` under DistributedDataParallel on `device` (its GPU, or the CPU), without syncing buffers at each
    forward: ours (the positional encoding table) are constants. torch 2.13 names that `forward_sync_buffers=False`
    (and warns about the older `broadcast_buffers=False`, which earlier versions need)."""
    no_sync = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else "broadcast_buffers"
    )
    return DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, **{no_sync: False}
    )
