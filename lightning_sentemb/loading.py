"""Load a trained method from a Lightning checkpoint, or wrap a plain Hugging Face folder."""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .backbones import family_of
from .encoders.pretrained import load_config
from .errors import SentEmbUserError
from .methods.base import SentEmbMethod
from .methods.simcse import SimCSE
from .user_code import add_user_folders, missing_module_error

# What a checkpoint may hold beyond tensors and plain containers under `weights_only=True`: numpy
# scalars and arrays (RNG states, metric values). Found by loading checkpoints of every method;
# a class outside this list (or code planted in the file) stops the load instead of running.
SAFE_GLOBALS = [
    np._core.multiarray.scalar, np._core.multiarray._reconstruct, np.ndarray, np.dtype,
    *(getattr(np.dtypes, name) for name in np.dtypes.__all__),
]
TRUST_HINT = "if you wrote the file or trust its source, pass --trust-checkpoint"


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


def read_checkpoint(
    path: str | Path, map_location: str = "cpu", trust_checkpoint: bool = False, mmap: bool = False
) -> dict[str, Any]:
    """The checkpoint's contents. Unless trusted, only tensors, plain values and `SAFE_GLOBALS` are
    unpickled (`weights_only=True`), so a downloaded file cannot run code; any unreadable file
    gives one error naming it. `mmap` leaves the tensors in the file until used: reading a large
    checkpoint's step, scores or hyperparameters then costs little."""
    path = Path(path)
    if not path.is_file():
        raise SentEmbUserError(f"checkpoint {path} does not exist")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=not trust_checkpoint, mmap=mmap)
    except pickle.UnpicklingError as error:
        blocked = re.search(r"GLOBAL (\S+)|but got (<class '[^']+'>)", str(error))
        if not trust_checkpoint and blocked:
            raise SentEmbUserError(
                f"checkpoint {path} holds {next(g for g in blocked.groups() if g)}, which is not a tensor or plain "
                f"value and could run code when loaded; {TRUST_HINT}"
            ) from error
        raise _unreadable(path, error) from error
    except (RuntimeError, EOFError, KeyError, OSError) as error:
        raise _unreadable(path, error) from error


def _unreadable(path: Path, error: BaseException) -> SentEmbUserError:
    """One line naming the file and torch's own reason, without torch's advice to unpickle it fully."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith(boilerplate)]
    reason = lines[0].split(". ")[0] if lines else type(error).__name__
    return SentEmbUserError(f"checkpoint {path} is not a readable PyTorch checkpoint (truncated, or not a checkpoint): "
                            f"{type(error).__name__}: {reason}")


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
