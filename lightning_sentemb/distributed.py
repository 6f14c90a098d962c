"""All-gather that keeps gradients, so in-batch negatives are the global batch under DDP; the
all-gather of evaluation embeddings; rank 0's state and decisions on every rank; when the host may read the device."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment
from torch import Tensor


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenate `tensor` from every rank along dim 0, differentiably.

    Each rank's loss over its local anchors then sees all columns, and the backward pass sums the
    column gradients back to their owners; with DDP's gradient averaging this equals the
    gradient of the single-process loss on the global batch. (SimCSE's reference gathers without
    gradient and re-inserts only the local slice, which drops the cross-rank terms.)
    """
    _, size = world()
    if size == 1:
        return tensor
    return torch.cat(dist_fn.all_gather(tensor.contiguous()), dim=0)


def gather_strided_rows(share: Tensor, total: int) -> Tensor:
    """The (total, ...) rows of which each rank holds every world_size-th, starting at its rank
    (`rows[rank::world_size]`), assembled on every rank in their order. The shares differ by at most one
    row: each is padded to the largest for the all-gather (on the share's device, as the backend needs)."""
    _, size = world()
    longest = -(-total // size)
    padded = share.new_zeros(longest, *share.shape[1:])
    padded[: len(share)] = share
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded)
    # row i is rank i % size's row i // size: interleave the shares, then drop the padding at the end
    return torch.stack(gathered, dim=1).flatten(0, 1)[:total]


def local_labels(local_batch: int, device: torch.device) -> Tensor:
    """Column of each local anchor's positive inside the gathered global batch."""
    rank, _ = world()
    return torch.arange(local_batch, device=device) + rank * local_batch


def broadcast_from_rank_zero(tensor: Tensor) -> Tensor:
    """`tensor` overwritten in place with rank 0's (a no-op outside a process group); returns it. A
    tensor collective on the tensor's own device, not Lightning's pickling `strategy.broadcast`."""
    _, size = world()
    if size > 1:
        dist.broadcast(tensor, src=0)
    return tensor


def at_decision_step(trainer: Any) -> bool:
    """Whether this training step is one where the host reads the device (and the ranks agree):
    every `log_every_n_steps` steps, every step when it is 0."""
    return trainer.log_every_n_steps <= 0 or trainer.global_step % trainer.log_every_n_steps == 0


# rank 0's decision, inherited by the processes Lightning's own launcher starts (they re-run the command)
INHERITED_DECISION = "SENTEMB_RANK_ZERO_DECISION"


def decided_by_rank_zero(decision: str, timeout: timedelta = timedelta(minutes=10)) -> str:
    """Rank 0's `decision` on every process, also before the trainer has a process group (the CLI decides
    what to resume from before it builds the trainer). Through the process group where there is one; where
    the processes were launched outside (torchrun, SLURM's srun), through a store on the address and port
    the process group will use, closed before the trainer opens it; under Lightning's own launcher, rank 0
    decides and the processes it starts inherit its decision by the environment. One process: `decision`."""
    if dist.is_available() and dist.is_initialized():
        shared = [decision]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]
    environment = external_launch()
    if environment is not None:
        return _through_store(decision, environment, timeout)
    if "LOCAL_RANK" in os.environ and INHERITED_DECISION in os.environ:  # started by rank 0
        return os.environ[INHERITED_DECISION]
    os.environ[INHERITED_DECISION] = decision  # for the processes this one may start
    return decision


def external_launch() -> ClusterEnvironment | None:
    """The cluster environment of processes started outside Lightning (torchrun, srun), several of them;
    None otherwise."""
    for kind in (TorchElasticEnvironment, SLURMEnvironment):
        if kind.detect():
            environment = kind()
            return environment if environment.world_size() > 1 else None
    return None


def _through_store(decision: str, environment: ClusterEnvironment, timeout: timedelta) -> str:
    """Rank 0 writes its decision to a TCP store it serves; the others read it and say so; rank 0 closes the
    store once all have read, freeing the port for the trainer's process group. The others return only once
    it is closed (a connection of theirs to it ends), so none joins the trainer's group through it."""
    rank, size = environment.global_rank(), environment.world_size()
    address, port = environment.main_address, environment.main_port
    store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if rank == 0:
        store.set("decision", decision)
        store.wait([f"read-{other}" for other in range(1, size)])
        del store
        return decision
    decision = store.get("decision").decode()
    with socket.create_connection((address, port), timeout=timeout.total_seconds()) as watch:
        store.set(f"read-{rank}", "1")
        watch.recv(1)  # b"" once rank 0 has closed the store
    return decision
