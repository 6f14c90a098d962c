"""Where data, evaluation and cache files live, and one clear error when data is missing.

One rule finds the data directory for every command (`fit` and the other LightningCLI subcommands,
`evaluate`, `data check`): `--data-dir` / `data.data_dir` when given, else `$SENTEMB_DATA`, else
`./data` (where `sentemb data download --to data` puts it) if it exists, else `../shared/data`
(the offline mirror beside the repository).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import SentEmbUserError

DATA_ENV_VAR = "SENTEMB_DATA"
DEFAULT_DATA_DIRS = (Path("data"), Path("..") / "shared" / "data")
DATA_DIR_HELP = "data directory (default: $SENTEMB_DATA, else ./data if it exists, else ../shared/data)"


class MissingDataError(SentEmbUserError, FileNotFoundError):
    """A data file the run needs is absent; the message names it, how to fetch it, and `option`, the
    data-directory option of the command that needs it (`--data-dir` for evaluate and data check;
    the LightningCLI subcommands say `--data.data_dir` with `for_option`)."""

    def __init__(self, path: Path, what: str, option: str = "--data-dir") -> None:
        super().__init__(f"{what} not found at {path}. Fetch it with `sentemb data download --to DIR` (or point "
                         f"{option} / {DATA_ENV_VAR} at an existing mirror).")
        self.path, self.what = path, what

    def for_option(self, option: str) -> MissingDataError:
        return MissingDataError(self.path, self.what, option)


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory by the rule above; `./data` when no candidate exists (errors then name
    the files missing there).

    The layout is SimCSE's: ``senteval/downstream/...``, ``corpora/...``, ``clustering/...``.
    """
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get(DATA_ENV_VAR):
        return Path(os.environ[DATA_ENV_VAR]).expanduser()
    return next((folder for folder in DEFAULT_DATA_DIRS if folder.is_dir()), DEFAULT_DATA_DIRS[0])


def default_cache_dir() -> Path:
    """Tokenized corpora and `--help` texts: `$SENTEMB_CACHE`, else ~/.cache/lightning_sentemb."""
    return Path(os.environ.get("SENTEMB_CACHE", Path.home() / ".cache" / "lightning_sentemb"))


def require_file(path: str | os.PathLike, what: str) -> Path:
    """Return ``path`` if it exists, else raise one error naming it and the fetch command."""
    path = Path(path)
    if not path.exists():
        raise MissingDataError(path, what)
    return path
