"""How a method is built, the one way for the CLI, tests, `load_method` and exports alike: `__init__`
builds everything but the backbone's weights (a skeleton on the meta device: tokenizer, config, input
format, heads), and `configure_model` reads them straight onto the rank's device in the dtype it trains
in, then adds LoRA adapters, fp32 for what trains, and gradient checkpointing, once. Lightning calls
`configure_model` itself (`fit`, `validate`, `test`, `load_from_checkpoint`); everywhere else
`build_method` does. `attn_implementation` is the one switch of the attention path (`padding_free`
is its deprecated alias)."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Literal

import torch
from lightning.pytorch import LightningModule

from ..backbones import UnsupportedBackbone, with_dropout
from ..build import build_method
from ..encoders.lora import add_lora, peft_base_reference
from ..encoders.memory import enable_gradient_checkpointing, from_pretrained_options
from ..encoders.plain import Encoder, backbone_loading
from ..errors import SentEmbUserError, check_choice
from ..fsdp import is_sharded

# null = padding-free; "padded" = transformers' padded forward with the kernel it picks; a kernel name = with it
__all__ = ["build_method", "configure_backbone", "weights_device"]  # build_method: `lightning_sentemb.build`

AttnImplementation = Literal["padded", "sdpa", "eager", "flash_attention_2", "flex_attention"]

@functools.cache
def _warn_padding_free() -> None:
    warnings.warn("model.init_args.padding_free is deprecated: use attn_implementation (null = padding-free, "
                  "padded = the padded forward that padding_free: false chose)", FutureWarning, stacklevel=4)


def resolve_attention(method: LightningModule) -> None:
    """The deprecated `padding_free` (said once per process) as `attn_implementation`: false = "padded";
    the hyper-parameters (and so checkpoints) keep `attn_implementation` only."""
    hp = method.hparams
    if hp.padding_free is None:
        return
    _warn_padding_free()
    if not hp.padding_free and hp.attn_implementation is None:
        hp.attn_implementation = "padded"
    hp.padding_free = None


def kernel_option(method: LightningModule) -> dict[str, str]:
    """The `from_pretrained` option of the kernel `attn_implementation` names (none for null and "padded")."""
    kernel = method.hparams.attn_implementation
    return {} if kernel in (None, "padded") else {"attn_implementation": kernel}


def build_encoder_for(method: LightningModule) -> Encoder:
    """The method's `build_encoder()` with a skeleton backbone that `configure_model` fills as the
    hyper-parameters say (dtype, 4-bit, dropout, attention kernel), `bidirectional` applied."""
    hp = method.hparams
    options = with_dropout(from_pretrained_options(hp.backbone_dtype, hp.load_in_4bit), method.family, hp.dropout)
    check_choice("model.init_args.attn_implementation", hp.attn_implementation, AttnImplementation, allow_none=True)
    options.update(kernel_option(method))
    try:
        with backbone_loading(defer_weights=True, **options):
            encoder = method.build_encoder()
            if hp.bidirectional:
                encoder.set_bidirectional()
            if hp.template is not None and not encoder.reads_echo:
                raise SentEmbUserError(f"model.init_args.template: {type(method).__name__} builds its own input format")
            return encoder
    except UnsupportedBackbone as refusal:
        raise UnsupportedBackbone(f"{type(method).__name__} on {hp.backbone} ({method.family.model_type}): "
                                  f"{refusal}") from None


def check_options(method: LightningModule) -> None:
    """Options that cannot work together: low-precision or 4-bit weights suit a frozen backbone only
    (what trains stays fp32); a guide needs a loss that takes its mask (`drop`)."""
    hp = method.hparams
    if method.guide is not None and "drop" not in inspect.signature(method.embedding_loss).parameters:
        raise SentEmbUserError(
            f"model.init_args.guide: {type(method).__name__}.embedding_loss takes no `drop`, so the guide's mask "
            "would go unused; a method of your own takes `drop` and applies it (docs/negatives.md), or remove the guide"
        )
    if hp.grad_cache_chunk < 0:
        raise SentEmbUserError(f"model.init_args.grad_cache_chunk must be >= 0 (0 = off), got {hp.grad_cache_chunk}")
    if not method.backbone_frozen and (hp.backbone_dtype != "fp32" or hp.load_in_4bit):
        option = "load_in_4bit" if hp.load_in_4bit else f"backbone_dtype {hp.backbone_dtype}"
        raise SentEmbUserError(
            f"model.init_args.{option} stores the backbone's weights in low precision, which suits a frozen "
            "backbone only: set model.init_args.lora (or, for full fine-tuning, keep backbone_dtype fp32 and "
            "use trainer.precision bf16-mixed)"
        )


def weights_device(method: LightningModule) -> torch.device | None:
    """Where the backbone's weights load: the trainer's root device, which Lightning numbers by its
    local rank (torchrun, SLURM and Lightning's own launcher alike). None (the CPU; 4-bit: the current
    GPU) outside a trainer, and under FSDP, which shards the module from host memory as it wraps it."""
    trainer = method._trainer
    if trainer is None or is_sharded(trainer.strategy):
        return None
    return trainer.strategy.root_device


def configure_backbone(method: LightningModule) -> None:
    """Lightning's `configure_model` (also FSDP's) before the strategy wraps the module; it runs at every
    stage, and `build_method` runs it outside a trainer. The first time, the backbone loads straight from
    the checkpoint files onto this rank's device (`weights_device`) in `backbone_dtype`; then LoRA
    adapters, fp32 for what trains, and gradient checkpointing."""
    if method.backbone_adapted:
        return
    hp, encoder = method.hparams, method.encoder
    options = from_pretrained_options(hp.backbone_dtype, hp.load_in_4bit, weights_device(method))
    options.update(kernel_option(method))
    encoder.load_backbone(**with_dropout(options, method.family, hp.dropout))
    backbone = encoder.backbone
    if hp.lora is not None:
        # the adapters' initial values from the run's seed alone: Lightning reseeds before this hook under
        # DDP, not on one device, and k processes must start as 1 does
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(method.run_seed)
            add_lora(backbone, hp.lora, peft_base_reference(hp.backbone), encoder.family.unread_modules(backbone))
    for parameter in encoder.parameters():  # adapters and heads of a low-precision backbone
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
    if hp.gradient_checkpointing:
        enable_gradient_checkpointing(backbone)
    method.backbone_adapted = True
