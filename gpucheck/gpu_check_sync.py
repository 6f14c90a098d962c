"""Host syncs of a training step on CUDA, each with the line that made it: `SyncRecorder`.

torch's sync debug mode "warn" lets a step finish and warns at every synchronizing call (`SYNC_WARNING`; a
warning raised in the backward's threads is replayed at the end of the backward), so the recorder lists
them all: the line that made each, and the innermost line of this package on the stack when the sync is
made deeper (in Lightning, transformers or torch). Code that silences warnings would hide its syncs from
that list, so the verdict comes from mode "error" on the next step, which raises at the first one
(`raised_sync` names its line). On the CPU there is no sync debug mode: nothing is recorded or raised.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.h: warn_or_error_on_sync
PACKAGE = "lightning_sentemb"
HERE = Path(__file__).resolve()


def short_path(filename: str) -> str:
    """A frame's file from the package's or the installed library's root (`lightning/pytorch/...`)."""
    parts = Path(filename).parts
    for root in ("site-packages", "dist-packages"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root):])
    if PACKAGE in parts:
        return "/".join(parts[parts.index(PACKAGE):])
    return "/".join(parts[-2:])


@dataclass(frozen=True)
class HostSync:
    """One synchronizing call: `site`, the line that made it; `ours`, the innermost line of this package
    on the stack when `site` is elsewhere (None when it is ours, or no line of ours is on the stack)."""

    site: str
    ours: str | None = None

    def __str__(self) -> str:
        return f"{self.site} (from {self.ours})" if self.ours else self.site


def sync_of(stack: list[traceback.FrameSummary]) -> HostSync:
    """The `HostSync` of a warning's stack (innermost frame last; the warnings machinery and this module's
    frames are dropped)."""
    frames = [f for f in stack if Path(f.filename).resolve() != HERE and Path(f.filename).name != "warnings.py"]
    if not frames:
        return HostSync("(no Python frame)")

    def line(frame: traceback.FrameSummary) -> str:
        return f"{short_path(frame.filename)}:{frame.lineno} {frame.name}"

    site = frames[-1]
    if PACKAGE in Path(site.filename).parts:
        return HostSync(line(site))
    ours = next((f for f in reversed(frames) if PACKAGE in Path(f.filename).parts), None)
    return HostSync(line(site), line(ours) if ours is not None else None)


def raised_sync(error: BaseException) -> HostSync | None:
    """The sync that mode "error" raised `error` at (its traceback's lines), or None for another error."""
    if SYNC_WARNING not in str(error):
        return None
    return sync_of(traceback.extract_tb(error.__traceback__))


class SyncRecorder:
    """Between `start()` and `stop()`, CUDA's sync debug mode `mode`: "warn" records every host sync in
    `syncs`; "error" raises at the first one (`raised_sync`). `cuda` False (the CPU): the warnings hook is
    installed, no mode is set, nothing is found."""

    def __init__(self, cuda: bool, mode: str = "warn") -> None:
        self.cuda = cuda
        self.mode = mode
        self.syncs: list[HostSync] = []
        self._catching: Any = None

    def start(self) -> None:
        if self._catching is not None:
            return
        self._catching = warnings.catch_warnings()
        self._catching.__enter__()
        warnings.filterwarnings("always", message=re.escape(SYNC_WARNING))  # not once per line: every one
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if SYNC_WARNING in str(message):
                self.syncs.append(sync_of(traceback.extract_stack()))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode(self.mode)

    def stop(self) -> None:
        """End the recording (again: nothing); the sync debug mode back to "default"."""
        if self._catching is None:
            return
        try:
            if self.cuda:
                import torch

                torch.cuda.set_sync_debug_mode("default")
        finally:
            self._catching.__exit__(None, None, None)
            self._catching = None

    def summary(self) -> str:
        """Each distinct sync with its count, in the order first seen; "none" when there was none."""
        counts = Counter(str(sync) for sync in self.syncs)
        return "; ".join(f"{site} ×{n}" if n > 1 else site for site, n in counts.items()) or "none"
