"""Memory switches of the backbone: how its frozen weights are stored, `backbone_dtype` (fp32, bf16,
fp16) and `load_in_4bit` (QLoRA: NF4 weights with double quantization through bitsandbytes, as the
PromptEOL reference loads its LLMs), both for frozen weights only (what trains stays fp32); and
gradient checkpointing."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from ..errors import SentEmbUserError

__all__ = ["DTYPES", "BackboneDtype", "enable_gradient_checkpointing", "from_pretrained_options"]

BackboneDtype = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def from_pretrained_options(
    backbone_dtype: BackboneDtype, load_in_4bit: bool, device: torch.device | None = None
) -> dict[str, Any]:
    """`from_pretrained` keyword arguments for the backbone's weights; 4-bit without a GPU or without
    bitsandbytes is one line saying so.

    `device`: where the weights load, straight from the checkpoint files (`device_map`); a method passes
    its rank's device (Lightning's root device, numbered by Lightning's local rank under torchrun and
    SLURM alike). None: the CPU, or for 4-bit the current CUDA device.

    4-bit: linear layers in NF4 with double quantization, computed in `backbone_dtype` (the reference
    computes in fp32: `backbone_dtype: fp32`), the other weights (embeddings, norms) in `backbone_dtype`."""
    if backbone_dtype not in DTYPES:
        raise SentEmbUserError(f"model.init_args.backbone_dtype must be one of {', '.join(DTYPES)}, "
                               f"got {backbone_dtype!r}")
    options: dict[str, Any] = {"dtype": DTYPES[backbone_dtype]}
    if device is not None:
        options["device_map"] = {"": device}
    if not load_in_4bit:
        return options
    if not torch.cuda.is_available():
        raise SentEmbUserError("model.init_args.load_in_4bit: 4-bit weights (bitsandbytes) need a CUDA GPU and none "
                               "is visible; set it to false (backbone_dtype: bf16 halves the weights' memory instead)")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise SentEmbUserError("model.init_args.load_in_4bit needs bitsandbytes, which is not installed: "
                               "pip install 'lightning_sentemb[qlora]'")
    from transformers import BitsAndBytesConfig

    options["quantization_config"] = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=DTYPES[backbone_dtype],
    )
    options.setdefault("device_map", {"": torch.device("cuda", torch.cuda.current_device())})
    return options


def enable_gradient_checkpointing(backbone: PreTrainedModel) -> None:
    """The backbone's own gradient checkpointing, per layer (the padding-free forward follows the same
    per-layer flags): each layer's activations are recomputed in backward instead of kept. Non-reentrant,
    so a frozen embedding layer needs no gradient, and the recomputation replays the forward's random
    state (same dropout masks: same loss and gradients)."""
    if not backbone.supports_gradient_checkpointing:
        raise SentEmbUserError(f"model.init_args.gradient_checkpointing: {type(backbone).__name__} does not support "
                               "gradient checkpointing; set it to false")
    kwargs = {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):  # its name since transformers 5 (the old one warns)
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
