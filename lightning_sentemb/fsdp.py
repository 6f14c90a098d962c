"""FSDP2 (`torch.distributed.fsdp.fully_shard`) through Lightning's `ModelParallelStrategy`: one unit per
transformer layer of any backbone, the rest of the method in one root unit. It runs on CPU (gloo) as on
GPUs (NCCL), so the tests train it; torch's FSDP1 refuses a CPU."""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import Strategy
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from transformers.modeling_layers import GradientCheckpointingLayer

from .errors import SentEmbUserError

# the modules' methods, besides `forward`, that run parameters of the root unit (the MLM head)
ROOT_FORWARD_METHODS = ("mlm_logits",)


def is_sharded(strategy: Strategy | None) -> bool:
    """Whether the strategy shards the module (its parameters are DTensors after setup)."""
    return isinstance(strategy, ModelParallelStrategy)


def holds_fsdp_units(module: torch.nn.Module) -> bool:
    """Whether FSDP2 has sharded (part of) `module`."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def grad_free(module: torch.nn.Module) -> AbstractContextManager:
    """What evaluation runs under: `torch.no_grad` where FSDP2 shards `module`, `torch.inference_mode` elsewhere.
    FSDP2's unshard raises "Inference tensors do not track version counter" where its all-gather buffers are
    first made under inference mode (torch 2.13 too; pytorch/pytorch#197327 fixes it later): `sentemb validate`
    or `test` on NCCL, whose first forward is the loop's, since Lightning runs evaluation under `no_grad` only
    for gloo process groups and FSDP1 (`LayerFSDPStrategy.setup`)."""
    return torch.no_grad() if holds_fsdp_units(module) else torch.inference_mode()


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16-mixed: the layers compute in bf16 (all-gathered in bf16), the sharded parameters that AdamW
    steps stay fp32 and gradients are reduced in fp32; buffers (ClusterNS's centroids) are not FSDP's and
    keep their dtype. 32-true: everything fp32."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision in ("32-true", "32"):
        return MixedPrecisionPolicy()
    raise SentEmbUserError(f"trainer.precision {precision} under FSDP (trainer.strategy fsdp_layers): use bf16-mixed "
                           "or 32-true")


def shard_by_layer(module: LightningModule, mesh: Any, policy: MixedPrecisionPolicy) -> None:
    """`fully_shard` every transformer layer (transformers' layers all derive from
    `GradientCheckpointingLayer`), then each of the method's own children that hold parameters, a root unit
    each (the encoder with its embeddings, final norm and heads; the MLP): FSDP2 takes one module a root.
    The LightningModule itself is not wrapped (FSDP2 would change its class, which checkpoints record).
    Besides `forward`, the children's `ROOT_FORWARD_METHODS` gather their parameters."""
    # a layer's inputs are left as they come (bf16 hidden states under bf16-mixed): FSDP's cast would rebuild the
    # dataclasses among them, and the packed forward's state (`encoders.packed.Packing`) must reach the layers
    layer_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    for layer in module.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            fully_shard(layer, mesh=mesh, mp_policy=layer_policy, reshard_after_forward=True)
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
            for name in ROOT_FORWARD_METHODS:
                if hasattr(child, name):
                    register_fsdp_forward_method(child, name)


class LayerFSDPStrategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` as data parallelism only (no tensor parallelism): FSDP2 over all
    processes, one unit per transformer layer (`shard_by_layer`), mixed precision by `trainer.precision`
    (`mixed_precision_policy`). Checkpoints are single files gathered on rank 0 (Lightning's
    `save_distributed_checkpoint=False`), which `sentemb evaluate`, `sentemb export` and `--ckpt_path last`
    read as any other. Registered as `trainer.strategy: fsdp_layers`.

    Args:
        timeout: the process group's collective timeout (evaluation scores on every rank between
            collectives).
    """

    def __init__(self, timeout: timedelta = timedelta(minutes=30), process_group_backend: str | None = None) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False,
                         process_group_backend=process_group_backend, timeout=timeout)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process shards the model
        super().setup_environment()

    def setup(self, trainer: Trainer) -> None:
        module = self.lightning_module
        if not holds_fsdp_units(module):  # once, though setup runs per stage
            policy = mixed_precision_policy(str(trainer.precision))
            shard_by_layer(module, self.device_mesh["data_parallel"], policy)
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):  # `grad_free`
            loop.inference_mode = False  # no_grad, as Lightning runs FSDP1's and fit's validation
        super().setup(trainer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, strict except for a frozen backbone, whose checkpoint holds only what trains:
        there the module's `check_state_keys` (`SentEmbMethod`) checks the names first."""
        if Path(checkpoint_path).is_file():
            state = torch.load(checkpoint_path, mmap=True, map_location="cpu", weights_only=weights_only)
            self.lightning_module.strict_loading = self.lightning_module.check_state_keys(state["state_dict"].keys())
        return super().load_checkpoint(checkpoint_path, weights_only)


StrategyRegistry.register("fsdp_layers", LayerFSDPStrategy,
                          "FSDP2, one unit per transformer layer (lightning_sentemb)", override=True)
