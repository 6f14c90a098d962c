"""Load a trained method from a Lightning checkpoint, or wrap a plain Hugging Face folder."""

from __future__ import annotations

import importlib

import torch

from .backbones import family_of
from .checkpoint_file import SAFE_GLOBALS, read_checkpoint
from .encoders.pretrained import load_config
from .errors import SentEmbUserError
from .methods.base import SentEmbMethod
from .methods.simcse import SimCSE
from .user_code import add_user_folders, missing_module_error

# read here for `load_method`; re-exported for code that imported them from `loading`
__all__ = ["SAFE_GLOBALS", "load_method", "method_class", "read_checkpoint"]


def method_class(qualified_name: str, wanted_by: str) -> type[SentEmbMethod]:
    """The class a checkpoint names; a method outside the package is imported from the working
    directory (`user_code`), and a missing module is one line naming `wanted_by` (the checkpoint)."""
    module, _, name = qualified_name.rpartition(".")
    add_user_folders()
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as error:
        if error.name is None or not (module == error.name or module.startswith(f"{error.name}.")):
            raise
        raise missing_module_error(error.name, f"{wanted_by} was trained with {qualified_name}") from None


def load_method(
    path: str, pooler: str | None = None, map_location: str = "cpu", trust_checkpoint: bool = False, **overrides
) -> SentEmbMethod:
    """A method ready to `encode`.

    `path` is a `.ckpt` written by `sentemb fit` (the method class is stored in it, and so is its
    evaluation-time pooling) or a Hugging Face model folder / hub name / `pkg:MODULE`, evaluated
    with `pooler` (default `cls_before_pooler` on encoders, the family's default, `last`, on decoders;
    ignored for checkpoints). For a plain folder, `cls`
    means the backbone's own pooler output (Linear+Tanh over [CLS]) as in SimCSE's evaluation.
    A checkpoint is read with `weights_only=True` unless `trust_checkpoint` (see `read_checkpoint`).
    """
    if str(path).endswith(".ckpt"):
        if overrides.get("template") is not None:
            raise SentEmbUserError(f"--template applies to model folders; checkpoint {path} keeps its own input format")
        checkpoint = read_checkpoint(path, map_location, trust_checkpoint)
        cls = method_class(checkpoint.get("sentemb_method", "lightning_sentemb.methods.SimCSE"), f"checkpoint {path}")
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return cls.load_from_checkpoint(path, map_location=map_location, weights_only=not trust_checkpoint,
                                            **overrides)
    if pooler is None and overrides.get("template") is None and family_of(load_config(path)).default_pooler == "cls":
        pooler = "cls_before_pooler"
    if pooler != "cls":
        return SimCSE(path, pooler=pooler, mlp="none", **overrides)
    method = SimCSE(path, pooler="cls", mlp="always", **overrides)
    backbone_pooler = getattr(method.encoder.backbone, "pooler", None)
    if backbone_pooler is None:
        raise SentEmbUserError(f"--pooler cls: {path} has no pooler layer, so 'cls' is undefined; use cls_before_pooler")
    method.mlp[0].load_state_dict(backbone_pooler.dense.state_dict())
    return method
