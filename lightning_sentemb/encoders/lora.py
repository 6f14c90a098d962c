"""LoRA adapters (the `peft` library) on any backbone, and the two ways a model with adapters is written out.

`add_lora` freezes the backbone and injects peft's LoRA layers into it in place
(`inject_adapter_in_model`): module tree, forward and parameter names stay the backbone's own
(`query` becomes a `lora.Linear` holding `base_layer`, `lora_A`, `lora_B`), so every input format
(templates, prompt vectors, deep prefixes), the padding-free forward and gradient caching run unchanged,
and only the adapters and the method's own heads train.

Written out (`save_backbone`):
- merged (default): the adapters added into the weights they adapt, a plain Hugging Face folder that
  `AutoModel` and `SentenceTransformer` load without peft (`merged_state_dict`);
- adapter only: peft's adapter folder (`adapter_config.json` naming the base model,
  `adapter_model.safetensors`), which `AutoModel.from_pretrained`, `PeftModel.from_pretrained` and
  sentence-transformers load on top of the base model (peft installed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from ..errors import SentEmbUserError
from .pretrained import ADAPTER_CONFIG, resolve_model_path

__all__ = ["LORA_DEFAULTS", "LoraSettings", "add_lora", "has_lora", "merged_state_dict", "peft_base_reference",
           "save_backbone"]

ADAPTER = "default"  # peft's adapter name; one adapter per backbone

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file names, so peft and transformers load the folder


class LoraSettings(TypedDict, total=False):
    """`model.init_args.lora` (null = no LoRA). Missing keys take `LORA_DEFAULTS`.

    r: rank of each adapter; alpha: the update is scaled by alpha / r; dropout: on the adapter's
    input; target_modules: `all-linear` (every linear layer of the backbone but its unused pooler), a
    list of module names (`[q_proj, v_proj]`, matched as name suffixes) or a regex (peft's rules).
    """

    r: int
    alpha: float
    dropout: float
    target_modules: str | list[str]


# The PromptEOL reference (kongds/scaling_sentemb, train_llm.sh / ft_llm.py): r 64, alpha 16, dropout 0.05.
# Its 4-bit runs adapt every linear layer but lm_head (`find_all_linear_names`); its default list
# [q_proj, v_proj] applies to its 8/16-bit runs only.
LORA_DEFAULTS: LoraSettings = {"r": 64, "alpha": 16.0, "dropout": 0.05, "target_modules": "all-linear"}


def lora_config(settings: Mapping[str, Any], backbone: PreTrainedModel, unread: list[str]) -> LoraConfig:
    """peft's LoraConfig from `model.init_args.lora`; a bad key or value is one line naming it. The linear
    layers inside the `unread` modules (the family's: e.g. BERT's own pooler, which no pooler of ours
    reads) get no adapter: it would never get a gradient (and stop DDP)."""
    unknown = sorted(set(settings) - set(LORA_DEFAULTS))
    if unknown:
        raise SentEmbUserError(f"model.init_args.lora: unknown key(s) {', '.join(unknown)}; "
                               f"give {', '.join(LORA_DEFAULTS)} (or null for no LoRA)")
    values = {**LORA_DEFAULTS, **settings}
    if not isinstance(values["r"], int) or values["r"] < 1:
        raise SentEmbUserError(f"model.init_args.lora.r must be a positive integer, got {values['r']!r}")
    if not 0 <= values["dropout"] < 1:
        raise SentEmbUserError(f"model.init_args.lora.dropout must be in [0, 1), got {values['dropout']!r}")
    config = LoraConfig(r=values["r"], lora_alpha=values["alpha"], lora_dropout=values["dropout"],
                        target_modules=values["target_modules"], bias="none")
    excluded = [f"{prefix}.{name}" for prefix in unread
                for name, module in backbone.get_submodule(prefix).named_modules() if isinstance(module, nn.Linear)]
    config.exclude_modules = excluded or None
    return config


def add_lora(backbone: PreTrainedModel, settings: Mapping[str, Any], base_reference: str, unread: list[str]) -> None:
    """Freeze `backbone` and inject trainable LoRA adapters in place (in the backbone's dtype: the method
    makes what trains fp32), none inside the `unread` modules (see `lora_config`).
    `base_reference` is what the adapter folder names as its base model (`peft_base_reference`)."""
    backbone.requires_grad_(False)
    config = lora_config(settings, backbone, unread)
    config.base_model_name_or_path = base_reference
    try:
        inject_adapter_in_model(config, backbone, adapter_name=ADAPTER)
    except ValueError as error:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in backbone.named_modules() if isinstance(m, nn.Linear)})
        raise SentEmbUserError(
            f"model.init_args.lora.target_modules {settings.get('target_modules')!r} matches no layer of this "
            f"{backbone.config.model_type} backbone ({' '.join(str(error).split())[:200]}); its linear layers are "
            f"named {', '.join(linear)}, or use all-linear"
        ) from error


def has_lora(backbone: nn.Module) -> bool:
    return any(isinstance(module, LoraLayer) for module in backbone.modules())


def peft_base_reference(name: str) -> str:
    """The base model as an adapter folder names it: hub names as they are, folders and `pkg:MODULE`
    (which peft and transformers cannot resolve) as absolute paths."""
    path = resolve_model_path(name)
    return str(Path(path).resolve()) if os.path.isdir(path) else path


@torch.no_grad()
def merged_state_dict(backbone: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The backbone's state dict with every adapter added into the weight it adapts (peft's
    `get_delta_weight`: B·A·alpha/r), under the plain model's names (no `base_layer`, no `lora_*`).

    The backbone itself is left as it is (merging in place would change the model being exported). The sum
    is taken in fp32 and stored in the base weight's dtype."""
    state = {key.replace(".base_layer.", "."): tensor for key, tensor in backbone.state_dict().items()
             if ".lora_" not in key}
    for name, layer in backbone.named_modules():
        if isinstance(layer, LoraLayer):
            weight = layer.get_base_layer().weight
            delta = sum(layer.get_delta_weight(adapter).float() for adapter in layer.active_adapters)
            state[f"{name}.weight"] = (weight.float() + delta).to(weight.dtype)
    return state


def save_backbone(backbone: PreTrainedModel, folder: str | os.PathLike, adapter_only: bool = False) -> None:
    """The backbone as a Hugging Face folder: merged when it carries adapters, or with `adapter_only`
    peft's adapter folder (config naming the base model + adapter weights, no base weights)."""
    folder = Path(folder)
    if not has_lora(backbone):
        if adapter_only:
            raise SentEmbUserError("--adapter-only needs a model trained with LoRA (model.init_args.lora); "
                                   "export this one without it")
        backbone.save_pretrained(folder)
    elif adapter_only:
        folder.mkdir(parents=True, exist_ok=True)
        backbone.peft_config[ADAPTER].save_pretrained(folder)
        weights = get_peft_model_state_dict(backbone, adapter_name=ADAPTER)
        # peft's on-disk names are the PeftModel's: base_model.model.<module path>
        save_file({f"base_model.model.{key}": tensor.detach().contiguous() for key, tensor in weights.items()},
                  str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    else:
        backbone.save_pretrained(folder, state_dict=merged_state_dict(backbone))


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()
