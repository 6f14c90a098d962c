"""How a method's backbone becomes ready to train: its weights read straight onto the rank's device
(`configure_model`, deferred under the CLI), then LoRA adapters, fp32 for what trains, and gradient
checkpointing, once. `SentEmbMethod.configure_model` runs `configure_backbone`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Literal

import torch

from ..backbones import UnsupportedBackbone, with_dropout
from ..encoders.lora import add_lora, peft_base_reference
from ..encoders.memory import enable_gradient_checkpointing, from_pretrained_options
from ..encoders.plain import Encoder, backbone_loading
from ..errors import SentEmbUserError
from ..fsdp import is_sharded

if TYPE_CHECKING:
    from .base import SentEmbMethod

AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flex_attention"]

_WEIGHTS_IN_CONFIGURE_MODEL: ContextVar[bool] = ContextVar("weights_in_configure_model", default=False)


@contextmanager
def backbone_weights_in_configure_model() -> Iterator[None]:
    """Methods built inside leave their backbone's weights to `configure_model`, which the trainer calls
    once it knows the rank's device: each rank then reads them once, onto its own device, in the dtype it
    trains in, instead of all of them in fp32 on the host in `__init__`. Until then the backbone is a
    skeleton on the meta device (tokenizer, config and everything else are built as usual). Outside
    (tests, `sentemb evaluate`, `load_from_checkpoint`, exports) `__init__` loads them on the CPU."""
    token = _WEIGHTS_IN_CONFIGURE_MODEL.set(True)
    try:
        yield
    finally:
        _WEIGHTS_IN_CONFIGURE_MODEL.reset(token)


def weights_deferred() -> bool:
    """Whether methods built now leave their weights to `configure_model`."""
    return _WEIGHTS_IN_CONFIGURE_MODEL.get()


def build_encoder_for(method: SentEmbMethod) -> Encoder:
    """The method's `build_encoder()` with its backbone read as the hyper-parameters say (dtype, 4-bit,
    dropout, attention kernel, `bidirectional`), or a skeleton when its weights wait for `configure_model`."""
    hp = method.hparams
    options = with_dropout(from_pretrained_options(hp.backbone_dtype, hp.load_in_4bit), method.family, hp.dropout)
    if hp.attn_implementation is not None:
        if hp.attn_implementation not in AttnImplementation.__args__:
            raise SentEmbUserError(f"model.init_args.attn_implementation must be null or one of "
                                   f"{', '.join(AttnImplementation.__args__)}, got {hp.attn_implementation!r}")
        options["attn_implementation"] = hp.attn_implementation
    try:
        with backbone_loading(defer_weights=weights_deferred(), **options):
            encoder = method.build_encoder()
            if hp.bidirectional:
                encoder.set_bidirectional()
            if hp.template is not None and not encoder.reads_echo:
                raise SentEmbUserError(f"model.init_args.template: {type(method).__name__} builds its own input format")
            return encoder
    except UnsupportedBackbone as refusal:
        raise UnsupportedBackbone(f"{type(method).__name__} on {hp.backbone} ({method.family.model_type}): "
                                  f"{refusal}") from None


def check_options(method: SentEmbMethod) -> None:
    """Options that cannot work together: low-precision or 4-bit weights suit a frozen backbone only
    (what trains stays fp32)."""
    hp = method.hparams
    if hp.grad_cache_chunk < 0:
        raise SentEmbUserError(f"model.init_args.grad_cache_chunk must be >= 0 (0 = off), got {hp.grad_cache_chunk}")
    if not method.backbone_frozen and (hp.backbone_dtype != "fp32" or hp.load_in_4bit):
        option = "load_in_4bit" if hp.load_in_4bit else f"backbone_dtype {hp.backbone_dtype}"
        raise SentEmbUserError(
            f"model.init_args.{option} stores the backbone's weights in low precision, which suits a frozen "
            "backbone only: set model.init_args.lora (or, for full fine-tuning, keep backbone_dtype fp32 and "
            "use trainer.precision bf16-mixed)"
        )


def weights_device(method: SentEmbMethod) -> torch.device | None:
    """Where the backbone's weights load: the trainer's root device, which Lightning numbers by its
    local rank (torchrun, SLURM and Lightning's own launcher alike). None (the CPU; 4-bit: the current
    GPU) outside a trainer, and under FSDP, which shards the module from host memory as it wraps it."""
    trainer = method._trainer
    if trainer is None or is_sharded(trainer.strategy):
        return None
    return trainer.strategy.root_device


def configure_backbone(method: SentEmbMethod) -> None:
    """Lightning's `configure_model` (also FSDP's) before the strategy wraps the module; it runs at every
    stage. A deferred backbone loads now, straight from the checkpoint files onto this rank's device
    (`weights_device`) in `backbone_dtype`; then, once, LoRA adapters, fp32 for what trains, and
    gradient checkpointing."""
    if method.backbone_adapted:
        return
    hp, encoder = method.hparams, method.encoder
    if encoder.weights_deferred:
        options = from_pretrained_options(hp.backbone_dtype, hp.load_in_4bit, weights_device(method))
        if hp.attn_implementation is not None:
            options["attn_implementation"] = hp.attn_implementation
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
