"""Methods outside the package: the module a `class_path` names (`my_method.MyMethod`) is imported
from the working directory and from the folder of each `-c` config, as `python -m` and `python
config_folder/script.py` would find it, so a method in one file beside its YAML needs no
`PYTHONPATH` (the `sentemb` launcher's own folder is the venv's `bin`, where Python looks instead).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import SentEmbUserError

__all__ = ["add_user_folders", "missing_module_error", "user_folders"]

_SEARCHED: list[str] = []  # the folders of the latest command, in the order they are looked in


def add_user_folders(config_files: Sequence[str | os.PathLike] = ()) -> list[str]:
    """Put the working directory, then each config's folder, at the front of `sys.path` (where
    `python -m` puts the working directory); the folders searched, in order."""
    folders = list(dict.fromkeys([os.getcwd(), *(str(Path(file).resolve().parent) for file in config_files)]))
    for position, folder in enumerate(folders):
        if folder not in sys.path:
            sys.path.insert(position, folder)
    _SEARCHED[:] = folders
    return folders


def user_folders() -> list[str]:
    """Where the latest command looked for a `class_path` module outside the installed packages."""
    return list(_SEARCHED) or [os.getcwd()]


def missing_module_error(module: str, wanted_by: str) -> SentEmbUserError:
    """One line: which module is missing, who asked for it, and where it was looked for."""
    folders = ", ".join(user_folders())
    return SentEmbUserError(
        f"{wanted_by}: no module named {module!r}, looked for {module.replace('.', '/')}.py in {folders} and in the "
        "installed packages; put the file there (or run from its folder), or install it"
    )
