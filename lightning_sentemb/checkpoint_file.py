"""Reading a checkpoint file safely: the lowest layer that touches checkpoints, so the console, the CLI,
exports and `loading` all read them the same way without importing the methods."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import SentEmbUserError

# What a checkpoint may hold beyond tensors and plain containers under `weights_only=True`: numpy
# scalars and arrays (RNG states, metric values). Found by loading checkpoints of every method;
# a class outside this list (or code planted in the file) stops the load instead of running.
SAFE_GLOBALS = [
    np._core.multiarray.scalar, np._core.multiarray._reconstruct, np.ndarray, np.dtype,
    *(getattr(np.dtypes, name) for name in np.dtypes.__all__),
]
TRUST_HINT = "if you wrote the file or trust its source, pass --trust-checkpoint"


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
