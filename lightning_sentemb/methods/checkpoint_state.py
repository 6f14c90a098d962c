"""What a method's checkpoint holds and how it is read back: the method class, run seed and backbone
identity beside the state; for a frozen backbone (LoRA, DCPCSE) only what trains plus the state outside
the encoder, the rest rebuilt from `backbone` and checked against the identity stored with it.
`SentEmbMethod`'s checkpoint hooks are these functions."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule
from torch import Tensor, nn
from transformers.utils import cached_file

from ..encoders.pretrained import resolve_model_path
from ..errors import SentEmbUserError


def backbone_identity(name: str) -> dict[str, str | None]:
    """The backbone as a checkpoint remembers it: its name and the SHA-256 of its config.json (parsed,
    without the keys saving rewrites), None where it has none (an adapter folder)."""
    path = cached_file(resolve_model_path(name), "config.json", _raise_exceptions_for_missing_entries=False)
    digest = None
    if path is not None:
        config = json.loads(Path(path).read_text())
        for key in ("_name_or_path", "transformers_version"):
            config.pop(key, None)
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return {"name": name, "config_sha256": digest}


def trainable_state_keys(method: LightningModule) -> set[str]:
    """state_dict names of what a checkpoint of a frozen backbone keeps: the trainable tensors (every
    name of a shared one) and the state outside the encoder (e.g. ClusterNS's centroids)."""
    trainable = {name for name, p in method.named_parameters(remove_duplicate=False) if p.requires_grad}
    return trainable | {name for name in method.state_dict() if not name.startswith("encoder.")}


def on_save_checkpoint(method: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Record the method class (so `sentemb evaluate/export` rebuild it from the file alone) and the
    backbone's identity; drop a frozen backbone (hyper-parameter `backbone` names it)."""
    checkpoint["sentemb_method"] = f"{type(method).__module__}.{type(method).__qualname__}"
    checkpoint["sentemb_run_seed"] = method.run_seed
    checkpoint["sentemb_backbone"] = method.backbone_identity
    if method.backbone_frozen:
        keep = method.trainable_state_keys()
        checkpoint["state_dict"] = {name: t for name, t in checkpoint["state_dict"].items() if name in keep}


def on_load_checkpoint(method: LightningModule, checkpoint: dict[str, Any]) -> None:
    """A resumed run keeps the seed of the run it continues. A checkpoint of a frozen backbone needs the
    very base it was trained on: a different config.json is one line."""
    method._run_seed = checkpoint.get("sentemb_run_seed", method._run_seed)
    saved, ours = checkpoint.get("sentemb_backbone"), method.backbone_identity
    if method.backbone_frozen and saved and saved["config_sha256"] != ours["config_sha256"]:
        raise SentEmbUserError(
            f"the checkpoint holds adapters/prefixes trained on backbone {saved['name']!r} (config "
            f"{str(saved['config_sha256'])[:12]}), but model.init_args.backbone {method.hparams.backbone!r} is a "
            f"different model (config {str(ours['config_sha256'])[:12]}); point it to the model "
            "the checkpoint was trained on"
        )


def load_state_dict(method: LightningModule, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
    """A frozen backbone's checkpoint holds exactly `trainable_state_keys`: those are loaded (strictly:
    a missing or unknown name is an error) and the frozen weights stay as loaded from `backbone`."""
    if not strict:
        return nn.Module.load_state_dict(method, state_dict, strict=strict, assign=assign)
    return nn.Module.load_state_dict(method, state_dict, strict=check_state_keys(method, state_dict.keys()),
                                     assign=assign)


def check_state_keys(method: LightningModule, names: Collection[str]) -> bool:
    """Whether a checkpoint's state_dict names load strictly (False: a frozen backbone's, which holds exactly
    `trainable_state_keys`; a missing or unknown name is then an error here). The FSDP strategy asks too."""
    if not method.backbone_frozen:
        return True
    missing = sorted(method.trainable_state_keys() - set(names))
    unexpected = sorted(set(names) - method.state_dict().keys())
    if missing or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(method).__name__}: Missing key(s) {missing}; "
                           f"unexpected key(s) {unexpected}")
    return False


def trainable_summary(method: nn.Module) -> str:
    """How many parameters train, of how many (4-bit weights counted unpacked)."""
    sizes = {id(p): (unpacked_numel(p), p.requires_grad) for p in method.parameters()}.values()
    total = sum(n for n, _ in sizes)
    trainable = sum(n for n, grad in sizes if grad)
    return f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.3g}%)"


def unpacked_numel(parameter: Tensor) -> int:
    """Elements of a parameter; bitsandbytes' 4-bit weights pack two in a byte (their quant state keeps
    the shape)."""
    quant_state = getattr(parameter, "quant_state", None)
    return math.prod(quant_state.shape) if quant_state is not None else parameter.numel()
