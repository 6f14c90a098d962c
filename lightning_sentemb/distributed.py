"""All-gather that keeps gradients, so in-batch negatives are the global batch under DDP; the
all-gather of evaluation embeddings and of each rank's results (its errors too); rank 0's state and decisions on
every rank; when the host may read the device."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment
from torch import Tensor

from .data.loader import gathered_position
from .errors import SentEmbUserError

T = TypeVar("T")


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
    (`data.loader.rank_rows`), assembled on every rank in their order. The shares differ by at most one
    row: each is padded to the largest for the all-gather (on the share's device, as the backend needs)."""
    _, size = world()
    longest = -(-total // size)
    padded = share.new_zeros(longest, *share.shape[1:])
    padded[: len(share)] = share
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded)
    return torch.cat(gathered).index_select(0, gathered_position(total, size, longest, share.device))


def gather_or_raise(work: Callable[[], T], doing: str) -> list[T]:
    """`work()` on this rank, and every rank's result in rank order, on every rank (`all_gather_object`). Where
    it raised on some rank, every rank raises, naming that rank, what it was `doing` and its error: otherwise the
    others would wait in the gather until the process group's timeout (30 minutes under fsdp_layers). A
    `SentEmbUserError` on every failing rank stays one; on the failing rank, its own error is the cause."""
    _, size = world()
    if size == 1:
        return [work()]
    cause = None
    try:
        outcome = work(), None
    except Exception as error:  # what all_gather_object can pickle, whatever the exception holds
        cause, outcome = error, (None, (doing, f"{type(error).__name__}: {error}", isinstance(error, SentEmbUserError)))
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, outcome)
    failures = {rank: failure for rank, (_, failure) in enumerate(everyone) if failure is not None}
    if failures:
        kind = SentEmbUserError if all(user for _, _, user in failures.values()) else RuntimeError
        raise kind("; ".join(f"rank {rank} failed {what}: {error}" for rank, (what, error, _) in failures.items())
                   ) from cause
    return [result for result, _ in everyone]


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
    the processes were launched outside (torchrun, SLURM's srun), through the store the trainer's process group
    will use (`_through_store`); under Lightning's own launcher, rank 0 decides and the processes it starts
    inherit its decision by the environment. One process: `decision`."""
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


# the stores `_through_store` opened, kept for the life of the process: on rank 0 under srun, the server the
# trainer's process group joins
_STORES: list[dist.Store] = []


def _through_store(decision: str, environment: ClusterEnvironment, timeout: timedelta) -> str:
    """Rank 0 writes `decision` into the store the trainer's process group will use; the others read it there
    and say so; rank 0 then deletes the keys and tells each reader, which returns only then (else a rank that
    asks again at once, as a fast restart does, could read the old decision before its deletion).

    The store is the one `torch.distributed.rendezvous` gives the process group on the environment's address and
    port (what `init_process_group` does): under torchrun, a client of the store its elastic agent already serves
    on MASTER_PORT (`TORCHELASTIC_USE_AGENT_STORE=True`; binding the port ourselves once left the other ranks
    waiting forever); under srun, no agent: rank 0 serves it, multi-tenant, and keeps it, so the trainer's process
    group joins that server on the same port instead of binding it again. Nothing is closed before the trainer.

    The agent's store outlives an elastic restart, so the keys are the run's (TORCHELASTIC_RUN_ID; SLURM's job
    and step) and are deleted once every rank has read them: a restarted rank never reads the decision of an
    attempt that trained (one that died before all had read it trained nothing, and decided the same). Not
    TORCHELASTIC_RESTART_COUNT: each agent counts its own restarts, and a node restarted because another
    failed counts none, so the nodes would look under different attempts from then on."""
    rank, size = environment.global_rank(), environment.world_size()
    address, port = environment.main_address, environment.main_port
    run = (f"torchrun run {os.environ.get('TORCHELASTIC_RUN_ID')}" if isinstance(environment, TorchElasticEnvironment)
           else f"SLURM job {os.environ.get('SLURM_JOB_ID')} step {os.environ.get('SLURM_STEP_ID')}")
    readers = [f"read-{other}" for other in range(1, size)]
    waited_for = (f"the other ranks to read its decision ({', '.join(readers)})" if rank == 0
                  else "rank 0's decision and its clean-up")
    try:
        store, _, _ = next(dist.rendezvous(f"tcp://{address}:{port}?rank={rank}&world_size={size}", timeout=timeout))
        _STORES.append(store)
        store = dist.PrefixStore(f"sentemb/ckpt_path_last/{run}", store)
        if rank != 0:
            decision = store.get("decision").decode()
            store.set(f"read-{rank}", "")
            store.wait([f"cleared-{rank}"])  # rank 0 deleted the decision: a next ask never reads this one
            store.delete_key(f"cleared-{rank}")
            return decision
        store.set("decision", decision)
        store.wait(readers)
        for key in ("decision", *readers):
            store.delete_key(key)
        for other in range(1, size):
            store.set(f"cleared-{other}", "")
        return decision
    except dist.DistError as error:
        raise TimeoutError(f"--ckpt_path last: rank {rank} of {size}, waiting up to {timeout} for {waited_for} "
                           f"through the store at {address}:{port} ({run}): {error}") from error
