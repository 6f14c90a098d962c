"""Writes that never leave a half-written file: a unique temporary name beside the target, then
one rename. A kill at any moment leaves either the previous complete file or none.

The temporary file lives in the target's own folder (never `$TMPDIR`, which may be another
filesystem, where a "move" is a copy that a kill can cut short), has a unique name (two writers at
once never share it), and gets the permissions `open()` would give a new file under the current
umask (`mkstemp` alone would leave it 0600, unusable by a group on shared storage).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "atomic_directory",
           "default_file_mode", "default_dir_mode"]


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status), so a
    file another thread creates meanwhile never sees a zero umask; elsewhere set-and-restore."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:
        mask = os.umask(0)
        os.umask(mask)
    return mask


def default_file_mode() -> int:
    """What `open(path, "w")` gives a new file: 0666 less the umask."""
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """What `mkdir` gives a new folder: 0777 less the umask."""
    return 0o777 & ~_umask()


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call `write(file)` on a fresh temporary file beside `path`, flush it to disk, rename it over
    `path`. On any error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        with _ignore_missing():
            os.unlink(tmp)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda file: file.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf8"))


def atomic_write_json(path: str | os.PathLike, content: Any) -> Path:
    return atomic_write_text(path, json.dumps(content, indent=2) + "\n")


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder beside `target`; on success it replaces `target` whole (an
    existing `target` is removed only then), on error it is deleted and `target` is untouched.
    Everything in it gets the umask's default modes, as `cp` gives (some writers, such as
    safetensors, create files 0600)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", suffix=".tmp", dir=target.parent))
    try:
        yield staging
        _chmod_tree(staging)
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _chmod_tree(folder: Path) -> None:
    file_mode, dir_mode = default_file_mode(), default_dir_mode()
    os.chmod(folder, dir_mode)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            os.chmod(os.path.join(root, name), file_mode)


@contextmanager
def _ignore_missing() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        pass
