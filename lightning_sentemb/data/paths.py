"""Where evaluation and corpus files live, and one clear error when they are missing."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import SentEmbUserError

DATA_ENV_VAR = "SENTEMB_DATA"
FETCH_HINT = "`sentemb data download --to DIR` (or point --data-dir / SENTEMB_DATA at an existing mirror)"


class MissingDataError(SentEmbUserError, FileNotFoundError):
    """A data file the run needs is absent; the message names it and how to fetch it."""


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory: the explicit argument, else $SENTEMB_DATA, else ./data.

    The layout is SimCSE's: ``senteval/downstream/...``, ``corpora/...``, ``clustering/...``.
    """
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get(DATA_ENV_VAR):
        return Path(os.environ[DATA_ENV_VAR]).expanduser()
    return Path("data")


def require_file(path: str | os.PathLike, what: str) -> Path:
    """Return ``path`` if it exists, else raise one error naming it and the fetch command."""
    path = Path(path)
    if not path.exists():
        raise MissingDataError(f"{what} not found at {path}. Fetch it with {FETCH_HINT}.")
    return path
