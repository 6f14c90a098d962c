"""All-gather that keeps gradients, so in-batch negatives are the global batch under DDP; the
all-gather of evaluation embeddings; rank 0's state on every rank; when the host may read the device;
FSDP by transformer layer."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry
from torch import Tensor
from transformers.modeling_layers import GradientCheckpointingLayer


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


class LayerFSDPStrategy(FSDPStrategy):
    """Lightning's `FSDPStrategy` with one FSDP unit per transformer layer of any backbone: every
    transformers layer (BertLayer, LlamaDecoderLayer, Qwen2DecoderLayer, ModernBertEncoderLayer, ...) is a
    `GradientCheckpointingLayer`, so one class names them all (a config file cannot give Lightning's
    `auto_wrap_policy` a set of classes). The embeddings, the final norm and the method's own heads stay
    in the root unit. The ranks start from rank 0's weights (`sync_module_states`). Registered as
    `trainer.strategy: fsdp_layers` (defaults below).

    Args:
        checkpoint_layers: recompute each layer's activations in backward (FSDP's activation
            checkpointing; leave `model.init_args.gradient_checkpointing` off with it).
        sharding_strategy, state_dict_type, cpu_offload: Lightning's (`full`: checkpoints gathered into one
            file on rank 0, read like any other).
    """

    def __init__(
        self,
        checkpoint_layers: bool = True,
        sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        cpu_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        layers = {GradientCheckpointingLayer}
        # every rank loads the weights itself; rank 0's go to all (a head the checkpoint lacks starts random)
        kwargs.setdefault("sync_module_states", True)
        super().__init__(auto_wrap_policy=layers, activation_checkpointing_policy=layers if checkpoint_layers else None,
                         sharding_strategy=sharding_strategy, state_dict_type=state_dict_type, cpu_offload=cpu_offload,
                         **kwargs)


StrategyRegistry.register("fsdp_layers", LayerFSDPStrategy, "FSDP, one unit per transformer layer (lightning_sentemb)",
                          override=True)
