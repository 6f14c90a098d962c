"""The training loop's side of a method: the objective of a step (the method's loss, with the guide's
mask and over Matryoshka truncations, plus the weighted MLM loss, in one forward or with gradient
caching), the per-batch seeding that makes a resumed run draw what the uninterrupted one drew, the
optimizer and schedule, and the trainer options a method refuses.
`SentEmbMethod`'s Lightning hooks are these functions."""

from __future__ import annotations

import math
import random
from contextlib import nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins import FSDPPrecision, MixedPrecision
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from transformers import get_linear_schedule_with_warmup

from .. import matryoshka
from ..data.loader import batch_seed
from ..data.mixture import MixtureSource
from ..errors import SentEmbUserError
from ..fsdp import is_sharded
from ..losses.mlm import token_prediction_loss
from .checkpoint_state import trainable_summary

Guided = tuple[Tensor | None, dict[str, Tensor]]  # the guide's mask (None: no guide) and what it logs


def guide_drop(method: LightningModule, embeddings: Tensor, batch: dict[str, Any]) -> Guided:
    """The guide's mask over the views the loss reads (`guide_candidate_views`) and what it logs; (None, {})
    without a guide. Once per batch, at full size, for every truncation."""
    if method.guide is None:
        return None, {}
    return method.guide.drop(embeddings, batch, method.guide_candidate_views)


def sentence_loss(
    method: LightningModule, embeddings: Tensor, batch: dict[str, Any], guided: Guided | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The method's `embedding_loss`, given the guide's mask when there is a guide (`guided`: the mask a
    caller already has for these texts; else `guide_drop`'s); with `matryoshka_dims`, summed over
    truncations (`matryoshka_loss`). A batch from a mixture's dataset is first checked against what the
    method applies (`check_source`)."""
    if "dataset" in batch:
        method.check_source(batch["dataset"])
    drop, guide_logs = guided if guided is not None else method.guide_drop(embeddings, batch)
    loss_fn = method.embedding_loss if drop is None else partial(method.embedding_loss, drop=drop)
    dims = method.hparams.matryoshka_dims
    if not dims:
        loss, logs = loss_fn(embeddings, batch)
    else:
        batch = method.prepare_truncations(embeddings, batch)
        loss, logs = matryoshka.matryoshka_loss(loss_fn, embeddings, batch, dims, method.hparams.matryoshka_weights)
    return loss, {**logs, **guide_logs}


def check_source(method: LightningModule, source: MixtureSource) -> None:
    """One line for a mixture's dataset asking what this method does not apply (`mixture_options`);
    checked on every batch from a mixture (a few attribute reads, on the host)."""
    asked = {"instruction": bool(source.instruction_ids), "in_batch_negatives": not source.in_batch_negatives,
             "query_max_len": source.query_max_len is not None, "doc_max_len": source.doc_max_len is not None}
    refused = [option for option, set_ in asked.items() if set_ and option not in method.mixture_options]
    if refused:
        raise SentEmbUserError(f"data.datasets.{source.name}.{refused[0]}: {type(method).__name__} does not apply it "
                               "(SimCSE does, docs/mixtures.md); remove it from that dataset")
    if source.instruction_ids and method.hparams.template is not None:
        raise SentEmbUserError(f"data.datasets.{source.name}.instruction: model.init_args.template wraps the "
                               "sentence in a template of its own; instructions go before plain input only")


def training_loss(method: LightningModule, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, extra values to log) of one training batch embedded in one forward pass."""
    return method.sentence_loss(method.embed(batch["features"]), batch)


def step_loss(method: LightningModule, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """The training objective of one batch in one forward: the method's loss plus the
    weighted MLM loss when enabled."""
    loss, logs = method.training_loss(batch)
    if "mlm" in batch:
        logs["mlm_loss"] = token_prediction_loss(method.encoder, batch["mlm"], batch["mlm"]["predicted"])
        loss = loss + method.mlm_weight_at(method.global_step) * logs["mlm_loss"]
    return loss, logs


def training_step(method: LightningModule, batch: dict[str, Any], batch_idx: int) -> Tensor:
    """`step_loss`, or with `grad_cache_chunk` the whole step by gradient caching (manual optimization:
    its own backward passes and optimizer step); logs the loss and the method's values."""
    if method.hparams.grad_cache_chunk:
        optimizer = method.optimizers()
        optimizer.zero_grad()
        no_sync = getattr(method.trainer.strategy, "block_backward_sync", nullcontext)  # DDP-like strategies
        loss, logs = method.grad_cache_backward(batch, method.manual_backward, no_sync)
        optimizer.step()
        method.lr_schedulers().step()
    else:
        loss, logs = method.step_loss(batch)
    # collate may give "batch_size" when its features hold extra rows (e.g. template-bias rows)
    batch_size = batch.get("batch_size") or batch["features"]["input_ids"].size(0) // batch["num_views"]
    # not prog_bar: Lightning would read it back every step; `SentEmbProgressBar` shows it at log steps
    method.log("train/loss", loss, batch_size=batch_size)
    method.log_dict({f"train/{k}": v for k, v in logs.items()}, batch_size=batch_size)
    if "dataset" in batch:  # a mixture's batch: its dataset's own curve, at the steps it draws (a host-side name)
        method.log(f"train/loss/{batch['dataset'].name}", loss, batch_size=batch_size)
    return loss


def seed_batch(method: LightningModule, batch: dict[str, Any], batch_idx: int) -> None:
    """Seed torch (CPU and CUDA), numpy and random from (run seed, rank, epoch, batch): dropout,
    SimCSE's augmentation, then depends only on where the run is, so a resumed run draws what
    the uninterrupted one drew, and ranks draw differently."""
    seed = batch_seed(method.run_seed, method.global_rank, method.current_epoch, batch_idx)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def on_fit_start(method: LightningModule) -> None:
    """Log how much trains. Under DDP, no broadcast of the buffers before every forward, a
    collective per step for nothing: every rank holds the same buffers by construction (the
    backbone's constant position ids; ClusterNS's centroids, updated from the all-gathered batch
    and re-broadcast from rank 0 by its K-means callback at log steps)."""
    rank_zero_info(f"{type(method).__name__}: {trainable_summary(method)}")
    model = method.trainer.strategy.model
    if isinstance(model, DistributedDataParallel):
        model.forward_sync_buffers = False  # torch >= 2.13
        model.broadcast_buffers = False  # its name before


def configure_optimizers(method: LightningModule) -> dict[str, Any]:
    """AdamW over what trains, linear warm-up then linear decay to 0 over the run's steps."""
    params = [p for p in method.parameters() if p.requires_grad]
    hp = method.hparams
    # fused: one kernel for all parameters, no per-tensor launches (CPU and CUDA alike). Not under fp16's loss
    # scaling: fused AdamW unscales inside its step, where the clip cannot see unscaled gradients (Lightning
    # refuses clipping then); the foreach kernel lets the scaler unscale first.
    plugin = method.trainer.precision_plugin
    scaled = isinstance(plugin, (MixedPrecision, FSDPPrecision)) and plugin.scaler is not None
    optimizer = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, fused=not scaled)
    total = method.trainer.estimated_stepping_batches
    total = int(total) if math.isfinite(total) else 10**9
    schedule = get_linear_schedule_with_warmup(optimizer, hp.warmup_steps, total)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def check_trainer_options(method: LightningModule) -> list:
    """`configure_callbacks`: no callbacks of its own (ClusterNS adds K-means); refuses trainer options
    that gradient caching or a low-precision backbone cannot honour, before Lightning's own, less
    specific, check, and what is refused under FSDP: gradient caching (several forward and backward
    passes of the backbone within one step, which its DDP path keeps out of the reduction with
    `no_sync`; under FSDP's gather and reshard per layer this is unverified without a GPU, so refused
    rather than risked) and 4-bit weights (bitsandbytes' packed tensors do not shard)."""
    trainer = method._trainer
    fitting = trainer is not None and trainer.state.fn == "fit"
    hp = method.hparams
    if hp.backbone_dtype != "fp32" and fitting and not str(trainer.precision).endswith("-mixed"):
        dtype = hp.backbone_dtype
        raise SentEmbUserError(
            f"model.init_args.backbone_dtype {dtype} keeps the frozen weights in {dtype} and what trains in fp32, "
            f"which run together under mixed precision: set trainer.precision {'bf16' if dtype == 'bf16' else '16'}"
            f"-mixed (got {trainer.precision})"
        )
    if fitting and is_sharded(trainer.strategy):
        for option in ("grad_cache_chunk", "load_in_4bit"):
            if hp[option]:
                raise SentEmbUserError(
                    f"model.init_args.{option} is not supported under FSDP (trainer.strategy), which shards a "
                    "backbone that trains whole; train with DDP (docs/training.md: what each strategy supports)"
                )
    if hp.grad_cache_chunk and fitting:
        # Lightning refuses gradient_clip_val under manual optimization; the method clips itself
        # (`clip_cached_gradients`), so it takes the setting over before Lightning's check.
        method.manual_gradient_clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        trainer.gradient_clip_val = None
        if trainer.accumulate_grad_batches != 1:
            raise SentEmbUserError(
                f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} with "
                "model.init_args.grad_cache_chunk > 0: accumulation does not add negatives; raise "
                "data.batch_size instead (caching keeps its memory to one chunk)"
            )
    return []


def clip_cached_gradients(method: LightningModule, optimizer: torch.optim.Optimizer) -> None:
    """`on_before_optimizer_step`: gradient caching steps the optimizer itself, where Lightning does not
    clip: the trainer's `gradient_clip_val` / `gradient_clip_algorithm` apply here, where automatic
    optimization clips (after DDP's gradient all-reduce and fp16's unscaling, before the step)."""
    clip_val, algorithm = method.manual_gradient_clip
    if clip_val:
        method.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
