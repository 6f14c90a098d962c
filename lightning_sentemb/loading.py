"""Load a trained method from a Lightning checkpoint, or wrap a plain Hugging Face folder."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from .methods.base import SentEmbMethod
from .methods.simcse import SimCSE


def method_class(qualified_name: str) -> type[SentEmbMethod]:
    module, _, name = qualified_name.rpartition(".")
    return getattr(importlib.import_module(module), name)


def load_method(path: str, pooler: str | None = None, map_location: str = "cpu", **overrides) -> SentEmbMethod:
    """A method ready to `encode`.

    `path` is a `.ckpt` written by `sentemb fit` (the method class is stored in it, and so is its
    evaluation-time pooling) or a Hugging Face model folder / hub name / `pkg:MODULE`, evaluated
    with `pooler` (default `cls_before_pooler`; ignored for checkpoints). For a plain folder, `cls`
    means the backbone's own pooler output (Linear+Tanh over [CLS]) as in SimCSE's evaluation.
    """
    if str(path).endswith(".ckpt"):
        if not Path(path).exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        checkpoint = torch.load(path, map_location=map_location, weights_only=False)
        cls = method_class(checkpoint.get("sentemb_method", "lightning_sentemb.methods.SimCSE"))
        return cls.load_from_checkpoint(path, map_location=map_location, **overrides)
    pooler = pooler or "cls_before_pooler"
    if pooler != "cls":
        return SimCSE(path, pooler=pooler, mlp="none", **overrides)
    method = SimCSE(path, pooler="cls", mlp="always", **overrides)
    backbone_pooler = getattr(method.encoder.backbone, "pooler", None)
    if backbone_pooler is None:
        raise ValueError(f"{path} has no pooler layer, so pooler 'cls' is undefined; use cls_before_pooler")
    method.mlp[0].load_state_dict(backbone_pooler.dense.state_dict())
    return method
